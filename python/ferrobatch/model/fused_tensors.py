"""Checkpoints that store q/k/v or gate/up as one tensor (Phi-3 / Phi-4: ``qkv_proj``,
``gate_up_proj``; llama.cpp's ``attn_qkv`` and Phi-3's fused ``ffn_up``) seen under the separate
Hugging Face Llama names every other path reads (``q_proj`` ... ``up_proj``)."""

from __future__ import annotations

import torch

from ferrobatch.model.config import ModelConfig

_QKV, _GATE_UP = "self_attn.qkv_proj.", "mlp.gate_up_proj."


def split_fused_projections(state: dict[str, torch.Tensor],
                            config: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` with each fused ``...self_attn.qkv_proj.{weight,bias}`` split into
    ``q_proj`` / ``k_proj`` / ``v_proj`` rows and each ``...mlp.gate_up_proj.weight`` into
    ``gate_proj`` / ``up_proj`` (views, no copies); other tensors as they are. ValueError
    when a fused tensor's rows do not add up to the config's parts."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if _QKV in name:
            parts = _split(name, tensor, (q, kv, kv))
            prefix, suffix = name.split(_QKV)
            for part, letter in zip(parts, "qkv"):
                out[f"{prefix}self_attn.{letter}_proj.{suffix}"] = part
        elif _GATE_UP in name:
            parts = _split(name, tensor, (config.intermediate_size,) * 2)
            prefix, suffix = name.split(_GATE_UP)
            out[f"{prefix}mlp.gate_proj.{suffix}"] = parts[0]
            out[f"{prefix}mlp.up_proj.{suffix}"] = parts[1]
        else:
            out[name] = tensor
    return out


def _split(name: str, tensor: torch.Tensor, rows: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] != sum(rows):
        raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {' + '.join(map(str, rows))}"
                         f" = {sum(rows)} for this model's shape")
    return tensor.split(list(rows))
