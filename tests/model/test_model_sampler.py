"""Sampler: masks, penalties, logit bias, seeds across batch compositions, logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from step_builder import sampling_arrays

from ferrobatch.runtime.sampler import RequestExtras, Sampler, argmax_rows, greedy_rows

VOCAB = 64
EOS = [3, 7]


def _batch(num_samples: int, **overrides):
    return SimpleNamespace(**sampling_arrays(num_samples, **overrides))


@pytest.fixture(params=[True, False], ids=["rust", "torch"])
def sampler(request):
    """The CPU sampler both ways: penalties and sampled rows' draws on the Rust kernels (the
    CPU default) and on torch (the CUDA path, and ``FERROBATCH_RUST_SAMPLER=0``)."""
    s = Sampler(VOCAB, EOS, "cpu", seed=1234)
    s.rust_kernels = request.param
    return s


@pytest.fixture
def logits():
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2.0


def _draw_many(sampler, row, num_draws, **params):
    logits = row.expand(num_draws, VOCAB).clone()
    params.setdefault("temperature", np.ones(num_draws))
    batch = _batch(num_draws, **params)
    return sampler.sample(logits, batch).token_ids


def test_greedy_is_exact_argmax(sampler):
    logits = torch.randn(9, VOCAB)
    assert np.array_equal(sampler.sample(logits, _batch(9)).token_ids, logits.argmax(-1).numpy())
    mixed = _batch(9, temperature=[0, 1] * 4 + [0])  # greedy rows in a sampled batch stay argmax
    out = sampler.sample(logits, mixed).token_ids
    assert np.array_equal(out[::2], logits.argmax(-1).numpy()[::2])


def test_argmax_rows_is_torch_argmax_on_ties_infinities_and_nans():
    """numpy's argmax (the CPU path) picks exactly what torch's does: the first maximum, a NaN
    as the maximum, -inf rows, signed zeros, random rows of every shape the sampler sees."""
    gen = torch.Generator().manual_seed(5)
    cases = [torch.randn(rows, 49152, generator=gen) for rows in (1, 3, 16)]
    tied = torch.zeros(4, 64)
    tied[0, [5, 9]] = 1.0                       # a tie: the first one
    tied[1, :] = float("-inf")                  # every token masked
    tied[2, [3, 7]] = float("-inf")
    tied[2, 10] = float("nan")                  # a NaN wins, as in torch
    tied[3, 0], tied[3, 1] = -0.0, 0.0          # equal zeros: the first
    tied[3, 2:] = -1.0
    cases += [tied, torch.randn(5, 97, generator=gen)[:, ::2]]   # a strided view too
    for x in cases:
        got = argmax_rows(x)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.argmax(dim=-1)), x.shape
    assert torch.equal(argmax_rows(tied.double()), tied.double().argmax(dim=-1))   # torch path


def test_greedy_rows_hold_each_rows_argmax_and_whether_it_is_finite():
    x = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    x[3, 0] = float("-inf")                       # a -inf also fails the sum: not finite
    x[4, :] = 1e38                                # finite logits whose sum overflows float32
    rows = greedy_rows(x)
    assert rows.dtype == torch.int64 and rows.shape == (6, 2)
    assert torch.equal(rows[:, 0], x.argmax(dim=-1))
    assert rows[:, 1].tolist() == [1, 0, 0, 0, 0, 1]
    # (row 4 goes to the general path, whose exact check then finds nothing to fail)
    assert torch.equal(greedy_rows(x.to(torch.bfloat16))[:, 0], x.to(torch.bfloat16).argmax(-1))


def test_plain_greedy_is_what_sample_returns_as_the_bare_argmax(sampler):
    """is_plain_greedy is True exactly when sample() would take the rows' argmax and attach
    nothing: each feature that changes the tokens or adds output turns it off."""
    plain = _batch(4)
    assert Sampler.is_plain_greedy(plain) and Sampler.is_plain_greedy(plain, {})
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    assert np.array_equal(sampler.sample(logits, plain).token_ids,
                          greedy_rows(logits)[:, 0].numpy())
    not_plain = [
        (_batch(4, temperature=[0, 0, 0.7, 0]), None),
        (_batch(4, repetition_penalty=[1, 1.1, 1, 1]), None),
        (_batch(4, presence_penalty=[0, 0, 0, 0.5]), None),
        (_batch(4, frequency_penalty=[0.2, 0, 0, 0]), None),
        (_batch(4, suppress_eos=[0, 1, 0, 0]), None),
        (plain, {1: RequestExtras(logprobs=0)}),
        (plain, {2: RequestExtras(logit_bias={5: 3.0})}),
        (plain, {3: RequestExtras(min_tokens=2, stop_token_ids=[9])}),
    ]
    for batch, extras in not_plain:
        assert not Sampler.is_plain_greedy(batch, extras), (batch, extras)
    assert Sampler.is_plain_greedy(plain, {0: RequestExtras(prompt_token_ids=[1, 2])})


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray):
    """The full-sort formulation (the sampler's until session 21): the reference."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    k = torch.from_numpy(np.where(top_k > 0, np.minimum(top_k, vocab), vocab))
    remove = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    remove |= (probs.cumsum(dim=-1) - probs) > torch.from_numpy(top_p)[:, None]
    # (it also cut rows of top_k 0 and top_p 1.0 short: their float32 cumulative mass passes
    # 1.0 before the tail; such a row keeps every token)
    remove[torch.from_numpy((k.numpy() == vocab) & (top_p >= 1.0))] = False
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def test_top_k_top_p_mask_is_the_full_sorts():
    """The candidates-only mask keeps exactly the full sort's tokens: peaked and flat rows (a
    nucleus past the first candidates, up to the whole vocabulary), top-k below, at and past
    the first candidate count, mixed with rows that keep every token."""
    vocab = 5000
    sampler = Sampler(vocab, EOS, "cpu", seed=1)
    gen = torch.Generator().manual_seed(11)
    scales = torch.tensor([8.0, 3.0, 1.0, 0.3, 0.01, 2.0, 5.0, 0.5])[:, None]
    logits = torch.randn(8, vocab, generator=gen) * scales
    for top_k, top_p in [
        ([0, 0, 0, 0, 0, 0, 0, 0], [0.9, 0.95, 0.9, 0.99, 0.5, 0.8, 0.3, 0.999]),
        ([50, 0, 3, 1000, 0, 64, 65, 0], [1.0, 0.9, 0.5, 0.95, 1.0, 0.7, 1.0, 1.0]),
        ([0, 7, 0, 0, 4999, 0, 0, 2], [1.0, 1.0, 0.9, 1.0, 0.95, 1.0, 1.0, 0.1]),
    ]:
        k = np.asarray(top_k, np.int32)
        p = np.asarray(top_p, np.float32)
        got = sampler._mask_top_k_top_p(logits, k, p)
        want = _sorted_top_k_top_p(logits, k, p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (top_k, top_p)
        kept = ~torch.isinf(want)
        assert torch.equal(got[kept], logits[kept])     # kept logits pass unchanged


def test_temperature_matches_softmax_distribution(sampler, logits):
    draws = _draw_many(sampler, logits, 40_000, temperature=np.full(40_000, 0.7))
    expected = (logits / 0.7).softmax(-1).numpy()
    observed = np.bincount(draws, minlength=VOCAB) / draws.size
    assert np.abs(observed - expected).max() < 0.015


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-38, 1e-44])
def test_a_tiny_temperature_is_near_greedy_not_garbage(sampler, temperature):
    """logits / T overflowed to +-inf for T below ~1e-37: NaN probabilities, and the draw
    returned the last token id every time."""
    rows = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(5)) * 8.0
    batch = _batch(16, temperature=np.full(16, temperature, np.float32))
    assert np.array_equal(sampler.sample(rows, batch).token_ids, rows.argmax(-1).numpy())


def test_a_tiny_repetition_penalty_does_not_overflow_the_logits(sampler):
    """A positive logit divided by a tiny penalty became inf (NaN after the softmax)."""
    extras = {0: RequestExtras(prompt_token_ids=[12], output_token_ids=[[11]])}
    for temperature in (0.0, 1.0):
        out = sampler.sample(_two_way_logits(), _batch(1, repetition_penalty=[1e-38],
                                                       temperature=[temperature]), extras)
        assert out.token_ids.tolist() == [11]   # the seen positive logit grows the most


def test_top_k_keeps_only_k_best_with_renormalised_probs(sampler, logits):
    draws = _draw_many(sampler, logits, 20_000, top_k=np.full(20_000, 3))
    top3 = set(logits.topk(3).indices.tolist())
    assert set(draws.tolist()) == top3
    expected = logits[sorted(top3)].softmax(-1).numpy()
    observed = np.bincount(draws, minlength=VOCAB)[sorted(top3)] / draws.size
    assert np.abs(observed - expected).max() < 0.02


def test_top_p_keeps_smallest_nucleus(sampler, logits):
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    nucleus_size = int((sorted_probs.cumsum(0) < 0.6).sum()) + 1
    draws = _draw_many(sampler, logits, 20_000, top_p=np.full(20_000, 0.6, np.float32))
    assert set(draws.tolist()) == set(order[:nucleus_size].tolist())


def test_min_p_drops_unlikely_tokens(sampler, logits):
    probs = logits.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    draws = _draw_many(sampler, logits, 20_000, min_p=np.full(20_000, 0.2, np.float32))
    assert set(draws.tolist()) == allowed


def _two_way_logits() -> torch.Tensor:
    row = torch.full((VOCAB,), -5.0)
    row[10], row[11], row[12] = 5.0, 4.5, -1.0
    return row[None].clone()


@pytest.mark.parametrize("params, expected", [
    ({}, 10),
    ({"repetition_penalty": [2.0]}, 11),  # 5.0 / 2 < 4.5
    ({"frequency_penalty": [0.3]}, 11),  # 5.0 - 2 * 0.3 < 4.5
    ({"frequency_penalty": [0.2]}, 10),  # 5.0 - 2 * 0.2 > 4.5
    ({"presence_penalty": [0.6]}, 11),  # 5.0 - 0.6 < 4.5
    ({"presence_penalty": [0.4]}, 10),  # presence counts once: 5.0 - 0.4 > 4.5
])
def test_penalties_change_what_they_should(sampler, params, expected):
    extras = {0: RequestExtras(prompt_token_ids=[12], output_token_ids=[[10, 10]])}
    out = sampler.sample(_two_way_logits(), _batch(1, **params), extras)
    assert out.token_ids.tolist() == [expected]


def test_repetition_penalty_covers_prompt_and_scales_negative_logits_down(sampler):
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 12], logits[0, 13] = -1.0, -1.5
    extras = {0: RequestExtras(prompt_token_ids=[12], output_token_ids=[[]])}
    out = sampler.sample(logits, _batch(1, repetition_penalty=[2.0]), extras)
    assert out.token_ids.tolist() == [13]  # -1.0 * 2 < -1.5


def test_penalties_use_the_right_sequence_of_the_request(sampler):
    extras = {5: RequestExtras(output_token_ids=[[11], [10]])}
    logits = _two_way_logits().expand(2, VOCAB).clone()
    batch = _batch(2, sample_req_ids=[5, 5], sample_seq_indices=[0, 1], presence_penalty=[1.0, 1.0])
    assert sampler.sample(logits, batch, extras).token_ids.tolist() == [10, 11]


def test_drafted_rows_count_the_drafts_before_them(sampler):
    """A speculative step: the sequence's last token 10 then drafts 10 and 11, one row each.
    Row j's penalties count the output so far plus drafts 0..j-1 (its output if kept)."""
    extras = {0: RequestExtras(output_token_ids=[[10]])}
    logits = _two_way_logits().expand(3, VOCAB).clone()        # 10: 5.0, 11: 4.5
    batch = _batch(3, sample_req_ids=[0, 0, 0], sample_output_lens=[1, 2, 3],
                   frequency_penalty=[0.3] * 3)
    batch.input_ids = np.array([10, 10, 11], np.int32)
    batch.logits_indices = np.array([0, 1, 2], np.int32)
    # row 0: 10 seen once (4.7 > 4.5); row 1: twice (4.4 < 4.5); row 2: 10 twice, 11 once
    assert sampler.sample(logits, batch, extras).token_ids.tolist() == [10, 11, 10]


def test_logit_bias_and_suppress_eos(sampler):
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS[0]] = 10.0
    extras = {0: RequestExtras(logit_bias={42: 100.0})}
    out = sampler.sample(logits, _batch(2, suppress_eos=[0, 1], sample_req_ids=[0, 1]), extras)
    assert out.token_ids[0] == 42
    assert out.token_ids[1] not in EOS
    with pytest.raises(ValueError):
        sampler.sample(logits, _batch(2), {0: RequestExtras(logit_bias={VOCAB + 1: 1.0})})


def test_stop_token_ids_are_masked_below_min_tokens(sampler):
    """Below `min_tokens` a request's stop token ids are masked as EOS is; from token
    min_tokens + 1 on (output length >= min_tokens) they are sampled again."""
    logits = torch.zeros(4, VOCAB)
    logits[:, 20] = 10.0            # the stop token id is every row's argmax
    logits[:, 21] = 5.0
    extras = {0: RequestExtras(min_tokens=3, stop_token_ids=(20,)),
              1: RequestExtras(min_tokens=3, stop_token_ids=(20,))}
    batch = _batch(4, sample_req_ids=[0, 0, 1, 2], sample_output_lens=[0, 2, 3, 0],
                   temperature=[0, 1, 0, 0])
    out = sampler.sample(logits, batch, extras).token_ids.tolist()
    assert out[0] == 21 and out[1] != 20       # below min_tokens: masked (greedy and sampled)
    assert out[2] == 20                        # at min_tokens: the stop token may end it
    assert out[3] == 20                        # a request without the rule


def test_seeded_rows_do_not_depend_on_batch_composition(logits):
    sampler_a, sampler_b = Sampler(VOCAB, EOS, "cpu", seed=1), Sampler(VOCAB, EOS, "cpu", seed=2)
    target = logits[None]
    alone = sampler_a.sample(target.clone(), _batch(1, temperature=[1.0], seed=[77], sample_output_lens=[5]))
    others = torch.randn(6, VOCAB)
    mixed_logits = torch.cat([others[:4], target, others[4:]])
    mixed = _batch(7, temperature=[1.0] * 7, seed=[-1, 3, -1, 9, 77, -1, 5],
                   sample_output_lens=[0, 1, 2, 3, 5, 4, 9], top_k=[0, 5, 0, 0, 0, 2, 0])
    together = sampler_b.sample(mixed_logits, mixed)
    assert together.token_ids[4] == alone.token_ids[0]
    # the draw depends on the position: over many positions the tokens are not all equal
    rows = target.expand(32, VOCAB).clone()
    spread = sampler_a.sample(rows, _batch(32, temperature=[1.0] * 32, seed=[77] * 32,
                                           sample_output_lens=list(range(32))))
    assert len(set(spread.token_ids.tolist())) > 1


def test_seeded_sequences_of_one_request_draw_differently(logits):
    """A seeded request with n > 1: its sequences draw with different keys (not n copies of one
    sample), each still reproducible, and sequence 0 keeps the key of an n=1 request."""
    rows = logits[None].expand(64, VOCAB).clone()
    seq_indices = [0, 1, 2, 3] * 16
    params = dict(temperature=[1.0] * 64, seed=[77] * 64, sample_seq_indices=seq_indices,
                  sample_output_lens=[i // 4 for i in range(64)])
    first = Sampler(VOCAB, EOS, "cpu", seed=1).sample(rows, _batch(64, **params)).token_ids
    again = Sampler(VOCAB, EOS, "cpu", seed=2).sample(rows, _batch(64, **params)).token_ids
    np.testing.assert_array_equal(first, again)
    per_seq = first.reshape(16, 4).T                 # [seq index, position]
    assert len({tuple(s) for s in per_seq.tolist()}) == 4
    alone = Sampler(VOCAB, EOS, "cpu", seed=3).sample(
        rows[:16], _batch(16, temperature=[1.0] * 16, seed=[77] * 16,
                          sample_output_lens=list(range(16)))).token_ids
    np.testing.assert_array_equal(per_seq[0], alone)


def test_logprobs_agree_with_log_softmax(sampler):
    logits = torch.randn(4, VOCAB)
    extras = {0: RequestExtras(logprobs=5), 2: RequestExtras(logprobs=0)}
    batch = _batch(4, temperature=[0, 1, 0, 1], sample_req_ids=[0, 1, 2, 3])
    out = sampler.sample(logits, batch, extras)
    reference = logits.log_softmax(-1)
    rows = torch.arange(4)
    expected = reference[rows, torch.from_numpy(out.token_ids).long()].numpy()
    np.testing.assert_allclose(out.logprobs, expected, rtol=1e-5, atol=1e-6)
    top_values, top_ids = reference.topk(5, dim=-1)
    assert out.top_logprob_ids.shape == (4, 5)
    np.testing.assert_array_equal(out.top_logprob_ids, top_ids.numpy())
    np.testing.assert_allclose(out.top_logprobs, top_values.numpy(), rtol=1e-5, atol=1e-6)
    assert sampler.sample(logits, batch).logprobs is None  # nobody asked


def test_empty_batch(sampler):
    out = sampler.sample(torch.empty(0, VOCAB), _batch(0))
    assert out.token_ids.shape == (0,) and out.token_ids.dtype == np.int32


# --- guided decoding ---------------------------------------------------------------------------


class _StubGuide:
    """Stands in for `GuidedSequence`: `write_mask` sets its allowed ids in a bool row."""

    def __init__(self, allowed):
        self.allowed = sorted(int(t) for t in allowed)

    def write_mask(self, mask_row: np.ndarray) -> int:
        assert mask_row.dtype == np.bool_ and mask_row.shape == (VOCAB,) and not mask_row.any()
        mask_row[self.allowed] = True
        return len(self.allowed)


def _allowed_without_argmax(row: torch.Tensor, size: int, rng: np.random.Generator) -> list[int]:
    """`size` random ids, never the row's argmax (so the mask must change the greedy pick)."""
    best = int(row.argmax())
    return sorted(rng.choice([t for t in range(VOCAB) if t != best], size=size, replace=False).tolist())


def _guided_argmax(row: torch.Tensor, allowed: list[int]) -> int:
    return allowed[int(row[allowed].argmax())]


def test_greedy_guided_rows_take_the_argmax_of_their_allowed_ids(sampler):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(11)) * 2.0
    rng = np.random.default_rng(11)
    allowed = {1: _allowed_without_argmax(logits[1], 5, rng), 4: _allowed_without_argmax(logits[4], 9, rng)}
    extras = {row: RequestExtras(guides=[_StubGuide(ids)]) for row, ids in allowed.items()}
    extras[2] = RequestExtras(logit_bias={0: 0.0})            # extras without guides: unguided
    out = sampler.sample(logits.clone(), _batch(6), extras).token_ids
    plain = logits.argmax(-1).numpy()
    for row in range(6):
        if row in allowed:
            assert out[row] == _guided_argmax(logits[row], allowed[row]) != plain[row]
        else:
            assert out[row] == plain[row]


def test_guided_rows_keep_bias_and_penalties_inside_the_mask(sampler):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(12))
    logits[0, [5, 9, 20, 40]] = torch.tensor([1.0, 6.0, 2.0, 0.0])
    extras = {0: RequestExtras(output_token_ids=[[9]], logit_bias={40: 100.0, 5: 3.0},
                               guides=[_StubGuide([5, 9, 20])])}
    out = sampler.sample(logits, _batch(1, presence_penalty=[50.0]), extras).token_ids
    # 40 (biased to the top) is not allowed, 9 is penalised below the rest, 5's bias lifts it over 20
    assert out.tolist() == [5]


@pytest.mark.parametrize("params", [{}, {"top_k": 3}, {"top_p": 0.7}, {"seed": 77}],
                         ids=["plain", "top_k", "top_p", "seeded"])
def test_sampled_guided_rows_never_draw_a_disallowed_id(sampler, params):
    num_draws = 4_000
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(13)) * 2.0
    allowed = _allowed_without_argmax(row, 6, np.random.default_rng(13))
    # one row per sequence (rows of one sequence in a row would be speculative drafts)
    batch = _batch(num_draws, temperature=np.ones(num_draws), sample_req_ids=np.zeros(num_draws),
                   sample_seq_indices=np.arange(num_draws),   # seeded rows: a new key per row
                   **{name: np.full(num_draws, value) for name, value in params.items()})
    extras = {0: RequestExtras(guides=[_StubGuide(allowed)] * num_draws)}
    draws = sampler.sample(row.expand(num_draws, VOCAB).clone(), batch, extras).token_ids
    assert set(draws.tolist()) <= set(allowed)
    if "top_k" in params:   # top-k counts among the allowed ids only
        assert set(draws.tolist()) == set(sorted(allowed, key=lambda t: -float(row[t]))[:3])
    if "top_p" in params:   # the nucleus of the distribution renormalised over the allowed ids
        probs, order = row[allowed].softmax(-1).sort(descending=True)
        size = int((probs.cumsum(0) - probs <= 0.7).sum())
        assert set(draws.tolist()) == {allowed[i] for i in order[:size].tolist()}
    if not params:          # the allowed ids keep their relative probabilities
        expected = row[allowed].softmax(-1).numpy()
        observed = np.bincount(draws, minlength=VOCAB)[allowed] / num_draws
        assert np.abs(observed - expected).max() < 0.03


def test_each_sequence_of_a_request_uses_its_own_guide(sampler):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(14)) * 2.0
    guides = [_StubGuide(range(0, 10)), _StubGuide(range(20, 30)), _StubGuide(range(40, 50))]
    extras = {7: RequestExtras(guides=guides)}
    batch = _batch(4, sample_req_ids=[7, 7, 7, 8], sample_seq_indices=[2, 0, 1, 0])
    out = sampler.sample(logits.clone(), batch, extras).token_ids
    assert out[0] == _guided_argmax(logits[0], guides[2].allowed)
    assert out[1] == _guided_argmax(logits[1], guides[0].allowed)
    assert out[2] == _guided_argmax(logits[2], guides[1].allowed)
    assert out[3] == int(logits[3].argmax())                 # request 8 is not guided
    # sampled: every draw stays inside the set of the guide of its own sequence
    num_rows = 3 * 500
    seq_indices = np.arange(num_rows) % 3
    rows = logits[0].expand(num_rows, VOCAB).clone()
    batch = _batch(num_rows, temperature=np.ones(num_rows), sample_req_ids=np.full(num_rows, 7),
                   sample_seq_indices=seq_indices)
    draws = sampler.sample(rows, batch, extras).token_ids
    for seq_index, guide in enumerate(guides):
        assert set(draws[seq_indices == seq_index].tolist()) <= set(guide.allowed), seq_index


def test_guided_row_logprobs_are_those_of_the_raw_logits(sampler):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(15)) * 2.0
    allowed = _allowed_without_argmax(logits[0], 4, np.random.default_rng(15))
    extras = {0: RequestExtras(logprobs=3, guides=[_StubGuide(allowed)]), 1: RequestExtras(logprobs=3)}
    out = sampler.sample(logits.clone(), _batch(2), extras)
    token = _guided_argmax(logits[0], allowed)
    assert out.token_ids[0] == token
    raw = logits.log_softmax(-1)
    np.testing.assert_allclose(out.logprobs, raw[[0, 1], out.token_ids.tolist()].numpy(), rtol=1e-5, atol=1e-6)
    masked = logits[0, allowed].log_softmax(-1)[allowed.index(token)]
    assert float(out.logprobs[0]) < float(masked) - 1e-3     # not renormalised over the allowed ids
    top_values, top_ids = raw.topk(3, dim=-1)
    np.testing.assert_array_equal(out.top_logprob_ids, top_ids.numpy())
    np.testing.assert_allclose(out.top_logprobs, top_values.numpy(), rtol=1e-5, atol=1e-6)
    assert out.top_logprob_ids[0, 0] == int(logits[0].argmax()) not in allowed   # a masked id


class _ChainGuide:
    """A grammar that allows exactly `chain[i]` after `i` tokens (then nothing)."""

    def __init__(self, chain, pos=0):
        self.chain, self.pos = chain, pos

    def copy(self):
        return _ChainGuide(self.chain, self.pos)

    def advance(self, token: int) -> bool:
        if self.pos < len(self.chain) and token == self.chain[self.pos]:
            self.pos += 1
            return True
        return False

    @property
    def num_allowed(self) -> int:
        return int(self.pos < len(self.chain))

    def write_mask(self, mask_row: np.ndarray) -> int:
        mask_row[self.chain[self.pos]] = True
        return 1


def test_drafted_guided_rows_use_the_grammar_after_the_drafts(sampler):
    """Drafts 10, 11 after the last token: row j's mask is the grammar's after j drafts; a
    refused draft (row 2 of the second sequence follows 9, not allowed) leaves the last mask."""
    logits = torch.zeros(6, VOCAB)
    logits[:, 20] = 9.0                                   # never allowed: the mask decides
    batch = _batch(6, sample_req_ids=[0, 0, 0, 1, 1, 1], sample_output_lens=[0, 1, 2, 0, 1, 2])
    batch.input_ids = np.array([5, 10, 11, 5, 10, 9], np.int32)
    batch.logits_indices = np.arange(6, dtype=np.int32)
    extras = {0: RequestExtras(guides=[_ChainGuide([10, 11, 12])]),
              1: RequestExtras(guides=[_ChainGuide([10, 11, 12])])}
    assert sampler.sample(logits, batch, extras).token_ids.tolist() == [10, 11, 12, 10, 11, 11]
    assert extras[0].guides[0].pos == 0                   # the sequence's own guide is untouched
