"""CUDA attention backend: ferrobatch's paged kernels (``cuda/``) as ``torch.ops.ferrobatch.*``.

* ``write_kv``  -> ``reshape_and_cache`` (slot -1 skips a row, for padded CUDA-graph batches).
* ``forward``   -> decode-only steps (every sequence has one query token): split-KV paged decode
  kernel + reduce (fused into the split kernel once ``use_fused_reduce``'s start-up check agrees:
  ``attention.decode_reduce``). Steps with prefill chunks: the paged prefill kernel (causal over the cached
  context plus the chunk) for the prefill sequences, and in a mixed batch the decode kernel for
  the decode rows (gathered, then scattered back): a decode row would otherwise occupy a whole
  64-row query tile of the prefill kernel. In bf16 / fp16 the prefill sequences go to torch's
  FlashAttention-2 varlen kernel instead (tensor cores; ``attention.flash_prefill``), once a
  start-up check on the model's shape agrees with ferrobatch's prefill kernel
  (``flash_prefill=False`` keeps ferrobatch's kernel). A mixed step whose whole context fits
  ``flash_prefill.MAX_CONTEXT_TOKENS`` goes to FlashAttention whole, decode rows included: on
  the H200 such a step was host-bound (~10 eager launches per layer around the piecewise
  graphs; the cap-32 ablation's refills, session 31), one varlen call is ~4.

The kernels are compiled on first use (see ``ferrobatch.runtime.cuda_ops``); ``cuda_available()``
says whether that can work here and why not. ``get_attention_backend("auto"|"cuda"|"torch")``
picks this backend on CUDA devices; the choice is logged at construction.

Supported: bf16 / fp16 / fp32, head_dim 64 or 128, num_heads / num_kv_heads <= 8. Other shapes
raise ValueError at the first forward (use the torch backend for them).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from ferrobatch.runtime import cuda_ops
from ferrobatch.runtime.attention import flash_prefill as flash
from ferrobatch.runtime.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    static_decode_fields,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CudaAttentionBackend",
    "CudaMetadata",
    "CudaPagedBackend",
    "cuda_available",
    "is_available",
]

MIN_COMPUTE_CAPABILITY = (8, 0)


def cuda_available(device: torch.device | int | None = None) -> tuple[bool, str]:
    """``(ok, reason)``: whether the CUDA kernels can be built/loaded for ``device`` here."""
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False (no CUDA device or a CPU-only torch)"
    if isinstance(device, torch.device) and device.type != "cuda":
        return False, f"device {device} is not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_COMPUTE_CAPABILITY:
        return False, f"compute capability {cap[0]}.{cap[1]} < 8.0 is not supported"
    if cuda_ops.ops_loaded():
        return True, "ferrobatch CUDA ops already loaded"
    try:
        src = cuda_ops.cuda_source_dir()
    except FileNotFoundError as exc:
        return False, str(exc)
    tk = cuda_ops.find_cuda_toolkit()
    if tk is None:
        return False, (f"nvcc not found (set CUDA_HOME, or pip install nvidia-cuda-nvcc matching "
                       f"torch's CUDA {torch.version.cuda})")
    return True, f"sources {src}, nvcc {tk.version} at {tk.nvcc}"


def is_available() -> bool:
    """Bool form of ``cuda_available()`` (logs the reason when False)."""
    ok, reason = cuda_available()
    if not ok:
        logger.warning("CUDA attention kernels unavailable: %s", reason)
    return ok


@dataclass
class CudaMetadata(AttentionMetadata):
    """AttentionMetadata plus the decode kernel's split count.

    ``num_splits`` None lets ``forward`` choose from (num_seqs, Hkv, max_seq_len, SM count); a
    CUDA-graph runner fixes it per batch bucket (the kernel partitions each sequence on the device,
    so one value is valid for every seq_lens).
    """

    num_splits: int | None = None
    # Mixed batches (prefill chunks + decode rows), precomputed once per step for all layers:
    decode_token_idx: torch.Tensor | None = None     # int64 [n_dec] flat rows of decode sequences
    decode_block_tables: torch.Tensor | None = None  # int32 [n_dec, M]
    decode_seq_lens: torch.Tensor | None = None      # int32 [n_dec]
    decode_max_seq_len: int = 0
    prefill_seq_ids: torch.Tensor | None = None      # int32 [n_pre]
    prefill_max_query_len: int = 0
    # The prefill sequences laid out for FlashAttention (steps with prefill rows, when the
    # backend's flash_prefill is on)
    flash_plan: flash.FlashPrefillPlan | None = None


def flash_whole_steps_requested() -> bool:
    """Whether a mixed step within ``flash_prefill.MAX_CONTEXT_TOKENS`` goes to FlashAttention
    whole (the default); ``FERROBATCH_FLASH_WHOLE_STEP=0`` sends only its prefill sequences
    there and its decode rows to the decode kernel (the bench's ``ferrobatch-splitmixed``)."""
    return os.environ.get("FERROBATCH_FLASH_WHOLE_STEP", "1") != "0"


def _device_tensor(array, dtype: np.dtype, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class CudaPagedBackend(AttentionBackend):
    """Paged attention through ferrobatch's CUDA kernels."""

    name = "cuda"
    supports_decode_graphs = True

    def __init__(self, block_size: int = 16, device: torch.device | str | int | None = None,
                 max_splits: int = 32, flash_prefill: bool = True) -> None:
        ok, reason = cuda_available(device if not isinstance(device, str) else torch.device(device))
        if not ok:
            raise RuntimeError(f"CUDA attention backend unavailable: {reason}")
        self.block_size = block_size
        self.max_splits = max_splits
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.library = cuda_ops.load_ops(dev)
        self.sm_count = cuda_ops.num_sms(dev)
        self._workspaces: dict[tuple[int, int], cuda_ops.DecodeWorkspace] = {}
        # Captured graphs hold raw addresses of the workspace current at capture: once graphs
        # are prepared, a workspace replaced by a bigger one is kept alive here, never freed.
        self._graph_workspaces_fixed = False
        self._retired_workspaces: list[cuda_ops.DecodeWorkspace] = []
        # bf16 / fp16 prefill sequences through FlashAttention-2 (see the module docstring); the
        # start-up check's verdict per (dtype, Hq, Hkv, D)
        self.flash_prefill = flash_prefill
        self._flash_verdicts: dict[tuple, bool] = {}
        # mixed steps planned whole (decode rows in the varlen call), after a check of their own
        self.flash_whole_steps = flash_whole_steps_requested()
        self._whole_step_verdicts: dict[tuple, bool] = {}
        # split-KV partial states combined by the last split CTA instead of a reduce pass: off
        # until use_fused_reduce's start-up check agrees (ModelRunner calls it)
        self.fused_reduce = False
        logger.info("attention backend: cuda (ferrobatch paged kernels, sm_%s, %d SMs, %s)",
                    cuda_ops.device_arch(dev), self.sm_count, self.library)

    @property
    def description(self) -> str:
        """What runs attention, in words (the serve banner's ``attention:`` line)."""
        whole = (", with the decode rows of a mixed step of <= 32k context tokens"
                 if self.flash_whole_steps else "")
        prefill = ("FlashAttention-2 (torch) for prefills of 128+ tokens" + whole + " once its "
                   "start-up check agrees, else ferrobatch's paged prefill kernel"
                   if self.flash_prefill else "ferrobatch's paged prefill kernel")
        reduce = ", splits reduced in the kernel" if self.fused_reduce else ""
        return (f"ferrobatch CUDA kernels (decode: split-KV paged kernel{reduce}; "
                f"prefill: {prefill})")

    def use_fused_reduce(self, num_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> bool:
        """Turns the fused split-KV reduce on for this backend when it is requested and its
        start-up check on this shape agrees with the reduce pass (``attention.decode_reduce``);
        logs the verdict and returns it."""
        from ferrobatch.runtime.attention import decode_reduce

        self.fused_reduce = False
        if not decode_reduce.fused_reduce_requested():
            logger.info("decode attention: splits combined by a reduce pass (%s=0)",
                        decode_reduce.ENV_FLAG)
            return False
        ok, detail = decode_reduce.check_fused_reduce(num_heads, num_kv_heads, head_dim, dtype,
                                                      self.block_size, self.device)
        if ok:
            logger.info("decode attention: splits combined in the kernel, no reduce pass "
                        "(start-up check: %s)", detail)
        else:
            logger.warning("decode attention: splits combined by a reduce pass; the fused "
                           "reduce disagrees with it in the start-up check (%s)", detail)
        self.fused_reduce = ok
        return ok

    # ---- capabilities -------------------------------------------------------------------------
    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
        """None when the kernels handle this shape/dtype, else the reason they don't."""
        if head_dim not in cuda_ops.SUPPORTED_HEAD_DIMS:
            return f"head_dim {head_dim} not in {cuda_ops.SUPPORTED_HEAD_DIMS}"
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        if num_heads // num_kv_heads > cuda_ops.MAX_GQA_RATIO:
            return f"GQA ratio {num_heads // num_kv_heads} > {cuda_ops.MAX_GQA_RATIO}"
        if dtype not in cuda_ops.SUPPORTED_DTYPES:
            return f"dtype {dtype} not supported"
        return None

    # ---- workspace ----------------------------------------------------------------------------
    def reserve_workspace(self, max_batch: int, num_heads: int, head_dim: int,
                          max_splits: int | None = None) -> cuda_ops.DecodeWorkspace:
        """Allocates (or grows) the split-KV workspace; call before capturing CUDA graphs so that
        no allocation happens inside a capture and every graph sees the same buffers."""
        max_splits = max_splits or self.max_splits
        key = (num_heads, head_dim)
        ws = self._workspaces.get(key)
        if ws is None or ws.partial_out.shape[0] < max_batch or ws.max_splits < max_splits:
            rows = max(max_batch, ws.partial_out.shape[0] if ws is not None else 0)
            splits = max(max_splits, ws.max_splits if ws is not None else 0)
            if ws is not None and self._graph_workspaces_fixed:
                self._retired_workspaces.append(ws)
            ws = cuda_ops.DecodeWorkspace.allocate(rows, num_heads, head_dim, splits, self.device)
            self._workspaces[key] = ws
        return ws

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                splits: int | None) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        if splits is None:
            splits = cuda_ops.choose_num_splits(batch, kv_cache.shape[-2], max_seq_len,
                                                self.sm_count, max_splits=self.max_splits)
        ws = None
        if splits > 1:
            ws = self._workspaces.get((num_heads, head_dim))
            if ws is None or not ws.fits(batch, num_heads, head_dim) or ws.max_splits < splits:
                ws = self.reserve_workspace(batch, num_heads, head_dim, max(splits, self.max_splits))
        return cuda_ops.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale,
                                               num_splits=splits, workspace=ws,
                                               fused_reduce=self.fused_reduce)

    # ---- decode CUDA graphs -------------------------------------------------------------------
    def prepare_decode_graphs(self, max_batch: int, num_heads: int, head_dim: int) -> None:
        self.reserve_workspace(max_batch, num_heads, head_dim, self.max_splits)
        self._graph_workspaces_fixed = True

    def decode_graph_splits(self, bucket: int, num_kv_heads: int, max_seq_len: int) -> int:
        # The kernel partitions each sequence by its actual length on the device, so a count
        # chosen for the longest possible context stays correct for every replay.
        return cuda_ops.choose_num_splits(bucket, num_kv_heads, max_seq_len, self.sm_count,
                                          max_splits=self.max_splits)

    def static_decode_metadata(self, inputs) -> CudaMetadata:
        """CudaMetadata over a graph runner's static buffers (padding rows: slot -1 is skipped by
        reshape_and_cache, seq_len 0 makes the decode kernel write zeros)."""
        return CudaMetadata(**static_decode_fields(inputs), num_splits=inputs.num_splits)

    # ---- AttentionBackend ---------------------------------------------------------------------
    def build_metadata(self, batch, device) -> CudaMetadata:
        device = torch.device(device)
        qsl = np.asarray(batch.query_start_loc)
        seq_lens = np.asarray(batch.seq_lens)
        num_tokens = int(np.asarray(batch.input_ids).shape[0])
        query_lens = np.diff(qsl.astype(np.int64))
        mixed = {}
        is_dec = query_lens == 1
        pre = np.flatnonzero(~is_dec)             # the prefill sequences (more than one query)
        if is_dec.any() and not is_dec.all():
            dec = np.flatnonzero(is_dec)
            tables = np.asarray(batch.block_tables)
            mixed = {
                "decode_token_idx": _device_tensor(qsl[dec], np.int64, device),
                "decode_block_tables": _device_tensor(tables[dec], np.int32, device),
                "decode_seq_lens": _device_tensor(seq_lens[dec], np.int32, device),
                "decode_max_seq_len": int(seq_lens[dec].max()),
                "prefill_seq_ids": _device_tensor(pre, np.int32, device),
                "prefill_max_query_len": int(query_lens[pre].max()),
            }
        if self.flash_prefill and int(query_lens[pre].sum()) >= flash.MIN_QUERY_TOKENS \
                and False not in self._flash_verdicts.values():
            # A mixed step whose whole context is small goes to FlashAttention as a whole, its
            # decode rows as sequences of one query: one varlen call per layer instead of the
            # prefill call, the decode kernel and the gathers and scatters between them.
            seqs = np.arange(len(seq_lens)) if self.flash_whole_steps \
                and int(seq_lens.sum()) <= flash.MAX_CONTEXT_TOKENS else pre
            if int(seq_lens[seqs].sum()) <= flash.MAX_CONTEXT_TOKENS:
                mixed["flash_plan"] = flash.plan_flash_prefill(
                    qsl, seq_lens, np.asarray(batch.block_tables), self.block_size, seqs,
                    lambda a, dt: _device_tensor(a, dt, device))
        return CudaMetadata(
            slot_mapping=_device_tensor(batch.slot_mapping, np.int64, device),
            query_start_loc=_device_tensor(qsl, np.int32, device),
            seq_lens=_device_tensor(seq_lens, np.int32, device),
            block_tables=_device_tensor(batch.block_tables, np.int32, device),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            num_tokens=num_tokens,
            num_seqs=int(seq_lens.shape[0]),
            query_start_loc_cpu=np.asarray(qsl, np.int32),
            seq_lens_cpu=np.asarray(seq_lens, np.int32),
            **mixed,
        )

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        if key.dtype != kv_cache.dtype:
            key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        cuda_ops.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[-2]
        reason = self.supports(num_heads, num_kv_heads, head_dim, kv_cache.dtype)
        if reason is not None:
            raise ValueError(f"CUDA attention backend: {reason}; use attention backend 'torch'")
        in_dtype = query.dtype
        if in_dtype != kv_cache.dtype:
            query = query.to(kv_cache.dtype)
        if meta.max_query_len <= 1 and num_tokens == meta.num_seqs:
            out = self._decode(query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                               scale, getattr(meta, "num_splits", None))
        else:
            plan = getattr(meta, "flash_plan", None)
            out = None
            if plan is not None and plan.q_rows is None:     # every row: one varlen call
                out = self._flash(query, kv_cache, plan, scale, None)
            if out is None:
                out = self._prefill_and_decode(query, kv_cache, meta, scale)
        return out if out.dtype == in_dtype else out.to(in_dtype)

    def _prefill_and_decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A step with prefill rows: the prefill sequences through ``_prefill`` and, in a mixed
        step, the decode rows through the decode kernel."""
        if getattr(meta, "prefill_seq_ids", None) is None:
            return self._prefill(query, kv_cache, meta, scale)
        out = self._prefill(query, kv_cache, meta, scale,
                            out=torch.empty(query.shape, dtype=query.dtype, device=query.device))
        out_dec = self._decode(query.index_select(0, meta.decode_token_idx), kv_cache,
                               meta.decode_block_tables, meta.decode_seq_lens,
                               meta.decode_max_seq_len, scale, None)
        out.index_copy_(0, meta.decode_token_idx, out_dec)
        return out

    def _flash(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: flash.FlashPrefillPlan,
               scale: float, out: torch.Tensor | None) -> torch.Tensor | None:
        """The plan's rows through FlashAttention (written into ``out`` when given), or None when
        it is not usable here. An error from it at run time switches it off for good (logged)."""
        if not self._flash_usable(query, kv_cache, plan.one_query_seqs):
            return None
        try:
            return flash.flash_prefill_attention(query, kv_cache, plan, scale, out=out)
        except RuntimeError as exc:
            self._flash_verdicts = {k: False for k in self._flash_verdicts}
            logger.warning("prefill attention: FlashAttention-2 failed (%s: %s); "
                           "ferrobatch's kernels from now on", type(exc).__name__, exc)
            return None

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the prefill sequences: every sequence of the step, or with ``out`` those
        of ``meta.prefill_seq_ids`` (their rows of ``out`` written). FlashAttention when usable
        and its plan covers just those rows (a plan of every row was tried by ``forward``),
        else ferrobatch's prefill kernel."""
        plan = getattr(meta, "flash_plan", None)
        if out is not None and plan is not None and plan.q_rows is not None:
            res = self._flash(query, kv_cache, plan, scale, out)
            if res is not None:
                return res
        if out is None:
            return cuda_ops.paged_prefill_attention(query, kv_cache, meta.block_tables,
                                                    meta.seq_lens, meta.query_start_loc, scale,
                                                    meta.max_query_len)
        cuda_ops.paged_prefill_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, scale, meta.prefill_max_query_len,
                                         out=out, seq_ids=meta.prefill_seq_ids)
        return out

    def _flash_usable(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      one_query_seqs: bool = False) -> bool:
        """Whether this call's prefill rows (with ``one_query_seqs``: a mixed step planned whole)
        may go to FlashAttention: a bf16 / fp16 contiguous cache, not inside a CUDA-graph
        capture, and the start-up check passed for this shape (run here, once per shape, on
        first use; a whole mixed step has a check of its own, whose failure only stops planning
        mixed steps whole)."""
        if not self.flash_prefill or kv_cache.dtype not in flash.FLASH_DTYPES \
                or not kv_cache.is_contiguous():
            return False
        if kv_cache.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        num_heads, head_dim = query.shape[1:]
        key = (kv_cache.dtype, num_heads, kv_cache.shape[-2], head_dim)
        verdict = self._flash_verdicts.get(key)
        if verdict is None:
            verdict, detail = flash.check_flash_prefill(
                cuda_ops.paged_prefill_attention, num_heads, kv_cache.shape[-2], head_dim,
                kv_cache.dtype, self.block_size, kv_cache.device)
            self._flash_verdicts[key] = verdict
            if verdict:
                logger.info("prefill attention: FlashAttention-2 varlen (torch) for %s, Hq %d, "
                            "Hkv %d, D %d; start-up check: %s", str(kv_cache.dtype)[6:],
                            num_heads, kv_cache.shape[-2], head_dim, detail)
            else:
                logger.warning("prefill attention: FlashAttention-2 not used, ferrobatch's "
                               "prefill kernel instead (start-up check: %s)", detail)
        if verdict and one_query_seqs:
            verdict = self._whole_step_verdicts.get(key)
            if verdict is None:
                verdict, detail = flash.check_flash_prefill(
                    cuda_ops.paged_prefill_attention, num_heads, kv_cache.shape[-2], head_dim,
                    kv_cache.dtype, self.block_size, kv_cache.device, whole_step=True)
                self._whole_step_verdicts[key] = verdict
                if not verdict:
                    self.flash_whole_steps = False
                    logger.warning("prefill attention: mixed steps not planned whole (their "
                                   "decode rows stay on the decode kernel; start-up check: %s)",
                                   detail)
        return verdict


# The name the model runtime's get_attention_backend() looks up.
CudaAttentionBackend = CudaPagedBackend
