"""Writes a random-weight GGUF of a Llama shape in llama.cpp's Q4_K_M mix (or all Q8_0), for
the CPU block kernels' benchmarks (gguf-py cannot quantize to Q4_K, so the blocks are random
bytes with small fp16 factors: any bytes are valid blocks, and speed does not depend on the
values).

    python benches/kquant_gguf.py /tmp/q4km.gguf [--hidden 1024 --intermediate 2816 --layers 12]
    python benches/kquant_gguf.py /tmp/q8.gguf --mix q8_0
    python benches/model_forward.py --model /tmp/q4km.gguf --compare-gguf-blocks

The Q4_K_M mix follows llama.cpp's: Q4_K for most linears, Q6_K for the output matrix and for
``attn_v`` / ``ffn_down`` of every other layer, F32 norms, Q4_K token embeddings. ``--mix
q8_0``: every matrix Q8_0 (llama.cpp's Q8_0 files). SmolLM2's tokenizer and chat template so
the engine can serve it.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from argtypes import positive_int


def random_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes in a k-quant's layout, fp16 factors set small and finite."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block_elems * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, block_bytes)
    for start in {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}[type_name]:
        factor = rng.uniform(1e-4, 4e-4, blocks.shape[:2]).astype(np.float16)
        blocks[..., start:start + 2] = factor.view(np.uint8).reshape(rows, -1, 2)
    return raw


def write(path: str, hidden: int, intermediate: int, layers: int, heads: int,
          kv_heads: int, seed: int = 0, mix: str = "q4_k_m") -> None:
    import gguf

    from ferrobatch.model.gguf_file import GGUFFile
    from ferrobatch.model.gguf_loader import read_tokenizer_metadata
    from ferrobatch.model.loader import smollm2_gguf_path

    tok = read_tokenizer_metadata(GGUFFile(smollm2_gguf_path()))
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(4096)
    w.add_tokenizer_model(tok.model)
    w.add_tokenizer_pre(tok.pre or "default")
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    vocab = len(tok.tokens)

    def add(name: str, type_name: str, rows: int, cols: int) -> None:
        type_name = "Q8_0" if mix == "q8_0" else type_name
        w.add_tensor(name, random_blocks(type_name, rows, cols, rng),
                     raw_dtype=gguf.GGMLQuantizationType[type_name])

    add("token_embd.weight", "Q4_K", vocab, hidden)
    add("output.weight", "Q6_K", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        more_bits = "Q6_K" if i % 2 == 0 else "Q4_K"
        add(f"blk.{i}.attn_q.weight", "Q4_K", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", "Q4_K", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", more_bits, kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", "Q4_K", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", "Q4_K", intermediate, hidden)
        add(f"blk.{i}.ffn_up.weight", "Q4_K", intermediate, hidden)
        add(f"blk.{i}.ffn_down.weight", more_bits, hidden, intermediate)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--hidden", type=positive_int, default=1024)
    parser.add_argument("--intermediate", type=positive_int, default=2816)
    parser.add_argument("--layers", type=positive_int, default=12)
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--kv-heads", type=positive_int, default=4)
    parser.add_argument("--mix", choices=("q4_k_m", "q8_0"), default="q4_k_m")
    args = parser.parse_args()
    multiple = 256 if args.mix == "q4_k_m" else 32
    for name in ("hidden", "intermediate"):
        if getattr(args, name) % multiple:
            parser.error(f"--{name} {getattr(args, name)}: {args.mix} needs multiples of {multiple}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must divide --hidden and be a multiple of --kv-heads")
    write(args.path, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads,
          mix=args.mix)
    print(f"wrote {args.path} ({os.path.getsize(args.path) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
