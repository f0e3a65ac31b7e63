"""GGUF file -> (ModelConfig, float32 state dict in Hugging Face naming, tokenizer metadata).

llama.cpp stores Llama Q/K projection rows permuted for its interleaved RoPE; we undo that so the
model can use the Hugging Face (half-split) rotation. Tied embeddings: no ``output.weight``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ferrobatch.model.attention_window import capped_to_window
from ferrobatch.model.block_weights import (
    BlockWeight,
    kept_as_blocks,
    module_block_weights,
)
from ferrobatch.model.config import GGUF_PERMUTED_QK, ModelConfig
from ferrobatch.model.dequant import dequantize_tensor
from ferrobatch.model.fused_tensors import split_fused_projections
from ferrobatch.model.gguf_file import GGUFFile, GGUFTensorInfo
from ferrobatch.model.progress import load_progress
from ferrobatch.model.quantized_embedding import QuantizedEmbedding, keeps_table
from ferrobatch.model.rope import rope_context_length
from ferrobatch.model.tokenizer import BOS_BY_DEFAULT

_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
               "granite": "granite", "smollm3": "smollm3", "gemma3": "gemma3"}

# GGUF per-block tensor name -> Hugging Face module name.
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",      # fused (Phi-3); split by fused_tensors
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",      # Qwen3: per-head q / k RMSNorm weights
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Phi-3's converter keeps gate/up fused under ffn_up (gate rows first, as ggml's swiglu splits);
# Gemma 3's norms after attention and the MLP, its ffn_norm before the MLP (transformers' names)
_ARCH_BLOCK_TENSORS = {
    "phi3": {**_BLOCK_TENSORS, "ffn_up": "mlp.gate_up_proj"},
    "gemma3": {**_BLOCK_TENSORS, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}


@dataclass
class GGUFTokenizerMetadata:
    """The ``tokenizer.*`` fields of a GGUF file."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    extra: dict[str, Any] = field(default_factory=dict)


def reverse_llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row permutation: rows ``(head, half, pair)`` -> ``(head, pair, half)``."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's forward Q/K permutation (HF layout -> GGUF layout); the inverse of the above."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def _read_config(reader: GGUFFile, tensor_names: set[str]) -> ModelConfig:
    gguf_arch = _field_value(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(_GGUF_ARCHS)}"
        )
    a = gguf_arch

    def need(key: str) -> Any:
        v = _field_value(reader, f"{a}.{key}")
        if v is None:
            raise ValueError(f"GGUF file lacks required metadata key {a}.{key}")
        return v

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    vocab = _field_value(reader, f"{a}.vocab_size")
    if vocab is None:
        vocab = len(reader.metadata.get("tokenizer.ggml.tokens", ()))
    head_dim = int(_field_value(reader, f"{a}.attention.key_length", hidden // num_heads))
    rotary_dim = int(_field_value(reader, f"{a}.rope.dimension_count", head_dim))
    rope_scaling = None
    scaling_type = _field_value(reader, f"{a}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": float(_field_value(reader, f"{a}.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                _field_value(reader, f"{a}.rope.scaling.original_context_length", 0)),
        }
        for key in ("beta_fast", "beta_slow"):     # YaRN's ramp, where the converter wrote it
            value = _field_value(reader, f"{a}.rope.scaling.yarn_{key}")
            if value is not None:
                rope_scaling[key] = float(value)
    if "rope_factors_short.weight" in tensor_names:    # LongRoPE (Phi-3 128k, Phi-3.5)
        rope_scaling = _longrope_scaling(reader, a)
    context = rope_context_length(int(_field_value(reader, f"{a}.context_length", 4096)),
                                  rope_scaling)
    if a != "gemma3":     # Gemma 3's windows are attended as windows (_gemma3_fields)
        context = capped_to_window(context, _field_value(reader, f"{a}.attention.sliding_window"),
                                   "the GGUF file")
    return ModelConfig(
        arch=_GGUF_ARCHS[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field_value(reader, f"{a}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        **_granite_scalars(reader, a),
        **_gemma3_fields(reader, a, head_dim),
        # llama.cpp's SmolLM3: no RoPE in every fourth layer (a constant there, no key)
        nope_layers=tuple(i for i in range(int(need("block_count"))) if (i + 1) % 4 == 0)
        if a == "smollm3" else (),
        rms_norm_eps=float(_field_value(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field_value(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=_field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field_value(reader, "tokenizer.ggml.eos_token_id"),
    )


def _granite_scalars(reader: GGUFFile, a: str) -> dict[str, Any]:
    """Granite's four scalars as llama.cpp's converter writes them."""
    if a != "granite":
        return {}
    return {"embedding_multiplier": float(_field_value(reader, f"{a}.embedding_scale", 1.0)),
            "residual_multiplier": float(_field_value(reader, f"{a}.residual_scale", 1.0)),
            "logits_scaling": float(_field_value(reader, f"{a}.logit_scale", 1.0)),
            "attention_multiplier": float(_field_value(reader, f"{a}.attention.scale", 1.0))}


def _gemma3_fields(reader: GGUFFile, a: str, head_dim: int) -> dict[str, Any]:
    """Gemma 3 as llama.cpp runs it (``model.gemma3``): what its converter leaves out of the
    metadata are constants there: every sixth layer global, the sliding layers' RoPE base
    10,000, the attention scale ``head_dim ** -0.5`` (27B, 62 layers: ``(hidden / heads) **
    -0.5``) unless the file gives one."""
    if a != "gemma3":
        return {}
    layers = int(_field_value(reader, f"{a}.block_count"))
    hidden = int(_field_value(reader, f"{a}.embedding_length"))
    window = _field_value(reader, f"{a}.attention.sliding_window")
    if not window:
        raise ValueError(f"GGUF file lacks {a}.attention.sliding_window")
    scale = _field_value(reader, f"{a}.attention.scale")
    if scale is None:
        heads = int(_field_value(reader, f"{a}.attention.head_count"))
        scale = (hidden / heads if layers == 62 else head_dim) ** -0.5
    return {"sliding_window": int(window),
            "sliding_layers": tuple(i for i in range(layers) if (i + 1) % 6),
            "local_rope_theta": 10000.0, "sandwich_norms": True, "hidden_act": "gelu_tanh",
            "attention_multiplier": float(scale),
            "embedding_scale": float(torch.tensor(hidden ** 0.5, dtype=torch.float32))}


def _longrope_scaling(reader: GGUFFile, a: str) -> dict[str, Any]:
    """LongRoPE as llama.cpp's converter stores it: the per-frequency factors as the tensors
    ``rope_factors_short`` / ``rope_factors_long``, the attention factor and the original
    context as metadata."""
    def factors(name: str) -> list[float]:
        tensor = reader.tensors[name]
        return dequantize_tensor(tensor.data, tensor.type_id, tensor.type_name).flatten().tolist()

    original = _field_value(reader, f"{a}.rope.scaling.original_context_length")
    if not original:
        raise ValueError(f"GGUF file has LongRoPE factors but no {a}.rope.scaling.original_context_length")
    scaling = {"rope_type": "longrope", "short_factor": factors("rope_factors_short.weight"),
               "original_max_position_embeddings": int(original),
               "factor": int(_field_value(reader, f"{a}.context_length", original)) / int(original)}
    if "rope_factors_long.weight" in reader.tensors:
        scaling["long_factor"] = factors("rope_factors_long.weight")
    attention = _field_value(reader, f"{a}.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    block_tensors = _ARCH_BLOCK_TENSORS.get(arch, _BLOCK_TENSORS)
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in block_tensors:
        return f"model.layers.{parts[1]}.{block_tensors[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_TENSORS:
        return f"{_TOP_TENSORS[parts[0]]}.{parts[1]}"
    return None


def read_tokenizer_metadata(reader: GGUFFile) -> GGUFTokenizerMetadata:
    """Extracts the tokenizer fields (vocabulary, merges, token types, specials, chat template)."""
    model = _field_value(reader, "tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    pre = _field_value(reader, "tokenizer.ggml.pre")
    return GGUFTokenizerMetadata(
        model=model,
        pre=pre,
        tokens=list(_field_value(reader, "tokenizer.ggml.tokens", [])),
        token_types=[int(t) for t in _field_value(reader, "tokenizer.ggml.token_type", [])],
        merges=list(_field_value(reader, "tokenizer.ggml.merges", [])),
        bos_token_id=_field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field_value(reader, "tokenizer.ggml.eos_token_id"),
        # llama.cpp's default: BOS for SentencePiece vocabularies, none for byte-level BPE but
        # Llama 3's and Tekken's
        add_bos_token=bool(_field_value(reader, "tokenizer.ggml.add_bos_token",
                                        model == "llama" or pre in BOS_BY_DEFAULT)),
        chat_template=_field_value(reader, "tokenizer.chat_template"),
        extra={"add_eos_token": bool(_field_value(reader, "tokenizer.ggml.add_eos_token", False)),
               "scores": _field_value(reader, "tokenizer.ggml.scores"),
               "add_space_prefix": bool(_field_value(reader, "tokenizer.ggml.add_space_prefix",
                                                     True)),
               "unknown_token_id": _field_value(reader, "tokenizer.ggml.unknown_token_id")},
    )


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizerMetadata]:
    """Reads a GGUF file into a float32 CPU state dict (HF names, Q/K un-permuted for Llama)."""
    config, state, meta, _, _ = _read_gguf(path, keep_blocks=False)
    return config, state, meta


def load_gguf_blocks(path: str | os.PathLike) -> tuple[
        ModelConfig, dict[str, torch.Tensor], GGUFTokenizerMetadata, dict[str, BlockWeight],
        QuantizedEmbedding | None]:
    """As :func:`load_gguf`, but the linear layers the CPU block kernels read are never
    dequantized: their state entries are meta-device placeholders of the right shape, and the
    fourth value maps each such module (``layers.3.self_attn.qkv_proj``, ``lm_head``) to its
    blocks, laid out as the model keeps the weight (``block_weights.module_block_weights``).
    A module only partly in block formats is dequantized whole. The fifth value is the token
    embedding kept in the file's format (``quantized_embedding.keeps_table``; its state entry a
    placeholder too), or None where it is dequantized; a tied one is also the LM head's
    blocks."""
    return _read_gguf(path, keep_blocks=True)


def _read_gguf(path: str | os.PathLike, keep_blocks: bool) -> tuple[
        ModelConfig, dict[str, torch.Tensor], GGUFTokenizerMetadata, dict[str, BlockWeight],
        QuantizedEmbedding | None]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFFile(path)
    except OSError as exc:
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
    tensor_names = set(reader.tensors)
    config = _read_config(reader, tensor_names)
    if "rope_freqs.weight" in reader.tensors:  # Llama-3.1 style scaling baked into per-dim factors
        factors = reader.tensors["rope_freqs.weight"]
        values = dequantize_tensor(factors.data, factors.type_id, factors.type_name).flatten()
        config = dataclasses.replace(
            config, rope_scaling={"rope_type": "freq_factors", "factors": values.tolist()})
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, GGUFTensorInfo] = {}      # made into their modules' blocks below
    embedding = None
    tensors = list(reader.tensors.values())
    total = sum(t.data.nbytes for t in tensors)
    bar = load_progress(total, "Reading GGUF weights" if keep_blocks else "Dequantizing GGUF weights")
    for tensor in tensors:
        name = _hf_name(tensor.name, config.arch)
        ndim = len(tensor.shape)
        kept = False        # a placeholder in state: the weight is served from the file's bytes
        if name is not None and keep_blocks and \
                kept_as_blocks(name, tensor.type_id, ndim, config):
            blocks[name] = tensor       # (its bytes reach the bar as its module is made)
            kept = True     # (a tied embedding in blocks is also a kept table: keeps_table)
        else:
            bar.update(tensor.data.nbytes)
        if name is None:
            continue  # e.g. rope_freqs (not used) or tensors of other heads
        if keep_blocks and keeps_table(name, tensor.type_id, ndim, config):
            embedding = QuantizedEmbedding.from_gguf(tensor)
            kept = True
        if kept:
            state[name] = torch.empty(tensor.shape, device="meta")
            continue
        weight = dequantize_tensor(tensor.data, tensor.type_id, tensor.type_name)
        if config.arch == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp's converter stored 1 + weight, which the model layout computes again
            # (model.gemma3.norm_in_model_layout): weight - 1 in float64 is exact, so the file's
            # values come back bit for bit
            weight = weight.double() - 1.0
        state[name] = unpermute_qk(name, weight, config)
    modules = module_block_weights(blocks, state, config, progress=bar.update) \
        if keep_blocks else {}
    bar.close()
    return (config, split_fused_projections(state, config), read_tokenizer_metadata(reader),
            modules, embedding)


def permuted_qk_heads(name: str, config: ModelConfig) -> int | None:
    """The head count of a Q or K projection whose rows llama.cpp's converter permuted (the
    architectures in ``GGUF_PERMUTED_QK``); None for any other tensor."""
    if config.arch in GGUF_PERMUTED_QK and ".q_proj." in name:
        return config.num_heads
    if config.arch in GGUF_PERMUTED_QK and ".k_proj." in name:
        return config.num_kv_heads
    return None


def unpermute_qk(name: str, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A Q or K projection's rows back in Hugging Face order (:func:`permuted_qk_heads`);
    other tensors as they are."""
    heads = permuted_qk_heads(name, config)
    return rows if heads is None else reverse_llama_permute(rows, heads)
