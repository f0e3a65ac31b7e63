"""Logprobs through AsyncEngine on FakeCore: aligned with the tokens in every output kind, per
sequence for n > 1, cut at a stop string with the tokens, and a token that arrives without its
logprobs fails its request instead of shifting the rest."""

from __future__ import annotations

import math

import pytest
from fake_core import fake_logprob, fake_prompt_logprob, fake_top

from ferrobatch.sampling_params import MAX_LOGPROBS, SamplingParams


async def run(engine, prompt, **kw):
    return [out async for out in engine.generate(prompt, SamplingParams(**kw))]


def expected(token_ids, n_top):
    return [(t, fake_logprob(k), fake_top(t, k, n_top)) for k, t in enumerate(token_ids)]


def as_tuples(entries):
    return [(e.token_id, e.logprob, e.top) for e in entries]


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final"])
async def test_logprobs_follow_the_tokens_in_every_output_kind(fake_engine, kind):
    outs = await run(fake_engine, "hello", max_tokens=7, logprobs=2, output_kind=kind)
    if kind == "delta":
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        entries = [e for o in outs for e in o.outputs[0].logprobs]
        assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)
    else:
        tokens, entries = outs[-1].outputs[0].token_ids, outs[-1].outputs[0].logprobs
    assert tokens == [ord(c) for c in "hellohe"]
    assert as_tuples(entries) == expected(tokens, 2)
    assert math.isclose(outs[-1].outputs[0].cumulative_logprob,
                        sum(fake_logprob(k) for k in range(7)))


async def test_no_logprobs_unless_asked(fake_engine):
    out = (await run(fake_engine, "hello", max_tokens=3))[-1].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


async def test_logprobs_zero_gives_the_sampled_token_only(fake_engine):
    out = (await run(fake_engine, "abc", max_tokens=3, logprobs=0))[-1].outputs[0]
    assert [e.top for e in out.logprobs] == [[], [], []]
    assert [e.logprob for e in out.logprobs] == [fake_logprob(k) for k in range(3)]


async def test_each_of_n_sequences_has_its_own_logprobs(fake_engine):
    final = (await run(fake_engine, "abcd", max_tokens=3, n=3, logprobs=1))[-1]
    for c in final.outputs:
        assert as_tuples(c.logprobs) == expected(c.token_ids, 1)
    assert [c.token_ids for c in final.outputs] == [[97, 98, 99], [98, 99, 100], [99, 100, 97]]


async def test_a_stop_string_ends_the_logprobs_with_the_tokens(fake_engine):
    outs = await run(fake_engine, "abcXYZdef", max_tokens=50, stop=["XYZ"], logprobs=1,
                     output_kind="delta")
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    entries = [e for o in outs for e in o.outputs[0].logprobs]
    assert "".join(o.outputs[0].text for o in outs) == "abc"
    assert tokens == [ord(c) for c in "abcXYZ"]     # the stop string's tokens were generated
    assert as_tuples(entries) == expected(tokens, 1)


async def test_a_token_without_its_logprobs_fails_only_that_request(fake_engine):
    fake_engine._core.drop_logprobs = True
    bad = (await run(fake_engine, "hello", max_tokens=5, logprobs=1))[-1]
    fake_engine._core.drop_logprobs = False
    assert bad.outputs[0].finish_reason == "error"
    assert "output processing failed" in bad.error and "without its logprobs" in bad.error
    good = (await run(fake_engine, "hello", max_tokens=5, logprobs=1))[-1]
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].logprobs) == 5


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True, "3"])
def test_logprobs_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)


# -- prompt logprobs ---------------------------------------------------------------------------

def expected_prompt(prompt: str, n_top: int):
    ids = [ord(c) for c in prompt]
    return [None] + [(t, fake_prompt_logprob(p), fake_top(t, p, n_top, fake_prompt_logprob(p)))
                     for p, t in enumerate(ids[1:])]


def prompt_tuples(entries):
    return [None if e is None else (e.token_id, e.logprob, e.top) for e in entries]


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final"])
async def test_prompt_logprobs_arrive_complete_and_once_per_delta_stream(fake_engine, kind):
    outs = await run(fake_engine, "hello", max_tokens=3, prompt_logprobs=2, output_kind=kind)
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert prompt_tuples(carrying[0].prompt_logprobs) == expected_prompt("hello", 2)
    if kind == "delta":
        assert len(carrying) == 1
    else:
        assert carrying == outs                       # every output, once complete
    assert all(c.logprobs is None for o in outs for c in o.outputs)   # not asked for


async def test_no_prompt_logprobs_unless_asked(fake_engine):
    assert (await run(fake_engine, "hello", max_tokens=2, logprobs=1))[-1].prompt_logprobs is None


def test_a_recomputed_prompt_position_keeps_its_first_entry_and_a_wrong_one_is_refused():
    """After a preemption the prompt is computed again: the second entry for a position is
    ignored; an entry whose token is not the prompt's fails loudly."""
    from ferrobatch.engine.request_state import LogprobMismatch, RequestState

    params = SamplingParams(prompt_logprobs=0)
    st = RequestState(1, "r", None, [5, 6, 7], params, 4, [None], 0.0)
    assert st.prompt_logprobs_missing == 2
    st.add_prompt_logprobs([(0, (6, -1.0, []))])
    st.add_prompt_logprobs([(0, (6, -9.0, [])), (1, (7, -2.0, []))])
    assert prompt_tuples(st.prompt_logprobs) == [None, (6, -1.0, []), (7, -2.0, [])]
    assert st.prompt_logprobs_missing == 0
    with pytest.raises(LogprobMismatch):
        st.add_prompt_logprobs([(1, (8, -1.0, []))])
    with pytest.raises(LogprobMismatch):
        st.add_prompt_logprobs([(2, (7, -1.0, []))])   # no prompt token 3 to score


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
