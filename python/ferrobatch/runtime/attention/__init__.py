"""Attention backends: ``get_attention_backend("auto" | "torch" | "cpu" | "cuda", device)``."""

from __future__ import annotations

import importlib
import logging
import os

import torch

from ferrobatch.runtime.attention.base import AttentionBackend, AttentionMetadata
from ferrobatch.runtime.attention.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchReferenceBackend", "get_attention_backend"]

logger = logging.getLogger(__name__)
_BACKEND_NAMES = ("auto", "torch", "cpu", "cuda")


def _load_cuda_backend(block_size: int, device: torch.device,
                       model_shape: tuple[int, int, int, torch.dtype] | None) -> AttentionBackend:
    """Imports the CUDA backend lazily; raises ImportError/RuntimeError when unavailable or when
    its kernels do not cover ``model_shape`` (num_heads, num_kv_heads, head_dim, dtype)."""
    module = importlib.import_module("ferrobatch.runtime.attention.cuda")
    available = getattr(module, "is_available", None)
    if callable(available) and not available():
        raise RuntimeError("CUDA attention kernels are not available (extension not built?)")
    backend_cls = getattr(module, "CudaAttentionBackend", None)
    if backend_cls is None:
        raise ImportError("ferrobatch.runtime.attention.cuda defines no CudaAttentionBackend")
    supports = getattr(backend_cls, "supports", None)
    if model_shape is not None and callable(supports):
        reason = supports(*model_shape)
        if reason is not None:
            raise RuntimeError(f"CUDA kernels do not support this model: {reason}")
    return backend_cls(block_size=block_size, device=device)


def _load_cpu_backend(block_size: int,
                      model_shape: tuple[int, int, int, torch.dtype] | None) -> AttentionBackend:
    """The Rust CPU kernels' backend; RuntimeError when they do not cover ``model_shape``.
    ``FERROBATCH_PREFILL_KERNEL=0`` in the environment keeps prefill chunks on torch's SDPA
    (A/B runs)."""
    from ferrobatch.runtime.attention.cpu import CpuPagedBackend, kernel_available

    if not kernel_available():
        raise RuntimeError("the compiled extension lacks the CPU attention kernel (rebuild it)")
    reason = CpuPagedBackend.supports(*model_shape) if model_shape is not None else None
    if reason is not None:
        raise RuntimeError(reason)
    return CpuPagedBackend(block_size=block_size,
                           prefill_kernel=os.environ.get("FERROBATCH_PREFILL_KERNEL", "1") != "0",
                           head_dim=model_shape[2] if model_shape is not None else None)


def get_attention_backend(name: str | None, device: torch.device | str, *, block_size: int = 16,
                          model_shape: tuple[int, int, int, torch.dtype] | None = None,
                          windows: bool = False) -> AttentionBackend:
    """Picks an attention backend. ``None``/"auto": the CUDA kernels on a CUDA device, the Rust
    CPU kernels on the CPU (float32), each when it loads and covers ``model_shape`` =
    (num_heads, num_kv_heads, head_dim, dtype) if given and, with ``windows`` (a model with
    sliding-window layers), attends over windows; else the torch reference (the reason is
    logged). "cuda" / "cpu" raise if their kernels cannot be used."""
    name = name or "auto"
    if name not in _BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(_BACKEND_NAMES)}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "cuda" and not is_cuda:
        raise ValueError("attention backend 'cuda' needs a CUDA device")
    if name == "cpu" and is_cuda:
        raise ValueError("attention backend 'cpu' needs a CPU device")
    if name in ("auto", "cpu") and not is_cuda:
        try:
            return _load_cpu_backend(block_size, model_shape)
        except (ImportError, RuntimeError) as exc:
            if name == "cpu":
                raise RuntimeError(f"CPU attention backend unavailable: {exc}") from exc
            logger.info("CPU attention kernel not used (%s); using the torch reference", exc)
    if name == "auto" and is_cuda and windows:
        logger.warning("the CUDA attention kernels take no sliding window yet: this model's "
                       "attention runs on the torch reference backend")
        return TorchReferenceBackend(block_size=block_size)
    if name in ("auto", "cuda") and is_cuda:
        try:
            return _load_cuda_backend(block_size, torch.device(device), model_shape)
        except (ImportError, RuntimeError, OSError) as exc:
            if name == "cuda":
                raise RuntimeError(f"CUDA attention backend unavailable: {exc}") from exc
            logger.warning("CUDA attention backend unavailable (%s); using the torch reference", exc)
    return TorchReferenceBackend(block_size=block_size)
