"""GGUF files (float32) of tiny transformers models, named and keyed as llama.cpp's converter
writes them: the oracle of the GGUF loader's architecture and rope-scaling paths."""

from __future__ import annotations

from collections.abc import Callable

# transformers module name -> llama.cpp tensor name, per block and at the top level.
_BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
                "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm"}


def random_q4_k(rows: int, cols: int, seed: int):
    """Q4_K blocks ``uint8 [rows, cols / 256 * 144]`` with random 6-bit scales, minimums and
    nibbles (gguf-py cannot quantize to Q4_K), their fp16 factors set so that the weights lie
    within about +-0.3."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, 144)
    for start in (0, 2):                                    # d, then dmin
        factor = rng.uniform(1e-4, 4e-4, blocks.shape[:2]).astype(np.float16)
        blocks[..., start:start + 2] = factor.view(np.uint8).reshape(rows, -1, 2)
    return raw


def write_tiny_gguf(path, reference, cfg: dict, arch: str,
                    metadata: Callable | None = None, q8_0_linears: bool = False,
                    q4_k_linears: bool = False, vocabulary: Callable | None = None) -> None:
    """Writes ``reference`` (a transformers model of config dict ``cfg``) as a GGUF of ``arch``
    with a byte-level vocabulary of single characters. Only architectures whose converter keeps
    transformers' Q / K row order (rotate-half RoPE: qwen2, qwen3, phi3) are written this way.
    ``metadata(writer)`` adds keys of its own (rope scaling, ...). With ``q8_0_linears`` the
    linear layers' weights are stored as Q8_0 blocks and ``reference``'s own weights replaced by
    what those blocks hold, so it stays the oracle; with ``q4_k_linears`` they are random Q4_K
    blocks (:func:`random_q4_k`), dequantized into ``reference`` by gguf-py.
    ``vocabulary(writer)`` writes the tokenizer keys in place of the single-character one."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_context_length(cfg["max_position_embeddings"])
    if vocabulary is not None:
        vocabulary(writer)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(sorted(ByteLevel.alphabet())[:cfg["vocab_size"]])
        writer.add_token_merges([])
    if metadata is not None:
        metadata(writer)
    tied = cfg.get("tie_word_embeddings", False)
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight":
            if tied:
                continue
            gguf_name = "output.weight"
        else:
            parts = name.removeprefix("model.").split(".")
            if parts[0] == "layers":
                module = ".".join(parts[2:-1])
                gguf_name = f"blk.{parts[1]}.{_BLOCK_NAMES[module]}.{parts[-1]}"
            else:
                gguf_name = f"{_TOP_NAMES[parts[0]]}.{parts[-1]}"
        values = tensor.detach().float().numpy()
        if q4_k_linears and values.ndim == 2 and not gguf_name.startswith("token_embd"):
            import torch
            from gguf.quants import dequantize

            blocks = random_q4_k(*values.shape, seed=len(gguf_name) * 1000 + values.shape[0])
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(
                    dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(values.shape)))
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            continue
        if q8_0_linears and values.ndim == 2 and not gguf_name.startswith("token_embd"):
            import torch
            from gguf.quants import dequantize, quantize

            blocks = quantize(values, gguf.GGMLQuantizationType.Q8_0)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(
                    dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(values.shape)))
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
