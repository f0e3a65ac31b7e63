"""Prepacked oneDNN weights for the CPU's float32 linear layers.

At decode sizes (a few to a few dozen rows) a plain ``F.linear`` repacks its weight on every
call and streams it at about half the memory bandwidth a one-row GEMV reaches; oneDNN's
inner product with the weight reordered once into its blocked layout does not. Measured on the
2-core EPYC dev box over SmolLM2's 30 layers plus LM head (``benches/cpu_kernels.py``, README
"Results"): 1.6-1.8x faster at 4-16 rows, ~1.1x at 512 (prefill chunks). Results agree with ``F.linear`` to float32 rounding (relative ~1e-6), not bit
for bit: the summation order differs.

``pack_linear_layers(model)`` swaps every ``nn.Linear`` for a :class:`PackedLinear` (the dense
weight is released, so memory stays the same) and gives the model a packed LM head.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if linear layers on ``device``/``dtype`` can be prepacked, else the reason."""
    if device.type != "cpu":
        return f"prepacked weights are for the CPU (device {device})"
    if dtype != torch.float32:
        return f"prepacked weights are float32 only (dtype {dtype})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


@torch.no_grad()
def pack_linear_layers(model: nn.Module) -> int:
    """Replaces each ``nn.Linear`` under ``model`` by a :class:`PackedLinear` and, for a model with
    a ``packed_lm_head`` slot, fills it (the packed ``lm_head``, or a packed copy of the tied
    embedding matrix). Returns how many weights were packed (0 when already packed)."""
    num_packed = 0
    wants_head = hasattr(model, "packed_lm_head") and model.packed_lm_head is None
    if wants_head and getattr(model, "lm_head", None) is None:  # tied to the embeddings
        model.packed_lm_head = PackedLinear(model.lm_head_weight)
        num_packed += 1
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, linear in targets:
        setattr(parent, name, PackedLinear(linear.weight, linear.bias))
    if wants_head and model.packed_lm_head is None:
        model.packed_lm_head = model.lm_head
    return num_packed + len(targets)
