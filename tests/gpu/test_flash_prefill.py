"""The FlashAttention-2 prefill path on the GPU (``runtime.attention.flash_prefill``): against the
float64 reference on fresh random paged steps, through the CUDA backend, and in a model runner
next to ferrobatch's own prefill kernel. (Its host side is checked on the CPU in
tests/cuda/test_flash_prefill_cpu.py.)"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from paged_utils import make_batch, poison, random_cache, reference_attention, rel_err

pytestmark = pytest.mark.gpu

DEV = "cuda"
# FlashAttention rounds the softmax probabilities to the input dtype before P @ V (ferrobatch's
# kernel keeps them in fp32), so its bound is twice the kernels' (paged_utils.REL_TOL); a wrong
# causal alignment or a wrong gather gives errors of order 1
FLASH_REL_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 4e-3}
CASES = [
    # (context lengths after the step, query lengths)
    ([5], [5]),                                     # fresh short prompt
    ([1000, 77], [129, 77]),                        # chunk after prior context + fresh prompt
    ([513, 40, 1, 260, 2048], [1, 40, 1, 3, 100]),  # mixed: decode rows next to prefill chunks
    (list(range(17, 17 + 40 * 13, 13)), [1 + (i * 7) % 33 for i in range(40)]),
    ([8192, 1024], [2048, 1024]),                   # long: chunked prefill of a long prompt
]
SHAPES = [(8, 4, 128), (3, 3, 64), (1, 8, 128), (2, 1, 64)]   # (Hkv, group, D)


def _assert_flash_close(out, ref, dtype, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = rel_err(out, ref)
    assert err < FLASH_REL_TOL[dtype], f"{what}: relative error {err:.3e}"
    per_row = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    assert float(per_row.max()) < 2 * FLASH_REL_TOL[dtype], f"{what}: worst row {per_row.max():.3e}"


def _to_dev(a, dt):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dt)).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", SHAPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_flash_prefill_matches_the_float64_reference(dtype, num_kv_heads, group, head_dim, case):
    from ferrobatch.runtime.attention import flash_prefill as flash

    lens, qlens = CASES[case]
    seed = zlib.crc32(repr((str(dtype), num_kv_heads, group, head_dim, case)).encode())
    rng = np.random.default_rng(seed)
    block_size = 16 if case % 2 == 0 else 32
    pb = make_batch(rng, lens, qlens, block_size)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    cache = random_cache(pb, num_kv_heads, head_dim, dtype, DEV, gen)
    q = torch.randn(pb.num_tokens, num_kv_heads * group, head_dim, generator=gen,
                    device=DEV).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    ref = reference_attention(q, cache, pb, scale)
    plans = [np.arange(pb.num_seqs)]                 # the whole step (decode rows included)
    if (pb.query_lens == 1).any():                   # and a mixed step's prefill sequences
        plans.append(np.flatnonzero(pb.query_lens > 1))
    for seqs in plans:
        plan = flash.plan_flash_prefill(pb.query_start_loc, pb.seq_lens, pb.block_tables,
                                        block_size, seqs, _to_dev)
        out = poison(q.shape, dtype, DEV)
        flash.flash_prefill_attention(q, cache, plan, scale, out=out)
        torch.cuda.synchronize()
        rows = np.concatenate([np.arange(pb.query_start_loc[b], pb.query_start_loc[b + 1])
                               for b in seqs])
        _assert_flash_close(out[rows], ref[rows], dtype, f"flash case {case}, {len(seqs)} seqs")
        others = np.setdiff1d(np.arange(pb.num_tokens), rows)
        assert torch.isnan(out[others].float()).all(), "rows outside the plan were written"


def test_strided_query_of_a_fused_projection():
    """q as a view of a fused QKV output (row stride > Hq * D), as the model passes it."""
    from ferrobatch.runtime.attention import flash_prefill as flash

    rng = np.random.default_rng(5)
    pb = make_batch(rng, [300, 77], [300, 77], 16)
    gen = torch.Generator(device=DEV).manual_seed(5)
    cache = random_cache(pb, 2, 128, torch.bfloat16, DEV, gen)
    qkv = torch.randn(pb.num_tokens, (8 + 2 * 2) * 128, generator=gen, device=DEV).to(
        torch.bfloat16)
    q = qkv[:, :8 * 128].view(pb.num_tokens, 8, 128)
    assert not q.is_contiguous()
    plan = flash.plan_flash_prefill(pb.query_start_loc, pb.seq_lens, pb.block_tables, 16,
                                    np.arange(2), _to_dev)
    out = flash.flash_prefill_attention(q, cache, plan, 0.09)
    _assert_flash_close(out, reference_attention(q, cache, pb, 0.09), torch.bfloat16, "strided")


@pytest.mark.parametrize("whole_step", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)])   # Llama-3-8B, SmolLM2-135M
def test_start_up_check_passes_on_this_gpu(cuda_ops, dtype, shape, whole_step):
    from ferrobatch.runtime.attention import flash_prefill as flash

    ok, detail = flash.check_flash_prefill(cuda_ops.paged_prefill_attention, *shape, dtype, 16,
                                           torch.device(DEV), whole_step=whole_step)
    assert ok, detail


def test_backend_uses_flash_for_bf16_and_matches_its_kernel(cuda_ops):
    """CudaPagedBackend with and without FlashAttention on the same mixed and prefill steps (and
    with mixed steps split: decode rows on the decode kernel)."""
    from ferrobatch.runtime.attention.cuda import CudaPagedBackend

    rng = np.random.default_rng(8)
    with_flash, without = CudaPagedBackend(block_size=16), CudaPagedBackend(block_size=16,
                                                                            flash_prefill=False)
    split = CudaPagedBackend(block_size=16)
    split.flash_whole_steps = False
    for qlens in ([1, 70, 1, 133, 1, 2], [300, 45]):
        lens = [max(q, int(x)) for q, x in zip(qlens, rng.integers(40, 700, len(qlens)))]
        pb = make_batch(rng, lens, qlens, 16)
        gen = torch.Generator(device=DEV).manual_seed(len(qlens))
        cache = random_cache(pb, 3, 64, torch.bfloat16, DEV, gen)
        q = torch.randn(pb.num_tokens, 9, 64, generator=gen, device=DEV).to(torch.bfloat16)
        meta_f, meta_k = with_flash.build_metadata(pb, DEV), without.build_metadata(pb, DEV)
        assert meta_f.flash_plan is not None and meta_k.flash_plan is None
        a = with_flash.forward(q, cache, meta_f, 0.125)
        b = without.forward(q, cache, meta_k, 0.125)
        ref = reference_attention(q, cache, pb, 0.125)
        _assert_flash_close(a, ref, torch.bfloat16, f"backend flash {qlens}")
        _assert_flash_close(split.forward(q, cache, split.build_metadata(pb, DEV), 0.125), ref,
                            torch.bfloat16, f"backend flash, split mixed step {qlens}")
        assert rel_err(b, ref) < 8e-3
    assert list(with_flash._flash_verdicts.values()) == [True]
    assert list(with_flash._whole_step_verdicts.values()) == [True]      # the mixed step's


def test_model_runner_prefill_logits_with_and_without_flash(cuda_ops):
    """A small random Llama in bf16: prefill, chunk-after-context and mixed steps give the same
    logits (within bf16) on FlashAttention as on ferrobatch's prefill kernel."""
    import sys
    from pathlib import Path

    from ferrobatch.runtime.model_runner import ModelRunner

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from step_builder import context_prefill, mixed_step, random_llama_twins

    block_size, vocab = 16, 512
    loaded, twin = random_llama_twins(DEV, torch.bfloat16, vocab)
    flash_runner = ModelRunner(loaded, num_blocks=600, block_size=block_size, attn_backend="cuda")
    kernel_runner = ModelRunner(twin, num_blocks=600, block_size=block_size, attn_backend="cuda",
                                flash_prefill=False)
    rng = np.random.default_rng(2)
    for chunks in ([(0, 300)], [(40, 1), (0, 100), (200, 1), (33, 50)], [(100, 170), (7, 1)]):
        batch = mixed_step(rng, 600, block_size, chunks, vocab)
        fill = context_prefill(batch, block_size, vocab)
        if fill.input_ids.shape[0]:
            flash_runner.execute(fill, allow_graph=False)
            kernel_runner.execute(fill, allow_graph=False)
        got, want = flash_runner.execute(batch).clone(), kernel_runner.execute(batch).clone()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    assert list(flash_runner.attn_backend._flash_verdicts.values()) == [True]
    assert kernel_runner.attn_backend._flash_verdicts == {}


def test_real_model_bf16_prefill_logits_with_and_without_flash(cuda_ops):
    """SmolLM2 (or the e2e GGUF) in bf16, one step of fresh prompts, a chunk after context and
    decode rows: the sampled rows' logits on FlashAttention stay within bf16 noise of those on
    ferrobatch's kernel, and their top tokens agree wherever the kernel's top two are not a
    near-tie."""
    import copy
    import os
    import sys
    from pathlib import Path

    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.model_runner import ModelRunner

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from step_builder import context_prefill, mixed_step

    try:
        loaded = load_model(os.environ.get("FERROBATCH_E2E_GGUF") or "smollm2", device=DEV,
                            dtype=torch.bfloat16)
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    twin = copy.deepcopy(loaded)
    vocab = int(loaded.config.vocab_size)
    runners = [ModelRunner(loaded, num_blocks=400, block_size=16, attn_backend="cuda"),
               ModelRunner(twin, num_blocks=400, block_size=16, attn_backend="cuda",
                           flash_prefill=False)]
    rng = np.random.default_rng(4)
    batch = mixed_step(rng, 400, 16, [(0, 200), (0, 150), (300, 130), (50, 1), (90, 1)], vocab)
    fill = context_prefill(batch, 16, vocab)
    logits = []
    for runner in runners:
        runner.execute(fill, allow_graph=False)
        logits.append(runner.execute(batch, allow_graph=False).float())
    torch.cuda.synchronize()
    flash_logits, kernel_logits = logits
    scale = kernel_logits.abs().max()
    assert float((flash_logits - kernel_logits).abs().max() / scale) < 3e-2
    top2 = kernel_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
    assert torch.equal(flash_logits.argmax(-1)[clear], kernel_logits.argmax(-1)[clear])
    assert list(runners[0].attn_backend._flash_verdicts.values()) == [True]
