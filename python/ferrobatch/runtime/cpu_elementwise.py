"""The model's elementwise ops on the CPU (float32), each one Rust call instead of several torch
ops (``ferrobatch._scheduler.rms_norm_f32`` / ``rotary_f32``, source
``rust_scheduler/src/cpu_elementwise.rs``).

At decode sizes torch's per-op dispatch dominates these: an RMSNorm is seven ops (~70 µs, 61 per
SmolLM2 step: ~4.5 ms of a ~57 ms 8-row step on the dev VM), RoPE twelve (~2.6 ms per step).
``swap_elementwise_ops(model)`` replaces every llama ``RMSNorm`` and ``ApplyRotary`` module in
place (norm weights shared); results agree with the torch modules to float32 rounding.
``SiluAndMul`` stays in torch here: a scalar Rust version measured 1.2-1.5x slower than torch's
vectorized ``silu`` + ``mul`` at 16 and 256 rows. (The fused decode step, ``runtime.cpu_decoder``,
has its own vectorized one in Rust.)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def _check(x: torch.Tensor, what: str) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"{what} takes float32 CPU input, got {x.dtype} on {x.device}")


class RustRMSNorm(nn.Module):
    """``x / sqrt(mean(x**2, -1) + eps) * weight``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        from ferrobatch._scheduler import rms_norm_f32
        self._kernel = rms_norm_f32
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check(x, "RustRMSNorm")
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return torch.from_numpy(self.of_rows(rows.numpy())).view(x.shape)

    def of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The same on a C-contiguous float32 ``[N, hidden]`` array, without torch."""
        out = np.empty_like(rows)
        self._kernel(rows, self.weight.numpy(), self.eps, out)
        return out

    def extra_repr(self) -> str:
        return f"hidden={self.weight.shape[0]}, eps={self.eps}, kernel=rust"


class RustApplyRotary(nn.Module):
    """Rotate-half RoPE of ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` with
    ``RotaryEmbedding.tables`` (returns rotated contiguous copies)."""

    def __init__(self) -> None:
        super().__init__()
        from ferrobatch._scheduler import rotary_f32
        self._kernel = rotary_f32

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        _check(query, "RustApplyRotary")
        cos, sin = (t.reshape(t.shape[0], t.shape[-1]).contiguous().numpy() for t in tables)
        # rotated in place: on copies (contiguous() returns the input itself when it already is)
        query = query.contiguous() if not query.is_contiguous() else query.clone()
        key = key.contiguous() if not key.is_contiguous() else key.clone()
        self._kernel(query.numpy(), cos, sin)
        self._kernel(key.numpy(), cos, sin)
        return query, key


@torch.no_grad()
def swap_elementwise_ops(model: nn.Module) -> int:
    """Replaces each llama ``RMSNorm`` and ``ApplyRotary`` under ``model`` by its Rust
    counterpart; returns how many modules were replaced."""
    from ferrobatch.model.llama import RMSNorm
    from ferrobatch.model.rope import ApplyRotary

    def replacement(module: nn.Module) -> nn.Module | None:
        if type(module) is RMSNorm:
            return RustRMSNorm(module.weight, module.eps)
        if type(module) is ApplyRotary:
            return RustApplyRotary()
        return None

    targets = [(parent, name, new) for parent in model.modules()
               for name, child in parent.named_children()
               if (new := replacement(child)) is not None]
    for parent, name, new in targets:
        setattr(parent, name, new)
    return len(targets)
