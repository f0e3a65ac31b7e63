"""A float16 KV cache on the CPU (``--kv-cache-dtype float16``): the Rust kernels read it as the
float32 values it holds (the kernel checks here run for an FP8 cache too), the engine sizes it at
half the bytes per token, and SmolLM2's logits stay close to the float32 cache's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_cache_replay import replay_against_float32
from step_builder import ToyScheduler
from test_cpu_kernels import _random_decode_step, _random_prefill_step

from ferrobatch._scheduler import paged_decode_attention_f32, paged_prefill_attention_f32
from ferrobatch.config import EngineConfig
from ferrobatch.runtime.cpu_linear import packing_unsupported
from ferrobatch.runtime.kv_cache import (
    cache_array,
    check_kv_cache_dtype,
    num_blocks_for_budget,
    to_cache_dtype,
)
from ferrobatch.runtime.model_runner import ModelRunner, num_kv_blocks

pytestmark = pytest.mark.skipif(packing_unsupported(torch.device("cpu"), torch.float32) is not None,
                                reason="the Rust CPU kernels need AVX2 (packing unsupported)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["f16", "fp8"])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 2), 128), ((4, 4), 40)])
def test_decode_kernel_reads_a_rounded_cache_as_its_values_in_f32(heads, head_dim, dtype):
    # 40: the portable path; the others the SIMD loads (AVX2 / AVX-512 as the CPU has them);
    # * 8: FP8's normal range and its subnormals both
    rng = np.random.default_rng(head_dim + heads[0])
    torch.manual_seed(int(rng.integers(1 << 30)))
    query, cache, table, ctx = _random_decode_step(rng, 13, *heads, head_dim)
    rounded = to_cache_dtype(cache * 8, dtype)
    for threads in (1, 2):
        outs = {}
        for name, c in (("rounded", rounded), ("f32", rounded.float())):
            outs[name] = torch.full_like(query, float("nan"))
            paged_decode_attention_f32(query.numpy(), cache_array(c[0]), cache_array(c[1]),
                                       table, ctx, outs[name].numpy(), head_dim ** -0.5, threads)
        assert not outs["rounded"].isnan().any()
        assert torch.equal(outs["rounded"], outs["f32"]), "the cache is not read as its values"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["f16", "fp8"])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 4), 40)])
def test_prefill_kernel_reads_a_rounded_cache_as_its_values_in_f32(heads, head_dim, dtype):
    rng = np.random.default_rng(7 + head_dim)
    torch.manual_seed(int(rng.integers(1 << 30)))
    q_lens = np.array([9, 120, 33], np.int32)
    batch, q_starts, num_tokens, cache = _random_prefill_step(rng, q_lens, [0, 0, 300], heads[1],
                                                              head_dim)
    query = torch.randn(num_tokens, heads[0], head_dim)
    rounded = to_cache_dtype(cache, dtype)
    outs = {}
    for name, c in (("rounded", rounded), ("f32", rounded.float())):
        outs[name] = torch.full_like(query, float("nan"))
        paged_prefill_attention_f32(query.numpy(), cache_array(c[0]), cache_array(c[1]),
                                    batch.block_tables, q_starts, q_lens,
                                    batch.seq_lens.astype(np.int32), outs[name].numpy(),
                                    head_dim ** -0.5, 2)
    rows = np.concatenate([np.arange(s, s + n) for s, n in zip(q_starts, q_lens)])
    assert not outs["rounded"][rows].isnan().any()
    assert torch.equal(outs["rounded"][rows], outs["f32"][rows])
    assert outs["rounded"][np.setdiff1d(np.arange(num_tokens), rows)].isnan().all()


def test_kernels_refuse_mixed_or_other_cache_dtypes_without_writing():
    rng = np.random.default_rng(3)
    query, cache, table, ctx = _random_decode_step(rng, 4, 8, 2, 64)
    out = np.full(query.shape, np.nan, np.float32)
    k16, v16 = cache[0].half().numpy(), cache[1].half().numpy()
    k8 = cache[0].to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    for k, v in [(cache[0].numpy(), v16), (k16, cache[1].numpy()),
                 (cache[0].double().numpy(), cache[1].double().numpy()),
                 (cache[0].bfloat16().view(torch.int16).numpy(), v16), (k8, v16),
                 (k8, k8.view(np.int8)), (k8.view(np.int8), v16)]:
        with pytest.raises(ValueError, match="both float32, both float16, both uint8 .* or both "
                                             "int8"):
            paged_decode_attention_f32(query.numpy(), k, v, table, ctx, out, 0.125, 2)
        assert np.isnan(out).all()


def test_the_cache_dtype_is_checked_and_sizes_the_cache(loaded_smollm2):
    cfg = loaded_smollm2.config
    assert check_kv_cache_dtype(None, torch.float32, "cpu") == torch.float32
    assert check_kv_cache_dtype(torch.float16, torch.float32, "cpu") == torch.float16
    assert check_kv_cache_dtype(torch.bfloat16, torch.bfloat16, "cuda") == torch.bfloat16
    for kv, model, device in [(torch.bfloat16, torch.float32, "cpu"),
                              (torch.float16, torch.bfloat16, "cuda"),
                              (torch.float16, torch.bfloat16, "cpu")]:
        with pytest.raises(ValueError, match="KV cache is not supported"):
            check_kv_cache_dtype(kv, model, device)
    f32 = num_blocks_for_budget(cfg, 16, torch.float32, 1 << 28)
    assert num_kv_blocks(loaded_smollm2, block_size=16, max_num_batched_tokens=512,
                         cpu_kv_cache_bytes=1 << 28, kv_cache_dtype=torch.float16) == 2 * f32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="bfloat16")
    from ferrobatch.cli import _config, build_parser
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"])
    assert _config(args).kv_cache_dtype == "float16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


def test_smollm2_logits_with_an_f16_cache_stay_close(loaded_smollm2):
    """The f32 cache's greedy run replayed over an f16 cache (the same steps, the same tokens):
    the logits differ by float16's rounding of K/V only, far less than the gap between the
    two likeliest tokens almost everywhere."""
    worst, agree, total = replay_against_float32(loaded_smollm2, torch.float16)
    assert worst < 5e-3, f"logits moved by {worst:.2e} of their largest value"
    assert agree >= 0.95 * total, f"top-1 agreed on {agree} of {total} rows"


def test_the_torch_reference_reads_and_writes_an_f16_cache_like_the_kernels(loaded_smollm2):
    """`--attention-backend torch` over a float16 cache: the same steps as the Rust kernels'
    (fused) path, within float32 noise plus an occasional float16 rounding falling the other
    way. (One runner at a time: runners sharing a model share its attention backend.)"""
    sched = ToyScheduler(64, 16, token_budget=48, seed=2)
    rng = np.random.default_rng(9)
    for i, n in enumerate((30, 9, 50)):
        sched.add(i, rng.integers(100, 40000, size=n).tolist(), max_new_tokens=10)
    reference = ModelRunner(loaded_smollm2, num_blocks=64, block_size=16, attn_backend="torch",
                            kv_cache_dtype=torch.float16)
    steps = []
    while (batch := sched.schedule()) is not None:
        logits = reference.execute(batch).clone()
        steps.append((batch, logits))
        sched.update(logits.argmax(-1).numpy())
    kernels = ModelRunner(loaded_smollm2, num_blocks=64, block_size=16, attn_backend="cpu",
                          kv_cache_dtype=torch.float16)
    assert len(steps) > 10
    for i, (batch, want) in enumerate(steps):
        got = kernels.execute(batch)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()),
                                   msg=lambda m, i=i: f"step {i}: {m}")
    for a, b in zip(kernels.kv_cache.layers, reference.kv_cache.layers, strict=True):
        assert a.dtype == b.dtype == torch.float16
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-3 * float(b.abs().max()))
