"""Prefill latency on the CPU: one prompt at a time through `ferrobatch.LLM` (SmolLM2), one
output token, and the share of it spent in the reference prefill attention.

    python benches/prefill_latency.py --lengths 256,1024,2048

Each length is run once to warm up, then timed with fresh token ids (no prefix-cache hit
against the warm-up). Prompts are split into `--chunk`-token prefill steps (the step budget),
so later chunks attend to the earlier ones through the paged cache. Attention time is measured
by wrapping `attend_groups` (the torch reference the CPU backend uses for prefill chunks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: F401,E402 - sets the OpenMP defaults before torch is imported


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)

    import ferrobatch.runtime.attention.cpu as cpu_backend
    from ferrobatch import LLM, SamplingParams

    spent = {"s": 0.0}
    real = cpu_backend.attend_groups

    def timed(*a, **k):
        t = time.perf_counter()
        real(*a, **k)
        spent["s"] += time.perf_counter() - t

    cpu_backend.attend_groups = timed
    llm = LLM("smollm2", max_num_batched_tokens=args.chunk, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    print("prompt tokens | time to first token (ms) | prefill attention (ms) | runs")
    try:
        for length in [int(x) for x in args.lengths.split(",")]:
            llm.generate([[100 + i % 40000 for i in range(length)]], params, use_tqdm=False)
            rows = []
            for r in range(args.repeat):
                ids = [200 + (i * 37 + r) % 40000 for i in range(length)]
                spent["s"] = 0.0
                t = time.perf_counter()
                llm.generate([ids], params, use_tqdm=False)
                rows.append(((time.perf_counter() - t) * 1e3, spent["s"] * 1e3))
            best = min(rows)
            print(f"{length} | {best[0]:.0f} | {best[1]:.0f} | "
                  + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in rows))
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
