"""CPU (or GPU) tokens/s of one ModelRunner step at a few batch shapes.

    python benches/model_forward.py [--model random:smollm2-135m] [--device cpu] [--threads N]
    python benches/model_forward.py --model smollm2 --compare-gguf-blocks
    python benches/model_forward.py --model smollm2 --compare-fused-decode
    python benches/model_forward.py --model smollm2 --compare-amx

`--compare-gguf-blocks` builds two runners on two copies of a GGUF model, one reading the GGUF
Q4_1 / Q8_0 blocks in steps of <= 8 rows and one with float32 panels only, and times the same
decode steps on both, alternating, so the ratio is measured side by side.
`--compare-amx` does the same for steps of more than 8 rows, reading the GGUF blocks as AMX
tiles (CPUs with AMX) against the float32 panels.
`--compare-fused-decode` does the same for decode steps with every layer in one Rust call
(`runtime.cpu_decoder`) against the layer-by-layer forward.

Decode rows: B sequences with `context` cached tokens each, one new token each.
Prefill rows: B sequences computing `tokens` fresh prompt tokens each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

# the checkout's package last: one already on the path (the editable install's, or a copy named
# by PYTHONPATH for an A/B of two builds) wins
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))

from step_builder import ToyScheduler

from argtypes import model_ref, positive_int
from ferrobatch.model.loader import load_model
from ferrobatch.runtime.model_runner import ModelRunner

SHAPES = [("decode", 1, 128), ("decode", 8, 128), ("decode", 32, 128),
          ("prefill", 1, 256), ("prefill", 4, 128)]


def _step_for(kind: str, num_seqs: int, length: int, block_size: int, num_blocks: int, runner):
    sched = ToyScheduler(num_blocks, block_size, token_budget=1 << 20)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        sched.add(i, rng.integers(10, 1000, length).tolist(), max_new_tokens=4)
    batch = sched.schedule()  # prefill of every sequence
    if kind == "prefill":
        return batch
    sched.update(runner.execute(batch).argmax(-1).numpy())
    return sched.schedule()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=model_ref, default="random:smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--iters", type=positive_int, default=5)
    parser.add_argument("--compare-gguf-blocks", action="store_true")
    parser.add_argument("--compare-fused-decode", action="store_true")
    parser.add_argument("--compare-amx", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.compare_gguf_blocks:
        compare(args, ("gguf blocks", dict(gguf_blocks=True)),
                ("f32 panels", dict(gguf_blocks=False)), COMPARE_SHAPES)
        return
    if args.compare_amx:
        compare(args, ("amx tiles", dict(amx_tiles=True)),
                ("f32 panels", dict(amx_tiles=False)), AMX_SHAPES)
        return
    if args.compare_fused_decode:
        compare(args, ("fused", dict(fused_decode=True)),
                ("per layer", dict(fused_decode=False)), FUSED_SHAPES)
        return
    loaded = load_model(args.model, device=args.device)
    block_size, num_blocks = 16, 1024
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size)
    print(f"model={args.model} device={args.device} threads={args.threads} dtype={loaded.dtype}")
    print(f"{'kind':8} {'seqs':>5} {'len':>5} {'tokens':>7} {'ms/step':>9} {'tok/s':>9}")
    for kind, num_seqs, length in SHAPES:
        batch = _step_for(kind, num_seqs, length, block_size, num_blocks, runner)
        runner.execute(batch)  # warm-up
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            runner.execute(batch)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.iters
        print(f"{kind:8} {num_seqs:5d} {length:5d} {batch.num_tokens:7d} {seconds * 1e3:9.1f} "
              f"{batch.num_tokens / seconds:9.0f}")


COMPARE_SHAPES = [("decode", 1, 128), ("decode", 1, 1024), ("decode", 2, 128), ("decode", 4, 128),
                  ("decode", 5, 128), ("decode", 6, 128), ("decode", 8, 128), ("decode", 12, 128)]


FUSED_SHAPES = [("decode", 1, 128), ("decode", 1, 1024), ("decode", 4, 128), ("decode", 8, 128),
                ("decode", 16, 128), ("decode", 32, 128), ("decode", 16, 1024)]

AMX_SHAPES = [("decode", 4, 128), ("decode", 5, 128), ("decode", 8, 128), ("decode", 13, 128), ("decode", 16, 128), ("decode", 32, 128),
              ("decode", 64, 128), ("decode", 13, 1024), ("prefill", 1, 64), ("prefill", 1, 512)]


def compare(args, first: tuple[str, dict], second: tuple[str, dict], shapes) -> None:
    """Step ms of two runners (each ``(label, ModelRunner kwargs)``) on two copies of
    the model, the same steps, alternating; the speed-up is second / first."""
    block_size, num_blocks = 16, 2048
    runners = {}
    for name, kwargs in (first, second):
        loaded = load_model(args.model, device="cpu")
        runners[name] = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size,
                                    **kwargs)
    (a, _), (b, _) = first, second
    print(f"model={args.model} threads={args.threads}: step ms, median of "
          f"{args.iters} rounds, the two runners alternating")
    print(f"{'kind':8} {'seqs':>5} {'length':>7} {a:>12} {b:>12} {'speed-up':>9}")
    for kind, num_seqs, length in shapes:
        batches = {n: _step_for(kind, num_seqs, length, block_size, num_blocks, r)
                   for n, r in runners.items()}
        times: dict[str, list[float]] = {n: [] for n in runners}
        for _ in range(args.iters):
            for n, r in runners.items():
                r.execute(batches[n])                       # warm: weights streamed once
                start = time.perf_counter()
                for _ in range(3):
                    r.execute(batches[n])
                times[n].append((time.perf_counter() - start) / 3)
        med = {n: float(np.median(t)) * 1e3 for n, t in times.items()}
        print(f"{kind:8} {num_seqs:5d} {length:7d} {med[a]:12.1f} {med[b]:12.1f} "
              f"{med[b] / med[a]:8.2f}x")


if __name__ == "__main__":
    main()
