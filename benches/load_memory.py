"""Peak memory of loading a model: the growth of this process's peak RSS across `load_model`,
against the bytes of the loaded parameters.

    python benches/load_memory.py /path/to/model-dir-or.gguf [--device cpu]

Run each model in a fresh process (the peak only ever rises).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from argtypes import model_ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=model_ref)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
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
