"""Speculative decoding by prompt lookup on the real SmolLM2: drafts never change a greedy or
seeded output (penalties, bias, logprobs and grammars included), only single-sequence requests
draft, limits and stop rules hold, streams stay whole.

Two engines share the loaded weights: one never drafts, one drafts at any load with no step
limit (the CPU default caps drafted steps at 8 tokens)."""

from __future__ import annotations

import pytest
from engine_support import REAL_ENGINE_OPTIONS

from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.engine.llm import LLM
from ferrobatch.sampling_params import SamplingParams

PASSAGE = ("The river Seine flows through Paris. Its banks are lined with old bookstalls, and "
           "in the evening the bridges light up one after another while boats pass slowly below.")
COPY = [{"role": "user", "content": f"Repeat the following text exactly.\n\n{PASSAGE}"}]
CODE = [{"role": "user", "content": "Rewrite this code with clearer names.\n\ndef total(items):\n"
         "    result = 0\n    for item in items:\n        result = result + item\n"
         "    return result\n"}]
OPEN = [{"role": "user", "content": "Write a short story about a dragon who learns to cook."}]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def engines(loaded_smollm2):
    plain = LLM("smollm2", loaded_model=loaded_smollm2, num_speculative_tokens=0,
                **REAL_ENGINE_OPTIONS)
    drafting = LLM("smollm2", loaded_model=loaded_smollm2, num_speculative_tokens=3,
                   speculative_max_running=0, speculative_max_step_tokens=0,
                   speculative_ngram_min=1, **REAL_ENGINE_OPTIONS)
    yield plain, drafting
    plain.close()
    drafting.close()


@pytest.fixture(autouse=True)
def clean_after(engines):
    yield
    for llm in engines:
        llm._run(llm.engine.check_idle_clean())     # also the scheduler's integrity check


def _drafts(llm: LLM) -> tuple[int, int]:
    s = llm.engine.stats()
    return s["num_draft_tokens_total"], s["num_accepted_tokens_total"]


def test_greedy_outputs_do_not_change_alone_or_batched(engines):
    plain, drafting = engines
    convs = [COPY, CODE, OPEN]
    want = [o.outputs[0].token_ids for o in plain.chat(convs, GREEDY, use_tqdm=False)]
    d0, a0 = _drafts(drafting)
    together = [o.outputs[0] for o in drafting.chat(convs, GREEDY, use_tqdm=False)]
    alone = [drafting.chat(c, GREEDY, use_tqdm=False)[0].outputs[0] for c in convs]
    d1, a1 = _drafts(drafting)
    assert [o.token_ids for o in together] == want
    assert [o.token_ids for o in alone] == want
    assert [o.text for o in together] == [o.text for o in alone]
    # the check is only meaningful if drafts were both kept and refused
    assert 0 < a1 - a0 < d1 - d0
    assert _drafts(plain) == (0, 0)


def test_requests_with_logits_processors_do_not_draft(engines):
    """A processor may keep state between calls: its request never drafts (same tokens)."""
    plain, drafting = engines
    want = plain.chat(COPY, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    before = _drafts(drafting)
    out = drafting.chat(COPY, GREEDY.replace(logits_processors=[lambda history, row: row]),
                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want
    assert _drafts(drafting) == before
    drafting.chat(COPY, GREEDY, use_tqdm=False)          # the same request drafts without it
    assert _drafts(drafting)[0] > before[0]


def test_only_single_sequence_requests_draft(engines):
    _, drafting = engines
    p = SamplingParams(max_tokens=24, temperature=0.0, n=2)
    assert not p.allows_speculation
    before = _drafts(drafting)
    drafting.chat(COPY, p, use_tqdm=False)
    assert _drafts(drafting) == before
    assert GREEDY.allows_speculation
    assert SamplingParams(temperature=0.0, min_tokens=3, stop=["x"]).allows_speculation
    assert SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1).allows_speculation


PER_TOKEN_STATE = {
    "logprobs": dict(logprobs=3),
    "prompt_logprobs": dict(prompt_logprobs=1),
    "repetition_penalty": dict(repetition_penalty=1.03),
    "presence_frequency": dict(presence_penalty=0.4, frequency_penalty=0.3),
    "logit_bias": dict(logit_bias={13: -2.0, 28: 1.5}),
    "seeded_penalty_logprobs": dict(temperature=0.7, seed=3, frequency_penalty=0.2, logprobs=1),
    "guided_regex": dict(guided_regex="[A-Za-z ,.]+"),
    "guided_json": dict(max_tokens=64, guided_json={
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
    "seeded_guided": dict(temperature=0.7, seed=5, guided_regex="[A-Za-z ,.]+"),
}


@pytest.mark.parametrize("name", list(PER_TOKEN_STATE))
def test_requests_with_per_token_state_draft_and_match(engines, name):
    """Penalties count the drafts before each drafted row, a grammar masks it as if they were
    output, bias applies to every row, and each kept token's logprobs come from its own row:
    outputs and logprobs equal the plain engine's, and drafts were kept."""
    plain, drafting = engines
    p = SamplingParams(**{"max_tokens": 40, "temperature": 0.0, **PER_TOKEN_STATE[name]})
    assert p.allows_speculation
    want = plain.chat(COPY, p, use_tqdm=False)[0]
    d0, a0 = _drafts(drafting)
    got = drafting.chat(COPY, p, use_tqdm=False)[0]
    d1, a1 = _drafts(drafting)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert a1 > a0, "no draft was kept: the rows after a draft went unchecked"
    for g, w in ((got.outputs[0].logprobs, want.outputs[0].logprobs),
                 (got.prompt_logprobs, want.prompt_logprobs)):
        assert (g is None) == (w is None)
        for ge, we in zip(g or [], w or []):
            if we is None:
                assert ge is None
                continue
            assert ge.token_id == we.token_id
            assert ge.logprob == pytest.approx(we.logprob, abs=2e-3)
            # the alternatives' values agree (ids could swap only between near-equal values)
            assert [v for _, v in ge.top] == pytest.approx([v for _, v in we.top], abs=2e-3)
    if p.logprobs is not None:
        assert len(got.outputs[0].logprobs) == len(got.outputs[0].token_ids)


def test_seeded_sampling_gives_the_same_tokens_with_drafts(engines):
    """A seeded row's draw is keyed by its position, so a drafted row draws what the plain
    engine draws there: the outputs are identical, and drafts are still accepted (the model
    copies the passage at temperature 0.7 too)."""
    plain, drafting = engines
    params = [SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=s) for s in (1, 2)]
    tok = plain.engine.tokenizer
    prompts = [tok.apply_chat_template(COPY), tok.apply_chat_template(CODE)]
    want = plain.generate(prompts, params, use_tqdm=False)
    before = _drafts(drafting)
    got = drafting.generate(prompts, params, use_tqdm=False)
    after = _drafts(drafting)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert after[1] > before[1], "no draft was accepted"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 17])
def test_max_tokens_is_exact_with_drafts(engines, max_tokens):
    plain, drafting = engines
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = plain.chat(COPY, p, use_tqdm=False)[0].outputs[0]
    got = drafting.chat(COPY, p, use_tqdm=False)[0].outputs[0]
    assert len(got.token_ids) == max_tokens and got.token_ids == want.token_ids
    assert got.finish_reason == "length"


def test_stop_strings_and_stop_tokens_cut_where_they_did(engines):
    plain, drafting = engines
    text = plain.chat(COPY, GREEDY, use_tqdm=False)[0].outputs[0]
    word = text.text.split()[6]                      # a word several tokens in
    stop_token = text.token_ids[9]
    for p in (SamplingParams(max_tokens=48, temperature=0.0, stop=[word]),
              SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=48, temperature=0.0, stop=[word],
                             include_stop_str_in_output=True)):
        want = plain.chat(COPY, p, use_tqdm=False)[0].outputs[0]
        got = drafting.chat(COPY, p, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.text, want.token_ids, want.finish_reason, want.stop_reason)
        assert got.finish_reason == "stop"


async def test_streamed_deltas_add_up_when_steps_bring_several_tokens(loaded_smollm2):
    async with AsyncEngine(loaded_model=loaded_smollm2, num_speculative_tokens=3,
                           speculative_ngram_min=1, **REAL_ENGINE_OPTIONS) as engine:
        params = SamplingParams(max_tokens=48, temperature=0.0, output_kind="delta")
        deltas, ids = [], []
        async for out in engine.generate(None, params, "copy", messages=COPY):
            deltas.append(out.outputs[0].text)
            ids.extend(out.outputs[0].token_ids)
        final = None
        async for out in engine.generate(None, params.replace(output_kind="final"),
                                         "copy-final", messages=COPY):
            final = out.outputs[0]
        assert "".join(deltas) == final.text and ids == final.token_ids
        assert len(deltas) < len(ids), "no step brought more than one token"
        stats = engine.stats()
        assert stats["num_accepted_tokens_total"] > 0
        await engine.check_idle_clean()
