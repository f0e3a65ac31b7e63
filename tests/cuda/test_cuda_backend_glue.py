"""The CUDA attention backend's Python glue, without a GPU: its three ops are replaced by plain
torch versions on the CPU that also check the contract the real kernels rely on (the grid is sized
by ``max_query_len``, a workspace must hold the batch and its splits, ``seq_ids`` limits the rows
written). Then decode-only, prefill-only and mixed steps, and a padded graph step from static
buffers, must match the torch reference backend — so a gather/scatter or argument mistake shows
up here rather than in the short GPU session (tests/gpu runs the same steps on the kernels)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cuda_glue import BLOCK_SIZE, make_step

from ferrobatch.runtime.attention.cuda import CudaMetadata
from ferrobatch.runtime.attention.torch_ref import TorchReferenceBackend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("query_lens,expect", [
    ([1] * 12, {"decode"}),                              # decode-only: split-KV decode kernel
    ([5, 300], {"prefill"}),                             # prefill-only
    ([1, 7, 1, 33, 1, 2], {"prefill/subset", "decode"}),  # mixed: decode rows gathered out
])
def test_backend_glue_matches_the_reference(backend, dtype, num_kv_heads, group, query_lens,
                                            expect):
    rng = np.random.default_rng(len(query_lens) * 10 + group)
    seq_lens = [max(q, int(x)) for q, x in zip(query_lens, rng.integers(40, 700, len(query_lens)))]
    batch, num_blocks = make_step(rng, seq_lens, query_lens)
    head_dim, gen = 64, torch.Generator().manual_seed(7)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_tokens = int(sum(query_lens))
    q, k, v = (torch.randn(num_tokens, h, head_dim, generator=gen).to(dtype)
               for h in (num_kv_heads * group, num_kv_heads, num_kv_heads))
    ref_be = TorchReferenceBackend(BLOCK_SIZE)
    meta, ref_meta = backend.build_metadata(batch, "cpu"), ref_be.build_metadata(batch, "cpu")
    assert isinstance(meta, CudaMetadata)
    ref_cache = cache.clone()
    backend.write_kv(cache, k, v, meta)
    ref_be.write_kv(ref_cache, k, v, ref_meta)
    assert torch.equal(cache, ref_cache)
    out = backend.forward(q, cache, meta, head_dim ** -0.5)
    want = ref_be.forward(q.float(), ref_cache.float(), ref_meta, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    kinds = {c.split("/")[0] if c.startswith("decode") else c for c in backend.fake.calls} - {"cache"}
    assert kinds == expect, backend.fake.calls


def test_static_graph_step_through_the_cuda_glue(backend):
    """A padded decode step from static buffers (what a captured graph runs): the split count
    fixed at capture, padding rows (slot -1, length 0) write nothing and come out zero."""
    from ferrobatch.runtime.cuda_graphs import pad_decode_batch

    rng = np.random.default_rng(5)
    batch, num_blocks = make_step(rng, [33, 700, 17], [1, 1, 1])
    bucket, max_blocks = 4, 48
    backend.prepare_decode_graphs(bucket, 6, 64)
    splits = backend.decode_graph_splits(bucket, 2, max_blocks * BLOCK_SIZE)
    assert splits > 1                     # a small bucket over long contexts splits the KV
    p = pad_decode_batch(batch, bucket, max_blocks)
    inputs = SimpleNamespace(
        input_ids=torch.from_numpy(p.input_ids), positions=torch.from_numpy(p.positions),
        slot_mapping=torch.from_numpy(p.slot_mapping), seq_lens=torch.from_numpy(p.seq_lens),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
        block_tables=torch.from_numpy(p.block_tables), bucket=bucket, num_splits=splits,
        max_seq_len=max_blocks * BLOCK_SIZE)
    meta = backend.static_decode_metadata(inputs)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, 2, 64, generator=gen)
    q, k, v = (torch.randn(bucket, h, 64, generator=gen) for h in (6, 2, 2))
    ref_be = TorchReferenceBackend(BLOCK_SIZE)
    ref_meta, ref_cache = ref_be.build_metadata(batch, "cpu"), cache.clone()
    backend.write_kv(cache, k, v, meta)
    ref_be.write_kv(ref_cache, k[:3], v[:3], ref_meta)
    assert torch.equal(cache, ref_cache), "a padding row wrote into the cache"
    out = backend.forward(q, cache, meta, 0.125)
    torch.testing.assert_close(out[:3], ref_be.forward(q[:3], ref_cache, ref_meta, 0.125),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert backend.fake.calls == ["cache", f"decode/{splits}"]


def test_model_runner_on_the_cuda_glue_with_graphs_gives_the_reference_tokens(backend):
    """A tiny model stepped by the toy scheduler (chunked prefills, mixed steps, a shrinking
    decode batch): the CUDA backend's glue with emulated decode graphs (static CudaMetadata, split
    counts fixed per bucket) against the torch reference, eager."""
    import copy
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "model"))
    from step_builder import ToyScheduler

    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.loader import LoadedModel, build_model
    from ferrobatch.runtime.model_runner import ModelRunner
    from ferrobatch.runtime.sampler import Sampler

    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                         num_layers=2, num_heads=6, num_kv_heads=2, head_dim=64,
                         max_position_embeddings=512)
    torch.manual_seed(1)
    model = build_model(config, None, device=torch.device("cpu"), dtype=torch.float32)
    for p in model.parameters():
        p.data.mul_(4.0)
    loaded = LoadedModel("tiny", config, model, None, None, "random")
    twin = copy.deepcopy(loaded)
    ref = ModelRunner(loaded, num_blocks=200, block_size=BLOCK_SIZE, attn_backend="torch")
    glue = ModelRunner(twin, num_blocks=200, block_size=BLOCK_SIZE, attn_backend=backend)
    glue.capture_decode_graphs(max_num_seqs=8, max_model_len=512, emulate=True)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in (3, 40, 17, 90, 9, 60)]
    max_new = [10, 22, 5, 16, 28, 12]
    outputs = []
    for runner in (ref, glue):
        sampler = Sampler(64, [], "cpu")
        sched = ToyScheduler(200, BLOCK_SIZE, token_budget=48, seed=2)
        seqs = [sched.add(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_new))]
        while (batch := sched.schedule()) is not None:
            sched.update(sampler.sample(runner.execute(batch), batch).token_ids)
        outputs.append([s.output_ids for s in seqs])
    assert outputs[0] == outputs[1]
    assert glue.graph_steps > 5 and glue.eager_steps >= 3
    calls = set(backend.fake.calls)
    assert {"prefill", "prefill/subset"} <= calls            # prefill-only and mixed steps
    assert any(c.startswith("decode/") and c != "decode/1" for c in calls)   # split graphs


def test_fused_reduce_only_after_its_start_up_check(backend, monkeypatch, caplog):
    """``use_fused_reduce``: off with FERROBATCH_DECODE_FUSED_REDUCE=0 (no check run); on when
    the fused reduce agrees with the reduce pass, and then a split decode step asks the op for
    it; off, with a warning, when it disagrees. (The stand-in op computes the same either way:
    the kernel's fused reduce itself is checked on the GPU.)"""
    from ferrobatch.runtime import cuda_ops
    from ferrobatch.runtime.attention import decode_reduce

    caplog.set_level("INFO", logger="ferrobatch")
    monkeypatch.setenv(decode_reduce.ENV_FLAG, "0")
    assert backend.use_fused_reduce(6, 2, 64, torch.float32) is False
    assert backend.fake.calls == [] and "reduce pass" not in backend.description
    monkeypatch.delenv(decode_reduce.ENV_FLAG)
    assert backend.use_fused_reduce(6, 2, 64, torch.float32) is True
    n = decode_reduce.CHECK_SPLITS
    assert backend.fake.calls == [f"decode/{n}", f"decode/{n}/fused", f"decode/{n}/fused"]
    assert "splits reduced in the kernel" in backend.description
    rng = np.random.default_rng(2)
    batch, num_blocks = make_step(rng, [900, 1500], [1, 1])
    meta = backend.build_metadata(batch, "cpu")
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, 2, 64)
    backend.fake.calls.clear()
    backend.forward(torch.randn(2, 6, 64), cache, meta, 0.125)
    assert len(backend.fake.calls) == 1 and backend.fake.calls[0].endswith("/fused")

    right = backend.fake.paged_decode_attention

    def stale(q, *args, fused_reduce=False, **kw):      # a fused reduce that reads stale state
        out = right(q, *args, fused_reduce=fused_reduce, **kw)
        return out + 1.0 if fused_reduce else out

    monkeypatch.setattr(cuda_ops, "paged_decode_attention", stale)
    assert backend.use_fused_reduce(6, 2, 64, torch.float32) is False
    assert "disagrees with it" in caplog.text and "worst" in caplog.text
