"""Sliding-window decode attention in the Rust CPU kernel (``paged_decode_attention_f32(...,
starts=...)``, as Gemma 3's local layers need: row ``s`` attends keys ``starts[s]..ctx[s]``
only) against a float32 torch reference over the same keys gathered through the block table, on
fresh random inputs, for every cache type the kernel reads (float32, float16, FP8 E4M3, int8),
on one and two threads; the keys outside each window are NaN, so reading any of them fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_kernels import _random_decode_step

from ferrobatch._scheduler import paged_decode_attention_f32
from ferrobatch.runtime.cpu_linear import packing_unsupported
from ferrobatch.runtime.kv_cache import cache_array, cache_values, to_cache_dtype

pytestmark = pytest.mark.skipif(packing_unsupported(torch.device("cpu"), torch.float32) is not None,
                                reason="the Rust CPU kernels need AVX2 (packing unsupported)")
BLOCK_SIZE = 16
CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _window_starts(rng, ctx, block_size=BLOCK_SIZE, window=100):
    """A first key per row, its kind cycling over the rows from a random one: 0, mid-block, on a
    block boundary, the last key, anywhere, or a ``window``-key sliding window's start."""
    starts = np.zeros(len(ctx), np.int32)
    first_kind = int(rng.integers(6))
    for i, c in enumerate(int(c) for c in ctx):
        kind = (first_kind + i) % 6
        if kind == 1:
            mid = [t for t in range(1, c) if t % block_size]
            starts[i] = rng.choice(mid) if mid else 0
        elif kind == 2:
            boundaries = (c - 1) // block_size
            starts[i] = int(rng.integers(1, boundaries + 1)) * block_size if boundaries else 0
        elif kind == 3:
            starts[i] = c - 1
        elif kind == 4:
            starts[i] = rng.integers(c)
        elif kind == 5:
            starts[i] = max(0, c - window)
    assert ((starts >= 0) & (starts < ctx)).all()
    return starts


def _poison_outside_windows(cache, table, starts, block_size=BLOCK_SIZE):
    """NaN into the K and V rows (every KV head) of each row's keys before its start: the whole
    blocks before the window's first and the rows before the start inside it."""
    for s, start in enumerate(starts):
        for t in range(int(start)):
            cache[:, table[s, t // block_size], t % block_size] = float("nan")


def _reference_windowed(query, cache, table, ctx, starts, scale, block_size=BLOCK_SIZE):
    """float32 softmax attention of each row's query over its keys ``starts..ctx - 1``, gathered
    through the block table; query head ``h`` reads KV head ``h // (Hq / Hkv)``."""
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for s in range(query.shape[0]):
        keys = torch.arange(int(starts[s]), int(ctx[s]))
        blocks = torch.as_tensor(table[s])[keys // block_size].long()
        k = cache[0, blocks, keys % block_size].float()             # [n, Hkv, D]
        v = cache[1, blocks, keys % block_size].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[s], k) * scale
        out[s] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def _run(query, k, v, table, ctx, threads, scale, starts=None):
    out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
    if starts is None:
        paged_decode_attention_f32(query.numpy(), k, v, table, ctx, out.numpy(), scale, threads)
    else:
        paged_decode_attention_f32(query.numpy(), k, v, table, ctx, out.numpy(), scale, threads,
                                   starts=starts)
    assert not out.isnan().any()
    return out


@pytest.mark.parametrize("cache_dtype", list(CACHE_DTYPES))
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])   # GQA ratios 3, 4, 1
@pytest.mark.parametrize("head_dim", [64, 40])                # 40: the portable path
@pytest.mark.parametrize("num_seqs", [1, 7, 24])
def test_windowed_decode_matches_torch_reference(cache_dtype, heads, head_dim, num_seqs):
    seed = list(CACHE_DTYPES).index(cache_dtype) * 10_000 + num_seqs * 100 + heads[0] + head_dim
    rng = np.random.default_rng(seed)
    torch.manual_seed(int(rng.integers(1 << 30)))
    query, cache, table, ctx = _random_decode_step(rng, num_seqs, *heads, head_dim)
    starts = _window_starts(rng, ctx)
    full = _reference_windowed(query, cache, table, ctx, np.zeros_like(starts), head_dim ** -0.5)
    _poison_outside_windows(cache, table, starts)
    stored = to_cache_dtype(cache, CACHE_DTYPES[cache_dtype])
    values = cache_values(stored, torch.float32)      # what the kernel reads, as float32
    scale = head_dim ** -0.5
    want = _reference_windowed(query, values, table, ctx, starts, scale)
    assert not want.isnan().any()
    cut = starts > 0
    if cut.any():   # the window matters: it excludes keys whose weights were not negligible
        assert (want[cut] - full[cut]).abs().max() > 1e-3
    for threads in (1, 2):
        out = _run(query, cache_array(stored[0]), cache_array(stored[1]), table, ctx, threads,
                   scale, starts)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("ctx_len, start", [(3000, 1234), (3000, 2048), (2600, 2300)])
def test_a_long_windowed_row_split_between_threads(cache_dtype, ctx_len, start):
    """One long row: two threads each take part of its window (split-KV), merged after."""
    rng = np.random.default_rng(ctx_len + start)
    torch.manual_seed(start)
    num_blocks = -(-ctx_len // BLOCK_SIZE)
    table = (1 + rng.permutation(num_blocks)).astype(np.int32)[None]
    cache = torch.randn(2, num_blocks + 1, BLOCK_SIZE, 3, 64)
    query = torch.randn(1, 9, 64)
    ctx, starts = np.array([ctx_len], np.int32), np.array([start], np.int32)
    _poison_outside_windows(cache, table, starts)
    stored = to_cache_dtype(cache, CACHE_DTYPES[cache_dtype])
    want = _reference_windowed(query, cache_values(stored, torch.float32), table, ctx, starts,
                               0.125)
    for threads in (1, 2):
        out = _run(query, cache_array(stored[0]), cache_array(stored[1]), table, ctx, threads,
                   0.125, starts)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)


def test_no_window_and_zero_starts_are_bit_identical_and_a_window_changes_the_output():
    rng = np.random.default_rng(7)
    query, cache, table, ctx = _random_decode_step(rng, 12, 9, 3, 64)
    k, v = cache[0].numpy(), cache[1].numpy()
    for threads in (1, 2):
        none = _run(query, k, v, table, ctx, threads, 0.125)
        zeros = _run(query, k, v, table, ctx, threads, 0.125, np.zeros(len(ctx), np.int32))
        assert torch.equal(none, zeros)
        torch.testing.assert_close(
            none, _reference_windowed(query, cache, table, ctx, np.zeros_like(ctx), 0.125),
            rtol=1e-5, atol=2e-6)
        starts = (ctx // 2).astype(np.int32)
        windowed = _run(query, k, v, table, ctx, threads, 0.125, starts)
        changed = (windowed - none).abs().amax(dim=(1, 2))
        assert (changed[starts > 0] > 1e-3).all()
        assert torch.equal(windowed[starts == 0], none[starts == 0])


def test_bad_starts_raise_value_error():
    rng = np.random.default_rng(3)
    query, cache, table, ctx = _random_decode_step(rng, 3, 8, 2, 64)
    k, v = cache[0].numpy(), cache[1].numpy()
    out = torch.zeros_like(query)

    def call(starts):
        paged_decode_attention_f32(query.numpy(), k, v, table, ctx, out.numpy(), 0.125, 2,
                                   starts=np.asarray(starts, np.int32))

    for starts, match in [
        ([0, 0], r"starts has 2 elements, its shape needs 3"),
        ([0, 0, 0, 0], r"starts has 4 elements"),
        ([0, -1, 0], r"starts\[1\] = -1 outside 0\.\."),
        ([0, 0, ctx[2]], rf"starts\[2\] = {ctx[2]} outside 0\.\.{ctx[2]}"),
        ([ctx[0] + 5, 0, 0], r"starts\[0\] = "),
        ([np.iinfo(np.int32).max, 0, 0], r"starts\[0\] = 2147483647"),
    ]:
        with pytest.raises(ValueError, match=match):
            call(starts)
    with pytest.raises(ValueError, match="C-contiguous"):
        call(np.zeros(6, np.int32)[::2])                          # a strided view
    call(ctx - 1)                                                  # the last key alone: fine
