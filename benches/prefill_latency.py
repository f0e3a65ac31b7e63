"""Prefill latency on the CPU: one prompt at a time through `ferrobatch.LLM` (SmolLM2), one
output token, and the time spent in prefill attention; three engines side by side.

    python benches/prefill_latency.py --lengths 256,1024,2048

- `fused`: the engine as shipped (every step's layers in one Rust call, prompt chunks through
  the Rust prefill kernel);
- `layers`: the same kernels, layer by layer from Python (`FERROBATCH_FUSED_DECODE=0`);
- `sdpa`: prompt chunks on torch's SDPA (`FERROBATCH_PREFILL_KERNEL=0`), so prefill steps go
  layer by layer (decode steps stay fused): the engine before the prefill kernel;
- `vector`: `fused` with prompt attention kept off Intel AMX (the backend's and the fused
  stack's `amx = False`; the linear layers still use AMX): the engine before the prefill
  kernel's AMX path (`cpu_amx_prefill.rs`). On a CPU without AMX it equals `fused`;
- `f32panels`: `fused` with the linear layers' larger steps on float32 panels instead of the
  GGUF blocks packed as quantized panels (`FERROBATCH_QUANT_PANELS=0`; on a CPU with AMX the
  AMX tiles take those steps either way).

The engines take turns on each length (`--paths` picks some). Each length is run once to warm
up, then timed with fresh token ids (no prefix-cache hit against the warm-up). Prompts are split
into `--chunk`-token prefill steps (the step budget), so later chunks attend to the earlier ones
through the paged cache. Attention time is measured by wrapping the attention backend's
`forward` (every layer's attention of the step, K/V writes excluded): not measurable inside the
fused call (`-`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: F401,E402 - sets the OpenMP defaults before torch is imported
from argtypes import int_list, name_list, positive_int  # noqa: E402

PATHS = {"fused": {}, "layers": {"FERROBATCH_FUSED_DECODE": "0"},
         "sdpa": {"FERROBATCH_PREFILL_KERNEL": "0"}, "vector": {},
         "f32panels": {"FERROBATCH_QUANT_PANELS": "0"}}  # label -> its environment
NO_AMX_ATTENTION = {"vector"}   # labels whose prompt attention stays off AMX


def _engine(label: str, chunk: int):
    """An LLM whose CPU backend runs prefill chunks on `label`'s path; returns (llm, spent), where
    spent["s"] accumulates the seconds inside the backend's attention."""
    from ferrobatch import LLM

    os.environ.update(PATHS[label])
    try:
        llm = LLM("smollm2", max_num_batched_tokens=chunk, enable_prefix_caching=False)
    finally:
        for name in PATHS[label]:
            os.environ.pop(name, None)
    backend = llm.engine._core.runner.attn_backend
    if label in NO_AMX_ATTENTION:
        backend.amx = False
        fused = llm.engine._core.runner.fused_layers
        if fused is not None:
            fused.amx = False
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
    ap.add_argument("--lengths", type=int_list, default="256,1024,2048")
    ap.add_argument("--chunk", type=positive_int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--repeat", type=positive_int, default=2)
    ap.add_argument("--paths", type=name_list(PATHS), default=",".join(PATHS),
                    help="comma-separated, of: " + ", ".join(PATHS))
    args = ap.parse_args(argv)

    from ferrobatch import SamplingParams

    labels = args.paths
    engines = {label: _engine(label, args.chunk) for label in labels}
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    print("path | prompt tokens | time to first token (ms) | prefill attention (ms) | runs")
    best: dict[tuple[str, int], float] = {}
    try:
        for length in args.lengths:
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
                attn = "-" if label in ("fused", "vector") else f"{b[1]:.0f}"
                print(f"{label} | {length} | {b[0]:.0f} | {attn} | "
                      + ", ".join(f"{a:.0f}/{c:.0f}" for a, c in rows[label]))
            if "fused" in labels and len(labels) > 1:
                print("  time to first token vs fused: " + ", ".join(
                    f"{label} {best[label, length] / best['fused', length]:.2f}x"
                    for label in labels if label != "fused"))
    finally:
        for llm, _ in engines.values():
            llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
