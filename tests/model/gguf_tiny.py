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
# Gemma 3's layer norms (transformers' names: post_attention_layernorm is the attention output's)
_GEMMA3_NAMES = {**_BLOCK_NAMES, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def random_blocks(type_name: str, rows: int, cols: int, seed: int):
    """``type_name`` blocks ``uint8 [rows, bytes]`` of random bytes (gguf-py cannot quantize to
    the k-quants; any bytes are valid blocks), their fp16 factors set so that the weights stay
    within about +-0.3."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block_elems * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, block_bytes)
    factors = {"Q4_K": ((0, 4e-4), (2, 4e-4)), "Q5_K": ((0, 2e-4), (2, 2e-4)),
               "Q6_K": ((208, 1e-4),), "Q5_0": ((0, 0.02),), "Q5_1": ((0, 0.01), (2, 0.15)),
               "Q4_0": ((0, 0.04),), "Q4_1": ((0, 0.02), (2, 0.15)), "Q8_0": ((0, 0.002),),
               "Q2_K": ((80, 0.01), (82, 0.01)), "Q3_K": ((108, 0.005),),
               "IQ4_NL": ((0, 0.002),), "IQ4_XS": ((0, 2e-4),)}
    for start, high in factors[type_name]:
        factor = rng.uniform(high / 4, high, blocks.shape[:2]).astype(np.float16)
        blocks[..., start:start + 2] = factor.view(np.uint8).reshape(rows, -1, 2)
    return raw


def write_tiny_gguf(path, reference, cfg: dict, arch: str,
                    metadata: Callable | None = None, q8_0_linears: bool = False,
                    q4_k_linears: bool = False, vocabulary: Callable | None = None,
                    linear_types: Callable | None = None,
                    embedding_type: str | None = None) -> None:
    """Writes ``reference`` (a transformers model of config dict ``cfg``) as a GGUF of ``arch``
    with a byte-level vocabulary of single characters. For the architectures whose converter
    permutes Q / K rows for llama.cpp's interleaved RoPE (llama, granite) the rows are permuted
    as it does; Gemma 3's norm weights are stored as ``1 + weight``, as its converter does.
    ``metadata(writer)`` adds keys of its own (rope scaling, ...). With ``q8_0_linears`` the
    linear layers' weights are stored as Q8_0 blocks and ``reference``'s own weights replaced by
    what those blocks hold, so it stays the oracle; with ``q4_k_linears`` they are random Q4_K
    blocks (:func:`random_blocks`), dequantized into ``reference`` by gguf-py; ``linear_types``
    (llama.cpp tensor name -> a type name, or None for float32) does the same per tensor.
    ``vocabulary(writer)`` writes the tokenizer keys in place of the single-character one;
    ``embedding_type`` stores the token embeddings in that block type (random blocks, as the
    linears) or as F16 (the values rounded)."""
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
    writer.add_rope_freq_base(cfg.get("rope_theta", 1e6))
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
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
                names = _GEMMA3_NAMES if arch == "gemma3" else _BLOCK_NAMES
                gguf_name = f"blk.{parts[1]}.{names[module]}.{parts[-1]}"
            else:
                gguf_name = f"{_TOP_NAMES[parts[0]]}.{parts[-1]}"
        values = tensor.detach().float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1.0
        unpermute = None        # what turns the file's rows back into the reference's
        if arch in ("llama", "granite", "smollm3") and (".attn_q." in gguf_name
                                                        or ".attn_k." in gguf_name):
            from ferrobatch.model.gguf_loader import llama_permute, reverse_llama_permute
            heads = cfg["num_attention_heads"] if ".attn_q." in gguf_name \
                else cfg["num_key_value_heads"]
            values = llama_permute(values, heads)
            unpermute = lambda t, h=heads: reverse_llama_permute(t, h)      # noqa: E731
        values = values.numpy()
        chosen = "Q4_K" if q4_k_linears else None
        if linear_types is not None:
            chosen = linear_types(gguf_name)
        if gguf_name.startswith("token_embd"):
            chosen = embedding_type
        if chosen == "F16" and values.ndim == 2:
            import numpy as np
            import torch

            halves = values.astype(np.float16)
            with torch.no_grad():
                stored = torch.from_numpy(halves.astype(np.float32))
                tensor.copy_(stored if unpermute is None else unpermute(stored))
            writer.add_tensor(gguf_name, halves)
            continue
        if chosen and values.ndim == 2:
            import torch
            from gguf.quants import dequantize

            qtype = gguf.GGMLQuantizationType[chosen]
            blocks = random_blocks(chosen, *values.shape,
                                   seed=sum(map(ord, gguf_name)) * 1000 + values.shape[0])
            with torch.no_grad():
                stored = torch.from_numpy(dequantize(blocks, qtype).reshape(values.shape))
                tensor.copy_(stored if unpermute is None else unpermute(stored))
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            continue
        if q8_0_linears and values.ndim == 2 and not gguf_name.startswith("token_embd"):
            import torch
            from gguf.quants import dequantize, quantize

            blocks = quantize(values, gguf.GGMLQuantizationType.Q8_0)
            with torch.no_grad():
                stored = torch.from_numpy(
                    dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(values.shape))
                tensor.copy_(stored if unpermute is None else unpermute(stored))
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
