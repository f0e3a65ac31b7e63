"""Updating a loaded model's weights in place, from tensors named as in Hugging Face's checkpoints.

What reinforcement-learning loops do between rollouts: the trainer's new weights (all of them,
or a few at a time) replace the served model's without a restart. :func:`plan_update` maps each
named tensor to where it lives in ferrobatch's model (q / k / v rows of the fused ``qkv_proj``,
gate / up rows of ``gate_up_proj``) and checks every name, shape and value before anything is
written; :func:`apply_update` then copies them in:

* a plain parameter (embeddings, norms, ``nn.Linear`` weights on CUDA or in bfloat16) is copied
  into in place, so captured CUDA graphs, which read it by address, stay valid;
* a CPU linear layer in the Rust kernels (``PanelLinear``) has the rows written into its
  panels in place (``write_rows``); one also read from GGUF blocks stops reading them and gets
  float32 panels back (the quantized blocks no longer hold its weights);
* with tied embeddings, the packed LM head (a copy of the embedding matrix) is rewritten too;
* an embedding kept in the GGUF file's format (``QuantizedEmbedding``) is replaced by a float32
  ``nn.Embedding`` of the new values.

Names that carry no weight of this model (``rotary_emb.inv_freq``; ``lm_head.weight`` of a
model whose LM head is its embeddings) are skipped, as vLLM skips them; any other unknown name
is a ValueError that writes nothing. The caller keeps cached KV from mixing with the new
weights (``EngineCore.update_weights``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ferrobatch.model.model_layout import model_name, to_model_layout
from ferrobatch.model.quantized_embedding import QuantizedEmbedding
from ferrobatch.runtime.cpu_linear import PanelLinear

SKIPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {"self_attn.q_proj": ("self_attn", "qkv_proj", 0),
          "self_attn.k_proj": ("self_attn", "qkv_proj", 1),
          "self_attn.v_proj": ("self_attn", "qkv_proj", 2),
          "self_attn.o_proj": ("self_attn", "o_proj", 0),
          "mlp.gate_proj": ("mlp", "gate_up_proj", 0),
          "mlp.up_proj": ("mlp", "gate_up_proj", 1),
          "mlp.down_proj": ("mlp", "down_proj", 0),
          # Phi-3 / Phi-4 checkpoints name the fused modules themselves: all their rows
          "self_attn.qkv_proj": ("self_attn", "qkv_proj", None),
          "mlp.gate_up_proj": ("mlp", "gate_up_proj", None)}
_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
          "attn_out_norm", "mlp_out_norm")      # the last two: Gemma 3's (model_layout)


@dataclass
class _Write:
    """One tensor's destination: ``module``'s weight (or bias) rows ``start ..``, or a plain
    parameter (``module`` None)."""

    name: str
    value: torch.Tensor
    param: torch.Tensor | None = None      # a plain parameter, copied into whole
    module: nn.Module | None = None        # a linear layer (nn.Linear or PanelLinear), or
    #                                        a QuantizedEmbedding, replaced whole
    start: int = 0
    rows: int | None = None                # a fused module's part: its rows (None: all)
    bias: bool = False

    def expected_shape(self) -> tuple[int, ...]:
        if self.param is not None:
            return tuple(self.param.shape)
        out, k = _linear_shape(self.module)
        rows = out if self.rows is None else self.rows
        return (rows,) if self.bias else (rows, k)


@dataclass
class WeightUpdate:
    """What :func:`apply_update` will write (``writes``) and what it skips (``skipped``)."""

    writes: list[_Write]
    skipped: list[str]

    @property
    def num_tensors(self) -> int:
        return len(self.writes)


def _parts(config, module: str) -> list[tuple[int, int]] | None:
    """A fused module's parts (q, k, v / gate, up) as (first row, rows); None for others."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    if module == "qkv_proj":
        return [(0, q), (q, kv), (q + kv, kv)]
    if module == "gate_up_proj":
        inter = config.intermediate_size
        return [(0, inter), (inter, inter)]
    return None


def _linear_shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, QuantizedEmbedding):
        return module.num_embeddings, module.embedding_dim
    if isinstance(module, PanelLinear):
        return module.out_features, module.in_features
    return tuple(module.weight.shape)


def plan_update(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]] | Mapping
                ) -> WeightUpdate:
    """Checks every ``(name, tensor)`` against ``model`` (a ``LlamaForCausalLM``) and returns
    where each goes; ValueError (naming the tensor) for an unknown name, a shape that does not
    fit, a non-finite value or a name given twice. Reads nothing of the model's weights."""
    config = model.config
    writes: list[_Write] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for pair in weights.items() if isinstance(weights, Mapping) else weights:
        if not isinstance(pair, tuple | list) or len(pair) != 2 \
                or not isinstance(pair[0], str) or not isinstance(pair[1], torch.Tensor):
            raise ValueError("weights are (name, torch.Tensor) pairs or a dict of them")
        name, value = pair
        if name in seen:
            raise ValueError(f"{name}: given twice")
        seen.add(name)
        if SKIPPED.search(name) or (name == "lm_head.weight" and model.lm_head is None):
            skipped.append(name)
            continue
        value = to_model_layout(name, value, config)     # partial rotary, Granite's scalars
        write = _destination(model, config, model_name(name, config), value)
        want = write.expected_shape()
        if tuple(value.shape) != want:
            raise ValueError(f"{name}: shape {tuple(value.shape)}, the model's is {want}")
        if not value.is_floating_point():
            raise ValueError(f"{name}: dtype {value.dtype} is not a floating-point type")
        # any NaN or inf makes the sum non-finite; a non-finite sum of finite values (an
        # overflow) is told apart by the exact check
        if not bool(torch.isfinite(value.sum())) and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name}: holds NaN or infinite values")
        writes.append(write)
    return WeightUpdate(writes, skipped)


def _destination(model: nn.Module, config, name: str, value: torch.Tensor) -> _Write:
    if name == "model.embed_tokens.weight":
        if isinstance(model.embed_tokens, QuantizedEmbedding):
            return _Write(name, value, module=model.embed_tokens)
        return _Write(name, value, param=model.embed_tokens.weight)
    if name == "model.norm.weight":
        return _Write(name, value, param=model.norm.weight)
    if name == "lm_head.weight":
        return _Write(name, value, module=model.lm_head)
    match = _LAYER.match(name)
    if match is not None and int(match.group(1)) < len(model.layers):
        layer = model.layers[int(match.group(1))]
        rest = match.group(2)
        for norm in _NORMS:
            if rest == f"{norm}.weight":
                owner, _, attr = norm.rpartition(".")
                module = getattr(layer, owner) if owner else layer
                target = getattr(module, attr, None)
                if target is not None:
                    return _Write(name, value, param=target.weight)
        stem, _, kind = rest.rpartition(".")
        if stem in _FUSED and kind in ("weight", "bias"):
            owner, fused, part = _FUSED[stem]
            module = getattr(getattr(layer, owner), fused)
            if kind == "bias" and module.bias is None:
                raise ValueError(f"{name}: this model's {fused} has no bias")
            parts = _parts(config, fused)
            start, rows = (0, None) if parts is None or part is None else parts[part]
            return _Write(name, value, module=module, start=start, rows=rows,
                          bias=kind == "bias")
    raise ValueError(f"{name}: not a tensor of this model ({type(model).__name__}, "
                     f"{config.num_layers} layers)")


@torch.no_grad()
def apply_update(model: nn.Module, update: WeightUpdate) -> int:
    """Writes ``update`` (from :func:`plan_update` on the same model) into the model; returns
    how many linear layers stopped reading GGUF blocks. Between steps only."""
    unblocked = 0
    embedding_changed = False
    for w in update.writes:
        if w.param is not None:
            w.param.copy_(w.value.to(w.param.dtype))
            embedding_changed |= w.name == "model.embed_tokens.weight"
            continue
        module = w.module
        if isinstance(module, QuantizedEmbedding):
            table = torch.empty(w.value.shape, dtype=torch.float32).copy_(w.value)
            model.embed_tokens = nn.Embedding(*table.shape, _weight=table, _freeze=True)
            embedding_changed = True
            continue
        if w.bias:
            module.bias[w.start:w.start + w.value.shape[0]].copy_(w.value.to(module.bias.dtype))
        elif isinstance(module, PanelLinear):
            unblocked += module.blocks is not None
            module.write_rows(w.start, w.value.to(torch.float32))
        else:
            module.weight[w.start:w.start + w.value.shape[0]].copy_(
                w.value.to(module.weight.dtype))
    head = getattr(model, "packed_lm_head", None)
    if embedding_changed and model.lm_head is None and isinstance(head, PanelLinear):
        unblocked += head.blocks is not None       # the tied head's packed copy
        head.write_rows(0, model.embed_tokens.weight.float())
    model.weights_generation = getattr(model, "weights_generation", 0) + 1
    return unblocked
