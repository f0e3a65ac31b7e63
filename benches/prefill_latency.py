"""Prefill latency on the CPU: one prompt at a time through `ferrobatch.LLM` (SmolLM2), one
output token, and the time spent in prefill attention; the Rust prefill kernel and torch's SDPA
side by side.

    python benches/prefill_latency.py --lengths 256,1024,2048

Two engines (the shipped one, and one with `FERROBATCH_PREFILL_KERNEL=0`: prefill chunks on
SDPA) take turns on each length (`--only rust|sdpa` runs one). Each length is run once to warm
up, then timed with fresh token ids (no prefix-cache hit against the warm-up). Prompts are split
into `--chunk`-token prefill steps (the step budget), so later chunks attend to the earlier ones
through the paged cache. Attention time is measured by wrapping the attention backend's
`forward` (every layer's attention of the step, K/V writes excluded).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: F401,E402 - sets the OpenMP defaults before torch is imported

PATHS = {"rust": "1", "sdpa": "0"}   # label -> FERROBATCH_PREFILL_KERNEL


def _engine(label: str, chunk: int):
    """An LLM whose CPU backend runs prefill chunks on `label`'s path; returns (llm, spent), where
    spent["s"] accumulates the seconds inside the backend's attention."""
    from ferrobatch import LLM

    os.environ["FERROBATCH_PREFILL_KERNEL"] = PATHS[label]
    try:
        llm = LLM("smollm2", max_num_batched_tokens=chunk, enable_prefix_caching=False)
    finally:
        os.environ.pop("FERROBATCH_PREFILL_KERNEL", None)
    backend = llm.engine._core.runner.attn_backend
    spent = {"s": 0.0}
    real = backend.forward

    def timed(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        spent["s"] += time.perf_counter() - t
        return out

    backend.forward = timed
    return llm, spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", choices=sorted(PATHS), help="run one path only")
    args = ap.parse_args(argv)

    from ferrobatch import SamplingParams

    labels = [args.only] if args.only else ["rust", "sdpa"]
    engines = {label: _engine(label, args.chunk) for label in labels}
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    print("path | prompt tokens | time to first token (ms) | prefill attention (ms) | runs")
    best: dict[tuple[str, int], float] = {}
    try:
        for length in [int(x) for x in args.lengths.split(",")]:
            rows: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
            for llm, _ in engines.values():
                llm.generate([[100 + i % 40000 for i in range(length)]], params, use_tqdm=False)
            for r in range(args.repeat):       # the paths take turns
                ids = [200 + (i * 37 + r) % 40000 for i in range(length)]
                for label, (llm, spent) in engines.items():
                    spent["s"] = 0.0
                    t = time.perf_counter()
                    llm.generate([ids], params, use_tqdm=False)
                    rows[label].append(((time.perf_counter() - t) * 1e3, spent["s"] * 1e3))
            for label in labels:
                b = min(rows[label])
                best[label, length] = b[0]
                print(f"{label} | {length} | {b[0]:.0f} | {b[1]:.0f} | "
                      + ", ".join(f"{a:.0f}/{c:.0f}" for a, c in rows[label]))
            if len(labels) == 2:
                print(f"  time to first token, sdpa / rust: "
                      f"{best['sdpa', length] / best['rust', length]:.2f}x")
    finally:
        for llm, _ in engines.values():
            llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
