"""CPU paged attention in two Rust kernels: decode rows, and prefill chunks.

Decode rows (query length 1) dominate CPU serving; sequences with a few queries (a decode with
its speculative drafts, a short chunk) go through the same kernel, one row per query. The
reference backend gathers every decode sequence's K/V into a padded copy before
``scaled_dot_product_attention``; here the Rust kernel
(``ferrobatch._scheduler.paged_decode_attention_f32``, source ``rust_scheduler/src/cpu_attention.rs``)
reads each block in place through the block table with an online softmax, the sequences' blocks
cut into one equal run per thread of torch's intra-op count (a long sequence is split between
threads and its parts merged: split-KV). Longer chunks (prompts) go through the prefill kernel
(``paged_prefill_attention_f32``, ``rust_scheduler/src/cpu_prefill_attention.rs``): causal
attention of each chunk's queries over its whole paged context, no gather, register-tiled
(8 query rows x 32 keys), about twice torch's SDPA on the same threads.
``CpuPagedBackend(prefill_kernel=False)`` keeps SDPA for them (the reference, run on the
kernels' thread count although the forward otherwise keeps torch single-threaded), for
comparisons. float32 models only (other dtypes use "torch"); the cache may hold float32,
float16 or FP8 E4M3 (``--kv-cache-dtype``: the kernels convert on load).

Sliding-window layers (Gemma 3) pass ``window``: decode rows start at their window's first key
(the decode kernel's ``starts``: the blocks before it are not read), each prefill chunk's query
over its last ``window`` keys (the prefill kernel's ``window``: panels before a tile's earliest
key are skipped; such calls stay off AMX).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferrobatch.runtime.attention.base import StaticDecodeMetadata
from ferrobatch.runtime.attention.torch_ref import (
    TorchReferenceBackend,
    TorchRefMetadata,
    attend_groups,
)
from ferrobatch.runtime.cpu_threads import torch_threads
from ferrobatch.runtime.kv_cache import cache_array


@dataclass
class DecodeRows:
    """The step's query rows the Rust kernel attends, one kernel row per query token: every
    token of a sequence with at most ``KERNEL_QUERY_MAX`` queries (decodes, speculative drafts,
    short chunks). A sequence's j-th of q queries sees its first ``seq_len - q + j + 1``
    positions, which is causal attention over the paged cache."""

    token_index: torch.Tensor  # int64 [R]: row of each kernel query in the flat batch
    block_tables: np.ndarray  # int32 [R, max_blocks], C-contiguous
    ctx_lens: np.ndarray  # int32 [R]
    every_token: bool = False  # every query of the step is a kernel row: token_index is 0..T-1
    starts: dict = field(default_factory=dict)  # window -> its first keys (starts_for)

    def starts_for(self, window: int | None) -> np.ndarray | None:
        """Each row's first key in a layer attending over ``window`` positions (int32 [R]), or
        None where every row sees its whole context."""
        if window is None or int(self.ctx_lens.max()) <= window:
            return None
        starts = self.starts.get(window)
        if starts is None:
            starts = np.ascontiguousarray(np.maximum(self.ctx_lens - window, 0), dtype=np.int32)
            self.starts[window] = starts
        return starts


@dataclass
class PrefillRows:
    """The step's sequences with more than ``KERNEL_QUERY_MAX`` queries, for the prefill kernel:
    each one's first row in the flat batch, query count, keys (context included) and blocks."""

    q_starts: np.ndarray  # int32 [P]
    q_lens: np.ndarray  # int32 [P]
    seq_lens: np.ndarray  # int32 [P]
    block_tables: np.ndarray  # int32 [P, max_blocks], C-contiguous


@dataclass
class CpuPagedMetadata(TorchRefMetadata):
    decode: DecodeRows | None = None
    prefill: PrefillRows | None = None  # for the prefill kernel (SDPA uses ``groups`` instead)
    prefill_pairs: int = 0  # (query, key) pairs of the step's prefill chunks, causal mask ignored


# Prefill attention at or above this many (query, key) pairs runs on the kernels' threads; below
# it one thread was faster on the 2-core dev VM (a 256-token prompt: 117 vs 151 ms of attention).
THREADED_PREFILL_PAIRS = 1 << 18

# Sequences with at most this many query tokens (a decode plus its speculative drafts, a short
# prompt chunk) run through the decode kernel row by row instead of SDPA: gathering the context
# for SDPA cost a 2-query step twice a 1-query step (SmolLM2, 200-token context, 2 vCPUs).
KERNEL_QUERY_MAX = 8


def kernel_available() -> bool:
    """True when the compiled extension carries the CPU attention kernels."""
    from ferrobatch import _scheduler
    return hasattr(_scheduler, "paged_decode_attention_f32") and \
        hasattr(_scheduler, "paged_prefill_attention_f32")


class CpuPagedBackend(TorchReferenceBackend):
    """Rust decode and prefill kernels (or SDPA for prefill chunks with ``prefill_kernel=False``),
    float32 CPU tensors only."""

    name = "cpu"
    gathers_decode = False

    def __init__(self, block_size: int, num_threads: int | None = None,
                 prefill_kernel: bool = True, amx: bool = True,
                 head_dim: int | None = None) -> None:
        super().__init__(block_size)
        from ferrobatch._scheduler import paged_decode_attention_f32, paged_prefill_attention_f32
        self._kernel = paged_decode_attention_f32
        self._prefill_kernel = paged_prefill_attention_f32 if prefill_kernel else None
        self.num_threads = num_threads
        # long prompt chunks on Intel AMX where the CPU has it (cpu_amx_prefill.rs); the model
        # runner sets this from ``amx_tiles``
        self.amx = amx
        self.head_dim = head_dim   # the model's, if known (for ``description`` only)

    @property
    def description(self) -> str:
        """The kernels in words, for the start-up log and the serve banner."""
        from ferrobatch._scheduler import amx_available, linear_isa
        if self._prefill_kernel is None:
            prompts = "prompt chunks on torch's SDPA"
        elif self.amx and amx_available() and (self.head_dim or 64) % 64 == 0:
            # the AMX path takes head dims that are multiples of 64 (cpu_amx_prefill.rs)
            prompts = "long prompt chunks on AMX tiles"
        else:
            prompts = "prompt chunks in the prefill kernel"
        return f"Rust {linear_isa()} kernels (decode split over the threads, {prompts})"

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
        all_seq_lens = np.asarray(batch.seq_lens)
        kernel_ids = np.flatnonzero(query_lens <= KERNEL_QUERY_MAX)
        decode = None
        if kernel_ids.size:
            seq_lens = all_seq_lens[kernel_ids]
            num_blocks = -(-int(seq_lens.max()) // self.block_size)
            tables = np.asarray(batch.block_tables)[kernel_ids, :num_blocks]
            q = query_lens[kernel_ids]
            if int(q.max()) == 1:       # decodes only: one row per sequence
                token_index, ctx_lens = qsl[kernel_ids], seq_lens
            else:                       # row j of q queries sees seq_len - q + j + 1 positions
                per_row = np.repeat(np.arange(kernel_ids.size), q)
                offset = np.arange(per_row.size) - np.repeat(np.cumsum(q) - q, q)
                token_index = qsl[kernel_ids][per_row] + offset
                ctx_lens = seq_lens[per_row] - q[per_row] + offset + 1
                tables = tables[per_row]
            decode = DecodeRows(
                token_index=torch.from_numpy(np.ascontiguousarray(token_index, dtype=np.int64)),
                block_tables=np.ascontiguousarray(tables, dtype=np.int32),
                ctx_lens=np.ascontiguousarray(ctx_lens, dtype=np.int32),
                every_token=int(q.sum()) == int(qsl[-1]),
            )
        long = query_lens > KERNEL_QUERY_MAX
        pairs = int((query_lens * all_seq_lens)[long].sum())
        prefill = None
        if self._prefill_kernel is not None and long.any():
            long_ids = np.flatnonzero(long)
            num_blocks = -(-int(all_seq_lens[long_ids].max()) // self.block_size)
            prefill = PrefillRows(
                q_starts=np.ascontiguousarray(qsl[long_ids], dtype=np.int32),
                q_lens=np.ascontiguousarray(query_lens[long_ids], dtype=np.int32),
                seq_lens=np.ascontiguousarray(all_seq_lens[long_ids], dtype=np.int32),
                block_tables=np.ascontiguousarray(
                    np.asarray(batch.block_tables)[long_ids, :num_blocks], dtype=np.int32),
            )
        return CpuPagedMetadata(**vars(meta), decode=decode, prefill=prefill, prefill_pairs=pairs)

    def grouped_sequences(self, query_lens: np.ndarray) -> tuple[np.ndarray, ...]:
        """Sequences with more than ``KERNEL_QUERY_MAX`` queries go to SDPA when the prefill
        kernel is off; none otherwise."""
        if self._prefill_kernel is not None:
            return ()
        return (query_lens > KERNEL_QUERY_MAX,)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: CpuPagedMetadata,
                scale: float, window: int | None = None) -> torch.Tensor:
        """Causal attention of the step's queries; with ``window`` (a sliding-window layer),
        each query over its last ``window`` positions."""
        if isinstance(meta, StaticDecodeMetadata):     # emulated graph steps: the reference path
            return super().forward(query, kv_cache, meta, scale, window)
        num_tokens, num_heads, head_dim = query.shape
        rows = meta.decode
        starts = None if rows is None else rows.starts_for(window)
        threads = self.num_threads or torch.get_num_threads()
        if rows is not None and rows.every_token:  # a decode-only step: no gather, no scatter
            out = query.new_empty(query.shape)
            self._decode(query.contiguous(), kv_cache, rows, out, scale, threads, starts)
            return out
        out = query.new_empty(num_tokens + 1, num_heads, head_dim)
        if meta.prefill is not None:   # prefill chunks: the Rust kernel, in place
            p = meta.prefill
            self._prefill_kernel(query.contiguous().numpy(), cache_array(kv_cache[0]),
                                 cache_array(kv_cache[1]), p.block_tables, p.q_starts, p.q_lens,
                                 p.seq_lens, out[:num_tokens].numpy(), float(scale), threads,
                                 amx=self.amx, window=window)
        if meta.groups:    # prefill chunks: torch's SDPA, long ones on the kernels' threads
            with torch_threads(threads if meta.prefill_pairs >= THREADED_PREFILL_PAIRS else 1):
                attend_groups(query, kv_cache, meta.groups, scale, out, window)
        if rows is not None:
            q = query.index_select(0, rows.token_index)
            o = torch.empty_like(q)
            self._decode(q, kv_cache, rows, o, scale, threads, starts)
            out.index_copy_(0, rows.token_index, o)
        return out[:num_tokens]

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, rows: DecodeRows,
                out: torch.Tensor, scale: float, threads: int, starts: np.ndarray | None) -> None:
        args = (q.numpy(), cache_array(kv_cache[0]), cache_array(kv_cache[1]), rows.block_tables,
                rows.ctx_lens, out.numpy(), float(scale), threads)
        if starts is None:
            self._kernel(*args)
        else:
            self._kernel(*args, starts=starts)
