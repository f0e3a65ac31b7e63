"""CUDA graphs for decode-only steps at padded batch-size buckets.

A decode step (every sequence contributes exactly one token) has the same kernel sequence for a
given batch size, whatever the sequences' lengths, because the attention kernels take lengths and
block tables from device memory and partition the context on the device. So one graph per batch
*bucket* (``decode_buckets``: 1, 2, 4, 8, 16, 24, 32, then every 16 up to ``max_num_seqs``) is
captured once and replayed for every decode step whose batch fits:

* static device buffers hold ``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens``,
  ``query_start_loc`` and ``block_tables`` for the largest bucket; a bucket's graph reads views of
  their first ``bucket`` rows;
* a step with ``n`` sequences uses the smallest bucket ``>= n``; rows ``n..bucket`` are padding:
  ``slot_mapping = -1`` (reshape_and_cache skips them: the cache, even the null block, is never
  written), ``seq_lens = 0`` (the decode kernel reads no K/V for them and writes zeros),
  ``block_tables = 0`` (the null block), ``input_ids = positions = 0``;
* the split-KV count of each bucket is fixed at capture from an upper bound of the context length
  (the kernel derives each sequence's chunks from its actual length, so this stays correct);
* outputs are the captured graph's static output tensor (or tuple of tensors), sliced to ``n``
  rows (valid until the next replay);
* with ``lora_blocks=True`` one more static buffer holds each row's LoRA block (-1 on padding and
  base-model rows; ``runtime.lora_graphs``).

``ModelRunner.capture_decode_graphs`` captures the model's decode step at start-up (the engine does
so on CUDA unless ``cuda_graphs=False`` / ``--enforce-eager``) and ``ModelRunner.execute`` replays
a graph for every step that fits one. The attention backend turns the static buffers into its
metadata (``AttentionBackend.static_decode_metadata``). ``emulate=True`` stands a plain re-run of
the forward in for each graph, so the whole data flow (padding, static buffers, outputs reused
across replays) is tested on the CPU; only capture itself needs the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_GRAPH_BATCH = 512      # larger decode steps run eagerly
PAD_SLOT = -1
PAD_SEQ_LEN = 0
PAD_BLOCK = 0
PAD_LORA_BLOCK = -1        # no adapter (base-model rows and padding)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch buckets for an engine running up to ``max_num_seqs`` sequences: 1, 2, 4, 8, 16, 24,
    32, then every 16 (a step pads at most 15 rows past 32), capped at ``max_num_seqs`` and
    MAX_GRAPH_BATCH; ``max_num_seqs`` itself is always a bucket when it is within the cap."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    candidates = [1, 2, 4, 8, 16, 24, 32, *range(48, MAX_GRAPH_BATCH + 1, 16)]
    return tuple(sorted({b for b in candidates if b < top} | {top}))


def bucket_for(num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int | None:
    """Smallest bucket >= ``num_seqs`` (None when the batch is larger than every bucket)."""
    if num_seqs < 1:
        return None
    for b in sorted(buckets):
        if b >= num_seqs:
            return b
    return None


@dataclass
class PaddedDecodeBatch:
    """Host arrays of one decode step padded to a bucket (all length ``bucket``)."""

    input_ids: np.ndarray      # int64 [bucket]
    positions: np.ndarray      # int64 [bucket]
    slot_mapping: np.ndarray   # int64 [bucket], PAD_SLOT on padding
    seq_lens: np.ndarray       # int32 [bucket], PAD_SEQ_LEN on padding
    block_tables: np.ndarray   # int32 [bucket, max_blocks], PAD_BLOCK past each table / on padding
    num_seqs: int
    bucket: int
    lora_blocks: np.ndarray | None = None   # int64 [bucket], PAD_LORA_BLOCK on padding


def is_decode_only(batch) -> bool:
    """Whether a StepBatch-like object has exactly one query token per sequence."""
    qsl = np.asarray(batch.query_start_loc)
    n = int(np.asarray(batch.seq_lens).shape[0])
    return n > 0 and qsl.shape == (n + 1,) and bool(np.all(np.diff(qsl) == 1))


def pad_decode_batch(batch, bucket: int, max_blocks: int,
                     lora_blocks: np.ndarray | None = None) -> PaddedDecodeBatch:
    """Pads a decode-only StepBatch-like object (README arrays) to ``bucket`` rows, and each
    sequence's LoRA block when given.

    ValueError when the step is not decode-only, is larger than the bucket, or its block tables
    are wider than ``max_blocks``.
    """
    if not is_decode_only(batch):
        raise ValueError("CUDA graphs only serve decode-only steps (one token per sequence)")
    seq_lens = np.asarray(batch.seq_lens)
    n = int(seq_lens.shape[0])
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit bucket {bucket}")
    tables = np.asarray(batch.block_tables)
    if tables.ndim != 2 or tables.shape[0] != n:
        raise ValueError("block_tables must be [num_seqs, M]")
    width = tables.shape[1]
    if width > max_blocks:
        # Block 0 is the null block, never handed out: columns holding only 0 are table padding
        # and may be dropped; a real block past the static width may not.
        if np.any(tables[:, max_blocks:] != PAD_BLOCK):
            raise ValueError(f"block tables need more than the graphs' {max_blocks} columns")
        tables = tables[:, :max_blocks]
        width = max_blocks
    out = PaddedDecodeBatch(
        input_ids=np.zeros(bucket, np.int64),
        positions=np.zeros(bucket, np.int64),
        slot_mapping=np.full(bucket, PAD_SLOT, np.int64),
        seq_lens=np.full(bucket, PAD_SEQ_LEN, np.int32),
        block_tables=np.full((bucket, max_blocks), PAD_BLOCK, np.int32),
        num_seqs=n,
        bucket=bucket,
    )
    out.input_ids[:n] = np.asarray(batch.input_ids)
    out.positions[:n] = np.asarray(batch.positions)
    out.slot_mapping[:n] = np.asarray(batch.slot_mapping)
    out.seq_lens[:n] = seq_lens
    out.block_tables[:n, :width] = tables
    if lora_blocks is not None:
        if np.shape(lora_blocks) != (n,):
            raise ValueError(f"lora_blocks must hold one block per sequence ({n})")
        out.lora_blocks = np.full(bucket, PAD_LORA_BLOCK, np.int64)
        out.lora_blocks[:n] = lora_blocks
    return out


@dataclass
class StaticDecodeInputs:
    """Device views (first ``bucket`` rows) of the static buffers that a captured graph reads."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    bucket: int
    num_splits: int
    max_seq_len: int
    lora_blocks: torch.Tensor | None = None   # int64: each row's LoRA block (lora_blocks=True)


class DecodeGraphRunner:
    """Captures ``forward(static_inputs) -> Tensor`` once per bucket and replays it.

    ``emulate=True`` (any device, for tests) captures nothing: "capture" runs the forward once to
    create the bucket's output tensor and each replay runs it again on the same static inputs and
    copies the result into that tensor, which is exactly what a graph's replay observes.

    ``forward`` must only launch device work on the current stream (no host syncs, no ``.item()``,
    no new CUDA allocations after warm-up except through torch's caching allocator, which capture
    redirects into the graph pool). It returns a tensor or a tuple of tensors whose first
    dimension is the batch (e.g. logits ``[bucket, vocab]``). Reserve the attention backend's
    split-KV workspace for ``max(buckets)`` rows before ``capture()``.

    ``lora_blocks=True`` adds the static LoRA-block buffer (``run(batch, lora_blocks=...)``);
    ``pool`` captures into another runner's memory pool (``.pool``: graphs that never replay at
    once may share one).
    """

    def __init__(self, forward: Callable[[StaticDecodeInputs], torch.Tensor], *,
                 max_blocks_per_seq: int, max_seq_len: int, device: torch.device | str,
                 num_splits_for: Callable[[int], int] | None = None,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, emulate: bool = False,
                 lora_blocks: bool = False, pool=None) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError("buckets must be positive batch sizes")
        self.forward = forward
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        self.num_splits_for = num_splits_for or (lambda _bucket: 1)
        big = self.buckets[-1]
        dev = self.device
        self._input_ids = torch.zeros(big, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(big, dtype=torch.int64, device=dev)
        self._slot_mapping = torch.full((big,), PAD_SLOT, dtype=torch.int64, device=dev)
        self._seq_lens = torch.zeros(big, dtype=torch.int32, device=dev)
        self._query_start_loc = torch.arange(big + 1, dtype=torch.int32, device=dev)
        self._block_tables = torch.zeros(big, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._lora_blocks = torch.full((big,), PAD_LORA_BLOCK, dtype=torch.int64, device=dev) \
            if lora_blocks else None
        self.emulate = emulate
        self.replays = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph | _EmulatedGraph] = {}
        self._outputs: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self._pool = pool
        self._staging: tuple[torch.Tensor, ...] | None = None   # host side of _copy_in
        self._staged = None        # CUDA event after the last copies out of _staging

    def static_inputs(self, bucket: int) -> StaticDecodeInputs:
        return StaticDecodeInputs(
            input_ids=self._input_ids[:bucket],
            positions=self._positions[:bucket],
            slot_mapping=self._slot_mapping[:bucket],
            seq_lens=self._seq_lens[:bucket],
            query_start_loc=self._query_start_loc[:bucket + 1],
            block_tables=self._block_tables[:bucket],
            bucket=bucket,
            num_splits=int(self.num_splits_for(bucket)),
            max_seq_len=self.max_seq_len,
            lora_blocks=None if self._lora_blocks is None else self._lora_blocks[:bucket],
        )

    @property
    def pool(self):
        """The memory pool of the captured graphs (None before capture, or emulated)."""
        return self._pool

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def output_of(self, bucket: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The captured graph's static output of ``bucket`` (all its rows)."""
        return self._outputs[bucket]

    def capture(self, warmup_iters: int = 2) -> None:
        """Captures every bucket, largest first (smaller graphs reuse the shared memory pool).

        The static buffers hold padding (every row a no-op) while capturing, so warm-up and capture
        never write the KV cache."""
        if self.device.type != "cuda" and not self.emulate:
            raise RuntimeError("CUDA graphs need a CUDA device")
        self._slot_mapping.fill_(PAD_SLOT)
        self._seq_lens.zero_()
        self._block_tables.zero_()
        if self._lora_blocks is not None:
            self._lora_blocks.fill_(PAD_LORA_BLOCK)
        if self.emulate:
            for bucket in reversed(self.buckets):
                graph = _EmulatedGraph(self.forward, self.static_inputs(bucket))
                self._graphs[bucket] = graph
                self._outputs[bucket] = graph.output
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                inputs = self.static_inputs(bucket)
                for _ in range(warmup_iters):
                    self.forward(inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for bucket in reversed(self.buckets):
            inputs = self.static_inputs(bucket)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.forward(inputs)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[bucket] = graph
            self._outputs[bucket] = out
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch buckets %s", self.captured_buckets)

    def can_run(self, batch) -> bool:
        """Decode-only, fits a captured bucket and the static block-table width."""
        if not self._graphs or not is_decode_only(batch):
            return False
        n = int(np.asarray(batch.seq_lens).shape[0])
        return bucket_for(n, self.captured_buckets) is not None and \
            np.asarray(batch.block_tables).shape[1] <= self.max_blocks and \
            int(np.max(np.asarray(batch.seq_lens), initial=0)) <= self.max_seq_len

    def run(self, batch, lora_blocks: np.ndarray | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Copies the padded step (and each sequence's LoRA block, which a runner made with
        ``lora_blocks=True`` needs) into the static buffers, replays, returns
        ``output[:num_seqs]`` (each output's, for a tuple)."""
        if (lora_blocks is None) != (self._lora_blocks is None):
            raise ValueError("LoRA blocks go with, and only with, graphs made with lora_blocks")
        n = int(np.asarray(batch.seq_lens).shape[0])
        bucket = bucket_for(n, self.captured_buckets)
        if bucket is None:
            raise ValueError(f"no captured bucket holds {n} sequences")
        if int(np.max(np.asarray(batch.seq_lens), initial=0)) > self.max_seq_len:
            raise ValueError("a sequence is longer than the graphs' max_seq_len")
        padded = pad_decode_batch(batch, bucket, self.max_blocks, lora_blocks)
        self._copy_in(padded)
        self._graphs[bucket].replay()
        self.replays += 1
        out = self._outputs[bucket]
        return tuple(t[:n] for t in out) if isinstance(out, tuple) else out[:n]

    def _copy_in(self, p: PaddedDecodeBatch) -> None:
        """The padded step into the static device buffers, through host staging buffers made
        once (pinned on CUDA: no page-locked allocation per step and per array). The previous
        step's copies out of them are waited for before they are overwritten."""
        b = p.bucket
        statics = (self._input_ids, self._positions, self._slot_mapping, self._seq_lens,
                   self._block_tables)
        arrays = (p.input_ids, p.positions, p.slot_mapping, p.seq_lens, p.block_tables)
        if self._lora_blocks is not None:
            statics, arrays = (*statics, self._lora_blocks), (*arrays, p.lora_blocks)
        cuda = self.device.type == "cuda"
        if self._staging is None:
            self._staging = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
                                  for t in statics)
            self._staged = torch.cuda.Event() if cuda else None
        elif self._staged is not None:
            self._staged.synchronize()
        for dst, host, src in zip(statics, self._staging, arrays, strict=True):
            host[:b].numpy()[...] = src
            dst[:b].copy_(host[:b], non_blocking=True)
        if self._staged is not None:
            self._staged.record()


class _EmulatedGraph:
    """A stand-in for a captured graph (``DecodeGraphRunner(emulate=True)``): replay re-runs the
    forward on the same static inputs into the same output tensor."""

    def __init__(self, forward: Callable[[StaticDecodeInputs], torch.Tensor],
                 inputs: StaticDecodeInputs) -> None:
        self.forward = forward
        self.inputs = inputs
        self.output = forward(inputs)

    def replay(self) -> None:
        fresh = self.forward(self.inputs)
        if isinstance(self.output, tuple):
            for dst, src in zip(self.output, fresh):
                dst.copy_(src)
        else:
            self.output.copy_(fresh)
