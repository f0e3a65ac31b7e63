"""Where one model step's GPU time goes, kernel by kernel (the next lever for the `gpu-small`
goal): per step shape, the step as the engine runs it (decode graph, or piecewise graphs for a
mixed step) against the sum of its kernels' own durations, and the kernels that take the most.

    python benches/gpu_kernel_profile.py [--model random:smollm2-135m] [--context 1024]
                                         [--decode 32,128,256] [--mixed 31:576] [--json PATH]

For each shape the sequences are prefilled to ``--context`` tokens first (``ToyScheduler``),
then:
- **step ms**: the step through ``ModelRunner.execute`` as the engine runs it (graphs when the
  device is CUDA), median of ``--iters``, synchronized;
- **kernel ms**: the same step run eagerly once under ``torch.profiler``, the sum of every
  kernel's device time (the same kernels a graph replays). ``step - kernel`` is what the step
  waits on besides arithmetic and memory traffic: launch gaps inside the graph, host work
  between pieces, the copies in;
- the top kernels of that eager step by device time (name, calls, us, share);
- with graphs, the kernel time the profiler reports for the step as the engine runs it (CUPTI
  may or may not see the kernels a graph replays: 0 then).

On the CPU (smoke runs, `tests/benches`) the profile lists aten ops by self CPU time instead.
`--mixed D:P` is a step of D decode rows plus one fresh prompt of P tokens (a cap-32 refill).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from step_builder import ToyScheduler  # noqa: E402

from argtypes import int_list, model_ref, positive_int  # noqa: E402
from common import machine_info, write_json  # noqa: E402

BLOCK_SIZE = 16
TOP_KERNELS = 12


def _mixed(spec: str) -> tuple[int, int]:
    try:
        decode, prompt = (int(x) for x in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mixed wants D:P (decode rows:prompt tokens), "
                                         f"got {spec!r}") from None
    if decode < 0 or prompt < 2:
        raise argparse.ArgumentTypeError("--mixed wants D >= 0 decode rows and P >= 2 tokens")
    return decode, prompt


def build_steps(runner, num_blocks: int, context: int, decode: list[int],
                mixed: list[tuple[int, int]], vocab: int) -> list[tuple[str, object]]:
    """``(label, StepBatch)`` per shape: decode-only steps of B rows at ``context`` tokens, and
    mixed steps of D decode rows plus one fresh prompt."""
    rng = np.random.default_rng(0)
    steps = []
    shapes = [(b, None) for b in decode] + [(d, p) for d, p in mixed]
    for rows, prompt in shapes:
        sched = ToyScheduler(num_blocks, BLOCK_SIZE, token_budget=1 << 22)
        for i in range(rows):
            sched.add(i, rng.integers(1, vocab, context).tolist(), max_new_tokens=8)
        if rows:
            batch = sched.schedule()                               # the prefills
            sched.update(runner.execute(batch, allow_graph=False).argmax(-1).cpu().numpy())
        if prompt is None:
            steps.append((f"decode B={rows} ctx={context}", sched.schedule()))
        else:
            sched.add(rows, rng.integers(1, vocab, prompt).tolist(), max_new_tokens=8)
            steps.append((f"mixed {rows} decode + {prompt}-token prompt", sched.schedule()))
    return steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(runner, batch, iters: int) -> float:
    """Median ms of the step as the engine runs it (re-running a step rewrites the same KV
    slots with the same values, so every run is the same work)."""
    times = []
    for _ in range(iters + 1):
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.execute(batch)
        _sync(runner.device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:])) * 1e3


def profile_step(runner, batch, allow_graph: bool = False) -> tuple[float, list[dict]]:
    """(sum of kernel device ms, top kernels) of one run of the step (eager unless
    ``allow_graph``: then as the engine runs it, whose graph kernels CUPTI may or may not
    report); on the CPU the aten ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runner.execute(batch, allow_graph=allow_graph)         # warm (allocator, lazy init)
    _sync(runner.device)
    with profile(activities=activities) as prof:
        runner.execute(batch, allow_graph=allow_graph)
        _sync(runner.device)
    rows = []
    if cuda:
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time_total > 0:
                rows.append((evt.name, float(evt.device_time_total)))
    else:
        for evt in prof.key_averages():
            if evt.self_cpu_time_total > 0 and evt.key.startswith("aten::"):
                rows.extend([(evt.key, float(evt.self_cpu_time_total) / evt.count)] * evt.count)
    by_name: dict[str, list[float]] = {}
    for name, us in rows:
        by_name.setdefault(name, []).append(us)
    total_us = sum(us for _, us in rows)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return total_us / 1e3, [
        {"name": name, "calls": len(us), "us": sum(us),
         "share": sum(us) / total_us if total_us else 0.0} for name, us in top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=model_ref, default="random:smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, the model's on CPU")
    ap.add_argument("--context", type=positive_int, default=1024)
    ap.add_argument("--decode", type=int_list, default=[32, 128, 256])
    ap.add_argument("--mixed", type=_mixed, action="append", default=None,
                    help="D:P, repeatable (default 31:576)")
    ap.add_argument("--iters", type=positive_int, default=20)
    ap.add_argument("--no-graphs", action="store_true", help="time the eager steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mixed = args.mixed if args.mixed is not None else [(31, 576)]

    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.model_runner import ModelRunner

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else \
        (torch.bfloat16 if device.type == "cuda" else None)
    loaded = load_model(args.model, device=device, dtype=dtype)
    cfg = loaded.config
    most_rows = max([*args.decode, *(d + 1 for d, _ in mixed), 1])
    longest = args.context + max([p for _, p in mixed] + [0]) + 16
    num_blocks = most_rows * (-(-longest // BLOCK_SIZE) + 1) + 8
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=BLOCK_SIZE, device=device)
    graphs = device.type == "cuda" and not args.no_graphs
    if graphs:
        runner.capture_decode_graphs(most_rows, longest)
        runner.capture_piecewise_graphs(max(most_rows + p for _, p in mixed) if mixed
                                        else most_rows)
    steps = build_steps(runner, num_blocks, args.context, args.decode, mixed, cfg.vocab_size)
    print(f"model {args.model} ({loaded.dtype}, {device}); attention: {runner.attention_kernels}; "
          f"graphs: {'on' if graphs else 'off'}")
    results = []
    for label, batch in steps:
        step_ms = time_step(runner, batch, args.iters)
        kernel_ms, top = profile_step(runner, batch)
        graph_ms = profile_step(runner, batch, allow_graph=True)[0] if graphs else None
        results.append({"step": label, "num_tokens": int(batch.num_tokens),
                        "step_ms": step_ms, "kernel_ms": kernel_ms,
                        "graph_step_kernel_ms": graph_ms, "top": top})
        print(f"\n{label}: step {step_ms:.3f} ms, kernels {kernel_ms:.3f} ms "
              f"({'device' if device.type == 'cuda' else 'CPU self'} time, eager run), "
              f"other {step_ms - kernel_ms:+.3f} ms"
              + ("" if graph_ms is None else
                 f"; kernels the profiler saw in the graph step {graph_ms:.3f} ms"))
        print(f"  {'calls':>5} {'us':>9} {'share':>6}  kernel")
        for k in top:
            print(f"  {k['calls']:5d} {k['us']:9.1f} {k['share']:6.1%}  {k['name'][:100]}")
    if args.json:
        write_json(args.json, {"model": args.model, "device": str(device),
                               "dtype": str(loaded.dtype), "graphs": graphs,
                               "context": args.context, "results": results,
                               "machine": machine_info(),
                               "command": "python benches/gpu_kernel_profile.py "
                                          + " ".join(sys.argv[1:] if argv is None else argv)})
        print(f"\njson: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
