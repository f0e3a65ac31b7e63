"""The Llama layer's elementwise modules on CUDA as ferrobatch's fused kernels (``cuda/elementwise.cu``):
RMSNorm in one kernel instead of ~8 (with the residual add before it in the same kernel:
``llama.add_then_norm``), SiLU-and-mul in one instead of 2, rotary embedding of q and k in place
in one instead of ~10. Inside a CUDA graph each launch costs ~2 us, so on the H200 a
decode step of SmolLM2-135M (30 layers, ~35 launches each) spends more on launches than on its
arithmetic. The kernels round where torch's eager ops round (see the .cu header).

Opt-in until checked on a GPU: ``FERROBATCH_CUDA_FUSED_OPS=1`` makes ``ModelRunner`` swap them in
on CUDA (``swap_cuda_elementwise_ops``); ``tests/gpu/test_elementwise.py`` checks them against the torch
modules they replace.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ferrobatch.model.llama import RMSNorm, SiluAndMul
from ferrobatch.model.rope import ApplyRotary
from ferrobatch.runtime import cuda_ops

ENV_FLAG = "FERROBATCH_CUDA_FUSED_OPS"


def fused_ops_requested() -> bool:
    """Whether ``FERROBATCH_CUDA_FUSED_OPS=1`` asks for the fused elementwise kernels."""
    return os.environ.get(ENV_FLAG, "0") == "1"


class CudaRMSNorm(nn.Module):
    """``RMSNorm`` in one kernel; shares the replaced module's weight."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))`` in one kernel (``llama.add_then_norm``)."""
        return cuda_ops.add_rms_norm(x, delta, self.weight, self.eps)


class CudaSiluAndMul(nn.Module):
    """``SiluAndMul`` in one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_ops.silu_and_mul(x)


class CudaApplyRotary(nn.Module):
    """``ApplyRotary`` in one kernel, rotating ``query`` and ``key`` in place (returns them)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = tables          # [T, 1, D], the model's dtype
        cuda_ops.rotary_inplace(query, key, cos.reshape(cos.shape[0], -1),
                                sin.reshape(sin.shape[0], -1))
        return query, key


def swap_cuda_elementwise_ops(model: nn.Module) -> int:
    """Replaces every RMSNorm / SiluAndMul / ApplyRotary of ``model`` (on CUDA) by its fused
    kernel; returns how many modules were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm:
                new = CudaRMSNorm(child)
            elif type(child) is SiluAndMul:
                new = CudaSiluAndMul()
            elif type(child) is ApplyRotary:
                new = CudaApplyRotary()
            else:
                continue
            setattr(parent, name, new)
            replaced += 1
    return replaced
