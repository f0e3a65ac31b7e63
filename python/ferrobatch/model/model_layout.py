"""A checkpoint's tensors (named and laid out as in transformers) as the model keeps them.

Three models keep some weights otherwise than their checkpoints:

* RoPE over part of each head (Phi-4-mini): q / k head dims reordered
  (``partial_rotary.reorder_heads``);
* Granite's scalars folded into the weights, exactly in real arithmetic: the embedding table
  times ``embedding_multiplier``, the attention and MLP output projections times
  ``residual_multiplier`` (their outputs are only ever added to the residual stream), and the
  final norm's weight divided by ``logits_scaling`` and, where the LM head is the (scaled)
  embedding table, by ``embedding_multiplier`` too (logits are linear in the normed hidden
  state). So every kernel runs these models as it runs Llama;
* Gemma 3's RMSNorm weights as ``1 + weight`` in float32 (``gemma3.norm_in_model_layout``), and
  its layer norms under the names of where they sit (:func:`model_name`: transformers'
  ``post_attention_layernorm`` is the attention output's norm, ``pre_feedforward_layernorm``
  the norm before the MLP, which Llama calls ``post_attention_layernorm``).

Everything that puts checkpoint tensors into the model goes through :func:`to_model_layout`:
the loaders (:func:`state_in_model_layout`), weight updates and LoRA B matrices.
"""

from __future__ import annotations

import re

import torch

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.gemma3 import LAYER_NORM_NAMES, norm_in_model_layout
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


_GEMMA_NORM = re.compile(r"^(model\.layers\.\d+\.)(" + "|".join(LAYER_NORM_NAMES)
                         + r")\.weight$")


def model_name(name: str, config: ModelConfig) -> str:
    """The model's name of the checkpoint tensor ``name`` (the same but for Gemma 3's layer
    norms)."""
    if config.arch != "gemma3":
        return name
    match = _GEMMA_NORM.match(name)
    return name if match is None else \
        f"{match.group(1)}{LAYER_NORM_NAMES[match.group(2)]}.weight"


def is_identity(config: ModelConfig) -> bool:
    """True when the model keeps every checkpoint tensor as it is."""
    return head_dim_order(config) is None and config.embedding_multiplier == 1.0 \
        and config.residual_multiplier == 1.0 and config.logits_scaling == 1.0 \
        and config.arch != "gemma3"


def to_model_layout(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """``tensor`` (transformers' name ``name``: a model weight or bias, or a LoRA B named as its
    module's weight) as the model keeps it."""
    tensor = reorder_heads(name, tensor, config)
    if config.arch == "gemma3" and name.endswith("norm.weight"):
        return norm_in_model_layout(tensor)
    factor = folded_factor(name, config)
    return tensor if factor == 1.0 else tensor * factor


def state_in_model_layout(state: dict[str, torch.Tensor],
                          config: ModelConfig) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with :func:`to_model_layout` applied, under :func:`model_name`."""
    if is_identity(config):
        return state
    return {model_name(name, config): to_model_layout(name, t, config)
            for name, t in state.items()}
