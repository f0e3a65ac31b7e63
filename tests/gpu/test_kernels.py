"""Each CUDA kernel against a float64 reference on fresh random inputs (needs a GPU: -m gpu).

Coverage per the kernel issue: batch sizes 1..256, context lengths that are not multiples of the
block size, GQA ratios 1/4/8, head dims 64/128, bf16/fp16 (+fp32), block tables in shuffled order,
outputs poisoned with NaN first so an unwritten element fails, split-KV on and off.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from paged_utils import (
    assert_close,
    make_batch,
    poison,
    random_cache,
    reference_attention,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _ctx_lens(rng, batch: int, max_ctx: int, block_size: int) -> np.ndarray:
    """Mostly non-multiples of the block size, plus the edge cases max_ctx (first, so a batch
    of one runs the longest context), 1, bs-1, bs+1."""
    lens = rng.integers(1, max_ctx + 1, size=batch)
    edge = [max_ctx, 1, block_size - 1, block_size + 1]
    lens[: min(batch, len(edge))] = edge[: min(batch, len(edge))]
    lens = np.maximum(lens, 1)
    if batch > 4:
        lens[lens % block_size == 0] += 1
    return lens


# ---------------------------------------------------------------------------------- cache write
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim,num_kv_heads", [(64, 3), (128, 8), (128, 1)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache(cuda_ops, dtype, head_dim, num_kv_heads, slot_dtype):
    rng = np.random.default_rng(1)
    block_size, num_blocks, T = 16, 97, 300
    g = _gen(2)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g,
                        device=DEV).to(dtype)
    # A strided key/value, as when split from a fused qkv projection.
    fused = torch.randn(T, num_kv_heads * 3, head_dim, generator=g, device=DEV).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, 2 * num_kv_heads:]
    slots = rng.choice(np.arange(block_size, num_blocks * block_size), size=T, replace=False)
    slots[rng.random(T) < 0.1] = -1  # padded rows: must not write anywhere
    expected = cache.clone()
    valid = torch.from_numpy(slots >= 0).to(DEV)
    idx = torch.from_numpy(slots).to(DEV)
    flat = expected.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, idx[valid], key[valid])
    flat[1].index_copy_(0, idx[valid], value[valid])
    cuda_ops.reshape_and_cache(key, value, cache, idx.to(slot_dtype))
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


# ---------------------------------------------------------------------------------- decode
# (KV heads, query heads per KV head): every compiled group size (1, 2, 4, 8) and the padded
# ones (3 -> 4, 6 -> 8)
GQA_SHAPES = [(4, 1), (4, 2), (2, 4), (1, 8), (3, 3), (1, 6)]
DECODE_CASES = [
    # batch, max_ctx, block_size
    (1, 1, 16),
    (1, 8191, 16),
    (3, 700, 16),
    (16, 1500, 32),
    (64, 1025, 16),
    (131, 300, 8),
    (7, 1000, 12),   # block size that is not a power of two (division path)
    (256, 600, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads,group", GQA_SHAPES)
@pytest.mark.parametrize("batch,max_ctx,block_size", DECODE_CASES)
def test_decode_attention(cuda_ops, dtype, head_dim, num_kv_heads, group, batch, max_ctx, block_size):
    seed = zlib.crc32(repr((str(dtype), head_dim, num_kv_heads, group, batch, max_ctx)).encode())
    rng = np.random.default_rng(seed)
    lens = _ctx_lens(rng, batch, max_ctx, block_size)
    pb = make_batch(rng, lens, np.ones(batch, np.int64), block_size)
    gen = _gen(seed)
    cache = random_cache(pb, num_kv_heads, head_dim, dtype, DEV, gen)
    Hq = num_kv_heads * group
    q = torch.randn(batch, Hq, head_dim, generator=gen, device=DEV).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    ref = reference_attention(q, cache, pb, scale)
    bt = torch.from_numpy(pb.block_tables).to(DEV)
    sl = torch.from_numpy(pb.seq_lens).to(DEV)
    sms = cuda_ops.num_sms()
    auto = cuda_ops.choose_num_splits(batch, num_kv_heads, int(lens.max()), sms)
    ws = cuda_ops.DecodeWorkspace.allocate(batch + 5, Hq, head_dim, 32, DEV)
    for splits in sorted({1, auto, 7, 32}):
        for fused in ((False, True) if splits > 1 else (False,)):
            out = poison(q.shape, dtype, DEV)
            ws.partial_out.fill_(float("nan"))
            ws.partial_lse.fill_(float("nan"))
            cuda_ops.paged_decode_attention(q, cache, bt, sl, scale, num_splits=splits,
                                            workspace=ws, out=out, fused_reduce=fused)
            torch.cuda.synchronize()
            assert_close(out, ref, dtype, f"decode splits={splits} fused_reduce={fused}")
            assert not ws.split_counters.any(), "the fused reduce must leave its counters at 0"


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (128, 8, 4)])
def test_decode_attention_fp32(cuda_ops, dtype, head_dim, num_kv_heads, group):
    rng = np.random.default_rng(5)
    lens = _ctx_lens(rng, 9, 2000, 16)
    pb = make_batch(rng, lens, np.ones(9, np.int64), 16)
    gen = _gen(5)
    cache = random_cache(pb, num_kv_heads, head_dim, dtype, DEV, gen)
    q = torch.randn(9, num_kv_heads * group, head_dim, generator=gen, device=DEV)
    ref = reference_attention(q, cache, pb, 0.125)
    bt, sl = torch.from_numpy(pb.block_tables).to(DEV), torch.from_numpy(pb.seq_lens).to(DEV)
    for splits, fused in ((1, False), (6, False), (6, True)):
        out = poison(q.shape, dtype, DEV)
        cuda_ops.paged_decode_attention(q, cache, bt, sl, 0.125, num_splits=splits, out=out,
                                        fused_reduce=fused)
        torch.cuda.synchronize()
        assert_close(out, ref, dtype, f"fp32 decode splits={splits} fused_reduce={fused}")


def test_decode_strided_query_and_zero_length_rows(cuda_ops):
    """q as a view of a fused qkv tensor; seq_len 0 rows (CUDA-graph padding) give zeros."""
    rng = np.random.default_rng(9)
    Hkv, G, D, B = 2, 4, 128, 6
    lens = np.array([37, 1, 250, 16, 17, 999])
    pb = make_batch(rng, lens, np.ones(B, np.int64), 16)
    gen = _gen(9)
    cache = random_cache(pb, Hkv, D, torch.bfloat16, DEV, gen)
    qkv = torch.randn(B, (G + 2) * Hkv, D, generator=gen, device=DEV).to(torch.bfloat16)
    q = qkv[:, : G * Hkv]
    ref = reference_attention(q.contiguous(), cache, pb, 0.1)
    sl = torch.from_numpy(pb.seq_lens).to(DEV)
    sl[[1, 4]] = 0
    bt = torch.from_numpy(pb.block_tables).to(DEV)
    for splits, fused in ((1, False), (4, False), (4, True)):
        out = poison(q.shape, torch.bfloat16, DEV)
        cuda_ops.paged_decode_attention(q, cache, bt, sl, 0.1, num_splits=splits, out=out,
                                        fused_reduce=fused)
        torch.cuda.synchronize()
        live = [0, 2, 3, 5]
        assert_close(out[live], ref[live], torch.bfloat16, f"strided q splits={splits} {fused}")
        assert torch.equal(out[[1, 4]], torch.zeros_like(out[[1, 4]]))


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (8, 4, 128), (2, 8, 128)])
def test_fused_reduce_in_a_replayed_graph_equals_the_reduce_pass(cuda_ops, num_kv_heads, group,
                                                                 head_dim):
    """One captured graph of the decode op with the fused reduce, replayed with new context
    lengths each time (padding rows included): each replay equals the reduce pass on the same
    inputs (within bf16 rounding; the arithmetic is the same), so the arrival counters are back
    at zero after every replay."""
    rng = np.random.default_rng(31)
    B, bs, max_ctx = 24, 16, 3000
    pb = make_batch(rng, np.full(B, max_ctx), np.ones(B, np.int64), bs)
    gen = _gen(31)
    cache = random_cache(pb, num_kv_heads, head_dim, torch.bfloat16, DEV, gen)
    q = torch.randn(B, num_kv_heads * group, head_dim, generator=gen, device=DEV).to(torch.bfloat16)
    bt = torch.from_numpy(pb.block_tables).to(DEV)
    sl = torch.from_numpy(pb.seq_lens).to(DEV)
    ws = cuda_ops.DecodeWorkspace.allocate(B, q.shape[1], head_dim, 8, DEV)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda_ops.paged_decode_attention(q, cache, bt, sl, 0.09, num_splits=8, workspace=ws,
                                        out=out, fused_reduce=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ops.paged_decode_attention(q, cache, bt, sl, 0.09, num_splits=8, workspace=ws,
                                        out=out, fused_reduce=True)
    for rep in range(6):
        lens = rng.integers(0, max_ctx + 1, size=B)
        lens[rep % B] = 0
        sl.copy_(torch.from_numpy(lens.astype(np.int32)))
        out.fill_(float("nan"))
        graph.replay()
        want = cuda_ops.paged_decode_attention(q, cache, bt, sl, 0.09, num_splits=8)
        torch.cuda.synchronize()
        assert_close(out, want, torch.bfloat16, f"replay {rep}")   # normally bit for bit
        assert not ws.split_counters.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_fused_reduce_start_up_check_passes_on_this_gpu(cuda_ops, dtype, num_heads,
                                                        num_kv_heads, head_dim):
    from ferrobatch.runtime.attention.decode_reduce import check_fused_reduce

    ok, detail = check_fused_reduce(num_heads, num_kv_heads, head_dim, dtype, 16,
                                    torch.device(DEV))
    assert ok, detail


# ---------------------------------------------------------------------------------- prefill / mixed
PREFILL_CASES = [
    # (context lengths after the step, query lengths)
    ([5], [5]),                                   # fresh short prompt
    ([300], [300]),                               # fresh prompt, several tiles
    ([1000, 77], [129, 77]),                      # chunk after prior context + fresh prompt
    ([513, 40, 1, 260, 2048], [1, 40, 1, 3, 100]),  # mixed: decode rows next to prefill chunks
    (list(range(17, 17 + 40 * 13, 13)), [1 + (i * 7) % 33 for i in range(40)]),
]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads,group", GQA_SHAPES)
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_attention(cuda_ops, dtype, head_dim, num_kv_heads, group, case):
    lens, qlens = PREFILL_CASES[case]
    seed = zlib.crc32(repr((str(dtype), head_dim, num_kv_heads, group, case)).encode())
    rng = np.random.default_rng(seed)
    block_size = 16 if case % 2 == 0 else 32
    pb = make_batch(rng, lens, qlens, block_size)
    gen = _gen(seed)
    cache = random_cache(pb, num_kv_heads, head_dim, dtype, DEV, gen)
    Hq = num_kv_heads * group
    q = torch.randn(pb.num_tokens, Hq, head_dim, generator=gen, device=DEV).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    ref = reference_attention(q, cache, pb, scale)
    out = poison(q.shape, dtype, DEV)
    cuda_ops.paged_prefill_attention(
        q, cache, torch.from_numpy(pb.block_tables).to(DEV), torch.from_numpy(pb.seq_lens).to(DEV),
        torch.from_numpy(pb.query_start_loc).to(DEV), scale, int(pb.query_lens.max()), out=out)
    torch.cuda.synchronize()
    assert_close(out, ref, dtype, f"prefill case {case}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_seq_ids_subset_writes_only_its_rows(cuda_ops, dtype):
    """seq_ids (the prefill sequences of a mixed batch) computes those sequences only."""
    rng = np.random.default_rng(31)
    lens, qlens = [513, 40, 1, 260, 2048, 77], [1, 40, 1, 3, 100, 1]
    pb = make_batch(rng, lens, qlens, 16)
    gen = _gen(31)
    cache = random_cache(pb, 2, 128, dtype, DEV, gen)
    q = torch.randn(pb.num_tokens, 8, 128, generator=gen, device=DEV).to(dtype)
    ref = reference_attention(q, cache, pb, 0.09)
    pre = np.flatnonzero(pb.query_lens > 1)
    out = poison(q.shape, dtype, DEV)
    cuda_ops.paged_prefill_attention(
        q, cache, torch.from_numpy(pb.block_tables).to(DEV), torch.from_numpy(pb.seq_lens).to(DEV),
        torch.from_numpy(pb.query_start_loc).to(DEV), 0.09, int(pb.query_lens[pre].max()), out=out,
        seq_ids=torch.from_numpy(pre.astype(np.int32)).to(DEV))
    torch.cuda.synchronize()
    rows = np.concatenate([np.arange(pb.query_start_loc[i], pb.query_start_loc[i + 1]) for i in pre])
    others = np.setdiff1d(np.arange(pb.num_tokens), rows)
    assert_close(out[rows], ref[rows], dtype, "prefill seq_ids subset")
    assert torch.isnan(out[others].float()).all(), "rows outside seq_ids were written"


def test_decode_and_prefill_kernels_agree(cuda_ops):
    """The prefill kernel on a decode-only batch must match the decode kernel."""
    rng = np.random.default_rng(11)
    lens = _ctx_lens(rng, 33, 3000, 16)
    pb = make_batch(rng, lens, np.ones(33, np.int64), 16)
    gen = _gen(11)
    cache = random_cache(pb, 8, 128, torch.bfloat16, DEV, gen)
    q = torch.randn(33, 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
    bt, sl = torch.from_numpy(pb.block_tables).to(DEV), torch.from_numpy(pb.seq_lens).to(DEV)
    a = cuda_ops.paged_decode_attention(q, cache, bt, sl, 0.08, num_splits=5)
    b = cuda_ops.paged_prefill_attention(q, cache, bt, sl, torch.from_numpy(pb.query_start_loc).to(DEV),
                                         0.08, 1)
    torch.cuda.synchronize()
    assert float((a.double() - b.double()).norm() / b.double().norm()) < 1e-2


# ---------------------------------------------------------------------------------- backend
def test_backend_matches_torch_reference(cuda_ops):
    """CudaPagedBackend vs the model runtime's TorchReferenceBackend on the same mixed step."""
    from ferrobatch.runtime.attention.cuda import CudaPagedBackend
    from ferrobatch.runtime.attention.torch_ref import TorchReferenceBackend

    rng = np.random.default_rng(21)
    block_size, Hkv, G, D = 16, 3, 3, 64
    for qlens in ([1] * 12, [1, 7, 1, 33, 1, 2]):
        lens = rng.integers(40, 400, size=len(qlens))
        pb = make_batch(rng, lens, qlens, block_size)
        gen = _gen(int(lens.sum()))
        cache_a = random_cache(pb, Hkv, D, torch.bfloat16, DEV, gen)
        cache_b = cache_a.clone()
        T = pb.num_tokens
        q = torch.randn(T, Hkv * G, D, generator=gen, device=DEV).to(torch.bfloat16)
        k = torch.randn(T, Hkv, D, generator=gen, device=DEV).to(torch.bfloat16)
        v = torch.randn(T, Hkv, D, generator=gen, device=DEV).to(torch.bfloat16)
        cuda_be = CudaPagedBackend(block_size=block_size, flash_prefill=False)  # its kernels
        ref_be = TorchReferenceBackend(block_size)
        ma, mb = cuda_be.build_metadata(pb, DEV), ref_be.build_metadata(pb, DEV)
        cuda_be.write_kv(cache_a, k, v, ma)
        ref_be.write_kv(cache_b, k, v, mb)
        assert torch.equal(cache_a, cache_b)
        out = cuda_be.forward(q, cache_a, ma, 0.125)
        ref = ref_be.forward(q.float(), cache_b.float(), mb, 0.125)
        torch.cuda.synchronize()
        assert_close(out, ref.double(), torch.bfloat16, f"backend qlens={qlens}")
