"""Scheduler overhead seen from Python: one `schedule()` + `update()` cycle through the
bindings (numpy arrays included) in steady state with R running sequences and 4096 waiting.

Mirrors the criterion bench `rust_scheduler/benches/schedule_cycle.rs`: prompts of 32 tokens,
max_tokens 64..191, ignore_eos; every finished request is replaced by a new submit through the
intake, so the waiting queue stays at 4096 and each cycle has a few prefill chunks besides the
decodes. The "sampler" is a preallocated int32 array, as a runner would hand over.

    python benches/scheduler_overhead.py [--cycles 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from argtypes import positive_int
from ferrobatch._scheduler import Scheduler

WAITING = 4096


class Cycle:
    def __init__(self, running: int):
        self.s = Scheduler(
            running * 14 + 256, 16, max_num_seqs=running, max_num_batched_tokens=max(2048, running + 256),
            max_model_len=4096, vocab_size=32000, eos_token_ids=[2], intake_capacity=8192,
        )
        self.intake = self.s.intake()
        self.next_id = 0
        self.sampled = 100 + np.arange(4096, dtype=np.int32)
        for _ in range(running):
            self.submit()
        while self.s.stats()["num_running"] < running or self.s.stats()["num_waiting"] > 0:
            self.cycle(resubmit=False)
        for _ in range(WAITING):
            self.submit()
        self.cycle()

    def submit(self) -> None:
        rid = self.next_id
        self.next_id += 1
        h = (rid * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        prompt = [((h >> (k % 48)) & 0x3FFF) + 3 for k in range(32)]
        self.intake.submit(rid, prompt, max_tokens=64 + h % 128, ignore_eos=True)

    def cycle(self, resubmit: bool = True) -> None:
        b = self.s.schedule()
        out = self.s.update(self.sampled[: b.num_samples])
        if resubmit:
            for _ in range(int(np.count_nonzero(out.finish_reasons))):
                self.submit()


def measure(running: int, cycles: int, repeats: int = 5) -> dict:
    c = Cycle(running)
    per_rep = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(cycles):
            c.cycle()
        per_rep.append((time.perf_counter() - t0) / cycles * 1e6)
    st = c.s.stats()
    assert st["num_running"] >= running - 16 and st["num_waiting"] >= WAITING - 64, st
    return {
        "running": running,
        "waiting": WAITING,
        "us_per_cycle": round(min(per_rep), 2),
        "us_per_cycle_median": round(statistics.median(per_rep), 2),
        "cycles": cycles * repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=positive_int, default=2000,
                    help="cycles per repeat at 64 running, scaled by 64 / R for R running, at "
                    "least 200 (5 repeats; best reported)")
    ap.add_argument("--running", type=positive_int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--json", metavar="PATH", help="write {'results': [...]} here")
    args = ap.parse_args()
    results = [measure(r, max(200, args.cycles * 64 // r)) for r in args.running]
    print(f"{'running':>8} {'waiting':>8} {'us/cycle (best)':>16} {'us/cycle (median)':>18}")
    for r in results:
        print(f"{r['running']:>8} {r['waiting']:>8} {r['us_per_cycle']:>16.1f} {r['us_per_cycle_median']:>18.1f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=2)
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
