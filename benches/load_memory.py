"""Peak memory of loading a model: the growth of this process's peak RSS across `load_model`,
against the bytes of the loaded parameters.

    python benches/load_memory.py /path/to/model-dir-or.gguf [--device cpu]
    python benches/load_memory.py /path/to/model.gguf --runner

Run each model in a fresh process (the peak only ever rises). ``--runner`` measures what a CPU
server pays before its first step: `load_model` plus a `ModelRunner` (weights packed for the
Rust kernels), two ways side by side, each in a fresh process: the GGUF dequantized to float32
first (``gguf_blocks=False`` at load, the blocks read again by the runner: the path before
session 41) and the block-format linears loaded as blocks alone (``gguf_blocks=True``, what
the engine does); peak RSS growth and the RSS once ready.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from argtypes import model_ref


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_runner(model: str, gguf_blocks: bool) -> dict:
    """This process: peak RSS growth across load + runner, and the RSS once ready."""
    import time

    import torch

    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.model_runner import ModelRunner

    torch.set_num_threads(1)
    base = _rss_bytes()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    loaded = load_model(model, gguf_blocks=gguf_blocks)
    runner = ModelRunner(loaded, num_blocks=16, block_size=16)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"gguf_blocks": gguf_blocks, "peak_growth": peak - max(before, base),
            "ready_growth": _rss_bytes() - base, "seconds": seconds,
            "kernels": runner.linear_kernels}


def compare_runners(model: str) -> None:
    rows = []
    for gguf_blocks in (False, True):
        out = subprocess.run([sys.executable, __file__, model, "--child-runner",
                              str(int(gguf_blocks))], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"gguf_blocks={gguf_blocks} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{model}: load_model + ModelRunner (CPU, weights packed), each in a fresh process")
    print(f"{'GGUF linears loaded':<34}{'peak RSS growth':>16}{'RSS when ready':>16}{'time':>8}")
    for row in rows:
        label = "as blocks (gguf_blocks=True)" if row["gguf_blocks"] else \
            "as float32 (gguf_blocks=False)"
        print(f"{label:<34}{row['peak_growth'] / 2**20:>12,.0f} MiB"
              f"{row['ready_growth'] / 2**20:>12,.0f} MiB{row['seconds']:>7.1f}s")
    old, new = rows
    print(f"peak {old['peak_growth'] / new['peak_growth']:.2f}x lower, ready RSS "
          f"{old['ready_growth'] / new['ready_growth']:.2f}x lower; kernels: {new['kernels']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=model_ref)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runner", action="store_true",
                        help="load + ModelRunner, GGUF linears as float32 vs as blocks")
    parser.add_argument("--child-runner", choices=("0", "1"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_runner is not None:
        print(json.dumps(measure_runner(args.model, args.child_runner == "1")))
        return
    if args.runner:
        compare_runners(args.model)
        return
    from ferrobatch.model.loader import load_model

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss     # KiB on Linux
    loaded = load_model(args.model, device=args.device)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    growth = (after - before) * 1024
    print(f"{args.model}: parameters {params / 2**20:,.0f} MiB, peak RSS growth "
          f"{growth / 2**20:,.0f} MiB ({growth / params:.2f}x)")


if __name__ == "__main__":
    main()
