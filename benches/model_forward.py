"""CPU (or GPU) tokens/s of one ModelRunner step at a few batch shapes.

    python benches/model_forward.py [--model random:smollm2-135m] [--device cpu] [--threads N]

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))

from step_builder import ToyScheduler

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
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
