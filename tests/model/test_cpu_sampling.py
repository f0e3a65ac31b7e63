"""Random sampling's draw on the CPU (``_scheduler.sample_rows_f32``, ``cpu_sampling.rs``): the
torch sampler's distribution and draw rule, so at the same uniform numbers both pick the same
token; the sampler's wiring (``Sampler.rust_kernels``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from step_builder import sampling_arrays

from ferrobatch._scheduler import sample_rows_f32
from ferrobatch.runtime.sampler import Sampler

SETTINGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.0, 50, 1.0, 0.0),
    (0.8, 40, 0.95, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.3, 3, 0.5, 0.1),
    (2.0, 0, 0.999, 0.0),
]


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from flat to peaked (a few large logits over a spread of small ones, as a language
    model's)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.3, 4.0, rows)[:, None]
    spikes = torch.randint(0, vocab, (rows, 5), generator=gen)
    x.scatter_add_(1, spikes, torch.rand(rows, 5, generator=gen) * 12.0)
    return x


def _batch(rows: int, temperature: float, top_k: int, top_p: float, min_p: float):
    return SimpleNamespace(**sampling_arrays(
        rows, temperature=np.full(rows, temperature, np.float32),
        top_k=np.full(rows, top_k, np.int32), top_p=np.full(rows, top_p, np.float32),
        min_p=np.full(rows, min_p, np.float32)))


@pytest.mark.parametrize("vocab", [64, 5000, 49152])
def test_rust_and_torch_draw_the_same_tokens_at_the_same_uniforms(vocab):
    """Two samplers seeded alike draw the same uniforms; the kernel and torch's sorted path then
    agree except where a uniform lands within float rounding of a boundary of the cumulative
    distribution (or of the top-p cut): at most 1 in 200 rows here."""
    rows = 300
    logits = _logits(rows, vocab, seed=vocab)
    for setting in SETTINGS:
        batch = _batch(rows, *setting)
        tokens = []
        for rust in (True, False):
            sampler = Sampler(vocab, [], "cpu", seed=99)
            sampler.rust_kernels = rust
            tokens.append(sampler.sample(logits, batch).token_ids)
        agree = float((tokens[0] == tokens[1]).mean())
        assert agree >= 0.995, (vocab, setting, agree)


def test_the_kernel_draws_the_inverse_of_the_cumulative_distribution():
    """At uniform u the token is the first, in index order, whose cumulative kept probability
    reaches 1 - u: checked against that rule in float64 over a grid of u."""
    vocab = 40
    row = _logits(1, vocab, seed=3)[0]
    for temperature, top_k, top_p, min_p in SETTINGS:
        w = torch.exp((row.double() - row.max()) / temperature)
        order = sorted(range(vocab), key=lambda i: (-float(w[i]), i))
        if 0 < top_k < vocab:
            order = order[:top_k]
        z = float(w[order].sum())
        kept, mass = torch.zeros(vocab, dtype=torch.float64), 0.0
        for i in order:
            if mass > top_p * z:
                break
            mass += float(w[i])
            if w[i] >= min_p:
                kept[i] = w[i]
        cdf = (kept / kept.sum()).cumsum(0)
        for u in np.linspace(0.0, 0.999, 211):
            want = int(torch.searchsorted(cdf, torch.tensor([1.0 - u], dtype=torch.float64)))
            if min(abs(float(c) - (1.0 - u)) for c in cdf) < 1e-6:
                continue        # on a boundary: either neighbour is right within rounding
            out = np.empty(1, np.int64)
            sample_rows_f32(row[None].numpy(), np.array([temperature], np.float32),
                            np.array([top_k], np.int32), np.array([top_p], np.float32),
                            np.array([min_p], np.float32), np.array([u]), out, 1)
            assert int(out[0]) == want, (temperature, top_k, top_p, min_p, u)


def test_masked_logits_are_never_drawn_and_greedy_rows_take_the_argmax():
    vocab = 1000
    logits = _logits(64, vocab, seed=5)
    logits[:, 1::2] = float("-inf")          # every odd token masked, as a grammar masks
    temperature = np.full(64, 1.5, np.float32)
    temperature[::8] = 0.0                   # greedy rows in the same step
    out = np.empty(64, np.int64)
    for u in np.linspace(0.0, 0.999, 25):
        sample_rows_f32(logits.numpy(), temperature, np.zeros(64, np.int32),
                        np.full(64, 0.99, np.float32), np.zeros(64, np.float32),
                        np.full(64, u), out, 2)
        assert (out % 2 == 0).all()
        assert np.array_equal(out[::8], logits[::8].argmax(-1).numpy())


def test_bad_arrays_and_parameters_are_value_errors():
    logits = np.zeros((2, 8), np.float32)
    ok = dict(temperature=np.ones(2, np.float32), top_k=np.zeros(2, np.int32),
              top_p=np.ones(2, np.float32), min_p=np.zeros(2, np.float32),
              uniform=np.full(2, 0.5), out=np.empty(2, np.int64))

    def call(**changes):
        args = {**ok, **changes}
        sample_rows_f32(logits if "logits" not in changes else changes["logits"],
                        args["temperature"], args["top_k"], args["top_p"], args["min_p"],
                        args["uniform"], args["out"], 1)

    call()
    for changes in [dict(top_p=np.ones(3, np.float32)), dict(out=np.empty(1, np.int64)),
                    dict(top_p=np.zeros(2, np.float32)), dict(min_p=np.full(2, 2.0, np.float32)),
                    dict(uniform=np.ones(2)), dict(temperature=np.full(2, np.nan, np.float32)),
                    dict(logits=np.zeros((2, 8), np.float32)[:, ::2])]:
        with pytest.raises(ValueError):
            call(**changes)


def test_the_sampler_draws_a_non_contiguous_logits_view_as_its_copy():
    logits = _logits(8, 300, seed=9)
    wide = torch.zeros(8, 400)
    wide[:, :300] = logits
    batch = _batch(8, 0.9, 0, 0.95, 0.0)
    a = Sampler(300, [], "cpu", seed=4).sample(wide[:, :300], batch).token_ids
    b = Sampler(300, [], "cpu", seed=4).sample(logits, batch).token_ids
    assert np.array_equal(a, b)


def test_the_rust_draw_leaves_the_callers_logits_unchanged():
    logits = _logits(4, 500, seed=2)
    before = logits.clone()
    Sampler(500, [], "cpu", seed=1).sample(logits, _batch(4, 0.5, 10, 0.8, 0.0))
    assert torch.equal(logits, before)


def test_the_cpu_sampler_defaults_to_the_rust_kernels_and_the_environment_turns_it_off(monkeypatch):
    assert Sampler(10, [], "cpu").rust_kernels
    monkeypatch.setenv("FERROBATCH_RUST_SAMPLER", "0")
    assert not Sampler(10, [], "cpu").rust_kernels


def test_rust_penalties_are_torchs_bit_for_bit():
    """``_apply_penalties`` on the Rust kernel and on torch: the same float32 values, over rows
    with each penalty alone and together, a drafting sequence's rows (each follows the drafts
    before it), a request's second sequence, a row without a token history, a tiny penalty that
    would overflow a large logit, and -inf logits."""
    from ferrobatch.runtime.sampler import RequestExtras

    vocab, rows = 3000, 10
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=gen) * 8.0
    logits[0, 17] = 3.0e38
    logits[3, :50] = float("-inf")
    rand = np.random.default_rng(2)
    extras = {
        10: RequestExtras(prompt_token_ids=rand.integers(0, vocab, 300).tolist() + [17],
                          output_token_ids=[rand.integers(0, 40, 80).tolist()]),
        11: RequestExtras(prompt_token_ids=[5, 5, 6],
                          output_token_ids=[[7, 7, 7, 8], [9, 9, 5]]),
        12: RequestExtras(prompt_token_ids=rand.integers(0, vocab, 50).tolist(),
                          output_token_ids=[rand.integers(0, vocab, 30).tolist()]),
        13: RequestExtras(prompt_token_ids=[1, 2, 3]),      # no token history kept
    }
    arrays = sampling_arrays(
        rows, repetition_penalty=np.array([1e-38, 1.1, 1.0, 1.3, 1.0, 2.0, 1.05, 1.0, 0.8, 1.2],
                                          np.float32),
        frequency_penalty=np.array([0, 0.5, 0, 0.2, 1.0, 0, 0.3, -0.4, 0, 0.1], np.float32),
        presence_penalty=np.array([0, 0, 0.8, 0.4, 0, 0, 0.6, 0, 0.2, 0.3], np.float32))
    arrays["sample_req_ids"] = np.array([10, 10, 10, 11, 11, 12, 12, 12, 13, 99], np.int64)
    arrays["sample_seq_indices"] = np.array([0, 0, 0, 0, 1, 0, 0, 0, 0, 0], np.int32)
    # rows 5..7: one sequence of request 12 with two drafts (its rows end at the drafts)
    arrays["input_ids"] = np.array([4, 21, 22, 23, 24, 25, 26, 27, 28, 29], np.int32)
    arrays["logits_indices"] = np.arange(rows, dtype=np.int64)
    batch = SimpleNamespace(**arrays)
    out = {}
    for rust in (True, False):
        sampler = Sampler(vocab, [], "cpu")
        sampler.rust_kernels = rust
        out[rust] = logits.clone()
        sampler._apply_penalties(out[rust], batch, extras)
    assert not torch.equal(out[True], logits)
    assert torch.equal(out[True].view(torch.int32), out[False].view(torch.int32))


@pytest.mark.parametrize("top_n", [0, 1, 5, 20])
def test_rust_logprobs_are_torchs_within_rounding(top_n):
    """``_with_logprobs`` on the Rust kernel against torch's ``log_softmax`` + ``topk``: the same
    top ids (distinct logits here), values within float32 rounding; a row's masked logits are
    -inf, and a row with fewer than ``top_n`` logits above -inf fills up with -inf ones."""
    from ferrobatch.runtime.sampler import RequestExtras

    vocab, rows = 5000, 12
    logits = _logits(rows, vocab, seed=top_n)
    logits[3, 100:] = float("-inf")               # 100 live logits
    logits[4, 3:] = float("-inf")                 # 3 live logits: fewer than top_n
    extras = {r: RequestExtras(logprobs=top_n) for r in range(rows)}
    tokens = torch.randint(0, 3, (rows,))         # the chosen tokens, live in every row
    out = {}
    for rust in (True, False):
        sampler = Sampler(vocab, [], "cpu")
        sampler.rust_kernels = rust
        out[rust] = sampler._with_logprobs(tokens, logits, SimpleNamespace(
            sample_req_ids=np.arange(rows)), extras)
    a, b = out[True], out[False]
    assert np.array_equal(a.token_ids, b.token_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-5)
    assert a.top_logprob_ids.shape == b.top_logprob_ids.shape == (rows, top_n)
    assert a.top_logprob_ids.dtype == b.top_logprob_ids.dtype
    np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, rtol=1e-6, atol=1e-5)
    live = np.isfinite(b.top_logprobs)
    assert np.array_equal(a.top_logprob_ids[live], b.top_logprob_ids[live])
    if top_n > 3:      # row 4's slots past its live logits: -inf, each a masked token
        assert np.isneginf(a.top_logprobs[4, 3:]).all()
        assert (a.top_logprob_ids[4, 3:] >= 3).all()
        assert len(set(a.top_logprob_ids[4].tolist())) == top_n


def test_rust_logprobs_rank_equal_logits_by_lower_id():
    from ferrobatch.runtime.sampler import RequestExtras

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    out = Sampler(6, [], "cpu")._with_logprobs(torch.tensor([2]), logits, SimpleNamespace(
        sample_req_ids=np.arange(1)), {0: RequestExtras(logprobs=4)})
    assert out.top_logprob_ids.tolist() == [[1, 3, 4, 2]]
    np.testing.assert_allclose(out.logprobs, logits.log_softmax(-1)[0, 2].numpy(), rtol=1e-6)
