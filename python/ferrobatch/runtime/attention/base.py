"""Attention-backend interface: per-step metadata built once, K/V writes, paged attention.

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from ferrobatch.runtime.kv_cache import storage_view, to_cache_dtype


@dataclass
class AttentionMetadata:
    """Device tensors describing one flat step of ``num_tokens`` tokens over ``num_seqs`` sequences."""

    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, M]
    max_query_len: int
    max_seq_len: int
    num_tokens: int
    num_seqs: int
    query_start_loc_cpu: np.ndarray  # int32 [B+1]
    seq_lens_cpu: np.ndarray  # int32 [B]


@dataclass
class StaticDecodeMetadata(AttentionMetadata):
    """Metadata over a decode-graph runner's static buffers (``runtime.cuda_graphs``).

    A padded decode-only step: rows past the real batch have ``slot_mapping`` -1 (write nothing)
    and ``seq_lens`` 0 (attend to nothing, output zeros). The host-side fields (``max_seq_len``,
    ``*_cpu``) are fixed when the graph is captured and are only upper bounds: a backend must take
    each row's length from the ``seq_lens`` tensor.
    """


def static_decode_fields(inputs) -> dict:
    """The AttentionMetadata fields over a decode-graph runner's static buffers
    (``cuda_graphs.StaticDecodeInputs``); the host-side ones are the bounds fixed at capture."""
    bucket = inputs.bucket
    return dict(slot_mapping=inputs.slot_mapping, query_start_loc=inputs.query_start_loc,
                seq_lens=inputs.seq_lens, block_tables=inputs.block_tables, max_query_len=1,
                max_seq_len=inputs.max_seq_len, num_tokens=bucket, num_seqs=bucket,
                query_start_loc_cpu=np.arange(bucket + 1, dtype=np.int32),
                seq_lens_cpu=np.full(bucket, inputs.max_seq_len, np.int32))


def check_step_arrays(batch, block_size: int, num_blocks: int) -> None:
    """Validates the step arrays' shapes and ranges (cheap, vectorized); ValueError on violation."""
    num_tokens = int(batch.input_ids.shape[0])
    qsl = np.asarray(batch.query_start_loc)
    seq_lens = np.asarray(batch.seq_lens)
    num_seqs = int(seq_lens.shape[0])
    if qsl.shape != (num_seqs + 1,) or (num_seqs and (qsl[0] != 0 or qsl[-1] != num_tokens)):
        raise ValueError("query_start_loc must have B+1 entries from 0 to num_tokens")
    query_lens = np.diff(qsl)
    if np.any(query_lens < 0) or np.any(query_lens > seq_lens):
        raise ValueError("each sequence needs 0 <= query length <= seq_len")
    if batch.block_tables.shape[0] != num_seqs or \
            batch.block_tables.shape[1] * block_size < int(seq_lens.max(initial=0)):
        raise ValueError("block_tables too small for seq_lens")
    slots = np.asarray(batch.slot_mapping)
    if slots.shape != (num_tokens,) or np.any(slots < 0) or np.any(slots >= num_blocks * block_size):
        raise ValueError("slot_mapping out of range of the KV cache")


class AttentionBackend(abc.ABC):
    """Paged attention over a flat batch mixing prefill chunks and decode tokens."""

    name: str = "abstract"
    # True: static_decode_metadata() gives metadata whose forward is capture-safe in a CUDA graph
    # (no host reads of device data, lengths taken from device tensors).
    supports_decode_graphs: bool = False
    # True: the model may hand rotary and this backend's K/V write to one fused kernel (a rotary
    # module's ``rotate_and_cache``, ``LlamaAttention.attend``) instead of calling ``write_kv``;
    # set per runner by ModelRunner on CUDA once that kernel passed its start-up check.
    rotary_with_kv_write: bool = False
    # True: ``forward`` takes ``window`` (a sliding-window layer's, Gemma 3), each query seeing
    # only its last ``window`` positions
    supports_window: bool = False

    @abc.abstractmethod
    def build_metadata(self, batch, device: torch.device | str) -> AttentionMetadata:
        """Converts the step arrays (numpy, README contract) into device metadata, once per step."""

    def static_decode_metadata(self, inputs) -> AttentionMetadata:
        """Metadata over a decode-graph runner's static buffers (a ``StaticDecodeInputs``: device
        views of ``bucket`` rows, padding rows with slot -1 and seq_len 0), built once at capture
        and reused by every replay."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run decode steps from "
                                  f"static (CUDA-graph) buffers")

    def prepare_decode_graphs(self, max_batch: int, num_heads: int, head_dim: int) -> None:
        """Allocates whatever a captured decode step needs for up to ``max_batch`` rows (called
        before capture, so that nothing is allocated inside one). Nothing by default."""
        return None

    def decode_graph_splits(self, bucket: int, num_kv_heads: int, max_seq_len: int) -> int:
        """Split-KV count fixed into the graph of one batch bucket (1: no split)."""
        return 1

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Stores ``key``/``value`` ``[T, Hkv, D]`` at ``meta.slot_mapping`` in ``kv_cache``
        (rows with slot -1, the padding of static decode steps, are skipped)."""
        num_kv_heads, row = kv_cache.shape[-2:]     # row: head_dim (int8: + its scale's bytes)
        flat = storage_view(kv_cache).view(2, -1, num_kv_heads, row)
        slots = meta.slot_mapping
        if isinstance(meta, StaticDecodeMetadata):
            real = torch.nonzero(slots >= 0).squeeze(1)
            slots, key, value = slots[real], key[real], value[real]
        flat[0].index_copy_(0, slots, storage_view(to_cache_dtype(key, kv_cache.dtype)))
        flat[1].index_copy_(0, slots, storage_view(to_cache_dtype(value, kv_cache.dtype)))

    @abc.abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Causal attention of ``query [T, Hq, D]`` over each sequence's cached context -> ``[T, Hq, D]``
        (a backend with ``supports_window`` also takes ``window=``: each query over its last
        ``window`` positions only)."""
