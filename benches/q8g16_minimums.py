"""A GGUF's Q8G16 layers whose minimums are all +0 (Q6_K's form: most Q4_K_M files' LM head and
half their `ffn_down` / `attn_v`) through the quantized panels, packed with their minimums
(768-byte records, 12 bits a weight, as before session 50) and without (`q8_s16`, 640 bytes, 10
bits), side by side in one process.

    python benches/kquant_gguf.py /tmp/q4km-1b.gguf --hidden 2048 --intermediate 8192 --layers 16
    python benches/q8g16_minimums.py /tmp/q4km-1b.gguf [--rows 1,4] [--threads 2] [--json PATH]

Each round calls every such layer once per packing (all of them: several hundred MiB, so each
call streams its panels from DRAM, as a decode step does), the packings alternating round by
round; the median round is reported. The two packings' outputs must be equal bit for bit (the
run fails otherwise): one minimum is set to -0 to keep the 768-byte records, which changes no
weight.
"""

# ruff: noqa: I001  (common must be imported before numpy / torch: it sets OpenMP defaults)
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, positive_int  # noqa: E402
from common import format_table, machine_info, write_json  # noqa: E402  (OpenMP defaults first)

import numpy as np  # noqa: E402


def zero_minimum_layers(path: str) -> list[tuple[str, tuple, tuple]]:
    """(module name, (out, in), (scale, min, qs)) of each Q8G16 layer whose minimums are +0."""
    from ferrobatch.model.block_weights import Q8_G16
    from ferrobatch.model.loader import load_model

    loaded = load_model(path, gguf_blocks=True)
    found = []
    for name, weight in sorted((loaded.model.gguf_block_weights or {}).items()):
        if weight.type_id != Q8_G16:
            continue
        scale, minimum, qs = weight.kernel_arrays()
        if not minimum.view(np.uint32).any():
            found.append((name, tuple(weight.shape), (scale, minimum, qs)))
    if not found:
        raise SystemExit(f"{path}: no Q8G16 layer without minimums (no Q6_K tensor?)")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="a GGUF with Q6_K tensors (benches/kquant_gguf.py writes one)")
    ap.add_argument("--rows", type=int_list, default="1,4")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=11)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not Path(args.gguf).is_file():
        ap.error(f"gguf: no such file: {args.gguf}")

    from ferrobatch import _scheduler
    from ferrobatch.runtime.cpu_linear import _aligned_64

    layers = zero_minimum_layers(args.gguf)
    packings: dict[str, list] = {"q8_g16": [], "q8_s16": []}
    for _, _, (scale, minimum, qs) in layers:
        signed = minimum.copy()
        signed.flat[0] = -0.0            # the same weights; the 768-byte records kept
        packings["q8_g16"].append(_aligned_64(_scheduler.pack_quant_panels_q8_g16(scale, signed,
                                                                                  qs)))
        packings["q8_s16"].append(_aligned_64(_scheduler.pack_quant_panels_q8_g16(scale, minimum,
                                                                                  qs)))
    mib = {kind: sum(p.nbytes for p in panels) / 2**20 for kind, panels in packings.items()}
    weights = sum(shape[0] * shape[1] for _, shape, _ in layers)
    print(f"{len(layers)} layers without minimums, {weights / 1e6:.0f}M weights: "
          f"{mib['q8_g16']:.0f} MiB with them, {mib['q8_s16']:.0f} MiB without", flush=True)
    rng = np.random.default_rng(0)
    results = []
    for rows in args.rows:
        xs = {k: rng.standard_normal((rows, k)).astype(np.float32) for _, (_, k), _ in layers}
        outs = {kind: [np.empty((rows, n), np.float32) for _, (n, _), _ in layers]
                for kind in packings}
        times: dict[str, list[float]] = {kind: [] for kind in packings}
        for i in range(args.rounds + 1):
            for kind, panels in packings.items():
                start = time.perf_counter()
                for (_, (_, k), _), packed, out in zip(layers, panels, outs[kind]):
                    _scheduler.linear_quant_panels_f32(xs[k], packed, kind, None, out,
                                                       args.threads)
                if i:                      # the first round warms both up
                    times[kind].append(time.perf_counter() - start)
        if not all(np.array_equal(a, b) for a, b in zip(outs["q8_g16"], outs["q8_s16"])):
            raise SystemExit("the two packings gave different outputs")
        ms = {kind: float(np.median(t)) * 1e3 for kind, t in times.items()}
        row = {"rows": rows, "threads": args.threads, "with_minimums_ms": ms["q8_g16"],
               "without_ms": ms["q8_s16"], "speedup": ms["q8_g16"] / ms["q8_s16"],
               "with_minimums_gb_per_s": mib["q8_g16"] * 2**20 / ms["q8_g16"] / 1e6,
               "without_gb_per_s": mib["q8_s16"] * 2**20 / ms["q8_s16"] / 1e6}
        results.append(row)
        print(f"rows={rows}: with minimums {ms['q8_g16']:.2f} ms, without {ms['q8_s16']:.2f} ms "
              f"({row['speedup']:.2f}x)", flush=True)
    print()
    print(format_table(results, [
        ("rows", "rows", "d"), ("threads", "threads", "d"),
        ("with_minimums_ms", "768-byte ms", ".2f"), ("without_ms", "640-byte ms", ".2f"),
        ("speedup", "x", ".3f"), ("with_minimums_gb_per_s", "768 GB/s", ".1f"),
        ("without_gb_per_s", "640 GB/s", ".1f")]))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "gguf": args.gguf,
                               "layers": [name for name, _, _ in layers], "mib": mib,
                               "rounds": args.rounds, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
