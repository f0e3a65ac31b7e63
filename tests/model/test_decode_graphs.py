"""Decode-step graphs, without a GPU: the bucket choice, the padded static-buffer attention path
(the reference semantics of graph padding), and the ModelRunner's whole graph data flow with
emulated graphs (``emulate=True`` re-runs the forward on the static buffers at each replay).
Capture itself is checked on the GPU (tests/gpu/test_cuda_graph.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from step_builder import ToyScheduler

from ferrobatch.model.config import ModelConfig
from ferrobatch.runtime.attention.base import StaticDecodeMetadata
from ferrobatch.runtime.attention.torch_ref import TorchReferenceBackend, static_decode_attention
from ferrobatch.runtime.cuda_graphs import decode_buckets

BLOCK_SIZE = 8
MAX_MODEL_LEN = 96


def test_decode_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(5) == (1, 2, 4, 5)
    assert decode_buckets(128) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
    assert decode_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)
    big = decode_buckets(4096)
    assert big[-1] == 512 and all(b - a <= 16 for a, b in zip(big[4:], big[5:]))
    with pytest.raises(ValueError):
        decode_buckets(0)


def _decode_batch(rng, lengths, num_blocks, block_size, num_tokens_vocab=50):
    """A decode-only step (one new token per sequence) over shuffled blocks."""
    free = list(rng.permutation(np.arange(1, num_blocks)))
    width = -(-int(max(lengths)) // block_size) + 1          # one all-zero padding column
    tables = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        tables[i, :-(-n // block_size)] = [free.pop() for _ in range(-(-n // block_size))]
    lengths = np.asarray(lengths, np.int32)
    last = lengths - 1
    slots = tables[np.arange(len(lengths)), last // block_size] * block_size + last % block_size
    n = len(lengths)
    return SimpleNamespace(
        input_ids=rng.integers(0, num_tokens_vocab, n).astype(np.int32), positions=last,
        slot_mapping=slots.astype(np.int32), query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=lengths, block_tables=tables, logits_indices=np.arange(n, dtype=np.int32),
        block_copies=np.zeros((0, 2), np.int32))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (4, 4, 16, 8), (6, 2, 32, 16), (8, 1, 64, 5)])
def test_static_decode_path_matches_reference_and_pads_with_nothing(num_heads, num_kv_heads,
                                                                     head_dim, block_size):
    from ferrobatch.runtime.cuda_graphs import pad_decode_batch

    rng = np.random.default_rng(num_heads * 7 + block_size)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    num_blocks = 200
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    backend = TorchReferenceBackend(block_size)
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 61]
    batch = _decode_batch(rng, lengths, num_blocks, block_size)
    n, bucket, max_blocks = len(lengths), 8, 16
    query = torch.randn(n, num_heads, head_dim, generator=gen)
    key = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(n, num_kv_heads, head_dim, generator=gen)

    eager_cache = cache.clone()
    meta = backend.build_metadata(batch, "cpu")
    backend.write_kv(eager_cache, key, value, meta)
    want = backend.forward(query, eager_cache, meta, head_dim ** -0.5)

    p = pad_decode_batch(batch, bucket, max_blocks)
    inputs = SimpleNamespace(
        input_ids=torch.from_numpy(p.input_ids), positions=torch.from_numpy(p.positions),
        slot_mapping=torch.from_numpy(p.slot_mapping), seq_lens=torch.from_numpy(p.seq_lens),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
        block_tables=torch.from_numpy(p.block_tables), bucket=bucket, num_splits=1,
        max_seq_len=max_blocks * block_size)
    static_meta = backend.static_decode_metadata(inputs)
    assert isinstance(static_meta, StaticDecodeMetadata)
    pad = lambda t: torch.cat([t, torch.randn(bucket - n, *t.shape[1:], generator=gen)])  # noqa: E731
    static_cache = cache.clone()
    backend.write_kv(static_cache, pad(key), pad(value), static_meta)
    assert torch.equal(static_cache, eager_cache), "padding rows (slot -1) must write nothing"
    got = backend.forward(pad(query), static_cache, static_meta, head_dim ** -0.5)
    assert got.shape == (bucket, num_heads, head_dim)
    torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[n:], torch.zeros_like(got[n:])), "padding rows must be zeros"
    # the lengths come from the tensor: shortening one row in place changes only that row
    inputs.seq_lens[0] = 0
    again = static_decode_attention(pad(query), static_cache, inputs.block_tables, inputs.seq_lens,
                                    head_dim ** -0.5)
    assert torch.equal(again[0], torch.zeros_like(again[0]))
    torch.testing.assert_close(again[1:n], want[1:], rtol=1e-5, atol=1e-5)


def _tiny_loaded(seed: int = 0):
    from ferrobatch.model.loader import LoadedModel, build_model

    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                         num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                         max_position_embeddings=256)
    torch.manual_seed(seed)
    model = build_model(config, None, device=torch.device("cpu"), dtype=torch.float32)
    for p in model.parameters():           # larger weights than nn.Linear's init: peaked logits
        p.data.mul_(4.0)
    return LoadedModel("tiny", config, model, None, None, "random")


def _twin_runners(num_blocks: int, backend: str, seed: int = 0):
    """Two ModelRunners on equal copies of the tiny model: (one to keep eager, one to graph)."""
    from ferrobatch.runtime.model_runner import ModelRunner

    loaded = _tiny_loaded(seed)
    twin = copy.deepcopy(loaded)          # before packing: packed kernels cannot be copied
    return (ModelRunner(loaded, num_blocks=num_blocks, block_size=BLOCK_SIZE, attn_backend=backend),
            ModelRunner(twin, num_blocks=num_blocks, block_size=BLOCK_SIZE, attn_backend=backend))


def _greedy_run(runner, prompts, max_new, token_budget=40):
    from ferrobatch.runtime.sampler import Sampler

    sampler = Sampler(runner.config.vocab_size, [], "cpu")
    sched = ToyScheduler(runner.num_blocks, BLOCK_SIZE, token_budget=token_budget, seed=11)
    seqs = [sched.add(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_new))]
    decode_sizes = []
    for _ in range(1000):
        batch = sched.schedule()
        if batch is None:
            break
        if np.all(np.diff(batch.query_start_loc) == 1):
            decode_sizes.append(int(batch.seq_lens.shape[0]))
        logits = runner.execute(batch)
        sched.update(sampler.sample(logits, batch).token_ids)
    used = {b for s in seqs for b in s.block_ids}
    return [s.output_ids for s in seqs], decode_sizes, used


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_emulated_decode_graphs_give_the_eager_tokens(backend):
    eager, graphed = _twin_runners(160, backend)
    buckets = graphed.capture_decode_graphs(max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                                            emulate=True)
    assert buckets == (1, 2, 4, 8)
    assert not graphed.kv_cache.layers[0].any(), "capture must not write the KV cache"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in (3, 9, 17, 8, 30, 12, 5)]
    max_new = [12, 20, 6, 25, 9, 15, 18]      # the decode batch shrinks 7 -> 1 as they finish
    want, sizes, used = _greedy_run(eager, prompts, max_new)
    got, sizes_g, used_g = _greedy_run(graphed, prompts, max_new)
    assert got == want
    assert sizes == sizes_g and {7, 6, 5, 3, 1} <= set(sizes), sizes   # 7 -> bucket 8, 3 -> 4, ...
    assert graphed.graph_steps == len(sizes) and graphed.decode_graphs.replays == len(sizes)
    assert eager.graph_steps == 0 and graphed.eager_steps == eager.eager_steps - len(sizes)
    assert used == used_g
    unused = sorted(set(range(160)) - used)
    for layer_e, layer_g in zip(eager.kv_cache.layers, graphed.kv_cache.layers, strict=True):
        assert not layer_g[:, unused].any(), "a padding row wrote into the KV cache"
        torch.testing.assert_close(layer_g, layer_e, rtol=1e-5, atol=1e-5)


def test_only_steps_that_fit_a_graph_replay_one():
    from ferrobatch.runtime.model_runner import ModelRunner

    runner = ModelRunner(_tiny_loaded(), num_blocks=80, block_size=BLOCK_SIZE, attn_backend="torch")
    # 100 tokens: 13 block-table columns, the last one not full
    runner.capture_decode_graphs(max_num_seqs=4, max_model_len=100, emulate=True)
    rng = np.random.default_rng(0)

    def fresh(lengths):
        return _decode_batch(rng, lengths, 80, BLOCK_SIZE, num_tokens_vocab=64)

    batch = fresh([5, 9, 20])
    replayed = runner.execute(batch)
    graph_logits = replayed.clone()
    assert (runner.graph_steps, runner.eager_steps) == (1, 0)
    # the graph computed the step's argmax and finite flags too (one read-back for the engine)
    from ferrobatch.runtime.sampler import greedy_rows
    rows = runner.greedy_rows(replayed)
    assert rows is not None and torch.equal(rows, greedy_rows(graph_logits))
    # other logits (a copy, not the graph's): computed afresh, by the Rust kernel on the CPU
    assert runner.rust_linears
    assert torch.equal(runner.greedy_rows(graph_logits), greedy_rows(graph_logits))
    eager_logits = runner.execute(batch, allow_graph=False)
    assert (runner.graph_steps, runner.eager_steps) == (1, 1)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-5, atol=1e-5)
    # an eager CPU step came after it: the graph's rows are not handed out again
    assert runner._graph_greedy_rows is None
    runner.execute(fresh([3, 4, 5, 6, 7]))                  # 5 rows > the largest bucket (4)
    partial = fresh([5, 6])
    partial.logits_indices = np.array([1], np.int32)        # not every row sampled
    assert runner.execute(partial).shape[0] == 1
    too_long = fresh([101])                                  # longer than the graphs' contexts
    too_long.block_tables = too_long.block_tables[:, :13]   # though its table fits their width
    runner.execute(too_long)
    prefill = fresh([6])
    prefill.input_ids = np.array([1, 2], np.int32)          # two query tokens: not decode-only
    prefill.positions = np.array([4, 5], np.int32)
    prefill.slot_mapping = np.concatenate([prefill.slot_mapping - 1, prefill.slot_mapping])
    prefill.query_start_loc = np.array([0, 2], np.int32)
    runner.execute(prefill)
    assert (runner.graph_steps, runner.eager_steps) == (1, 5)


def test_capture_needs_a_capable_backend():
    from ferrobatch.runtime.model_runner import ModelRunner

    runner = ModelRunner(_tiny_loaded(), num_blocks=8, block_size=BLOCK_SIZE, attn_backend="torch")
    with pytest.raises(RuntimeError, match="cannot be captured"):
        runner.capture_decode_graphs(max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    assert runner.decode_graphs is None


def test_engine_capture_failure_falls_back_to_eager(caplog):
    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.core import _maybe_capture_decode_graphs

    class Runner:
        device = torch.device("cpu")
        attn_backend = SimpleNamespace(supports_decode_graphs=True, name="cuda")
        decode_graphs = "partial"
        calls = 0

        def capture_decode_graphs(self, max_num_seqs, max_model_len):
            Runner.calls += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    runner = Runner()
    with caplog.at_level("WARNING", logger="ferrobatch.engine.core"):
        _maybe_capture_decode_graphs(EngineConfig(), runner, 128)
    assert runner.decode_graphs is None and Runner.calls == 1
    assert "capture failed" in caplog.text and "stream is capturing" in caplog.text
    _maybe_capture_decode_graphs(EngineConfig(cuda_graphs=False), runner, 128)
    runner.attn_backend = SimpleNamespace(supports_decode_graphs=False, name="torch")
    _maybe_capture_decode_graphs(EngineConfig(), runner, 128)
    assert Runner.calls == 1          # neither switched off nor an incapable backend captures
