"""Writes a copy of a llama-family GGUF keeping only its first N transformer blocks.

The GPU machine has no network and its working tree is limited in size, so the shipped SmolLM2
GGUF (~93 MB) cannot travel there. Its first few blocks can: the embeddings, the final norm, the
tokenizer and every hyperparameter but ``<arch>.block_count`` are copied byte for byte (quantized
tensors stay quantized), so transformers and ferrobatch load the same smaller, real-weight model
and the end-to-end greedy-parity tests run on it (``FERROBATCH_E2E_GGUF=<path> pytest -m gpu``).

    python tests/gpu/truncate_gguf.py OUT.gguf [--layers 8] [--source PATH]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np


def truncate(source: str, dest: str, layers: int) -> tuple[int, int]:
    """Copies ``source`` to ``dest`` with blocks ``0..layers-1``; returns (kept, original) counts."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    original = int(reader.fields[count_key].contents())
    if not 1 <= layers <= original:
        raise ValueError(f"--layers must be in 1..{original}, got {layers}")
    writer = gguf.GGUFWriter(dest, arch, use_temp_file=False)
    skip = {"general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for name, field in reader.fields.items():
        if name in skip:
            continue
        vtype = field.types[0]
        if name == count_key:
            writer.add_key_value(name, layers, vtype)
        elif vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), vtype)
    block = re.compile(r"^blk\.(\d+)\.")
    for t in reader.tensors:
        m = block.match(t.name)
        if m and int(m.group(1)) >= layers:
            continue
        data = np.asarray(t.data)
        if data.dtype == np.uint8:  # quantized: rows of raw bytes, shape given in bytes
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, data, raw_shape=list(reversed(t.shape.tolist())),
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return layers, original


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--source", default=None, help="default: the shipped SmolLM2 GGUF")
    args = parser.parse_args(argv)
    source = args.source
    if source is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
        from ferrobatch.model.loader import smollm2_gguf_path
        source = smollm2_gguf_path()
    kept, original = truncate(source, args.dest, args.layers)
    print(f"wrote {args.dest}: {kept} of {original} blocks of {source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
