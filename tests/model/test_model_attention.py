"""Paged KV layout and the torch reference attention vs a naive per-sequence oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from step_builder import ToyScheduler

from ferrobatch.model.config import ModelConfig
from ferrobatch.runtime.attention import TorchReferenceBackend, get_attention_backend
from ferrobatch.runtime.kv_cache import KVCache, kv_block_bytes, num_blocks_for_budget

NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 6, 16, 4, 64


def _mixed_batch(seed: int, token_budget: int = 9):
    """Three sequences: a finished prefill now decoding, a chunked prefill, a fresh prompt."""
    sched = ToyScheduler(NUM_BLOCKS, BLOCK_SIZE, token_budget=token_budget, seed=seed)
    rng = np.random.default_rng(seed)
    for req_id, length in enumerate((5, 13, 7)):
        sched.add(req_id, rng.integers(0, 100, length).tolist(), max_new_tokens=4)
    batches = []
    while (batch := sched.schedule()) is not None and len(batches) < 8:
        batches.append(batch)
        sched.update(rng.integers(0, 100, batch.num_samples))
    return batches


def _naive_attention(query, kv_cache, batch, scale):
    """Loops over sequences; reads each context position through the block table."""
    out = torch.empty_like(query)
    group = NUM_HEADS // NUM_KV_HEADS
    for i in range(batch.num_seqs):
        start, end = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        ctx = int(batch.seq_lens[i])
        positions = np.arange(ctx)
        blocks = batch.block_tables[i][positions // BLOCK_SIZE]
        k = kv_cache[0, blocks, positions % BLOCK_SIZE].repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = kv_cache[1, blocks, positions % BLOCK_SIZE].repeat_interleave(group, dim=1)
        q = query[start:end]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - (end - start), ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, -math.inf)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def test_written_kv_is_read_back_through_shuffled_block_tables():
    backend = TorchReferenceBackend(block_size=BLOCK_SIZE)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    seen_non_monotonic = False
    for batch in _mixed_batch(seed=3):
        meta = backend.build_metadata(batch, "cpu")
        key = torch.randn(batch.num_tokens, NUM_KV_HEADS, HEAD_DIM)
        value = torch.randn(batch.num_tokens, NUM_KV_HEADS, HEAD_DIM)
        backend.write_kv(cache, key, value, meta)
        for i in range(batch.num_seqs):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            pos = batch.positions[start:end]
            blocks = batch.block_tables[i][pos // BLOCK_SIZE]
            torch.testing.assert_close(cache[0, blocks, pos % BLOCK_SIZE], key[start:end], rtol=0, atol=0)
            torch.testing.assert_close(cache[1, blocks, pos % BLOCK_SIZE], value[start:end], rtol=0, atol=0)
            table = batch.block_tables[i][batch.block_tables[i] > 0]
            seen_non_monotonic |= bool(np.any(np.diff(table) < 0))
    assert seen_non_monotonic, "block tables were not shuffled"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference_matches_naive_attention(seed, dtype):
    torch.manual_seed(seed)
    backend = TorchReferenceBackend(block_size=BLOCK_SIZE)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM ** -0.5
    batches = _mixed_batch(seed)
    assert any(np.diff(b.query_start_loc).max() > 1 and np.diff(b.query_start_loc).min() == 1
               for b in batches), "want a step mixing decode and prefill rows"
    for batch in batches:
        meta = backend.build_metadata(batch, "cpu")
        query = torch.randn(batch.num_tokens, NUM_HEADS, HEAD_DIM).to(dtype)
        backend.write_kv(cache, torch.randn(batch.num_tokens, NUM_KV_HEADS, HEAD_DIM),
                         torch.randn(batch.num_tokens, NUM_KV_HEADS, HEAD_DIM), meta)
        got = backend.forward(query, cache, meta, scale)
        want = _naive_attention(query.float(), cache.float(), batch, scale)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_backend_selection_on_cpu():
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend(None, "cpu").name == "cpu"
    assert get_attention_backend("torch", "cpu").name == "torch"
    fp32, bf16 = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float32), (8, 2, 64, torch.bfloat16)
    assert get_attention_backend("auto", "cpu", model_shape=fp32).name == "cpu"
    assert get_attention_backend("auto", "cpu", model_shape=bf16).name == "torch"
    with pytest.raises(RuntimeError, match="float32 only"):
        get_attention_backend("cpu", "cpu", model_shape=bf16)
    with pytest.raises(ValueError):
        get_attention_backend("cpu", "cuda")
    with pytest.raises(ValueError):
        get_attention_backend("cuda", "cpu")
    with pytest.raises(ValueError):
        get_attention_backend("flash", "cpu")


def test_kv_cache_sizing_and_block_copies():
    config = ModelConfig(arch="llama", vocab_size=10, hidden_size=12, intermediate_size=8,
                         num_layers=3, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    per_block = kv_block_bytes(config, BLOCK_SIZE, torch.float32)
    assert per_block == 2 * 3 * NUM_KV_HEADS * HEAD_DIM * 4 * BLOCK_SIZE
    assert num_blocks_for_budget(config, BLOCK_SIZE, torch.float32, 10 * per_block + 5) == 10
    with pytest.raises(ValueError):
        num_blocks_for_budget(config, BLOCK_SIZE, torch.float32, per_block)
    cache = KVCache(config, 10, BLOCK_SIZE, "cpu", torch.float32)
    assert cache.num_bytes == 10 * per_block
    for layer in cache.layers:
        layer.normal_()
    before = [layer.clone() for layer in cache.layers]
    cache.copy_blocks(np.array([[2, 5], [7, 1]], np.int32))
    for old, new in zip(before, cache.layers):
        torch.testing.assert_close(new[:, 5], old[:, 2])
        torch.testing.assert_close(new[:, 1], old[:, 7])
        torch.testing.assert_close(new[:, 2], old[:, 2])
    with pytest.raises(ValueError):
        cache.copy_blocks(np.array([[0, 10]]))


def test_warm_up_batch_runs_and_cpu_block_count():
    from ferrobatch.model.loader import LoadedModel, build_model
    from ferrobatch.runtime.model_runner import (
        ModelRunner,
        _warm_up_batch,
        num_kv_blocks,
    )

    config = ModelConfig(arch="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=128)
    model = build_model(config, None, device=torch.device("cpu"), dtype=torch.float32)
    loaded = LoadedModel("tiny", config, model, None, None, "random")
    batch, blocks_needed = _warm_up_batch(37, BLOCK_SIZE, config.vocab_size)
    runner = ModelRunner(loaded, num_blocks=blocks_needed, block_size=BLOCK_SIZE)
    assert torch.isfinite(runner.execute(batch)).all()
    budget = 7 * 2 * 2 * NUM_KV_HEADS * HEAD_DIM * 4 * BLOCK_SIZE
    assert num_kv_blocks(loaded, block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                         cpu_kv_cache_bytes=budget) == 7


def test_auto_backend_plugs_in_cuda_module_and_falls_back(monkeypatch):
    import sys
    import types

    from ferrobatch.runtime.attention.base import AttentionBackend

    class FakeCudaBackend(TorchReferenceBackend):
        name = "cuda"

        def __init__(self, block_size, device):
            super().__init__(block_size)
            self.device = device

        @staticmethod
        def supports(num_heads, num_kv_heads, head_dim, dtype):
            return None if head_dim in (64, 128) else f"head_dim {head_dim}"

    fake = types.ModuleType("ferrobatch.runtime.attention.cuda")
    fake.is_available = lambda: True
    fake.CudaAttentionBackend = FakeCudaBackend
    monkeypatch.setitem(sys.modules, "ferrobatch.runtime.attention.cuda", fake)
    chosen = get_attention_backend("auto", "cuda", block_size=8, model_shape=(8, 2, 64, torch.bfloat16))
    assert isinstance(chosen, AttentionBackend) and chosen.name == "cuda" and chosen.block_size == 8
    fallback = get_attention_backend("auto", "cuda", model_shape=(8, 2, 96, torch.bfloat16))
    assert fallback.name == "torch"
    with pytest.raises(RuntimeError, match="head_dim 96"):
        get_attention_backend("cuda", "cuda", model_shape=(8, 2, 96, torch.bfloat16))
    fake.is_available = lambda: False
    assert get_attention_backend("auto", "cuda").name == "torch"
