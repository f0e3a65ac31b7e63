"""An int8 KV cache on the CPU (``--kv-cache-dtype int8``: a scale per token and KV head, each head
row ``[head_dim]`` int8 values then its float32 scale's 4 bytes): the Rust kernels read it as
the values it holds, both write paths (torch's, the fused Rust step's) quantize alike, the engine
sizes it by its row bytes, and SmolLM2's greedy steps stay close to the float32 cache's (closer
than FP8's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_cache_replay import replay_against_float32, serve_end_to_end
from test_cpu_decoder import _random_loaded, _replay_layer_by_layer
from test_cpu_kernels import (
    _random_decode_step,
    _random_prefill_step,
    _reference_decode,
    _reference_on_chunk_rows,
)

from ferrobatch._scheduler import paged_decode_attention_f32, paged_prefill_attention_f32
from ferrobatch.config import EngineConfig
from ferrobatch.runtime.cpu_linear import packing_unsupported
from ferrobatch.runtime.kv_cache import (
    INT8_SCALE_BYTES,
    KVCache,
    cache_array,
    cache_values,
    check_kv_cache_dtype,
    kv_block_bytes,
    num_blocks_for_budget,
    quantize_rows,
    to_cache_dtype,
)
from ferrobatch.runtime.model_runner import num_kv_blocks

pytestmark = pytest.mark.skipif(packing_unsupported(torch.device("cpu"), torch.float32) is not None,
                                reason="the Rust CPU kernels need AVX2 (packing unsupported)")
INT8 = torch.int8


def _scales(rows: torch.Tensor) -> torch.Tensor:
    return rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)[..., 0]


def test_rows_quantize_to_their_largest_value_with_ties_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -127.0, 3.49],
                      [2.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    rows = quantize_rows(x)
    assert rows.dtype == INT8 and rows.shape == (2, 8 + INT8_SCALE_BYTES)
    assert _scales(rows).tolist() == [1.0, torch.tensor(2.0 / 127).item()]
    assert rows[0, :8].tolist() == [127, 0, 2, 2, 0, -2, -127, 3]
    # 1 / (2 / 127) = 63.5 in float32: to even, 64; the largest magnitude is always 127 steps
    assert rows[1, :2].tolist() == [127, -64]
    values = cache_values(rows, torch.float32)
    assert values.shape == x.shape
    assert ((values - x).abs() <= 0.5 * _scales(rows)[:, None] * 1.0001).all()
    rng = torch.Generator().manual_seed(0)
    y = torch.randn(50, 3, 64, generator=rng) * 4
    rows = to_cache_dtype(y, INT8)                          # the writers' entry point
    assert rows.shape == (50, 3, 64 + INT8_SCALE_BYTES)
    assert (rows[..., :64].abs().amax(-1) == 127).all()
    step = _scales(rows)[..., None]
    assert ((cache_values(rows, torch.float32) - y).abs() <= 0.5 * step * 1.0001).all()


def test_zero_infinite_and_nan_rows():
    x = torch.tensor([[0.0, -0.0, 0.0], [1.0, float("inf"), 2.0], [1.0, float("nan"), 2.0]])
    rows = quantize_rows(x)
    assert (rows[:, :3] == 0).all()                         # no scale to divide by: bytes 0
    values = cache_values(rows, torch.float32)
    assert values[0].tolist() == [0.0, 0.0, 0.0]
    assert values[1:].isnan().all()                         # 0 x inf, 0 x NaN: the request fails


def test_the_kernels_read_an_int8_cache_as_its_values():
    """Decode applies each row's scale to its scores and weights (the values' result up to
    float32 rounding); prefill copies the blocks out as their values (the same result, bit for
    bit, on every path)."""
    rng = np.random.default_rng(2)
    for heads, head_dim in [((9, 3), 64), ((8, 2), 128), ((4, 4), 40)]:
        query, cache, table, ctx = _random_decode_step(rng, 6, *heads, head_dim)
        cache8 = to_cache_dtype(cache, INT8)
        values = cache_values(cache8, torch.float32)
        out, want = torch.zeros_like(query), torch.zeros_like(query)
        for c, o in ((cache8, out), (values, want)):
            paged_decode_attention_f32(query.numpy(), cache_array(c[0]), cache_array(c[1]),
                                       table, ctx, o.numpy(), 0.125, 2)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        assert (out - _reference_decode(query, cache, table, ctx, 16, 0.125)).abs().max() < 0.05
        q_lens = np.array([9, 40], np.int32)
        batch, q_starts, num_tokens, cache = _random_prefill_step(rng, q_lens, [0, 70], heads[1],
                                                                  head_dim)
        query = torch.randn(num_tokens, heads[0], head_dim)
        cache8 = to_cache_dtype(cache, INT8)
        values = cache_values(cache8, torch.float32)
        seq_lens = batch.seq_lens.astype(np.int32)
        for amx in (True, False):
            out, want = torch.zeros_like(query), torch.zeros_like(query)
            for c, o in ((cache8, out), (values, want)):
                paged_prefill_attention_f32(query.numpy(), cache_array(c[0]), cache_array(c[1]),
                                            batch.block_tables, q_starts, q_lens, seq_lens,
                                            o.numpy(), 0.125, 2, amx=amx)
            assert torch.equal(out, want)


def test_a_bad_int8_cache_is_a_clear_error():
    rng = np.random.default_rng(1)
    query, cache, table, ctx = _random_decode_step(rng, 2, 4, 2, 64)
    cache8 = to_cache_dtype(cache, INT8)
    out = torch.zeros_like(query)
    unscaled = cache8[..., :64].contiguous()               # rows without their scales
    with pytest.raises(ValueError, match=r"head_dim of q \(64\) and of the cache \(60\) differ"):
        paged_decode_attention_f32(query.numpy(), cache_array(unscaled[0]),
                                   cache_array(unscaled[1]), table, ctx, out.numpy(), 0.125, 1)
    with pytest.raises(ValueError, match="both int8"):
        paged_decode_attention_f32(query.numpy(), cache_array(cache8[0]),
                                   cache_array(cache[1]), table, ctx, out.numpy(), 0.125, 1)


def test_a_nan_written_to_the_cache_reaches_the_output():
    rng = np.random.default_rng(1)
    query, cache, table, ctx = _random_decode_step(rng, 3, 8, 2, 64)
    cache[1, table[0, 0], 0, 0, 5] = float("nan")
    cache8 = to_cache_dtype(cache, INT8)
    out = torch.zeros_like(query)
    paged_decode_attention_f32(query.numpy(), cache_array(cache8[0]), cache_array(cache8[1]),
                               table, ctx, out.numpy(), 0.125, 2)
    assert out[0, :4].isnan().all()             # the query heads of KV head 0: its whole V row
    assert not out[1:].isnan().any()


def test_the_int8_dtype_is_checked_named_and_sizes_the_cache(loaded_smollm2):
    cfg = loaded_smollm2.config                  # head_dim 64: rows of 68 bytes, not 256
    assert check_kv_cache_dtype(INT8, torch.float32, "cpu") == INT8
    with pytest.raises(ValueError, match=r"an int8 KV cache is not supported beside a bfloat16"):
        check_kv_cache_dtype(INT8, torch.bfloat16, "cuda")
    assert kv_block_bytes(cfg, 16, INT8) * 256 == kv_block_bytes(cfg, 16, torch.float32) * 68
    budget = 1 << 28
    blocks = num_kv_blocks(loaded_smollm2, block_size=16, max_num_batched_tokens=512,
                           cpu_kv_cache_bytes=budget, kv_cache_dtype=INT8)
    assert blocks == num_blocks_for_budget(cfg, 16, INT8, budget) == budget // (
        2 * cfg.num_layers * cfg.num_kv_heads * 68 * 16)
    cache = KVCache(cfg, num_blocks=4, block_size=16, device="cpu", dtype=INT8)
    assert cache.layers[0].shape == (2, 4, 16, cfg.num_kv_heads, 68)
    assert cache.num_bytes == 4 * kv_block_bytes(cfg, 16, INT8)
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    from ferrobatch.cli import _config, build_parser
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert _config(args).kv_cache_dtype == "int8"


def test_block_copies_move_int8_rows_with_their_scales(loaded_smollm2):
    cache = KVCache(loaded_smollm2.config, num_blocks=6, block_size=4, device="cpu", dtype=INT8)
    layer = cache.layers[1]
    layer[:, 2] = to_cache_dtype(torch.randn(*layer[:, 2].shape[:-1], 64), INT8)
    cache.copy_blocks([[2, 5]])
    assert torch.equal(layer[:, 5], layer[:, 2])
    assert cache_values(layer[:, 5], torch.float32).abs().sum() > 0


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-head-norms"])
def test_fused_steps_and_the_layer_path_write_the_same_int8_rows(qk_norm):
    """The fused Rust step quantizes K/V in Rust (``cpu_kv_q8.rs``), the layer-by-layer path in
    torch (``quantize_rows``): the same rows but where the two paths' float32 sums differ in
    their last bits. That moves a row's largest value, so its scale, by an ulp or so (about
    half the rows), and a value within that noise of a rounding boundary by one step (rare)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (30, 4, 17, 3, 40)]
    max_new = [12, 20, 6, 9, 5]
    fused_caches, plain_caches, num_steps, num_fused = _replay_layer_by_layer(
        _random_loaded(True, False, qk_norm), _random_loaded(True, False, qk_norm), prompts,
        max_new, kv_cache_dtype=INT8, logits_atol=1e-2)
    assert num_fused == num_steps
    values_apart = values = 0
    for a, b in zip(fused_caches, plain_caches, strict=True):
        written = _scales(a) != 0
        assert torch.equal(written, _scales(b) != 0)           # the same rows written
        a, b = a[written], b[written]
        torch.testing.assert_close(_scales(b), _scales(a), rtol=1e-5, atol=0)
        codes_a, codes_b = a[:, :-INT8_SCALE_BYTES].int(), b[:, :-INT8_SCALE_BYTES].int()
        assert ((codes_a - codes_b).abs() <= 1).all()           # at most one step apart
        values_apart += int((codes_a != codes_b).sum())
        values += codes_a.numel()
    print(f"{values_apart} of {values} written values a step apart")
    assert values > 0 and values_apart <= 1e-2 * values


def test_smollm2_steps_with_an_int8_cache_stay_close(loaded_smollm2):
    """The float32 cache's greedy run replayed over an int8 cache: a scale per head row keeps
    seven bits of each row's largest value, and the top token stays the same on nearly every
    row (FP8's check asks 85 %)."""
    worst, agree, total = replay_against_float32(loaded_smollm2, INT8)
    assert worst < 0.1, f"logits moved by {worst:.2e} of their largest value"
    assert agree >= 0.93 * total, f"top-1 agreed on {agree} of {total} rows"


def test_the_torch_reference_reads_an_int8_cache_as_its_values():
    rng = np.random.default_rng(4)
    query, cache, table, ctx = _random_decode_step(rng, 7, 9, 3, 64)
    cache8 = to_cache_dtype(cache, INT8)
    values = cache_values(cache8, torch.float32)
    got = _reference_decode(query, cache8, table, ctx, 16, 0.125)
    assert torch.equal(got, _reference_decode(query, values, table, ctx, 16, 0.125))
    q_lens = np.array([9, 40], np.int32)
    batch, q_starts, num_tokens, cache = _random_prefill_step(rng, q_lens, [0, 70], 3, 64)
    query = torch.randn(num_tokens, 9, 64)
    cache8 = to_cache_dtype(cache, INT8)
    rows, got = _reference_on_chunk_rows(query, cache8, batch, q_starts, q_lens, 0.125)
    _, want = _reference_on_chunk_rows(query, cache_values(cache8, torch.float32), batch,
                                       q_starts, q_lens, 0.125)
    assert torch.equal(got, want)


def test_the_engine_serves_with_an_int8_cache(loaded_smollm2):
    serve_end_to_end(loaded_smollm2, "int8", INT8)
