"""An FP8 E4M3 KV cache on the CPU (``--kv-cache-dtype fp8``, torch's ``float8_e4m3fn``): the Rust
kernels read it as the float32 values it holds (checked beside float16's in
``test_kv_cache_f16.py``), both write paths (torch's, the fused Rust step's) round and saturate
alike, the engine sizes it at a quarter of float32's bytes per token, and SmolLM2's greedy steps
stay close to the float32 cache's."""

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

from ferrobatch._scheduler import paged_decode_attention_f32
from ferrobatch.config import EngineConfig
from ferrobatch.runtime.cpu_linear import packing_unsupported
from ferrobatch.runtime.kv_cache import (
    FP8_E4M3_MAX,
    KVCache,
    cache_array,
    check_kv_cache_dtype,
    num_blocks_for_budget,
    to_cache_dtype,
)
from ferrobatch.runtime.model_runner import num_kv_blocks

pytestmark = pytest.mark.skipif(packing_unsupported(torch.device("cpu"), torch.float32) is not None,
                                reason="the Rust CPU kernels need AVX2 (packing unsupported)")
FP8 = torch.float8_e4m3fn


def test_writes_round_to_nearest_even_and_saturate():
    every_value = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = every_value[every_value.isfinite()]
    assert finite.abs().max() == FP8_E4M3_MAX and finite.numel() == 254
    x = torch.tensor([500.0, -1e30, float("inf"), 460.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 1e-9])
    got = to_cache_dtype(x, FP8).float()
    # beyond 448 saturates (torch alone gives NaN); ties go to the even mantissa
    assert got.tolist() == [448.0, -448.0, 448.0, 448.0, 1.0, 1.25, 0.0]
    assert to_cache_dtype(torch.tensor([float("nan")]), FP8).float().isnan().all()
    assert to_cache_dtype(x, torch.float16).dtype == torch.float16   # others: a plain cast


def test_a_nan_written_to_the_cache_reaches_the_output():
    """NaN is kept (not saturated), so a model that produced one still fails its request at the
    engine's finite-logits check instead of attending to a made-up value."""
    rng = np.random.default_rng(1)
    query, cache, table, ctx = _random_decode_step(rng, 3, 8, 2, 64)
    cache[1, table[0, 0], 0, 0, 5] = float("nan")
    cache8 = to_cache_dtype(cache, FP8)
    out = torch.zeros_like(query)
    paged_decode_attention_f32(query.numpy(), cache_array(cache8[0]), cache_array(cache8[1]),
                               table, ctx, out.numpy(), 0.125, 2)
    assert out[0, :4, 5].isnan().all()          # the query heads of KV head 0, dim 5
    assert not out[1:].isnan().any()


def test_the_fp8_dtype_is_checked_named_and_sizes_the_cache(loaded_smollm2):
    cfg = loaded_smollm2.config
    assert check_kv_cache_dtype(FP8, torch.float32, "cpu") == FP8
    for model, device in [(torch.bfloat16, "cuda"), (torch.bfloat16, "cpu")]:
        with pytest.raises(ValueError, match=r"an fp8 \(float8_e4m3fn\) KV cache is not supp"):
            check_kv_cache_dtype(FP8, model, device)
    f32 = num_blocks_for_budget(cfg, 16, torch.float32, 1 << 28)
    assert num_kv_blocks(loaded_smollm2, block_size=16, max_num_batched_tokens=512,
                         cpu_kv_cache_bytes=1 << 28, kv_cache_dtype=FP8) == 4 * f32
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    from ferrobatch.cli import _config, build_parser
    for name in ("fp8", "fp8_e4m3"):
        args = build_parser().parse_args(["serve", "--kv-cache-dtype", name])
        assert _config(args).kv_cache_dtype == name


def test_block_copies_move_fp8_bytes(loaded_smollm2):
    cache = KVCache(loaded_smollm2.config, num_blocks=6, block_size=4, device="cpu", dtype=FP8)
    layer = cache.layers[1]
    layer[:, 2] = to_cache_dtype(torch.randn(layer[:, 2].shape), FP8)
    cache.copy_blocks([[2, 5]])
    assert torch.equal(layer[:, 5].view(torch.uint8), layer[:, 2].view(torch.uint8))
    assert layer[:, 5].float().abs().sum() > 0


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-head-norms"])
def test_fused_steps_and_the_layer_path_write_the_same_fp8_bytes(qk_norm):
    """The fused Rust step rounds K/V in Rust (``cpu_kv_fp8.rs``), the layer-by-layer path in
    torch (after the same clamp): the same byte for nearly every value. A value within float32
    noise of a rounding boundary may round the other way (the two paths' float32 sums differ in
    their last bits): one code apart, and rare."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (30, 4, 17, 3, 40)]
    max_new = [12, 20, 6, 9, 5]
    fused_caches, plain_caches, num_steps, num_fused = _replay_layer_by_layer(
        _random_loaded(True, False, qk_norm), _random_loaded(True, False, qk_norm), prompts,
        max_new, kv_cache_dtype=FP8, logits_atol=2e-2)
    assert num_fused == num_steps
    differ = total = 0
    for a, b in zip(fused_caches, plain_caches, strict=True):
        codes_a, codes_b = a.view(torch.uint8).int(), b.view(torch.uint8).int()
        apart = codes_a != codes_b
        # one code apart: the same sign, the magnitudes' codes (which ascend with the value)
        # differing by one
        assert ((codes_a[apart] ^ codes_b[apart]) & 0x80 == 0).all()
        assert ((codes_a[apart] - codes_b[apart]).abs() == 1).all()
        differ += int(apart.sum())
        total += codes_a.numel()
    written = sum(len(p) + n for p, n in zip(prompts, max_new)) * 2 * 2 * 16 * 3
    print(f"{differ} of {written} written values rounded apart")
    assert differ <= 1e-3 * written, f"{differ} of {written} written values rounded apart"


def test_smollm2_steps_with_an_fp8_cache_stay_close(loaded_smollm2):
    """The float32 cache's greedy run replayed over an FP8 cache (the same steps and tokens):
    three mantissa bits move the logits more than float16's rounding does, yet the top token
    stays the same on most rows."""
    worst, agree, total = replay_against_float32(loaded_smollm2, FP8)
    assert worst < 0.2, f"logits moved by {worst:.2e} of their largest value"
    assert agree >= 0.85 * total, f"top-1 agreed on {agree} of {total} rows"


def test_the_torch_reference_reads_an_fp8_cache_as_its_values():
    """`--attention-backend torch` gathers an FP8 cache and converts what it gathers: decode rows
    and prefill chunks alike, exactly what it computes over the float32 values. (Its writes
    are the layer path's, checked against the Rust step's above.)"""
    rng = np.random.default_rng(4)
    query, cache, table, ctx = _random_decode_step(rng, 7, 9, 3, 64)
    cache8 = to_cache_dtype(cache, FP8)
    got = _reference_decode(query, cache8, table, ctx, 16, 0.125)
    assert torch.equal(got, _reference_decode(query, cache8.float(), table, ctx, 16, 0.125))
    q_lens = np.array([9, 40], np.int32)
    batch, q_starts, num_tokens, cache = _random_prefill_step(rng, q_lens, [0, 70], 3, 64)
    query = torch.randn(num_tokens, 9, 64)
    cache8 = to_cache_dtype(cache, FP8)
    rows, got = _reference_on_chunk_rows(query, cache8, batch, q_starts, q_lens, 0.125)
    _, want = _reference_on_chunk_rows(query, cache8.float(), batch, q_starts, q_lens, 0.125)
    assert torch.equal(got, want)


def test_the_engine_serves_with_an_fp8_cache(loaded_smollm2):
    serve_end_to_end(loaded_smollm2, "fp8", FP8)


def test_a_context_cut_by_a_small_cache_names_the_smaller_dtypes(loaded_smollm2, caplog):
    """When the KV cache cannot hold the model's context, the warning names what helps: more
    memory, and the smaller element types this device and model can store."""
    from ferrobatch.engine.core import EngineCore
    wants = {"auto": "--kv-cache-dtype float16 / fp8 / int8",
             "float16": "--kv-cache-dtype fp8 / int8", "fp8": None, "int8": None}
    for dtype, want in wants.items():
        caplog.clear()
        with caplog.at_level("WARNING", logger="ferrobatch.engine.core"):
            EngineCore.build(EngineConfig(kv_cache_dtype=dtype, num_blocks=20, device="cpu"),
                             loaded_smollm2)
        [line] = [r.getMessage() for r in caplog.records if "lowered" in r.getMessage()]
        assert "--kv-cache-gb" in line
        if want is None:
            assert "--kv-cache-dtype" not in line
        else:
            assert want in line
