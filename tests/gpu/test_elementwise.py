"""The fused elementwise kernels (cuda/elementwise.cu) against the torch modules they replace, on
fresh random inputs: every dtype, strided q/k views of a fused QKV output, odd row counts."""

from __future__ import annotations

import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = "cuda"


def _tol(dtype):
    # the kernel's mean square sums in another order than torch's reduction (and the build's fast
    # math), which can move a bf16 / fp16 rounding by one unit in the last place
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (300, 4096), (33, 1000)])
def test_rms_norm_matches_the_module(cuda_ops, dtype, rows, hidden):
    from ferrobatch.model.llama import RMSNorm
    from ferrobatch.runtime.cuda_elementwise import CudaRMSNorm

    gen = torch.Generator(device=DEV).manual_seed(rows * hidden)
    norm = RMSNorm(hidden, 1e-5, device=DEV, dtype=dtype)
    norm.weight.data = torch.randn(hidden, generator=gen, device=DEV).to(dtype)
    wide = torch.randn(rows, hidden + 32, generator=gen, device=DEV).to(dtype) * 3
    x = wide[:, 16:16 + hidden]                   # strided rows
    want = norm(x)
    got = CudaRMSNorm(norm)(x)
    assert got.dtype == dtype and got.shape == (rows, hidden)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (300, 4096), (33, 1000)])
def test_add_rms_norm_matches_the_add_then_the_module(cuda_ops, dtype, rows, hidden):
    """The residual add fused into the norm: the sum rounds exactly as torch's add, the norm of
    that rounded sum as the module's."""
    from ferrobatch.model.llama import RMSNorm, add_then_norm
    from ferrobatch.runtime.cuda_elementwise import CudaRMSNorm

    gen = torch.Generator(device=DEV).manual_seed(rows * hidden + 1)
    norm = RMSNorm(hidden, 1e-5, device=DEV, dtype=dtype)
    norm.weight.data = torch.randn(hidden, generator=gen, device=DEV).to(dtype)
    wide = torch.randn(rows, 2 * hidden + 8, generator=gen, device=DEV).to(dtype) * 3
    x, delta = wide[:, :hidden], wide[:, hidden + 8:]            # strided rows
    want_sum, want = add_then_norm(norm, x, delta)
    got_sum, got = add_then_norm(CudaRMSNorm(norm), x, delta)
    assert got.dtype == got_sum.dtype == dtype and got.shape == got_sum.shape == (rows, hidden)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (9, 1536), (257, 14336)])
def test_silu_and_mul_matches_the_module(cuda_ops, dtype, rows, inter):
    from ferrobatch.model.llama import SiluAndMul
    from ferrobatch.runtime.cuda_elementwise import CudaSiluAndMul

    gen = torch.Generator(device=DEV).manual_seed(rows + inter)
    x = (torch.randn(rows, 2 * inter, generator=gen, device=DEV) * 4).to(dtype)
    got = CudaSiluAndMul()(x)
    torch.testing.assert_close(got, SiluAndMul()(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,dim", [(1, 9, 3, 64), (17, 32, 8, 128), (300, 8, 8, 64)])
def test_rotary_in_place_matches_the_module(cuda_ops, dtype, tokens, hq, hkv, dim):
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.rope import ApplyRotary, RotaryEmbedding
    from ferrobatch.runtime.cuda_elementwise import CudaApplyRotary

    config = ModelConfig(arch="llama", vocab_size=10, hidden_size=hq * dim, intermediate_size=8,
                         num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=dim,
                         max_position_embeddings=4096)
    gen = torch.Generator(device=DEV).manual_seed(tokens * hq)
    rotary = RotaryEmbedding(config, DEV)
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEV)
    tables = rotary.tables(positions, dtype)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen, device=DEV).to(dtype)
    q, k, _ = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    q, k = q.view(tokens, hq, dim), k.view(tokens, hkv, dim)     # strided views, as the model's
    want_q, want_k = ApplyRotary()(q, k, tables)
    v_before = qkv[:, (hq + hkv) * dim:].clone()
    got_q, got_k = CudaApplyRotary()(q, k, tables)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()   # in place
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))
    assert torch.equal(qkv[:, (hq + hkv) * dim:], v_before), "v must be left alone"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,dim,block_size",
                         [(1, 9, 3, 64, 16), (17, 32, 8, 128, 16), (300, 8, 8, 64, 32),
                          (45, 12, 4, 128, 5)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_rotary_and_cache_is_rotary_then_reshape_and_cache(cuda_ops, dtype, tokens, hq, hkv, dim,
                                                           block_size, slot_dtype):
    """One kernel for rotary + the K/V write: q and k exactly as rotary_inplace leaves them, the
    cache exactly as reshape_and_cache of those k (and v) leaves it: shuffled slots over a
    strided cache view (block size 5: not a power of two), padding rows (slot -1) write
    nothing, every other cache element keeps its poison."""
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.rope import RotaryEmbedding
    from ferrobatch.runtime.cuda_elementwise import CudaApplyRotary

    config = ModelConfig(arch="llama", vocab_size=10, hidden_size=hq * dim, intermediate_size=8,
                         num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=dim,
                         max_position_embeddings=4096)
    gen = torch.Generator(device=DEV).manual_seed(tokens * hq + block_size)
    tables = RotaryEmbedding(config, DEV).tables(
        torch.randint(0, 4096, (tokens,), generator=gen, device=DEV), dtype)
    num_blocks = (tokens + block_size - 1) // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEV)[:tokens]
    slots[::7] = -1
    slots = slots.to(slot_dtype)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen, device=DEV).to(dtype)
    # a cache view that is one layer of a [layers, 2, ...] allocation (strided outer dims)
    whole = torch.full((3, 2, num_blocks, block_size, hkv, dim), float("nan"), dtype=dtype,
                       device=DEV)
    ref_whole = whole.clone()

    def views(t):
        q, k, v = t.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        return q.view(tokens, hq, dim), k.view(tokens, hkv, dim), v.view(tokens, hkv, dim)

    ref_qkv = qkv.clone()
    rq, rk, rv = views(ref_qkv)
    cos, sin = (t.reshape(tokens, dim) for t in tables)
    cuda_ops.rotary_inplace(rq, rk, cos, sin)
    cuda_ops.reshape_and_cache(rk, rv, ref_whole[1], slots)
    q, k, v = views(qkv)
    assert CudaApplyRotary().rotate_and_cache(q, k, v, tables, whole[1], slots)
    assert torch.equal(qkv, ref_qkv), "q / k must be rotated exactly as rotary_inplace does"
    assert torch.equal(whole.isnan(), ref_whole.isnan()), "written cache elements differ"
    written = ~ref_whole.isnan()
    assert written.any() and torch.equal(whole[written], ref_whole[written])
    # with a cache of another dtype it declines and touches nothing
    other = torch.zeros(2, num_blocks, block_size, hkv, dim, device=DEV,
                        dtype=torch.float16 if dtype != torch.float16 else torch.float32)
    before = qkv.clone()
    assert not CudaApplyRotary().rotate_and_cache(q, k, v, tables, other, slots)
    assert torch.equal(qkv, before) and not other.any()


def test_engine_with_fused_ops_gives_the_eager_engine_tokens(cuda_ops, monkeypatch):
    """fp32 SmolLM2 (or the e2e GGUF), greedy: the fused kernels swapped in give the same tokens
    as the torch modules."""
    import os

    from ferrobatch import LLM, SamplingParams
    from ferrobatch.model.loader import load_model

    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for fused in (False, "apart", True):        # torch's modules; rotary apart from the write
        monkeypatch.setenv("FERROBATCH_CUDA_FUSED_OPS", "1" if fused else "0")
        monkeypatch.setenv("FERROBATCH_ROTARY_CACHE", "1" if fused is True else "0")
        try:       # a fresh model each time: the swap replaces the model's modules
            loaded = load_model(os.environ.get("FERROBATCH_E2E_GGUF") or "smollm2", device="cuda",
                                dtype=torch.float32)
        except (ImportError, FileNotFoundError) as exc:
            pytest.skip(f"SmolLM2 unavailable: {exc}")
        with LLM("smollm2", loaded_model=loaded, device="cuda", dtype="float32", kv_cache_gb=1.0,
                 max_num_seqs=8) as llm:
            from ferrobatch.runtime.cuda_elementwise import CudaRMSNorm
            assert any(isinstance(m, CudaRMSNorm) for m in loaded.model.modules()) == bool(fused)
            backend = llm.engine._core.runner.attn_backend
            assert backend.rotary_with_kv_write == (fused is True)
            outs[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs["apart"] == outs[False]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["smollm2-135m", "llama3-8b-2layers"])
def test_start_up_check_passes_on_this_gpu(cuda_ops, dtype, shape):
    """The check that decides whether the engine swaps the kernels in (random weights of the
    model's shapes; Llama-3-8B with 2 of its 32 layers)."""
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.loader import build_model
    from ferrobatch.runtime.cuda_elementwise import check_fused_ops, check_rotary_cache

    if shape == "smollm2-135m":
        config = ModelConfig(arch="llama", vocab_size=1024, hidden_size=576,
                             intermediate_size=1536, num_layers=2, num_heads=9, num_kv_heads=3,
                             head_dim=64, max_position_embeddings=8192)
    else:
        config = ModelConfig(arch="llama", vocab_size=1024, hidden_size=4096,
                             intermediate_size=14336, num_layers=2, num_heads=32,
                             num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                             rope_theta=500000.0)
    model = build_model(config, None, device=torch.device(DEV), dtype=dtype)
    ok, detail = check_fused_ops(model, dtype)
    assert ok, detail
    ok, detail = check_rotary_cache(model, dtype)
    assert ok, detail
