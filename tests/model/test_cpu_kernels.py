"""The CPU fast paths against their references on fresh random inputs: the Rust paged decode
attention kernel (vs the torch reference backend) and the Rust linear-layer kernel over
panel-packed weights (vs ``F.linear``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_model_attention import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_BLOCKS,
    NUM_HEADS,
    NUM_KV_HEADS,
    _mixed_batch,
    _naive_attention,
)

from ferrobatch._scheduler import linear_f32, paged_decode_attention_f32
from ferrobatch.runtime.attention import TorchReferenceBackend
from ferrobatch.runtime.attention.cpu import CpuPagedBackend
from ferrobatch.runtime.cpu_linear import (
    PanelLinear,
    pack_linear_layers,
    pack_panels,
    packing_unsupported,
)
from ferrobatch.runtime.cpu_threads import torch_single_threaded


@pytest.mark.parametrize("prefill_kernel", [True, False], ids=["rust-prefill", "sdpa-prefill"])
@pytest.mark.parametrize("kernel_query_max", [1, 8], ids=["decodes", "short-queries"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_cpu_backend_matches_naive_attention_on_mixed_steps(seed, kernel_query_max,
                                                            prefill_kernel, monkeypatch):
    import ferrobatch.runtime.attention.cpu as cpu_backend
    monkeypatch.setattr(cpu_backend, "KERNEL_QUERY_MAX", kernel_query_max)
    torch.manual_seed(seed)
    backend = CpuPagedBackend(block_size=BLOCK_SIZE, prefill_kernel=prefill_kernel)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    saw_decode = saw_decode_only = saw_prefill = False
    # with 8-query kernel rows, a budget of 24 tokens lets the 13-token prompt be one chunk
    for batch in _mixed_batch(seed, token_budget=9 if kernel_query_max == 1 else 24):
        meta = backend.build_metadata(batch, "cpu")
        saw_prefill |= (meta.prefill is not None) if prefill_kernel else bool(meta.groups)
        assert meta.prefill is None or not meta.groups, "a chunk on both paths"
        saw_decode |= meta.decode is not None
        saw_decode_only |= meta.decode is not None and meta.decode.every_token
        query = torch.randn(batch.num_tokens, NUM_HEADS, HEAD_DIM)
        backend.write_kv(cache, torch.randn(batch.num_tokens, NUM_KV_HEADS, HEAD_DIM),
                         torch.randn(batch.num_tokens, NUM_KV_HEADS, HEAD_DIM), meta)
        got = backend.forward(query, cache, meta, HEAD_DIM ** -0.5)
        want = _naive_attention(query, cache, batch, HEAD_DIM ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert saw_decode, "no step had decode rows: the kernel was not exercised"
    assert saw_decode_only, "no decode-only step: the no-gather path was not exercised"
    assert saw_prefill, "no step had a prefill chunk"


def _random_decode_step(rng, num_seqs, num_heads, num_kv_heads, head_dim, block_size=16):
    """Random contexts (mostly not block multiples) over shuffled, disjoint blocks."""
    ctx = rng.integers(1, 700, num_seqs).astype(np.int32)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = int(blocks_per_seq.sum()) + 8
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    table = np.zeros((num_seqs, int(blocks_per_seq.max())), np.int32)
    offset = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = ids[offset:offset + n]
        offset += n
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    query = torch.randn(num_seqs, num_heads, head_dim)
    return query, cache, table, ctx


def _reference_decode(query, cache, table, ctx, block_size, scale):
    """The torch reference backend on the same decode step."""
    from types import SimpleNamespace
    n = len(ctx)
    batch = SimpleNamespace(query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=ctx,
                            block_tables=table, input_ids=np.zeros(n, np.int32),
                            slot_mapping=np.zeros(n, np.int32))
    ref = TorchReferenceBackend(block_size)
    return ref.forward(query, cache, ref.build_metadata(batch, "cpu"), scale)


@pytest.mark.parametrize("num_seqs", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (16, 2)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: not a multiple of 8 (portable path)
def test_decode_kernel_matches_torch_reference(num_seqs, heads, head_dim):
    if num_seqs == 256 and head_dim != 64:
        pytest.skip("the big batch once per GQA ratio is enough")
    rng = np.random.default_rng(num_seqs * 1000 + heads[0] * 10 + heads[1] + head_dim)
    torch.manual_seed(int(rng.integers(1 << 30)))
    query, cache, table, ctx = _random_decode_step(rng, num_seqs, *heads, head_dim)
    scale = head_dim ** -0.5
    for threads in (1, 2):
        out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
        paged_decode_attention_f32(query.numpy(), cache[0].numpy(), cache[1].numpy(), table, ctx,
                                   out.numpy(), scale, threads)
        want = _reference_decode(query, cache, table, ctx, 16, scale)
        assert not out.isnan().any()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)


def _shuffled_tables(rng, seq_lens, block_size):
    """Block tables for ``seq_lens`` over disjoint blocks 1.. in a shuffled order:
    (tables [S, max_blocks] int32, the largest block id)."""
    blocks_per_seq = -(-np.asarray(seq_lens) // block_size)
    ids = rng.permutation(np.arange(1, int(blocks_per_seq.sum()) + 1)).astype(np.int32)
    tables = np.zeros((len(blocks_per_seq), int(blocks_per_seq.max())), np.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = ids[start:start + n]
        start += n
    return tables, int(ids.max())


def _random_prefill_step(rng, q_lens, prior, num_kv_heads, head_dim, block_size=16):
    """Chunks of ``q_lens`` queries after ``prior`` keys of context each, one padding row
    between chunks, over shuffled disjoint blocks: (batch, q_starts, num_tokens, cache)."""
    from types import SimpleNamespace
    q_lens, prior = np.asarray(q_lens, np.int32), np.asarray(prior, np.int32)
    seq_lens = q_lens + prior
    tables, max_id = _shuffled_tables(rng, seq_lens, block_size)
    q_starts = (np.concatenate([[0], np.cumsum(q_lens + 1)[:-1]])).astype(np.int32)
    num_tokens = int(q_starts[-1] + q_lens[-1] + 1)
    cache = torch.randn(2, max_id + 1, block_size, num_kv_heads, head_dim)
    batch = SimpleNamespace(query_start_loc=np.concatenate([q_starts, [q_starts[-1] + q_lens[-1]]])
                            .astype(np.int32), seq_lens=seq_lens, block_tables=tables,
                            input_ids=np.zeros(num_tokens - 1, np.int32),
                            slot_mapping=np.zeros(num_tokens - 1, np.int32), num_seqs=q_lens.size)
    return batch, q_starts, num_tokens, cache


def _reference_on_chunk_rows(query, cache, batch, q_starts, q_lens, scale, window=None):
    """The chunks' rows of ``query`` (the rows between chunks dropped) and the reference
    backend's SDPA attention of them (over the last ``window`` keys): ``(rows, want)``."""
    rows = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(q_starts, q_lens)]))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ref = TorchReferenceBackend(16)
    batch.query_start_loc, batch.input_ids = qsl, np.zeros(int(qsl[-1]), np.int32)
    batch.slot_mapping = batch.input_ids
    return rows, ref.forward(query[rows], cache, ref.build_metadata(batch, "cpu"), scale,
                             window=window)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (16, 2), (9, 3)])  # GQA 1, 4, 8, SmolLM2's 3
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the portable path
def test_prefill_kernel_matches_torch_reference(heads, head_dim):
    """Chunks of 9-300 queries, first ones and later ones after up to 700 keys of context,
    against the reference backend's SDPA; rows between chunks stay untouched."""
    from ferrobatch._scheduler import paged_prefill_attention_f32
    rng = np.random.default_rng(heads[0] * 100 + heads[1] * 10 + head_dim)
    torch.manual_seed(int(rng.integers(1 << 30)))
    q_lens, prior = [9, 300, 33, 17], [0, 0, 700, 5]
    batch, q_starts, num_tokens, cache = _random_prefill_step(rng, q_lens, prior, heads[1],
                                                              head_dim)
    query = torch.randn(num_tokens, heads[0], head_dim)
    scale = head_dim ** -0.5
    for threads in (1, 2):
        out = torch.full_like(query, float("nan"))
        paged_prefill_attention_f32(query.numpy(), cache[0].numpy(), cache[1].numpy(),
                                    batch.block_tables, q_starts, np.asarray(q_lens, np.int32),
                                    batch.seq_lens.astype(np.int32), out.numpy(), scale, threads)
        for start, n in zip(q_starts, q_lens, strict=True):
            assert out[start + n].isnan().all(), "a row between chunks was written"
        rows, want = _reference_on_chunk_rows(query, cache, batch, q_starts, q_lens, scale)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("heads", [(8, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_amx_path_matches_torch_reference(heads, head_dim):
    """Chunks long enough for the AMX path (>= 128 queries per key on average; on a CPU with
    AMX, cpu_amx_prefill.rs) with amx=True and amx=False, both against the reference's SDPA.
    Large queries and keys make scores of several hundred, hence weights down to 1e-38 (whose
    bfloat16 parts are subnormal). Without AMX both calls take the vector path."""
    from ferrobatch._scheduler import amx_available, paged_prefill_attention_f32
    rng = np.random.default_rng(heads[0] + head_dim)
    torch.manual_seed(int(rng.integers(1 << 30)))
    q_lens, prior = [300, 200], [0, 500]
    batch, q_starts, num_tokens, cache = _random_prefill_step(rng, q_lens, prior, heads[1],
                                                              head_dim)
    cache[0] *= 4
    query = torch.randn(num_tokens, heads[0], head_dim) * 4
    scale = head_dim ** -0.5
    rows, want = _reference_on_chunk_rows(query, cache, batch, q_starts, q_lens, scale)
    outs = {}
    for amx in (True, False):
        out = torch.full_like(query, float("nan"))
        paged_prefill_attention_f32(query.numpy(), cache[0].numpy(), cache[1].numpy(),
                                    batch.block_tables, q_starts, np.asarray(q_lens, np.int32),
                                    batch.seq_lens.astype(np.int32), out.numpy(), scale, 2,
                                    amx=amx)
        # scores in the hundreds: float32 rounding of the scores alone moves outputs by ~1e-5
        torch.testing.assert_close(out[rows], want, rtol=1e-4, atol=1e-4)
        outs[amx] = out[rows]
    if not amx_available():
        assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("window", [1, 7, 64, 250, 5000])
def test_prefill_kernel_windows_match_torch_reference(window):
    """A sliding window (Gemma 3's local layers): each query over its last ``window`` keys,
    chunks at a context's start and deep into one, against the reference backend's windowed
    SDPA; windows cutting a context stay off AMX, so amx=True gives the same."""
    from ferrobatch._scheduler import paged_prefill_attention_f32
    rng = np.random.default_rng(window)
    torch.manual_seed(window)
    q_lens, prior = [9, 300, 33], [0, 0, 700]
    batch, q_starts, num_tokens, cache = _random_prefill_step(rng, q_lens, prior, 3, 64)
    query = torch.randn(num_tokens, 9, 64)
    rows, want = _reference_on_chunk_rows(query, cache, batch, q_starts, q_lens, 0.125, window)
    _, whole = _reference_on_chunk_rows(query, cache, batch, q_starts, q_lens, 0.125)
    assert (window >= 733) == torch.allclose(want, whole)    # the window cuts, where it can
    for amx in (True, False):
        out = torch.full_like(query, float("nan"))
        paged_prefill_attention_f32(query.numpy(), cache[0].numpy(), cache[1].numpy(),
                                    batch.block_tables, q_starts, np.asarray(q_lens, np.int32),
                                    batch.seq_lens.astype(np.int32), out.numpy(), 0.125, 2,
                                    amx=amx, window=window)
        torch.testing.assert_close(out[rows], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="window"):
        paged_prefill_attention_f32(query.numpy(), cache[0].numpy(), cache[1].numpy(),
                                    batch.block_tables, q_starts, np.asarray(q_lens, np.int32),
                                    batch.seq_lens.astype(np.int32), out.numpy(), 0.125, 2,
                                    window=0)


def test_prefill_kernel_rejects_bad_inputs_without_writing():
    from ferrobatch._scheduler import paged_prefill_attention_f32
    rng = np.random.default_rng(0)
    batch, q_starts, num_tokens, cache = _random_prefill_step(rng, [20, 12], [0, 30], 2, 64)
    query = torch.randn(num_tokens, 8, 64).numpy()
    out = np.full_like(query, np.nan)
    good = dict(q=query, k=cache[0].numpy(), v=cache[1].numpy(), tables=batch.block_tables,
                starts=q_starts, lens=np.array([20, 12], np.int32),
                seq_lens=batch.seq_lens.astype(np.int32), out=out)

    def call(**changes):
        a = good | changes
        paged_prefill_attention_f32(a["q"], a["k"], a["v"], a["tables"], a["starts"], a["lens"],
                                    a["seq_lens"], a["out"], 0.125, 2)

    bad_table = batch.block_tables.copy()
    bad_table[1, 2] = cache.shape[1]
    for changes, match in [
        (dict(tables=bad_table), "block id"),
        (dict(starts=np.array([0, 15], np.int32)), "not after the previous"),
        (dict(starts=np.array([0, 30], np.int32)), "within"),
        (dict(seq_lens=np.array([19, 42], np.int32)), "seq_lens"),
        (dict(lens=np.array([0, 12], np.int32)), "q_lens"),
        (dict(seq_lens=np.array([20, 10_000], np.int32)), "seq_lens"),
        (dict(q=np.asfortranarray(query[:, ::-1])), "C-contiguous"),
        (dict(out=np.empty((3, 8, 64), np.float32)), "out must have"),
        (dict(lens=np.array([20], np.int32)), "q_lens has"),
        (dict(q=query.reshape(num_tokens, 4, 128)), "head_dim"),
    ]:
        with pytest.raises(ValueError, match=match):
            call(**changes)
        assert np.isnan(out).all(), f"{match}: out was written"
    call()
    assert not np.isnan(out[:20]).any()


def test_decode_kernel_rejects_bad_inputs_without_reading_them():
    rng = np.random.default_rng(0)
    query, cache, table, ctx = _random_decode_step(rng, 4, 8, 2, 64)
    k, v, out = cache[0].numpy(), cache[1].numpy(), torch.empty_like(query).numpy()

    def call(q=query.numpy(), table=table, ctx=ctx, out=out, k=k, v=v):
        paged_decode_attention_f32(q, k, v, table, ctx, out, 0.125, 2)

    bad_table = table.copy()
    bad_table[2, 0] = cache.shape[1]  # one past the last block
    with pytest.raises(ValueError, match="block id"):
        call(table=bad_table)
    with pytest.raises(ValueError, match="ctx_lens"):
        call(ctx=np.where(np.arange(4) == 1, table.shape[1] * 16 + 1, ctx).astype(np.int32))
    with pytest.raises(ValueError, match="ctx_lens"):
        call(ctx=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        call(q=np.asfortranarray(query.numpy().reshape(4, 8, 64)[:, ::-1]))
    with pytest.raises(ValueError, match="out must have"):
        call(out=np.empty((3, 8, 64), np.float32))
    with pytest.raises(ValueError, match="head_dim"):
        call(k=np.zeros((cache.shape[1], 16, 2, 32), np.float32),
             v=np.zeros((cache.shape[1], 16, 2, 32), np.float32))
    with pytest.raises(ValueError, match="v_cache must have"):
        call(v=v[:-1])
    with pytest.raises(TypeError):
        call(q=query.numpy().astype(np.float64))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_panel_linear_matches_f_linear_on_fresh_inputs(threads):
    # Row counts around the 6-row register tile and the rows-per-pass limit; out features that
    # are not multiples of the 16-wide panel; with and without bias; a poisoned output buffer.
    gen = torch.Generator().manual_seed(threads)
    for rows in (1, 5, 6, 7, 16, 33, 512):
        for out_features, in_features in ((96, 80), (17, 3), (200, 576)):
            weight = torch.randn(out_features, in_features, generator=gen)
            bias = torch.randn(out_features, generator=gen)
            x = torch.randn(rows, in_features, generator=gen)
            for b in (None, bias):
                layer = PanelLinear(weight, b, num_threads=threads)
                torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 80, generator=gen)  # leading dims are kept
    layer = PanelLinear(torch.randn(96, 80, generator=gen), num_threads=threads)
    torch.testing.assert_close(layer(x3), F.linear(x3, layer_weight(layer)), rtol=1e-5, atol=1e-4)
    assert layer(torch.empty(0, 80)).shape == (0, 96)


def layer_weight(layer: PanelLinear) -> torch.Tensor:
    """Unpacks a PanelLinear's weight back to ``[N, K]``."""
    packed = layer.packed_weight
    return packed.transpose(1, 2).reshape(-1, layer.in_features)[:layer.out_features]


def test_pack_panels_layout():
    weight = torch.arange(17 * 3, dtype=torch.float32).view(17, 3)
    packed = pack_panels(weight)
    assert packed.shape == (2, 3, 16)
    assert packed[0, 2, 5] == weight[5, 2]
    assert packed[1, 1, 0] == weight[16, 1]
    assert torch.all(packed[1, :, 1:] == 0)  # padding past N


def test_linear_kernel_rejects_bad_input():
    weight = pack_panels(torch.randn(20, 8)).numpy()
    x, out = np.ones((3, 8), np.float32), np.empty((3, 20), np.float32)
    linear_f32(x, weight, None, out, 2)
    with pytest.raises(ValueError, match="rows"):
        linear_f32(x, weight, None, np.empty((2, 20), np.float32), 2)
    with pytest.raises(ValueError, match="packed weight has shape"):
        linear_f32(np.ones((3, 9), np.float32), weight, None, out, 2)
    with pytest.raises(ValueError, match="packed weight has shape"):
        linear_f32(x, weight, None, np.empty((3, 40), np.float32), 2)
    with pytest.raises(ValueError, match="bias"):
        linear_f32(x, weight, np.ones(3, np.float32), out, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        linear_f32(np.ones((8, 3), np.float32).T, weight, None, out, 2)
    with pytest.raises(TypeError):
        linear_f32(x.astype(np.float64), weight, None, out, 2)
    with pytest.raises(TypeError, match="float32"):
        PanelLinear(torch.randn(4, 8))(torch.randn(2, 8, dtype=torch.float64))


def test_torch_single_threaded_restores_the_count_even_on_error():
    before = torch.get_num_threads()
    with torch_single_threaded():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_single_threaded():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("tied", [True, False])
def test_pack_linear_layers_keeps_the_model_output(tied):
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.llama import LlamaForCausalLM
    if packing_unsupported(torch.device("cpu"), torch.float32):
        pytest.skip(packing_unsupported(torch.device("cpu"), torch.float32))
    torch.manual_seed(0)
    config = ModelConfig(arch="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    hidden = torch.randn(7, model.config.hidden_size)
    layer = model.layers[0]
    mlp_before = layer.mlp(hidden)
    logits_before = F.linear(hidden, model.lm_head_weight)
    num_linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert num_linears == 2 * 4 + (0 if tied else 1)
    assert pack_linear_layers(model, num_threads=2) == 2 * 4 + 1  # 4 per layer + the LM head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_linear_layers(model, num_threads=3) == 0  # idempotent
    assert {m.num_threads for m in model.modules() if isinstance(m, PanelLinear)} == {3}
    torch.testing.assert_close(layer.mlp(hidden), mlp_before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.packed_lm_head(hidden), logits_before, rtol=1e-5, atol=1e-5)


def test_rust_elementwise_ops_match_the_model_modules():
    from ferrobatch._scheduler import rms_norm_f32, rotary_f32
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.llama import RMSNorm, SiluAndMul
    from ferrobatch.model.rope import ApplyRotary, RotaryEmbedding
    from ferrobatch.runtime.cpu_elementwise import RustApplyRotary, RustRMSNorm, swap_elementwise_ops
    gen = torch.Generator().manual_seed(5)
    for rows, hidden in ((1, 576), (7, 13), (300, 64)):
        norm = RMSNorm(hidden, 1e-5)
        norm.weight.data = torch.rand(hidden, generator=gen) + 0.5
        x = torch.randn(rows, hidden, generator=gen) * 3
        torch.testing.assert_close(RustRMSNorm(norm.weight, norm.eps)(x), norm(x),
                                   rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 64, generator=gen)
    norm = RMSNorm(64, 1e-6)
    torch.testing.assert_close(RustRMSNorm(norm.weight, 1e-6)(x3), norm(x3), rtol=1e-5, atol=1e-5)
    # RoPE on strided q / k views of a fused projection, at scattered positions
    config = ModelConfig(arch="llama", vocab_size=50, hidden_size=64, intermediate_size=96,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=4096)
    tables = RotaryEmbedding(config).tables(torch.tensor([0, 5, 4095, 17]), torch.float32)
    qkv = torch.randn(4, (4 + 2 + 2) * 16, generator=gen)
    q, k = qkv[:, :64].view(4, 4, 16), qkv[:, 64:96].view(4, 2, 16)
    before = qkv.clone()
    want_q, want_k = ApplyRotary()(q, k, tables)
    got_q, got_k = RustApplyRotary()(q, k, tables)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv, before), "the inputs must not be rotated in place"
    contiguous_q = q.contiguous()
    RustApplyRotary()(contiguous_q, k.contiguous(), tables)
    assert torch.equal(contiguous_q, q), "a contiguous input must not be rotated in place"
    # the swap covers every kind, once
    container = torch.nn.Sequential(RMSNorm(8, 1e-6), torch.nn.Sequential(SiluAndMul(), ApplyRotary()))
    assert swap_elementwise_ops(container) == 2  # SiluAndMul stays in torch
    assert swap_elementwise_ops(container) == 0
    with pytest.raises(TypeError, match="float32"):
        container[0](torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not match"):
        rms_norm_f32(np.ones((2, 8), np.float32), np.ones(4, np.float32), 1e-6,
                     np.empty((2, 8), np.float32))
    with pytest.raises(ValueError, match="rotary"):
        rotary_f32(np.ones((2, 1, 8), np.float32), np.ones((3, 8), np.float32),
                   np.ones((3, 8), np.float32))
    with pytest.raises(ValueError, match="even"):
        rotary_f32(np.ones((2, 1, 7), np.float32), np.ones((2, 7), np.float32),
                   np.ones((2, 7), np.float32))


def test_runner_gives_the_cores_to_the_kernels_during_the_forward(loaded_smollm2):
    """torch runs single-threaded inside the CPU forward, the kernels get the count torch had,
    and torch's count is back afterwards."""
    from step_builder import ToyScheduler

    from ferrobatch.runtime.model_runner import ModelRunner
    if packing_unsupported(torch.device("cpu"), torch.float32):
        pytest.skip(packing_unsupported(torch.device("cpu"), torch.float32))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fused = ModelRunner(loaded_smollm2, num_blocks=64, block_size=16, attn_backend="cpu")
        assert fused.fused_layers.num_threads == 2
        # layer by layer, so a hook on the first layer sees the forward's thread count
        runner = ModelRunner(loaded_smollm2, num_blocks=64, block_size=16, attn_backend="cpu",
                             fused_decode=False)
        assert runner.kernel_threads == 2 and runner.attn_backend.num_threads == 2
        assert {m.num_threads for m in runner.model.modules() if isinstance(m, PanelLinear)} == {2}
        seen = []
        hook = runner.model.layers[0].register_forward_pre_hook(
            lambda *_: seen.append(torch.get_num_threads()))
        try:
            sched = ToyScheduler(64, 16, token_budget=64)
            sched.add(0, list(range(10, 30)), max_new_tokens=2)
            runner.execute(sched.schedule())
        finally:
            hook.remove()
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threshold,want_threads", [(0, 2), (1 << 40, 1)])
def test_prefill_attention_gets_the_kernel_threads_back(monkeypatch, threshold, want_threads):
    # inside the forward torch is single-threaded; the one long reference op, prefill attention,
    # runs on the kernels' thread count when it is big enough, and the count is restored after it
    import ferrobatch.runtime.attention.cpu as cpu_backend

    monkeypatch.setattr(cpu_backend, "THREADED_PREFILL_PAIRS", threshold)
    monkeypatch.setattr(cpu_backend, "KERNEL_QUERY_MAX", 1)   # every chunk on SDPA

    seen = []
    real = cpu_backend.attend_groups

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_backend, "attend_groups", recording)
    backend = CpuPagedBackend(block_size=BLOCK_SIZE, num_threads=2, prefill_kernel=False)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    with torch_single_threaded():
        for batch in _mixed_batch(0):
            meta = backend.build_metadata(batch, "cpu")
            query = torch.randn(batch.num_tokens, NUM_HEADS, HEAD_DIM)
            got = backend.forward(query, cache, meta, HEAD_DIM ** -0.5)
            want = _naive_attention(query, cache, batch, HEAD_DIM ** -0.5)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.get_num_threads() == 1
    assert seen and all(n == want_threads for n in seen)


@pytest.mark.parametrize("prefill_kernel", [True, False], ids=["rust-prefill", "sdpa-prefill"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_short_queries_go_through_the_kernel_causally(seed, prefill_kernel):
    """Sequences of up to KERNEL_QUERY_MAX queries (a decode with speculative drafts, a short
    chunk) are decode-kernel rows, each seeing its causal prefix; longer ones go to the prefill
    kernel (or SDPA). Checked against the naive per-sequence attention on a step that mixes all
    three, over shuffled blocks and contexts that are not block multiples."""
    from types import SimpleNamespace

    from ferrobatch.runtime.attention.cpu import KERNEL_QUERY_MAX

    rng = np.random.default_rng(seed)
    q_lens = np.array([1, 2, 4, KERNEL_QUERY_MAX, KERNEL_QUERY_MAX + 1, 3, 20, 1], np.int32)
    seq_lens = (q_lens + rng.integers(0, 40, q_lens.size)).astype(np.int32)
    tables, max_id = _shuffled_tables(rng, seq_lens, BLOCK_SIZE)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    batch = SimpleNamespace(query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
                            input_ids=np.zeros(num_tokens, np.int32),
                            slot_mapping=np.zeros(num_tokens, np.int32), num_seqs=q_lens.size)
    backend = CpuPagedBackend(block_size=BLOCK_SIZE, prefill_kernel=prefill_kernel)
    meta = backend.build_metadata(batch, "cpu")
    short = int(q_lens[q_lens <= KERNEL_QUERY_MAX].sum())
    assert meta.decode is not None and len(meta.decode.ctx_lens) == short
    assert not meta.decode.every_token
    if prefill_kernel:
        assert not meta.groups and list(meta.prefill.q_lens) == [KERNEL_QUERY_MAX + 1, 20]
        assert list(meta.prefill.q_starts) == list(qsl[:-1][q_lens > KERNEL_QUERY_MAX])
    else:
        assert meta.prefill is None and len(meta.groups) == 1
    torch.manual_seed(seed)
    cache = torch.randn(2, max_id + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    got = backend.forward(query, cache, meta, HEAD_DIM ** -0.5)
    want = _naive_attention(query, cache, batch, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # only short sequences: every query is a kernel row, no gather or scatter
    keep = q_lens <= KERNEL_QUERY_MAX
    sub_qsl = np.concatenate([[0], np.cumsum(q_lens[keep])]).astype(np.int32)
    sub = SimpleNamespace(query_start_loc=sub_qsl, seq_lens=seq_lens[keep],
                          block_tables=tables[keep], input_ids=np.zeros(sub_qsl[-1], np.int32),
                          slot_mapping=np.zeros(sub_qsl[-1], np.int32), num_seqs=int(keep.sum()))
    meta = backend.build_metadata(sub, "cpu")
    assert meta.decode.every_token and not meta.groups and meta.prefill is None
    query = torch.randn(int(sub_qsl[-1]), NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(backend.forward(query, cache, meta, HEAD_DIM ** -0.5),
                               _naive_attention(query, cache, sub, HEAD_DIM ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_cpu_isa_env_caps_the_linear_kernels_instruction_set():
    """FERROBATCH_CPU_ISA (read once per process) caps what the linear kernels use: `portable`
    always wins, `avx2` never reports AVX-512 (nor the AVX-512 VNNI one-row kernel), and unset
    keeps the widest the CPU has."""
    import os
    import subprocess
    import sys

    from ferrobatch._scheduler import linear_isa

    def isa_with(value: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "FERROBATCH_CPU_ISA"}
        if value is not None:
            env["FERROBATCH_CPU_ISA"] = value
        out = subprocess.run([sys.executable, "-c", "from ferrobatch._scheduler import"
                              " linear_isa, one_row_int16_available as v;"
                              " print(linear_isa(), v())"], env=env, capture_output=True,
                             text=True, check=True, timeout=120)
        isa, vnni = out.stdout.split()
        assert vnni == "False" or isa == "avx512", (value, isa, vnni)
        if isa == "avx512" and {"avx512_vnni", "avx512bw", "avx512vl"} <= cpu_flags:
            assert vnni == "True", (value, isa)
        return isa

    cpu_flags: set[str] = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu_flags = {w for line in f if line.startswith("flags") for w in line.split()}

    widest = isa_with(None)
    assert widest in ("avx512", "avx2", "portable")
    assert isa_with("portable") == "portable"
    assert isa_with("avx2") == ("portable" if widest == "portable" else "avx2")
    assert isa_with("avx512") == widest
    if "FERROBATCH_CPU_ISA" not in os.environ:
        assert linear_isa() == widest


def test_no_simd_intrinsic_is_called_out_of_line():
    """Every SIMD intrinsic is inlined into its `#[target_feature]` kernel. One that is not
    (e.g. called from a closure such as `array.map(|v| ..)`, which does not inherit the
    caller's target features) becomes a function call per vector operation: decode attention
    ran 2.8x slower that way (session 18). The symbol table of the built extension shows it."""
    import shutil
    import subprocess

    import ferrobatch._scheduler as ext
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    listing = subprocess.run([nm, "-C", ext.__file__], capture_output=True, text=True,
                             check=True).stdout
    if not listing.strip():
        pytest.skip("the extension is stripped of its symbols")
    # `_xgetbv` runs once, in instruction-set detection
    out_of_line = sorted({line.split(" ", 2)[-1] for line in listing.splitlines()
                          if "core::core_arch::" in line and "_xgetbv" not in line})
    assert out_of_line == []
