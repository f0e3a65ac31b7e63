"""Guided decoding through the engine on the real SmolLM2 (CPU): every output is valid for its
JSON Schema / regex / choice list and ends where the grammar is complete, guided and plain rows
share batches without leaking masks, and bad guided requests fail before anything runs."""

from __future__ import annotations

import json
import re

import pytest

from ferrobatch import LLM, SamplingParams

OPTIONS = dict(num_blocks=384, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048,
               device="cpu")

PERSON = {
    "title": "Person", "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                    "maxItems": 3},
    },
    "required": ["name", "age", "city"],
}


@pytest.fixture(scope="module")
def llm(loaded_smollm2):
    engine = LLM("smollm2", loaded_model=loaded_smollm2, **OPTIONS)
    yield engine
    engine.close()


def chat(text):
    return [{"role": "user", "content": text}]


def check_person(text):
    obj = json.loads(text)
    assert set(obj) <= set(PERSON["properties"]) and {"name", "age", "city"} <= set(obj)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 40
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert obj["city"] in ("Paris", "London", "Tokyo")
    assert list(obj) == [k for k in PERSON["properties"] if k in obj]      # declared order
    hobbies = obj.get("hobbies", [])
    assert isinstance(hobbies, list) and len(hobbies) <= 3
    assert all(isinstance(h, str) and len(h) <= 30 for h in hobbies)


def test_json_schema_greedy_and_sampled(llm):
    greedy = llm.chat(chat("Describe a person living in Paris as JSON."),
                      SamplingParams(max_tokens=120, temperature=0.0, guided_json=PERSON))[0]
    sampled = llm.chat(chat("Describe a person as JSON."),
                       SamplingParams(max_tokens=160, temperature=1.0, seed=3, n=4,
                                      guided_json=json.dumps(PERSON)))[0]
    for out in greedy.outputs + sampled.outputs:
        assert out.finish_reason == "stop", out.text
        check_person(out.text)
    assert len({o.text for o in sampled.outputs}) > 1


def test_any_json_object(llm):
    out = llm.chat(chat("Give me a JSON object describing a dog, with two short fields."),
                   SamplingParams(max_tokens=200, temperature=0.7, seed=0,
                                  guided_json={"type": "object"}))[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:                                       # cut by max_tokens: still a valid prefix
        assert out.finish_reason == "length" and out.text.startswith("{")


def test_regex_and_choice(llm):
    phone = r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}"
    outs = llm.generate(["My phone number is", "Call me at"],
                        SamplingParams(max_tokens=30, temperature=0.0, guided_regex=phone))
    for o in outs:
        assert re.fullmatch(phone, o.outputs[0].text) and o.outputs[0].finish_reason == "stop"
    choices = ["positive", "negative", "neutral 🙂"]
    res = llm.chat(chat("Classify the sentiment of: I love this phone!"),
                   SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=6,
                                  guided_choice=choices))[0]
    assert all(o.text in choices and o.finish_reason == "stop" for o in res.outputs)


def test_guided_and_plain_requests_share_a_batch_without_leaking(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = llm.generate(["The capital of France is", "Once upon a time"], plain)
    guided = SamplingParams(max_tokens=24, temperature=0.0, guided_regex="[A-Z]{2,6}")
    mixed = llm.generate(["The capital of France is", "Name a country code:",
                          "Once upon a time", "Another code:"],
                         [plain, guided, plain, guided])
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == \
        [o.outputs[0].token_ids for o in alone]
    for o in (mixed[1], mixed[3]):
        assert re.fullmatch("[A-Z]{2,6}", o.outputs[0].text)


def test_cut_by_max_tokens_is_a_valid_prefix_with_raw_logprobs(llm):
    out = llm.chat(chat("Describe a person as JSON."),
                   SamplingParams(max_tokens=5, temperature=0.0, guided_json=PERSON,
                                  logprobs=2))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"name":')
    # logprobs come from the model's raw distribution, so they stay finite and <= 0
    assert len(out.logprobs) == 5 and all(e.logprob <= 0.0 for e in out.logprobs)
    assert all(e.token_id == t for e, t in zip(out.logprobs, out.token_ids))


@pytest.mark.parametrize("kw, match", [
    (dict(guided_regex="(unclosed"), "unclosed group"),
    (dict(guided_json={"type": "object", "not": {}}), "unsupported JSON Schema keyword 'not'"),
    (dict(guided_json="{not json"), "JSON"),
    (dict(guided_regex="[ab]*a[ab]{20}"), "larger than"),
    (dict(guided_choice=["a"], guided_regex="a"), "at most one of"),
    (dict(guided_choice=["a"], ignore_eos=True), "ignore_eos"),
    (dict(guided_choice=["a"], min_tokens=2, max_tokens=4), "min_tokens"),
    (dict(guided_choice=[]), "non-empty list"),
])
def test_bad_guided_requests_fail_before_anything_runs(llm, kw, match):
    before = llm.engine.stats()
    with pytest.raises(ValueError, match=match):
        llm.generate("Hello", SamplingParams(**kw))
    after = llm.engine.stats()
    assert after["num_open_requests"] == 0 == before["num_open_requests"]


def test_grammars_are_compiled_once_per_pattern(llm):
    compiler = llm.engine._core.guided
    p = SamplingParams(max_tokens=4, temperature=0.0, guided_choice=["alpha", "beta"])
    llm.generate(["a", "b", "c"], p)
    n = compiler.num_cached()
    llm.generate(["d"], p)
    assert compiler.num_cached() == n
    assert compiler.grammar("alpha|beta") is compiler.grammar("alpha|beta")


def test_schemas_differing_only_in_property_order_get_their_own_grammar(llm):
    """The property order is the output's key order (users put "reasoning" before "answer" on
    purpose): the grammar cache must not treat two orders as one schema."""
    compiler = llm.engine._core.guided
    props = {"answer": {"type": "integer"}, "reasoning": {"type": "string"}}
    a = {"type": "object", "properties": props, "required": ["answer", "reasoning"]}
    b = {**a, "properties": dict(reversed(list(props.items())))}
    ga = compiler.grammar_for(SamplingParams(guided_json=a))
    gb = compiler.grammar_for(SamplingParams(guided_json=b))
    assert ga is not gb
    assert gb.matches('{"reasoning": "x", "answer": 1}')
    assert not gb.matches('{"answer": 1, "reasoning": "x"}')


class _Refusing:
    """Wraps a GuidedSequence; refuses the token after `after` accepted ones (what a masking
    bug would look like to the engine), or reports no continuation when `dead_end`."""

    def __init__(self, inner, after, dead_end=False):
        self.inner, self.after, self.dead_end = inner, after, dead_end
        self.is_finished = False

    def write_mask(self, row):
        return self.inner.write_mask(row)

    @property
    def num_allowed(self):
        return 0 if self.dead_end and self.after <= 0 else self.inner.num_allowed

    def advance(self, token):
        self.after -= 1
        if self.after < 0 and not self.dead_end:
            return False
        return self.inner.advance(token)


@pytest.mark.parametrize("dead_end, message", [(False, "not allowed by the grammar"),
                                               (True, "no token of the vocabulary")])
async def test_a_grammar_failure_fails_only_its_request(loaded_smollm2, dead_end, message):
    from ferrobatch.engine.async_engine import AsyncEngine

    async with AsyncEngine(loaded_model=loaded_smollm2, **OPTIONS) as engine:
        guided = SamplingParams(max_tokens=30, temperature=0.0, guided_regex="[a-z ]{1,60}")
        bad = engine.add_request("Say something:", guided)
        extras = bad._state.extras
        extras.guides[0] = _Refusing(extras.guides[0], after=3, dead_end=dead_end)
        good = engine.add_request("Say something:", guided)
        bad_out = [o async for o in bad][-1]
        good_out = [o async for o in good][-1]
        assert bad_out.outputs[0].finish_reason == "error" and message in bad_out.error
        assert good_out.outputs[0].finish_reason in ("stop", "length")
        assert re.fullmatch("[a-z ]{1,60}", good_out.outputs[0].text)
        await engine.check_idle_clean()
        assert engine.stats()["num_used_blocks"] == 0 and engine.is_running
        assert engine._core.num_tracked() == 0
