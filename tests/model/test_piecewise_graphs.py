"""Piecewise graphs without a GPU: the token buckets, and the ModelRunner's whole piecewise data
flow with emulated pieces (each "replay" calls the piece on the static buffers), against the eager
forward on prefill, mixed and speculative-shaped steps. Capture itself is checked on the GPU
(tests/gpu/test_cuda_graph.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from step_builder import context_prefill, mixed_step
from test_decode_graphs import BLOCK_SIZE, _greedy_run, _tiny_loaded, _twin_runners

from ferrobatch.model.config import ModelConfig
from ferrobatch.runtime.piecewise_graphs import (
    bucket_for,
    piecewise_buckets,
    pool_bytes_estimate,
)


def test_piecewise_buckets():
    assert piecewise_buckets(1) == (1,)
    assert piecewise_buckets(100) == (16, 32, 64, 100)
    assert piecewise_buckets(512) == (16, 32, 64, 128, 256, 384, 512)
    big = piecewise_buckets(4096)
    assert big[-1] == 4096 and big[:4] == (16, 32, 64, 128)
    # padding stays within a quarter of the step's tokens past 128
    assert all(b / a <= 2 for a, b in zip(big, big[1:]))
    assert all((b - a) / a <= 0.25 for a, b in zip(big[4:], big[5:]) if a >= 512)
    assert piecewise_buckets(5000)[-2:] == (4608, 5000)
    assert bucket_for(1, big) == 16 and bucket_for(129, big) == 256 and bucket_for(4097, big) is None
    with pytest.raises(ValueError):
        piecewise_buckets(0)


def test_pool_estimate_covers_the_largest_tensors():
    cfg = ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      max_position_embeddings=8192)
    est = pool_bytes_estimate(cfg, 4096, torch.bfloat16)
    gate_up = 4096 * 2 * 14336 * 2          # the fused gate/up output alone
    assert gate_up < est < 4 * gate_up


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_emulated_pieces_match_the_eager_step(backend):
    eager, pieced = _twin_runners(120, backend)
    assert pieced.capture_piecewise_graphs(64, emulate=True) == (16, 32, 64)
    assert not pieced.kv_cache.layers[0].any(), "capture must not write the KV cache"
    rng = np.random.default_rng(5)
    steps = [[(0, 11)],                                   # one prefill: bucket 16
             [(9, 1), (0, 20), (30, 1), (4, 5)],          # decode rows + a chunk + a draft
             [(17, 4), (5, 3), (40, 1)],                  # speculative-shaped: 4 + 3 + 1 rows
             [(0, 64)],                                   # exactly the largest bucket
             [(3, 1)]]                                    # one decode row (no decode graphs)
    for chunks in steps:
        batch = mixed_step(rng, eager.num_blocks, BLOCK_SIZE, chunks)
        fill = context_prefill(batch, BLOCK_SIZE)
        if fill.input_ids.shape[0]:
            eager.execute(fill, allow_graph=False)
            pieced.execute(fill, allow_graph=False)
        want = eager.execute(batch)
        before = pieced.piecewise_steps
        got = pieced.execute(batch)
        assert pieced.piecewise_steps == before + 1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the argmax a greedy sampler takes is the same
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for layer_e, layer_p in zip(eager.kv_cache.layers, pieced.kv_cache.layers, strict=True):
            torch.testing.assert_close(layer_p, layer_e, rtol=1e-5, atol=1e-5)
    assert pieced.piecewise_graphs.replays == len(steps)
    # hidden rows (prompt logprobs) come from the same residual stream
    batch = mixed_step(rng, eager.num_blocks, BLOCK_SIZE, [(0, 10), (6, 1)])
    rows = np.arange(9)
    want_l, want_h = eager.execute(batch, hidden_rows=rows)
    got_l, got_h = pieced.execute(batch, hidden_rows=rows)
    torch.testing.assert_close(got_l, want_l, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_h, want_h, rtol=1e-4, atol=1e-4)
    # larger than the largest bucket, or graphs declined: eager
    eager_before = pieced.eager_steps
    pieced.execute(mixed_step(rng, eager.num_blocks, BLOCK_SIZE, [(0, 40), (0, 30)]))
    pieced.execute(mixed_step(rng, eager.num_blocks, BLOCK_SIZE, [(0, 8)]), allow_graph=False)
    assert pieced.eager_steps == eager_before + 2


def test_emulated_pieces_give_the_eager_greedy_tokens_with_decode_graphs():
    """A whole run of the toy scheduler's steps (chunked prefills, mixed and decode steps): decode
    graphs for the decode steps, pieces for the rest, and the same tokens as the eager runner."""
    eager, graphed = _twin_runners(160, "torch", seed=1)
    graphed.capture_decode_graphs(max_num_seqs=8, max_model_len=96, emulate=True)
    graphed.capture_piecewise_graphs(40, emulate=True)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in (3, 9, 17, 8, 30, 12, 5)]
    max_new = [12, 20, 6, 25, 9, 15, 18]
    want, _, used = _greedy_run(eager, prompts, max_new)
    got, _, used_g = _greedy_run(graphed, prompts, max_new)
    assert got == want and used == used_g
    assert graphed.graph_steps > 0 and graphed.piecewise_steps > 0
    assert graphed.eager_steps == 0
    assert graphed.graph_steps + graphed.piecewise_steps == eager.eager_steps


def test_piecewise_capture_needs_cuda_unless_emulated():
    from ferrobatch.runtime.model_runner import ModelRunner

    runner = ModelRunner(_tiny_loaded(), num_blocks=8, block_size=BLOCK_SIZE, attn_backend="torch")
    with pytest.raises(RuntimeError, match="CUDA device"):
        runner.capture_piecewise_graphs(32)
    assert runner.piecewise_graphs is None


def test_engine_captures_pieces_per_config_and_survives_a_failed_capture(caplog, monkeypatch):
    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.core import _maybe_capture_piecewise_graphs

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 2 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    class Runner:
        device = "cuda"
        config = ModelConfig(arch="llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                             num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8)
        piecewise_graphs = None
        fail = False

        def __init__(self):
            self.calls = []

        def capture_piecewise_graphs(self, max_tokens, progress=None):
            self.calls.append(max_tokens)
            buckets = piecewise_buckets(max_tokens)
            progress(1, len(buckets))
            if self.fail:
                self.piecewise_graphs = "partial"
                raise RuntimeError("CUDA out of memory")
            self.piecewise_graphs = "captured"
            return buckets

    runner = Runner()
    with caplog.at_level("INFO", logger="ferrobatch.engine.core"):
        _maybe_capture_piecewise_graphs(EngineConfig(max_num_batched_tokens=300), runner)
        assert runner.calls == [300] and runner.piecewise_graphs == "captured"
        assert "6 token buckets up to 300" in caplog.text
        for off in (EngineConfig(cuda_graphs=False), EngineConfig(piecewise_max_tokens=0)):
            _maybe_capture_piecewise_graphs(off, runner)
    assert runner.calls == [300]
    assert "piecewise_max_tokens=0" in caplog.text
    runner.fail = True
    caplog.clear()
    with caplog.at_level("WARNING", logger="ferrobatch.engine.core"):
        _maybe_capture_piecewise_graphs(EngineConfig(piecewise_max_tokens=64), runner)
    assert runner.calls == [300, 64] and runner.piecewise_graphs is None
    assert "capture failed" in caplog.text and "out of memory" in caplog.text
