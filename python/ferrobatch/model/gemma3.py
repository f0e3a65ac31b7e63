"""Gemma 3 text models (``gemma3_text``: gemma-3-270m, gemma-3-1b and their fine-tunes) as a
Llama-family config.

What Gemma 3 does beyond Llama, and where ferrobatch does it:

* five of every six layers attend over a sliding window of the last ``sliding_window``
  positions (512), with RoPE base 10,000; the others over the whole context with base 1,000,000
  (``ModelConfig.sliding_layers`` / ``local_rope_theta``; the attention backends take the
  window, ``LlamaAttention.window``);
* RMSNorms on the attention and MLP outputs before their residual adds ("sandwich" norms), and
  every RMSNorm multiplies by ``1 + weight``: the loader keeps ``1 + weight`` in float32, as
  transformers computes it (``model_layout``), so the norms are Llama's;
* q / k RMS-normed per head (as Qwen3), attention scale ``query_pre_attn_scalar ** -0.5``;
* GeGLU (GELU, tanh form) instead of SwiGLU; token embeddings times ``sqrt(hidden_size)``
  (rounded to float32) as they are looked up; the embedding table is the LM head.

Gemma 2's logit soft-capping and EmbeddingGemma's bidirectional attention are refused; the
multimodal Gemma 3 checkpoints (4B and up, ``gemma3``) are not text checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

# transformers' names of a Gemma 3 layer's norms -> the model's (LlamaDecoderLayer): its
# ``post_attention_layernorm`` is the norm before the MLP, as in Llama
LAYER_NORM_NAMES = {
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_out_norm",
}


def is_gemma3(cfg: dict[str, Any]) -> bool:
    """True for a Gemma 3 text ``config.json``."""
    return cfg.get("model_type") == "gemma3_text"


def gemma3_config_json(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 ``config.json`` as the common parser reads it: the full-attention layers' RoPE
    settings at the top level (transformers >= 5 nests them per layer type)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"config.json: {key} is set; ferrobatch serves Gemma 3 without "
                             "logit soft-capping")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: bidirectional attention (an embedding model such as "
                         "EmbeddingGemma) is not a causal language model")
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        cfg = {**cfg, "rope_parameters": dict(rope["full_attention"])}
    return cfg


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:     # older configs: every `pattern`-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: layer_types must name 'full_attention' or "
                         f"'sliding_attention' for each of the {layers} layers")
    return list(types)


def gemma3_fields(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 3 ``config.json`` beyond the common ones."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json: hidden_activation {act!r} is not served (Gemma 3 uses "
                         "gelu_pytorch_tanh)")
    types = _layer_types(cfg)
    rope = cfg.get("rope_parameters")
    local = rope.get("sliding_attention") if isinstance(rope, dict) else None
    local_theta = (local or {}).get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0)
    hidden = int(cfg["hidden_size"])
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = cfg.get("sliding_window")
    if sliding and not window:
        raise ValueError("config.json: sliding-window layers without a sliding_window")
    return {
        "sliding_window": int(window) if window else None,
        "sliding_layers": sliding,
        "local_rope_theta": float(local_theta),
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
        "qk_norm": True,
        "attention_multiplier": float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        # transformers' `torch.tensor(hidden ** 0.5)` in the embedding's dtype (float32 here)
        "embedding_scale": float(torch.tensor(hidden ** 0.5, dtype=torch.float32)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def norm_in_model_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A Gemma RMSNorm weight as the model keeps it: ``1 + weight`` rounded once to float32
    (transformers' float32 sum; exact in float64 first, so a GGUF's stored ``1 + weight``,
    given back as ``weight - 1`` in float64, returns bit for bit)."""
    return (tensor.double() + 1.0).float()
