"""Where the engine's step time goes, phase by phase, on a throughput workload (CPU or CUDA).

    python benches/step_phases.py [--workload gpu-small] [--max-num-seqs 256] [--num-requests N]
                                  [--json PATH]

Runs the workload's requests through the engine as shipped (`ferrobatch.LLM.generate`, all
submitted at once), with a timer around each phase of `EngineCore.step`:
- **schedule** / **update**: the Rust scheduler forming the batch / taking the sampled tokens;
- **model: decode graph** / **model: piecewise** / **model: eager**: `ModelRunner.execute` on
  steps served by a decode CUDA-graph replay, by the piecewise graphs (prefill or mixed chunks,
  attention eager between the pieces), and on every other step (every step on the CPU);
- **greedy read-back**: a plain greedy step's tokens and finite flags, read back in one transfer
  (`EngineCore._plain_greedy`; on a decode-graph step the graph computed them);
- **finite check**, **sample**: the logits check and the sampler (every other step);
- **rest of step**: the remainder of `EngineCore.step` (logprobs, guides, building the result);
- **outside the step**: the wall time between steps (the step loop, output processing,
  detokenization, the asyncio side).

On CUDA each model phase ends with `torch.cuda.synchronize()`, so the GPU's time lands in the
phase that queued it (the synchronisation itself changes the timings a little: read the split,
not the total, and compare the total with `throughput.py`'s). One warm-up pass of two requests
runs first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402  (puts python/ on sys.path when not installed)
from throughput import warmup_requests  # noqa: E402
from workloads import WORKLOADS, build_requests  # noqa: E402

PHASES = ("schedule", "model: decode graph", "model: piecewise", "model: eager",
          "greedy read-back", "finite check", "sample", "update", "rest of step",
          "outside the step")


class PhaseTimer:
    """Accumulates seconds and calls per phase."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.enabled = False

    def add(self, phase: str, seconds: float) -> None:
        if self.enabled:
            self.seconds[phase] += seconds
            self.calls[phase] += 1


class _TimedScheduler:
    """Forwards to the Rust scheduler, timing schedule() and update()."""

    def __init__(self, inner, timer: PhaseTimer) -> None:
        self._inner, self._timer = inner, timer

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def schedule(self):
        t0 = time.perf_counter()
        out = self._inner.schedule()
        self._timer.add("schedule", time.perf_counter() - t0)
        return out

    def update(self, sampled):
        t0 = time.perf_counter()
        out = self._inner.update(sampled)
        self._timer.add("update", time.perf_counter() - t0)
        return out


def install(core, timer: PhaseTimer) -> dict[str, float]:
    """Wraps the phases of ``core`` (an EngineCore) in ``timer``; returns the in-step totals."""
    import ferrobatch.engine.core as core_module

    runner, sampler = core.runner, core.sampler
    execute, sample, step = runner.execute, sampler.sample, core.step
    plain_greedy = core._plain_greedy
    finite = core_module.rows_all_finite
    in_step = {"seconds": 0.0, "last_end": None}

    def timed_execute(*args, **kwargs):
        graphs_before = getattr(runner, "graph_steps", 0)
        pieces_before = getattr(runner, "piecewise_steps", 0)
        t0 = time.perf_counter()
        out = execute(*args, **kwargs)
        timer.sync()
        phase = "model: decode graph" if getattr(runner, "graph_steps", 0) != graphs_before \
            else "model: piecewise" if getattr(runner, "piecewise_steps", 0) != pieces_before \
            else "model: eager"
        timer.add(phase, time.perf_counter() - t0)
        return out

    def timed_sample(*args, **kwargs):
        t0 = time.perf_counter()
        out = sample(*args, **kwargs)
        timer.sync()
        timer.add("sample", time.perf_counter() - t0)
        return out

    def timed_plain_greedy(*args, **kwargs):
        t0 = time.perf_counter()
        out = plain_greedy(*args, **kwargs)
        timer.add("greedy read-back", time.perf_counter() - t0)
        return out

    def timed_finite(logits):
        t0 = time.perf_counter()
        out = finite(logits)
        timer.add("finite check", time.perf_counter() - t0)
        return out

    def timed_step():
        t0 = time.perf_counter()
        if in_step["last_end"] is not None:
            timer.add("outside the step", t0 - in_step["last_end"])
        out = step()
        t1 = time.perf_counter()
        if timer.enabled:
            in_step["seconds"] += t1 - t0
        in_step["last_end"] = t1 if out is not None else None
        return out

    runner.execute, sampler.sample, core.step = timed_execute, timed_sample, timed_step
    core._plain_greedy = timed_plain_greedy
    core.scheduler = _TimedScheduler(core.scheduler, timer)
    core_module.rows_all_finite = timed_finite
    return in_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpu-small", choices=sorted(WORKLOADS))
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="concurrency cap (default: the workload's)")
    ap.add_argument("--num-requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--device", default=None, help="override the workload's device")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import dataclasses

    import torch

    from fb_systems import FerrobatchRunner

    w = WORKLOADS[args.workload]
    if args.device:
        w = dataclasses.replace(w, device=args.device)
    reqs = build_requests(w)[:args.num_requests] if args.num_requests else build_requests(w)
    cap = args.max_num_seqs or w.max_num_seqs
    cuda = w.device.startswith("cuda")
    timer = PhaseTimer(torch.cuda.synchronize if cuda else (lambda: None))
    fb = FerrobatchRunner(w, cap)
    try:
        in_step = install(fb.engine._core, timer)
        fb.run(warmup_requests(reqs))
        timer.enabled = True
        in_step["seconds"], in_step["last_end"] = 0.0, None
        t0 = time.perf_counter()
        res = fb.run(reqs)
        wall = time.perf_counter() - t0
        timer.enabled = False
    finally:
        fb.close()
    accounted = sum(timer.seconds[p] for p in PHASES if p not in ("rest of step",
                                                                   "outside the step"))
    timer.seconds["rest of step"] = max(0.0, in_step["seconds"] - accounted)
    timer.calls["rest of step"] = timer.calls["schedule"]
    steps = max(1, timer.calls["schedule"])
    print(f"workload {w.name} ({w.model}, {w.dtype}, {w.device}), cap {cap}, {len(reqs)} requests: "
          f"{res['output_tokens'] / wall:.1f} output tok/s with the timers, {wall:.2f} s, "
          f"{steps} steps")
    print(f"{'phase':<22}{'calls':>7}{'total s':>10}{'% wall':>8}{'ms/call':>9}{'ms/step':>9}")
    rows = []
    for p in PHASES:
        s, n = timer.seconds[p], timer.calls[p]
        rows.append({"phase": p, "calls": n, "seconds": s, "pct_wall": 100 * s / wall,
                     "ms_per_call": 1e3 * s / n if n else None, "ms_per_step": 1e3 * s / steps})
        per_call = f"{1e3 * s / n:9.2f}" if n else f"{'-':>9}"
        print(f"{p:<22}{n:>7}{s:>10.3f}{100 * s / wall:>7.1f}%{per_call}{1e3 * s / steps:>9.2f}")
    unaccounted = wall - in_step["seconds"] - timer.seconds["outside the step"]
    print(f"(before the first / after the last step: {unaccounted:.3f} s)")
    if args.json:
        write_json(args.json, {"workload": w.name, "model": w.model, "device": w.device,
                               "dtype": w.dtype, "max_num_seqs": cap, "num_requests": len(reqs),
                               "wall_s": wall, "output_tokens": res["output_tokens"],
                               "num_steps": steps, "phases": rows,
                               "command": "python benches/step_phases.py " + " ".join(
                                   sys.argv[1:] if argv is None else argv)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
