"""CPU paged attention: decode rows in the Rust kernel, prefill chunks in the torch reference.

Decode rows (query length 1) dominate CPU serving. The reference backend gathers every decode
sequence's K/V into a padded copy before ``scaled_dot_product_attention``; here the Rust kernel
(``ferrobatch._scheduler.paged_decode_attention_f32``, source ``rust_scheduler/src/cpu_attention.rs``)
reads each block in place through the block table with an online softmax, splitting the
(sequence, KV head) pairs over torch's intra-op thread count. Prefill chunks keep the reference
path (compute-bound, and its padding is small there), run on the kernels' thread count although
the forward otherwise keeps torch single-threaded: a plain-Rust tiled prefill kernel was tried and
reached 20-29 GFLOP/s on two threads, below SDPA's ~32 on one. float32 only: other dtypes use
"torch".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferrobatch.runtime.attention.base import StaticDecodeMetadata
from ferrobatch.runtime.attention.torch_ref import (
    TorchReferenceBackend,
    TorchRefMetadata,
    attend_groups,
)
from ferrobatch.runtime.cpu_threads import torch_threads


@dataclass
class DecodeRows:
    """The step's decode sequences (query length 1) as the Rust kernel wants them."""

    token_index: torch.Tensor  # int64 [S_dec]: row of each decode query in the flat batch
    block_tables: np.ndarray  # int32 [S_dec, max_blocks], C-contiguous
    ctx_lens: np.ndarray  # int32 [S_dec]
    every_token: bool = False  # the step is all decode: token_index is 0..T-1


@dataclass
class CpuPagedMetadata(TorchRefMetadata):
    decode: DecodeRows | None = None
    prefill_pairs: int = 0  # (query, key) pairs of the step's prefill chunks, causal mask ignored


# Prefill attention at or above this many (query, key) pairs runs on the kernels' threads; below
# it one thread was faster on the 2-core dev VM (a 256-token prompt: 117 vs 151 ms of attention).
THREADED_PREFILL_PAIRS = 1 << 18


def kernel_available() -> bool:
    """True when the compiled extension carries the CPU decode kernel."""
    from ferrobatch import _scheduler
    return hasattr(_scheduler, "paged_decode_attention_f32")


class CpuPagedBackend(TorchReferenceBackend):
    """Rust decode kernel + torch reference prefill, float32 CPU tensors only."""

    name = "cpu"
    gathers_decode = False

    def __init__(self, block_size: int, num_threads: int | None = None) -> None:
        super().__init__(block_size)
        from ferrobatch._scheduler import paged_decode_attention_f32
        self._kernel = paged_decode_attention_f32
        self.num_threads = num_threads

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
        """None if the kernel covers this model, else the reason it does not."""
        if dtype != torch.float32:
            return f"the CPU kernel is float32 only (model dtype {dtype})"
        if num_heads % num_kv_heads:
            return f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
        return None

    def build_metadata(self, batch, device) -> CpuPagedMetadata:
        meta = super().build_metadata(batch, device)
        qsl = np.asarray(batch.query_start_loc, dtype=np.int64)
        query_lens = qsl[1:] - qsl[:-1]
        decode_ids = np.flatnonzero(query_lens == 1)
        decode = None
        if decode_ids.size:
            seq_lens = np.asarray(batch.seq_lens)[decode_ids]
            num_blocks = -(-int(seq_lens.max()) // self.block_size)
            tables = np.asarray(batch.block_tables)[decode_ids, :num_blocks]
            decode = DecodeRows(
                token_index=torch.from_numpy(qsl[decode_ids]),
                block_tables=np.ascontiguousarray(tables, dtype=np.int32),
                ctx_lens=np.ascontiguousarray(seq_lens, dtype=np.int32),
                every_token=decode_ids.size == int(qsl[-1]),
            )
        pairs = int((query_lens * np.asarray(batch.seq_lens))[query_lens > 1].sum())
        return CpuPagedMetadata(**vars(meta), decode=decode, prefill_pairs=pairs)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: CpuPagedMetadata,
                scale: float) -> torch.Tensor:
        if isinstance(meta, StaticDecodeMetadata):     # emulated graph steps: the reference path
            return super().forward(query, kv_cache, meta, scale)
        num_tokens, num_heads, head_dim = query.shape
        rows = meta.decode
        threads = self.num_threads or torch.get_num_threads()
        if rows is not None and rows.every_token:  # a decode-only step: no gather, no scatter
            out = query.new_empty(query.shape)
            self._kernel(query.contiguous().numpy(), kv_cache[0].numpy(), kv_cache[1].numpy(),
                         rows.block_tables, rows.ctx_lens, out.numpy(), float(scale), threads)
            return out
        out = query.new_empty(num_tokens + 1, num_heads, head_dim)
        if meta.groups:    # prefill chunks: torch's SDPA, long ones on the kernels' threads
            with torch_threads(threads if meta.prefill_pairs >= THREADED_PREFILL_PAIRS else 1):
                attend_groups(query, kv_cache, meta.groups, scale, out)
        if rows is not None:
            q = query.index_select(0, rows.token_index)
            o = torch.empty_like(q)
            self._kernel(q.numpy(), kv_cache[0].numpy(), kv_cache[1].numpy(), rows.block_tables,
                         rows.ctx_lens, o.numpy(), float(scale), threads)
            out.index_copy_(0, rows.token_index, o)
        return out[:num_tokens]
