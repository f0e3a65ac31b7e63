"""Rotary position embeddings (Hugging Face half-split rotation), with linear, Llama-3 and YaRN scaling."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from ferrobatch.model.config import ModelConfig

logger = logging.getLogger(__name__)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim / 2]`` inverse frequencies after any rope scaling."""
    return rope_parameters(config)[0]


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies [head_dim / 2], attention factor)`` after any rope scaling: the
    factor multiplies every cos / sin (YaRN's "mscale"; 1.0 for the other types)."""
    dim = config.rope_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs tensor: theta_i / factor_i
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq factors: expected {inv_freq.shape[0]} values, got {factors.shape[0]}")
        return inv_freq / factors, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
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
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(config, inv_freq, scaling)
    if rope_type in ("longrope", "su"):
        return _longrope(config, inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                     "(supported: linear, llama3, yarn, longrope, freq_factors)")


def _longrope(config: ModelConfig, inv_freq: torch.Tensor,
               scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): each frequency divided by its
    ``short_factor`` (within the original context, the default: loaders cap the context there,
    :func:`rope_context_length`) or, where the scaling says ``use_long_factor`` (a context past
    the original was asked for, :func:`longrope_for_context`), by its ``long_factor``, at every
    position, as llama.cpp does for such a context; cos / sin scaled by the attention factor of
    the whole stretch (as transformers does at every length)."""
    which = "long_factor" if scaling.get("use_long_factor") else "short_factor"
    if which not in scaling:
        raise ValueError(f"longrope scaling lacks {which}")
    factors = torch.tensor(scaling[which], dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"longrope {which}: expected {inv_freq.shape[0]} values, "
                         f"got {factors.shape[0]}")
    attention = scaling.get("attention_factor")
    if attention is None:
        original = float(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or 1.0     # the loaders set it: max positions / original
        attention = (1.0 if float(factor) <= 1.0
                     else math.sqrt(1 + math.log(float(factor)) / math.log(original)))
    return inv_freq / factors, float(attention)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched ``factor`` times (eq. 21 of the paper)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(config: ModelConfig, inv_freq: torch.Tensor,
          scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN ("NTK-by-parts" plus an attention temperature): dimensions that turn fewer than
    ``beta_slow`` times over the original context are interpolated (divided by ``factor``),
    those turning more than ``beta_fast`` times are kept, a linear ramp blends those between."""
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    original = float(original)
    factor = scaling.get("factor")
    factor = float(factor) if factor else config.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)
    dim, base = config.rope_dim, config.rope_theta

    def dimension_turning(turns: float) -> float:
        # the (fractional) dimension index whose wavelength fits `turns` times in the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp   # 1: the dimension keeps its frequency; 0: it is interpolated
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


def rope_context_length(max_position_embeddings: int, scaling: dict | None) -> int:
    """The positions a model serves: its ``max_position_embeddings``; for YaRN the original
    context times the factor where that is longer (the context YaRN is switched on to reach:
    Qwen's model cards ask for the scaling and expect ``32768 * 4`` tokens); for LongRoPE its
    original context (where its short factors apply, see :func:`_longrope_short`)."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("longrope", "su") and scaling.get("use_long_factor"):
        return int(max_position_embeddings)
    if rope_type in ("longrope", "su") and scaling.get("original_max_position_embeddings"):
        original = int(scaling["original_max_position_embeddings"])
        if original < int(max_position_embeddings):
            logger.warning("LongRoPE: serving the original context of %d tokens (not %d) with "
                           "the short factors; a longer --max-model-len switches every "
                           "position to the long factors", original, max_position_embeddings)
        return min(int(max_position_embeddings), original)
    if rope_type == "yarn" and scaling.get("factor") and scaling.get("original_max_position_embeddings"):
        stretched = int(float(scaling["original_max_position_embeddings"]) * float(scaling["factor"]))
        return max(int(max_position_embeddings), stretched)
    return int(max_position_embeddings)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` indexed by token position (a
    module so they follow the model's device); see :meth:`tables` and :func:`apply_rotary`."""

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_parameters(config)
        positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        # partial rotary: the dims RoPE leaves alone sit after the rotated ones in each half
        # (model.partial_rotary), where cos 1 and sin 0 keep them as they are
        rest = (config.head_dim - config.rope_dim) // 2
        cos = torch.cat((freqs.cos() * attention_factor, freqs.new_ones(len(positions), rest)), -1)
        sin = torch.cat((freqs.sin() * attention_factor, freqs.new_zeros(len(positions), rest)), -1)
        self.register_buffer("cos_cached", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cached", torch.cat((sin, sin), dim=-1), persistent=False)

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


def longrope_for_context(config: ModelConfig, max_model_len: int | None) -> ModelConfig:
    """``config`` with LongRoPE's long factors at every position where ``max_model_len`` asks
    for more than the original context (its whole stretched context served, as llama.cpp does
    for such a context; transformers switches per sequence length: a longer ask is then
    refused by the engine against the stretched context); as it is otherwise."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su") \
            or max_model_len is None or max_model_len <= config.max_position_embeddings:
        return config
    original = int(scaling["original_max_position_embeddings"])
    stretched = int(round(original * float(scaling.get("factor") or 1.0)))
    logger.info("LongRoPE: the long factors at every position, for a context of up to %d "
                "tokens (past the original %d)", stretched, original)
    return dataclasses.replace(config, max_position_embeddings=stretched,
                               rope_scaling={**scaling, "use_long_factor": True})
