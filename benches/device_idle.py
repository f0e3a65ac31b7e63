"""How long an accelerator waits for the host between two steps, measured on the CPU: the engine
with a stub model that emulates an asynchronous device.

    python benches/device_idle.py [--running 32,256] [--device-ms 2.0] [--tokens 64]
                                  [--repeat 3] [--json PATH]

On a GPU, `ModelRunner.execute` only launches the step (a CUDA graph replay) and the host waits
for it when it reads the sampled tokens back. Everything the host does between that read-back
and the next launch (scheduler update, the step's result, handing it to the asyncio side,
scheduling, preparing the inputs), and any wait for the GIL the asyncio side holds, is time the
GPU sits idle. `AsyncDeviceStub` stands in for the model runner: `execute` records the launch
and returns at once, the greedy read-back (`greedy_rows(...).cpu()`) sleeps until the launch
plus `--device-ms`. With N requests all running (`ferrobatch.LLM.generate`, greedy, 8-token
prompts, `--tokens` each), per decode step:

- **idle us**: next launch - (this launch + device time): what the device would wait for the
  host (median over the steady decode steps of all runs; sleeping past the target, the
  host's own wake-up latency, is measured in the same run and reported beside it);
- **us/step**: wall time per decode step.

The systems run one after the other, alternating `--repeat` times:

- `current`: the engine as shipped;
- `switch-100us`: `sys.setswitchinterval(1e-4)` (a thread waiting for the GIL takes it after
  100 us, not 5 ms).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, positive_float, positive_int  # noqa: E402
from common import machine_info, write_json  # noqa: E402
from engine_overhead import STUB_TOKEN, StubRunner, make_requests, num_blocks_for  # noqa: E402

SYSTEMS = ("current", "switch-100us")


class _DeviceRows:
    """The greedy read-back of an emulated device step: ``.cpu()`` waits for the step."""

    def __init__(self, runner: AsyncDeviceStub, rows) -> None:
        self.runner, self.rows = runner, rows

    def cpu(self):
        left = self.runner.busy_until - time.perf_counter()
        if left > 0:
            time.sleep(left)                      # GIL released, as in a CUDA sync
        self.runner.overshoot.append(time.perf_counter() - self.runner.busy_until)
        return self.rows


class AsyncDeviceStub(StubRunner):
    """StubRunner whose steps take ``device_s`` on an emulated asynchronous device."""

    device_s = 0.002

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.launches: list[float] = []
        self.overshoot: list[float] = []
        self.busy_until = 0.0

    def execute(self, batch):
        out = super().execute(batch)
        now = time.perf_counter()
        self.launches.append(now)
        self.busy_until = now + self.device_s
        return out

    def greedy_rows(self, logits):
        import torch
        rows = torch.zeros(logits.shape[0], 2, dtype=torch.int64)
        rows[:, 0] = STUB_TOKEN
        rows[:, 1] = 1
        return _DeviceRows(self, rows)


def build_llm(model_dir: str, n: int, tokens: int):
    import ferrobatch.runtime.model_runner as mr
    from ferrobatch import LLM

    real = mr.ModelRunner
    mr.ModelRunner = AsyncDeviceStub      # EngineCore.build looks the class up at build time
    try:
        return LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=n,
                   max_num_batched_tokens=max(512, n), enable_prefix_caching=False,
                   num_speculative_tokens=0,      # as on a GPU: one token per step
                   num_blocks=num_blocks_for(n, 8 + tokens))
    finally:
        mr.ModelRunner = real


def run_once(llm, n: int, tokens: int) -> dict:
    """One generate of n requests; the steady decode steps' idle gaps and step times."""
    from ferrobatch import SamplingParams

    runner = llm.engine._core.runner
    reqs = make_requests(n, tokens, llm.engine.vocab_size)
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)] * n
    runner.launches.clear()
    runner.overshoot.clear()
    outs = llm.generate([list(r.prompt_ids) for r in reqs], params, use_tqdm=False)
    if any(len(o.outputs[0].token_ids) != tokens for o in outs):
        raise RuntimeError("a request generated the wrong number of tokens")
    launches = runner.launches[4:-4]           # steady decode steps: admission and drain cut
    gaps = [b - (a + runner.device_s) for a, b in zip(launches, launches[1:])]
    steps = [b - a for a, b in zip(launches, launches[1:])]
    return {"idle": gaps, "step": steps, "overshoot": runner.overshoot[4:-4]}


def _fine_timer_slack() -> None:
    """Linux: sleeps wake within ~1 ns of their deadline instead of the default 50 us slack
    (the emulated device's end is a sleep's deadline)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)          # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int_list, default=[32, 256])
    ap.add_argument("--device-ms", type=positive_float, default=2.0)
    ap.add_argument("--tokens", type=positive_int, default=64)
    ap.add_argument("--repeat", type=positive_int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from bench_models import materialize_tiny_hf_dir

    AsyncDeviceStub.device_s = args.device_ms / 1e3
    _fine_timer_slack()
    model_dir = materialize_tiny_hf_dir(num_layers=1)
    default_switch = sys.getswitchinterval()
    rows = []
    print(f"emulated device step {args.device_ms:.2f} ms; {args.tokens} tokens per request; "
          f"medians over the steady decode steps of {args.repeat} runs per system")
    for n in args.running:
        llm = build_llm(model_dir, n, args.tokens)
        try:
            run_once(llm, min(n, 8), 4)                              # warm
            got = {s: {"idle": [], "step": [], "overshoot": []} for s in SYSTEMS}
            for _ in range(args.repeat):
                for system in SYSTEMS:
                    sys.setswitchinterval(1e-4 if system == "switch-100us" else default_switch)
                    try:
                        res = run_once(llm, n, args.tokens)
                    finally:
                        sys.setswitchinterval(default_switch)
                    for k, v in res.items():
                        got[system][k].extend(v)
            for system in SYSTEMS:
                g = got[system]
                row = {"system": system, "running": n, "device_ms": args.device_ms,
                       "idle_us": statistics.median(g["idle"]) * 1e6,
                       "idle_p90_us": sorted(g["idle"])[int(0.9 * (len(g["idle"]) - 1))] * 1e6,
                       "step_us": statistics.median(g["step"]) * 1e6,
                       "wakeup_us": statistics.median(g["overshoot"]) * 1e6,
                       "steps": len(g["step"])}
                rows.append(row)
                print(f"  {system:<14} N={n:<5d} idle {row['idle_us']:6.0f} us (p90 "
                      f"{row['idle_p90_us']:5.0f}; of it the wake-up {row['wakeup_us']:4.0f}), "
                      f"step {row['step_us']:6.0f} us, {row['steps']} steps", flush=True)
        finally:
            llm.close()
    if args.json:
        write_json(args.json, {"machine": machine_info(), "device_ms": args.device_ms,
                               "tokens": args.tokens, "repeat": args.repeat, "results": rows,
                               "command": "python benches/device_idle.py "
                                          + " ".join(sys.argv[1:] if argv is None else argv)})
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
