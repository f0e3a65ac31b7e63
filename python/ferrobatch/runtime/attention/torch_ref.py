"""Vectorized torch reference attention (CPU and GPU; the oracle for CUDA kernels).

Sequences are split into two groups, decode (one query token) and prefill (several), so a long
prefill chunk does not pad every decode row. Each group gathers its context K/V from the paged
cache a whole block at a time (through its block table) and runs one masked ``scaled_dot_product_attention``; GQA
folds the query heads of a KV head into the query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ferrobatch.runtime.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    StaticDecodeMetadata,
    static_decode_fields,
)
from ferrobatch.runtime.kv_cache import cache_values


@dataclass
class SequenceGroup:
    """Padded gather indices of a set of sequences (all tensors on device)."""

    query_token_index: torch.Tensor  # int64 [G, Q]; padded rows point at a dummy row (T)
    key_blocks: torch.Tensor  # int64 [G, K / block_size]; whole blocks are gathered (padding: 0)
    mask: torch.Tensor  # bool [G, 1, Q, K]; True = attend
    num_queries: int  # Q
    num_keys: int  # K (a multiple of block_size)
    query_pos: np.ndarray | None = None  # int64 [G, Q]: each query's position (for windows)
    windowed: dict = field(default_factory=dict)  # window -> its mask, made on first use

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer attending over ``window`` positions (None: the causal mask):
        query at position p sees keys p - window + 1 .. p."""
        if window is None:
            return self.mask
        mask = self.windowed.get(window)
        if mask is None:
            k_pos = np.arange(self.num_keys)[None, None, :]
            near = torch.from_numpy(k_pos > self.query_pos[:, :, None] - window)
            mask = self.mask & near[:, None].to(self.mask.device)
            mask[..., 0] |= ~mask.any(-1)   # padded query rows: one key (no NaN; discarded)
            self.windowed[window] = mask
        return mask


@dataclass
class TorchRefMetadata(AttentionMetadata):
    """AttentionMetadata plus the reference backend's per-group gather indices."""

    groups: list[SequenceGroup] = field(default_factory=list)


def _build_group(seq_ids: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
                 block_tables: np.ndarray, block_size: int, num_tokens: int,
                 device: torch.device) -> SequenceGroup:
    query_lens = (qsl[1:] - qsl[:-1])[seq_ids].astype(np.int64)
    ctx_lens = seq_lens[seq_ids].astype(np.int64)
    max_q = int(query_lens.max())
    num_key_blocks = -(-int(ctx_lens.max()) // block_size)
    max_k = num_key_blocks * block_size
    q_offsets = np.arange(max_q)[None, :]
    valid_q = q_offsets < query_lens[:, None]
    query_index = np.where(valid_q, qsl[seq_ids][:, None].astype(np.int64) + q_offsets, num_tokens)
    k_offsets = np.arange(max_k)[None, :]
    key_blocks = block_tables[seq_ids, :num_key_blocks].astype(np.int64)
    valid_k = k_offsets < ctx_lens[:, None]
    query_pos = (ctx_lens - query_lens)[:, None] + q_offsets  # [G, Q]
    mask = (k_offsets[:, None, :] <= query_pos[:, :, None]) & valid_k[:, None, :]
    mask[..., 0] |= ~valid_q  # padded query rows attend to one key (avoids NaN; discarded)
    return SequenceGroup(
        query_token_index=torch.from_numpy(query_index).to(device),
        key_blocks=torch.from_numpy(np.ascontiguousarray(key_blocks)).to(device),
        mask=torch.from_numpy(mask[:, None]).to(device),
        num_queries=max_q,
        num_keys=max_k,
        query_pos=query_pos,
    )


class TorchReferenceBackend(AttentionBackend):
    """Gather + masked SDPA per group of sequences; no per-token Python loops."""

    name = "torch"
    gathers_decode = True  # False: decode rows (query length 1) are left to a subclass
    supports_window = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build_metadata(self, batch, device) -> TorchRefMetadata:
        device = torch.device(device)
        qsl = np.asarray(batch.query_start_loc, dtype=np.int64)
        seq_lens = np.asarray(batch.seq_lens, dtype=np.int64)
        block_tables = np.asarray(batch.block_tables)
        num_tokens = int(np.asarray(batch.input_ids).shape[0])
        query_lens = qsl[1:] - qsl[:-1]
        groups = []
        for selected in self.grouped_sequences(query_lens):
            seq_ids = np.flatnonzero(selected)
            if seq_ids.size:
                groups.append(_build_group(seq_ids, qsl, seq_lens, block_tables,
                                           self.block_size, num_tokens, device))
        return TorchRefMetadata(
            slot_mapping=torch.from_numpy(np.asarray(batch.slot_mapping, dtype=np.int64)).to(device),
            query_start_loc=torch.from_numpy(np.asarray(batch.query_start_loc, np.int32)).to(device),
            seq_lens=torch.from_numpy(np.asarray(batch.seq_lens, np.int32)).to(device),
            block_tables=torch.from_numpy(np.asarray(block_tables, np.int32)).to(device),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            num_tokens=num_tokens,
            num_seqs=int(seq_lens.shape[0]),
            query_start_loc_cpu=np.asarray(batch.query_start_loc, np.int32),
            seq_lens_cpu=np.asarray(batch.seq_lens, np.int32),
            groups=groups,
        )

    def grouped_sequences(self, query_lens: np.ndarray) -> tuple[np.ndarray, ...]:
        """Masks over the step's sequences, one per group this backend attends with SDPA:
        here every sequence (decodes in a group of their own when ``gathers_decode``)."""
        if self.gathers_decode:
            return (query_lens == 1, query_lens > 1)
        return (query_lens > 1,)

    def static_decode_metadata(self, inputs) -> StaticDecodeMetadata:
        """Static decode buffers as metadata (the reference semantics of padded graph steps; not
        capture-safe on CUDA: it gathers every row's whole block table and skips padding writes
        through a host-synchronising ``nonzero``, so ``supports_decode_graphs`` stays False)."""
        return StaticDecodeMetadata(**static_decode_fields(inputs))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: TorchRefMetadata,
                scale: float, window: int | None = None) -> torch.Tensor:
        if isinstance(meta, StaticDecodeMetadata):
            if window is not None:
                raise ValueError("static (CUDA-graph) decode steps take no attention window")
            return static_decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens, scale)
        num_tokens, num_heads, head_dim = query.shape
        out = query.new_empty(num_tokens + 1, num_heads, head_dim)
        attend_groups(query, kv_cache, meta.groups, scale, out, window)
        return out[:num_tokens]


def attend_groups(query: torch.Tensor, kv_cache: torch.Tensor, groups: list[SequenceGroup],
                  scale: float, out: torch.Tensor, window: int | None = None) -> None:
    """Writes the attention of every group's query rows into ``out [T + 1, Hq, D]`` (row T is the
    padding sink); rows of tokens in no group are left untouched. ``window``: each query sees
    its last ``window`` positions only (a sliding-window layer)."""
    if not groups:
        return
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group_size = num_heads // num_kv_heads
    padded_query = torch.cat([query, query.new_zeros(1, num_heads, head_dim)])
    for g in groups:
        num_seqs = g.query_token_index.shape[0]
        # [G, Q, Hkv, group, D] -> [G, Hkv, group * Q, D]
        q = padded_query[g.query_token_index].view(num_seqs, g.num_queries, num_kv_heads,
                                                    group_size, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads,
                                             group_size * g.num_queries, head_dim)
        # whole-block gather: [G, K / bs, bs, Hkv, D] -> [G, Hkv, K, D]
        blocks = g.key_blocks.reshape(-1)
        shape = (num_seqs, g.num_keys, num_kv_heads, head_dim)
        k = cache_values(kv_cache[0].index_select(0, blocks), query.dtype).view(shape)
        v = cache_values(kv_cache[1].index_select(0, blocks), query.dtype).view(shape)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        mask = g.mask_for(window).expand(num_seqs, group_size, g.num_queries, g.num_keys)
        mask = mask.reshape(num_seqs, 1, group_size * g.num_queries, g.num_keys)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.view(num_seqs, num_kv_heads, group_size, g.num_queries, head_dim)
        o = o.permute(0, 3, 1, 2, 4).reshape(num_seqs * g.num_queries, num_heads, head_dim)
        out.index_copy_(0, g.query_token_index.reshape(-1), o)


def static_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row over the row's first ``seq_lens[i]`` cached tokens, lengths read
    from the tensor (never from the host); a row with length 0 gets zeros. ``[B, Hq, D]``."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    num_keys = block_tables.shape[1] * block_size
    blocks = block_tables.reshape(-1).long()
    shape = (num_seqs, num_keys, num_kv_heads, head_dim)
    k = cache_values(kv_cache[0].index_select(0, blocks), query.dtype).view(shape)
    v = cache_values(kv_cache[1].index_select(0, blocks), query.dtype).view(shape)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    lengths = seq_lens.long()
    has_context = lengths > 0
    valid = torch.arange(num_keys, device=query.device)[None, :] < lengths[:, None]
    valid[:, 0] |= ~has_context            # an empty row attends to one key (no NaN); zeroed below
    q = query.view(num_seqs, num_kv_heads, group_size, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    o = o * has_context.to(o.dtype)[:, None, None, None]
    return o.reshape(num_seqs, num_heads, head_dim)
