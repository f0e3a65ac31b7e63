"""The decode kernel's fused split-KV reduce, and the start-up check that turns it on.

With ``num_splits > 1`` each (sequence, KV head) is read by several CTAs, whose partial states
must be combined. Two ways, the same arithmetic in the same order (``cuda/decode_attention.cuh``):

* the reduce pass: a second kernel over ``(Hq, B)`` after the split kernel;
* the fused reduce: the last split CTA to finish (an atomic arrival counter per (sequence, KV
  head) in the workspace, reset by that CTA) combines them itself: one launch fewer per layer and
  step, which is what bounds small decode batches (on the H200 a launch inside a CUDA graph costs
  ~2-3 us, a SmolLM2 decode layer at batch 16 ~11 us).

The fused reduce relies on a memory-ordering pattern (fence, then count; the last arrival reads
through L2) that only a GPU can confirm, so the CUDA backend uses it only after
``check_fused_reduce`` agrees with the reduce pass on this device, dtype and head shape; a
disagreement (or ``FERROBATCH_DECODE_FUSED_REDUCE=0``) keeps the reduce pass, with the finding
in the log. ``tests/gpu/test_kernels.py`` checks it more widely.
"""

from __future__ import annotations

import math
import os

import torch

from ferrobatch.runtime import cuda_ops
from ferrobatch.runtime.cuda_elementwise import check_tolerance, tolerance_violation

ENV_FLAG = "FERROBATCH_DECODE_FUSED_REDUCE"
CHECK_SPLITS = 4


def fused_reduce_requested() -> bool:
    """False when ``FERROBATCH_DECODE_FUSED_REDUCE=0`` keeps the reduce pass."""
    return os.environ.get(ENV_FLAG, "1") != "0"


@torch.no_grad()
def check_fused_reduce(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       block_size: int, device: torch.device) -> tuple[bool, str]:
    """The fused reduce against the reduce pass on one random decode batch of this shape:
    contexts 0 (a padded row: zeros), 1, ``block_size - 1``, a few blocks and several hundred
    tokens, shuffled block tables, ``CHECK_SPLITS`` splits; run twice (the second run sees the
    counters the first one left, which must be zero again). ``(agree, what was found)``; the
    tolerance is the GPU tests' (both sides round the same fp32 sum to the dtype, so they
    normally agree exactly)."""
    gen = torch.Generator(device="cpu").manual_seed(2024)
    lens = [0, 1, max(1, block_size - 1), 3 * block_size + 5, 700, 1500]
    batch = len(lens)
    per_seq = math.ceil(max(lens) / block_size)
    try:
        cache = torch.randn(2, batch * per_seq + 1, block_size, num_kv_heads, head_dim,
                            generator=gen).to(device=device, dtype=dtype)
        tables = (1 + torch.randperm(batch * per_seq, generator=gen)).view(batch, per_seq)
        tables = tables.to(device=device, dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        ws = cuda_ops.DecodeWorkspace.allocate(batch, num_heads, head_dim, CHECK_SPLITS, device)
        scale = head_dim ** -0.5

        def run(fused: bool) -> torch.Tensor:
            out = torch.full_like(q, float("nan"))       # every element must be written
            return cuda_ops.paged_decode_attention(q, cache, tables, seq_lens, scale,
                                                   num_splits=CHECK_SPLITS, workspace=ws,
                                                   out=out, fused_reduce=fused)

        want = run(False)
        got = [run(True), run(True)]
        left = int(ws.split_counters.count_nonzero())
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the reduce pass
        return False, f"{type(exc).__name__}: {exc}"
    if left:
        return False, f"{left} arrival counters were left non-zero"
    if not bool(got[0][0].eq(0).all()):
        return False, "a padded row (context 0) was not written as zeros"
    if any(bool(g.isnan().any()) for g in got):
        return False, "an output element was not written"
    tol = check_tolerance(dtype)
    worst = max(tolerance_violation(g, want, *tol) for g in got)
    return worst <= 1.0, f"worst {worst:.2f} of the tolerance"
