"""A checkpoint's tensors (named and laid out as in transformers) as the model keeps them.

Two models keep some weights otherwise than their checkpoints:

* RoPE over part of each head (Phi-4-mini): q / k head dims reordered
  (``partial_rotary.reorder_heads``);
* Granite's scalars folded into the weights, exactly in real arithmetic: the embedding table
  times ``embedding_multiplier``, the attention and MLP output projections times
  ``residual_multiplier`` (their outputs are only ever added to the residual stream), and the
  final norm's weight divided by ``logits_scaling`` and, where the LM head is the (scaled)
  embedding table, by ``embedding_multiplier`` too (logits are linear in the normed hidden
  state). So every kernel runs these models as it runs Llama.

Everything that puts checkpoint tensors into the model goes through :func:`to_model_layout`:
the loaders (:func:`state_in_model_layout`), weight updates and LoRA B matrices.
"""

from __future__ import annotations

import torch

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.partial_rotary import head_dim_order, reorder_heads


def folded_factor(name: str, config: ModelConfig) -> float:
    """What the model multiplies the tensor ``name`` by (1.0 but for Granite's)."""
    if name.endswith("embed_tokens.weight"):
        return config.embedding_multiplier
    if name == "model.norm.weight":
        tied = config.embedding_multiplier if config.tie_word_embeddings else 1.0
        return 1.0 / (config.logits_scaling * tied)
    if "self_attn.o_proj." in name or "mlp.down_proj." in name:
        return config.residual_multiplier
    return 1.0


def is_identity(config: ModelConfig) -> bool:
    """True when the model keeps every checkpoint tensor as it is."""
    return head_dim_order(config) is None and config.embedding_multiplier == 1.0 \
        and config.residual_multiplier == 1.0 and config.logits_scaling == 1.0


def to_model_layout(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """``tensor`` (transformers' name ``name``: a model weight or bias, or a LoRA B named as its
    module's weight) as the model keeps it."""
    tensor = reorder_heads(name, tensor, config)
    factor = folded_factor(name, config)
    return tensor if factor == 1.0 else tensor * factor


def state_in_model_layout(state: dict[str, torch.Tensor],
                          config: ModelConfig) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with :func:`to_model_layout` applied."""
    if is_identity(config):
        return state
    return {name: to_model_layout(name, t, config) for name, t in state.items()}
