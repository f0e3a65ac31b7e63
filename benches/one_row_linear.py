"""One row of x through SmolLM2's 120 Q4_1 layer linears (the GGUF blocks kernel, as a decode
step of one sequence calls it), two builds of the Rust extension side by side in one process.

    python benches/one_row_linear.py --base-so /tmp/base/ferrobatch/_scheduler.abi3.so \
        [--threads 1,2] [--rows 1] [--rounds 15] [--json PATH]

`--rows 1,2,3` times steps of that many sequences too (x of that many rows; the picoseconds
are per weight per call, all rows together).

Two settings, each timed for both builds, alternating call by call:
- **in L2**: the first layer's qkv and o projections (0.7 MB of blocks) called 60 times over:
  what the kernel's arithmetic costs, picoseconds per weight per thread;
- **from DRAM**: all 120 linears, rotating over three copies of the weights (240 MB: no copy
  is still in the L3 cache when its turn comes), as a real step streams them.

`linear_q4_1_f32` is called from Python, ~1 us a call on top (the same for both builds). Each
row also gives the largest difference between the builds' outputs of one call, relative to the
largest output. Build the base as `build_ab.py`'s docstring says; run it against a copy of this
build too (an A/A control: session 49's 2-thread in-L2 figures moved 0.86-1.05x that way).
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


def _layer_blocks():
    """SmolLM2's 120 layer linears as (in_features, out_features, (scale, min, qs))."""
    from cpu_kernels import _smollm2_block_kernels

    out = []
    for linear in _smollm2_block_kernels()[:-1]:   # the layers, not the LM head
        if linear.blocks.kind != "q4_1":
            raise SystemExit(f"a {linear.blocks.kind} linear: expected SmolLM2's Q4_1 layers")
        out.append((linear.in_features, linear.out_features, linear.blocks.arrays))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-so", required=True, help="the other build's _scheduler*.so")
    ap.add_argument("--threads", type=int_list, default="1,2")
    ap.add_argument("--rows", type=int_list, default="1",
                    help="rows of x per call (a decode step of that many sequences)")
    ap.add_argument("--rounds", type=positive_int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from build_ab import load_extension
    from ferrobatch import _scheduler as this

    builds = {"base": load_extension(args.base_so), "this": this}
    layers = _layer_blocks()
    rng = np.random.default_rng(0)
    xs_of = {m: {k: rng.standard_normal((m, k)).astype(np.float32) for k, _, _ in layers}
             for m in args.rows}
    outs_of = {m: [np.empty((m, n), np.float32) for _, n, _ in layers] for m in args.rows}
    copies = [[tuple(a.copy() for a in arrays) for _, _, arrays in layers] for _ in range(3)]

    def weights_of(calls) -> int:
        return sum(k * n for (k, n, _), _, _ in calls)

    def calls_of(setting: str, m: int, i: int) -> list:
        """Round i's calls: (layer, its weights, its output) for steps of m rows."""
        outs = outs_of[m]
        if setting == "in L2":
            return list(zip(layers[:2] * 60, copies[0][:2] * 60, outs[:2] * 60))
        return list(zip(layers, copies[i % 3], outs))

    rows = []
    for threads, m, setting in [(t, m, s) for t in args.threads for m in args.rows
                                for s in ("in L2", "from DRAM")]:
        xs = xs_of[m]
        times = {name: [] for name in builds}
        weights = weights_of(calls_of(setting, m, 0))
        for i in range(args.rounds + 1):
            calls = calls_of(setting, m, i)
            for name, module in builds.items():
                start = time.perf_counter()
                for (k, _, _), arrays, out in calls:
                    module.linear_q4_1_f32(xs[k], *arrays, None, out, threads)
                if i:   # the first round warms both up
                    times[name].append(time.perf_counter() - start)
        ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        # the builds' outputs of the last call (float32 rounding apart where they differ)
        (k, _, _), arrays, _ = calls[-1]
        last = {name: np.empty((m, arrays[0].shape[0]), np.float32) for name in builds}
        for name, module in builds.items():
            module.linear_q4_1_f32(xs[k], *arrays, None, last[name], threads)
        diff = float(np.max(np.abs(last["this"] - last["base"]))
                     / max(float(np.max(np.abs(last["base"]))), 1e-30))
        row = {"threads": threads, "rows": m, "setting": setting, "base_ms": ms["base"],
               "this_ms": ms["this"], "speedup": ms["base"] / ms["this"],
               "out_max_rel_diff": diff,
               "base_ps_per_weight_thread": ms["base"] * 1e9 / weights * threads,
               "this_ps_per_weight_thread": ms["this"] * 1e9 / weights * threads}
        rows.append(row)
        print(f"threads={threads} rows={m} {setting}: base {ms['base']:.2f} ms, this "
              f"{ms['this']:.2f} ms ({row['speedup']:.2f}x)", flush=True)
    print()
    print(format_table(rows, [
        ("threads", "threads", "d"), ("rows", "rows", "d"), ("setting", "setting", ""),
        ("base_ms", "base ms", ".2f"),
        ("this_ms", "this ms", ".2f"), ("speedup", "x", ".2f"),
        ("base_ps_per_weight_thread", "base ps/weight/thread", ".1f"),
        ("this_ps_per_weight_thread", "this ps/weight/thread", ".1f"),
        ("out_max_rel_diff", "out diff", ".1e")]))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "base_so": args.base_so,
                               "rounds": args.rounds, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
