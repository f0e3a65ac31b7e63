"""Sampler: masks, penalties, logit bias, seeds across batch compositions, logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from step_builder import sampling_arrays

from ferrobatch.runtime.sampler import RequestExtras, Sampler

VOCAB = 64
EOS = [3, 7]


def _batch(num_samples: int, **overrides):
    return SimpleNamespace(**sampling_arrays(num_samples, **overrides))


@pytest.fixture
def sampler():
    return Sampler(VOCAB, EOS, "cpu", seed=1234)


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


def test_temperature_matches_softmax_distribution(sampler, logits):
    draws = _draw_many(sampler, logits, 40_000, temperature=np.full(40_000, 0.7))
    expected = (logits / 0.7).softmax(-1).numpy()
    observed = np.bincount(draws, minlength=VOCAB) / draws.size
    assert np.abs(observed - expected).max() < 0.015


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


def test_logit_bias_and_suppress_eos(sampler):
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS[0]] = 10.0
    extras = {0: RequestExtras(logit_bias={42: 100.0})}
    out = sampler.sample(logits, _batch(2, suppress_eos=[0, 1], sample_req_ids=[0, 1]), extras)
    assert out.token_ids[0] == 42
    assert out.token_ids[1] not in EOS
    with pytest.raises(ValueError):
        sampler.sample(logits, _batch(2), {0: RequestExtras(logit_bias={VOCAB + 1: 1.0})})


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
