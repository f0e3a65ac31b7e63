"""allowed_token_ids and bad_words: the masks against a brute-force reference on random logits,
speculative rows, the sampled path, and the parameter checks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from step_builder import sampling_arrays

from ferrobatch.runtime.sampler import RequestExtras, Sampler
from ferrobatch.runtime.token_restrictions import (
    allowed_mask,
    bad_word_sequences,
    banned_next_tokens,
)
from ferrobatch.sampling_params import SamplingParams

VOCAB = 64
EOS = [3]


def _batch(num_samples: int, **overrides):
    return SimpleNamespace(**sampling_arrays(num_samples, **overrides))


@pytest.fixture
def sampler():
    return Sampler(VOCAB, EOS, "cpu", seed=7)


def _reference_banned(history: list[int], sequences) -> set[int]:
    """Brute force: a token is banned when appending it makes the history end with a sequence."""
    out = set()
    for tok in range(VOCAB):
        after = history + [tok]
        if any(len(after) >= len(s) and after[-len(s):] == list(s) for s in sequences):
            out.add(tok)
    return out


def test_banned_next_tokens_match_the_brute_force_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        sequences = [tuple(rng.integers(0, 6, size=rng.integers(1, 4)).tolist())
                     for _ in range(rng.integers(1, 4))]
        history = rng.integers(0, 6, size=rng.integers(0, 6)).tolist()
        assert set(banned_next_tokens(history, sequences)) == \
            _reference_banned(history, sequences), (history, sequences)


def test_greedy_rows_take_the_best_token_the_restrictions_leave(sampler):
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = torch.from_numpy(rng.normal(size=(3, VOCAB)).astype(np.float32))
        allowed = sorted(rng.choice(VOCAB, size=5, replace=False).tolist())
        bad = ((int(rng.integers(VOCAB)),), (9, int(rng.integers(VOCAB))))
        extras = {0: RequestExtras(allowed_mask=allowed_mask(allowed, VOCAB)),
                  1: RequestExtras(output_token_ids=[[4, 9]], bad_word_ids=bad)}
        out = sampler.sample(logits.clone(), _batch(3, sample_req_ids=[0, 1, 2]), extras)
        expect0 = max(allowed, key=lambda t: logits[0, t].item())
        banned = _reference_banned([4, 9], bad)
        expect1 = max((t for t in range(VOCAB) if t not in banned),
                      key=lambda t: logits[1, t].item())
        assert out.token_ids.tolist() == [expect0, expect1, int(logits[2].argmax())]


def test_sampled_rows_never_draw_a_restricted_token(sampler):
    logits = torch.zeros(400, VOCAB)
    allowed = RequestExtras(allowed_mask=allowed_mask([5, 6, 40], VOCAB))
    even = RequestExtras(output_token_ids=[[]], bad_word_ids=tuple((t,) for t in
                                                                   range(0, VOCAB, 2)))
    extras = {r: allowed if r < 200 else even for r in range(400)}    # one request per row
    batch = _batch(400, sample_req_ids=list(range(400)), temperature=[1.0] * 400)
    out = sampler.sample(logits, batch, extras).token_ids
    assert set(out[:200].tolist()) == {5, 6, 40}           # all three drawn, nothing else
    assert all(t % 2 == 1 for t in out[200:].tolist())


def test_each_sequence_and_each_drafted_row_uses_its_own_history(sampler):
    """Bad word (10, 11): a row whose history ends in 10 may not take 11. Sequence 0 of the
    request ends in 10, sequence 1 does not; in a speculative step the row after draft 10
    counts it as history."""
    row = torch.zeros(VOCAB)
    row[11] = 5.0
    row[12] = 4.0
    extras = {0: RequestExtras(output_token_ids=[[10], [2]], bad_word_ids=((10, 11),))}
    batch = _batch(2, sample_req_ids=[0, 0], sample_seq_indices=[0, 1])
    assert sampler.sample(row.expand(2, VOCAB).clone(), batch, extras).token_ids.tolist() == \
        [12, 11]
    spec = _batch(2, sample_req_ids=[0, 0], sample_seq_indices=[1, 1], sample_output_lens=[1, 2])
    spec.input_ids = np.array([2, 10], np.int32)            # last token 2, then draft 10
    spec.logits_indices = np.array([0, 1], np.int32)
    assert sampler.sample(row.expand(2, VOCAB).clone(), spec, extras).token_ids.tolist() == \
        [11, 12]


def test_restricted_requests_leave_the_plain_greedy_path():
    batch = _batch(1)
    assert Sampler.is_plain_greedy(batch, {0: RequestExtras()})
    assert not Sampler.is_plain_greedy(batch, {0: RequestExtras(
        allowed_mask=allowed_mask([1], VOCAB))})
    assert not Sampler.is_plain_greedy(batch, {0: RequestExtras(bad_word_ids=((1,),))})


class _Tok:
    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return [ord(c) for c in text]


def test_bad_words_are_spelled_bare_and_after_a_space():
    assert bad_word_sequences(_Tok(), ["  ab", "ab", "c"]) == (
        (97, 98), (32, 97, 98), (99,), (32, 99))


@pytest.mark.parametrize("kwargs, message", [
    ({"allowed_token_ids": []}, "must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "non-negative"),
    ({"allowed_token_ids": [1.5]}, "non-negative integers"),
    ({"bad_words": ["ok", " "]}, "blank"),
    ({"bad_words": [3]}, "list of strings"),
    ({"bad_words": ["x" * 300]}, "at most"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": [1], "guided_regex": "a+"}, "allowed_token_ids"),
])
def test_bad_restrictions_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_allowed_ids_past_the_vocabulary_are_refused_before_anything_runs():
    p = SamplingParams(allowed_token_ids=[1, VOCAB])
    with pytest.raises(ValueError, match="below 64"):
        p.check_against(prompt_len=4, max_model_len=32, vocab_size=VOCAB, max_n=4,
                        max_stop_strings=4, max_stop_string_len=8, max_stop_token_ids=4,
                        max_logit_bias=4)


def test_truncated_prompt_keeps_the_last_tokens():
    ids = list(range(100))
    assert SamplingParams(truncate_prompt_tokens=10).truncated_prompt(ids, 64) == ids[-10:]
    assert SamplingParams().truncated_prompt(ids, 64) is ids
    # -1: what fits beside max_tokens (or one output token)
    assert SamplingParams(max_tokens=16, truncate_prompt_tokens=-1).truncated_prompt(
        ids, 64) == ids[-48:]
    assert SamplingParams(max_tokens=None, truncate_prompt_tokens=-1).truncated_prompt(
        ids, 64) == ids[-63:]
    with pytest.raises(ValueError, match="below the context window"):
        SamplingParams(truncate_prompt_tokens=64).truncated_prompt(ids, 64)
    with pytest.raises(ValueError, match="no room"):
        SamplingParams(max_tokens=64, truncate_prompt_tokens=-1).truncated_prompt(ids, 64)
