"""A decode step captured in CUDA graphs at padded batch buckets, replayed on new batches."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from paged_utils import assert_close, make_batch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def test_decode_step_graph_replay_matches_eager(cuda_ops):
    from ferrobatch.runtime.attention.cuda import CudaPagedBackend
    from ferrobatch.runtime.cuda_graphs import DecodeGraphRunner

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    block_size, Hkv, G, D, vocab = 16, 2, 4, 128, 1000
    Hq = Hkv * G
    num_blocks, max_blocks = 700, 40
    max_seq_len = max_blocks * block_size
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device=DEV).manual_seed(0)
    cache = torch.randn(2, num_blocks, block_size, Hkv, D, generator=gen, device=DEV).to(torch.bfloat16)
    # A stand-in "model": per-token q/k/v tables looked up by input id.
    q_tab = torch.randn(vocab, Hq, D, generator=gen, device=DEV).to(torch.bfloat16)
    k_tab = torch.randn(vocab, Hkv, D, generator=gen, device=DEV).to(torch.bfloat16)
    v_tab = torch.randn(vocab, Hkv, D, generator=gen, device=DEV).to(torch.bfloat16)

    backend = CudaPagedBackend(block_size=block_size)
    buckets = (1, 2, 4, 8, 16)
    backend.reserve_workspace(max(buckets), Hq, D, backend.max_splits)

    def step(inp):
        meta = backend.static_decode_metadata(inp)
        backend.write_kv(cache, k_tab[inp.input_ids], v_tab[inp.input_ids], meta)
        return backend.forward(q_tab[inp.input_ids], cache, meta, scale)

    sms = cuda_ops.num_sms()
    runner = DecodeGraphRunner(
        step, max_blocks_per_seq=max_blocks, max_seq_len=max_seq_len, device=DEV, buckets=buckets,
        num_splits_for=lambda b: cuda_ops.choose_num_splits(b, Hkv, max_seq_len, sms))
    before_capture = cache.clone()
    runner.capture()
    assert runner.captured_buckets == buckets
    assert torch.equal(cache, before_capture), "capture/warm-up wrote the KV cache"

    for n in (5, 16, 1, 9, 3):
        lens = rng.integers(1, max_seq_len - block_size, size=n)
        pb = make_batch(rng, lens, np.ones(n, np.int64), block_size, extra_columns=0)
        assert pb.num_blocks <= num_blocks
        pb.input_ids = rng.integers(0, vocab, size=n).astype(np.int32)
        assert runner.can_run(pb)
        eager_cache = cache.clone()
        out_graph = runner.run(pb).clone()
        meta = backend.build_metadata(pb, DEV)
        ids = torch.from_numpy(pb.input_ids.astype(np.int64)).to(DEV)
        backend.write_kv(eager_cache, k_tab[ids], v_tab[ids], meta)
        out_eager = backend.forward(q_tab[ids], eager_cache, meta, scale)
        torch.cuda.synchronize()
        # Same cache writes, and the padding rows (slot -1) wrote nothing.
        assert torch.equal(cache, eager_cache), f"n={n}: cache after replay differs from eager"
        assert out_graph.shape == out_eager.shape == (n, Hq, D)
        assert_close(out_graph, out_eager.double(), torch.bfloat16, f"graph vs eager n={n}")


def test_engine_with_decode_graphs_matches_eager_engine(cuda_ops):
    """Two engines on the same weights, one capturing decode graphs (the default on CUDA), one
    eager: the same greedy tokens for a batch whose size shrinks through several buckets. float32:
    a graph fixes its split-KV count for the longest context, so its attention sums in another
    order than the eager step's; in bf16 that could flip a near-tie argmax, in fp32 that is very
    unlikely."""
    from ferrobatch import LLM, SamplingParams
    from ferrobatch.model.loader import load_model

    try:
        loaded = load_model(os.environ.get("FERROBATCH_E2E_GGUF") or "smollm2", device="cuda",
                            dtype=torch.float32)
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time",
               "1, 2, 3, 4,", "The speed of light", "Water boils at", "import numpy as np\n"]
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    # longer prompts under a 64-token step budget: chunked prefills share steps with decode rows
    prompts += [" ".join(["The history of the printing press"] * (6 + 3 * i)) for i in range(4)]
    params += [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 4
    outs = {}
    for mode in ("graphs", "decode graphs only", "eager"):
        with LLM("smollm2", loaded_model=loaded, device="cuda", dtype="float32", kv_cache_gb=1.0,
                 max_num_seqs=16, max_num_batched_tokens=64, cuda_graphs=mode != "eager",
                 piecewise_max_tokens=0 if mode == "decode graphs only" else None) as llm:
            runner = llm.engine._core.runner
            assert (runner.decode_graphs is not None) == (mode != "eager")
            assert (runner.piecewise_graphs is not None) == (mode == "graphs")
            outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if mode != "eager":
                assert runner.graph_steps > 0
            if mode == "graphs":
                assert runner.piecewise_steps > 0 and runner.eager_steps == 0
            # every step is plain greedy: one read-back each (from the graph on graph steps)
            assert llm.engine._core.plain_greedy_steps > 0
    assert outs["graphs"] == outs["eager"]
    assert outs["decode graphs only"] == outs["eager"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_piecewise_graph_replay_matches_eager_steps(cuda_ops, dtype):
    """A small random Llama captured in pieces on the GPU: prefill, mixed, speculative-shaped
    and single-row steps of every size up to the largest bucket give the eager step's logits and
    the same KV cache; capture writes nothing into the cache."""
    import sys
    from pathlib import Path

    from ferrobatch.runtime.model_runner import ModelRunner

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from step_builder import context_prefill, mixed_step, random_llama_twins

    block_size, vocab = 16, 512
    loaded, twin = random_llama_twins("cuda", dtype, vocab)
    eager = ModelRunner(loaded, num_blocks=600, block_size=block_size, attn_backend="cuda")
    pieced = ModelRunner(twin, num_blocks=600, block_size=block_size, attn_backend="cuda")
    assert pieced.capture_piecewise_graphs(512) == (16, 32, 64, 128, 256, 384, 512)
    assert not pieced.kv_cache.layers[0].any(), "capture must not write the KV cache"
    rng = np.random.default_rng(1)
    steps = [[(0, 300)], [(40, 1), (0, 100), (200, 1), (33, 5)], [(70, 4), (12, 3), (500, 1)],
             [(0, 512)], [(9, 1)], [(100, 17)] + [(i * 3, 1) for i in range(1, 60)]]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for chunks in steps:
        batch = mixed_step(rng, 600, block_size, chunks, vocab)
        fill = context_prefill(batch, block_size, vocab)
        if fill.input_ids.shape[0]:
            eager.execute(fill, allow_graph=False)
            pieced.execute(fill, allow_graph=False)
        want = eager.execute(batch).clone()
        got = pieced.execute(batch).clone()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, **tol, msg=lambda m, c=chunks: f"{c[:3]}: {m}")
        for layer_e, layer_p in zip(eager.kv_cache.layers, pieced.kv_cache.layers, strict=True):
            torch.testing.assert_close(layer_p, layer_e, **tol)
    assert pieced.piecewise_steps == len(steps) and pieced.piecewise_graphs.replays == len(steps)


def test_graph_outputs_a_tuple_and_the_greedy_read_back(cuda_ops):
    """A graph whose forward returns (logits, greedy_rows(logits)), as the model runner's decode
    step does: both come back sliced to the step's rows, the argmax and finite flags computed
    inside the graph match an eager computation, including a NaN row and an inf row; back-to-back
    steps (no sync between them) reuse the pinned staging buffers safely."""
    from ferrobatch.runtime.cuda_graphs import DecodeGraphRunner
    from ferrobatch.runtime.sampler import greedy_rows

    vocab = 4096
    gen = torch.Generator(device=DEV).manual_seed(3)
    table = torch.randn(64, vocab, generator=gen, device=DEV)
    table[7, 100] = float("nan")
    table[9, 5] = float("inf")

    def step(inp):
        logits = table[inp.input_ids] * inp.positions[:, None].float().add(1.0)
        return logits, greedy_rows(logits)

    runner = DecodeGraphRunner(step, max_blocks_per_seq=4, max_seq_len=64, device=DEV,
                               buckets=(4, 8))
    runner.capture()
    rng = np.random.default_rng(4)
    got, want = [], []
    for n, ids in ((3, [7, 1, 9]), (8, list(range(10, 18))), (5, [9, 2, 3, 7, 4])):
        pb = make_batch(rng, rng.integers(1, 60, size=n), np.ones(n, np.int64), 16,
                        extra_columns=0)
        pb.input_ids = np.asarray(ids, np.int32)
        logits, rows = runner.run(pb)
        assert logits.shape == (n, vocab) and rows.shape == (n, 2)
        got.append(rows.clone())
        pos = torch.from_numpy(pb.positions.astype(np.int64)).to(DEV)
        want.append(greedy_rows(table[torch.tensor(ids, device=DEV)] * pos[:, None].float()
                                .add(1.0)))
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert got[0][:, 1].tolist() == [0, 1, 0] and got[2][:, 1].tolist() == [0, 1, 1, 0, 1]
