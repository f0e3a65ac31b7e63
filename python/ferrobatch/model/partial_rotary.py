"""RoPE over part of each head (``partial_rotary_factor``: Phi-4-mini rotates 96 of 128 dims)
on kernels that rotate whole heads.

Transformers rotates a head's first ``R`` dims as two halves (``i`` with ``i + R/2``) and leaves
the other ``P = D - R`` as they are. Every rotary path here (torch, the Rust CPU kernels, the
CUDA kernels) rotates dim ``i`` with ``i + D/2`` by a cos / sin table. So the model keeps q and k
in another order of each head's dims: ``[rotated first half, P/2 kept, rotated second half,
P/2 kept]``; the rotated pairs then sit ``D/2`` apart, and the kept dims pair with each other
under cos 1, sin 0 (``rope.RotaryEmbedding``). Attention scores are dot products of q and k
over a head, the same in any order both share, and v is not touched, so the outputs are
transformers'. What reorders: the q / k rows of the projections (weights, biases, LoRA B,
weight updates) and the q / k norms' weights, all through :func:`reorder_heads`
(``model_layout.to_model_layout``).
"""

from __future__ import annotations

import torch

from ferrobatch.model.config import ModelConfig


def head_dim_order(config: ModelConfig) -> torch.Tensor | None:
    """``order[j]``: the transformers dim the model keeps at dim ``j`` of a head; None when RoPE
    rotates whole heads (no reordering)."""
    d, r = config.head_dim, config.rope_dim
    if r == d:
        return None
    kept = (d - r) // 2
    return torch.cat((torch.arange(0, r // 2), torch.arange(r, r + kept),
                      torch.arange(r // 2, r), torch.arange(r + kept, d)))


def _rows_per_head(tensor: torch.Tensor, order: torch.Tensor, head_dim: int) -> torch.Tensor:
    heads = tensor.shape[0] // head_dim
    shaped = tensor.reshape(heads, head_dim, *tensor.shape[1:])
    return shaped[:, order].reshape(tensor.shape)


def reorder_heads(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """``tensor`` named as in transformers (``...self_attn.q_proj.weight``, ``k_proj``, a fused
    ``qkv_proj``, a ``q_norm`` / ``k_norm`` weight, or a LoRA B of one of those) in the model's
    order of each head's q / k dims; any other tensor, or a model with whole-head RoPE, as is."""
    order = head_dim_order(config)
    if order is None or "self_attn." not in name:
        return tensor
    d = config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    if ".q_proj." in name or ".k_proj." in name:
        return _rows_per_head(tensor, order, d)
    if ".qkv_proj." in name:
        q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
        return torch.cat((_rows_per_head(q, order, d), _rows_per_head(k, order, d), v))
    if ".q_norm." in name or ".k_norm." in name:
        return tensor[order]
    return tensor
