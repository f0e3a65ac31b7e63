"""Rotary position embeddings (Hugging Face half-split rotation), with Llama-3 / linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from ferrobatch.model.config import ModelConfig


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim / 2]`` inverse frequencies after any rope scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs tensor: theta_i / factor_i
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq factors: expected {inv_freq.shape[0]} values, got {factors.shape[0]}")
        return inv_freq / factors
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_factor = float(scaling.get("low_freq_factor", 1.0))
        high_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low_factor, old_len / high_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: linear, llama3, freq_factors)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` indexed by token position (a
    module so they follow the model's device); see :meth:`tables` and :func:`apply_rotary`."""

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(config).to(device)
        positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of each token's position, ``[T, 1, D]`` in ``dtype``: looked up once
        per step and shared by every layer (see :func:`apply_rotary`)."""
        cos = self.cos_cached[positions].to(dtype)[:, None, :]
        sin = self.sin_cached[positions].to(dtype)[:, None, :]
        return cos, sin


class ApplyRotary(nn.Module):
    """:func:`apply_rotary` as a module, so a runtime can swap in a faster implementation."""

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(query, key, tables)


def apply_rotary(query: torch.Tensor, key: torch.Tensor,
                 tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates ``query [T, Hq, D]`` and ``key [T, Hkv, D]`` with ``RotaryEmbedding.tables``."""
    cos, sin = tables
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
