"""The synchronous LLM on the real SmolLM2 with the Rust scheduler, end to end on CPU."""

from __future__ import annotations

import pytest

from ferrobatch.outputs import RequestOutput
from ferrobatch.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(autouse=True)
def clean_after(real_llm):
    yield
    real_llm._run(real_llm.engine.check_idle_clean())


def test_generate_text_and_token_prompts(real_llm):
    tok = real_llm.engine.tokenizer
    ids = tok.encode("The capital of France is")
    outs = real_llm.generate(["The capital of France is", ids], GREEDY)
    assert len(outs) == 2 and all(isinstance(o, RequestOutput) for o in outs)
    a, b = outs
    assert a.prompt == "The capital of France is" and a.prompt_token_ids == ids
    assert b.prompt is None and b.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids          # same prompt, greedy
    assert len(a.outputs[0].token_ids) <= 8 and a.outputs[0].finish_reason in ("stop", "length")
    assert "Paris" in a.outputs[0].text
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids)


def test_batching_does_not_change_greedy_output(real_llm):
    prompts = ["Once upon a time", "def fibonacci(n):", "The sky is", "1, 2, 3, 4,"]
    together = real_llm.generate(prompts, GREEDY)
    alone = [real_llm.generate(p, GREEDY)[0] for p in prompts]
    for t, a in zip(together, alone):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids


def test_per_prompt_params_seed_n_and_eos_controls(real_llm):
    p_seed = SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
    p_n = SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=7)
    p_ignore = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    p_min = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    outs = real_llm.generate(["Tell me a joke.", "Hi", "Hello", "Hello"],
                             [p_seed, p_n, p_ignore, p_min])
    again = real_llm.generate("Tell me a joke.", p_seed)[0]
    assert outs[0].outputs[0].token_ids == again.outputs[0].token_ids   # seeded = reproducible
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in outs[1].outputs)
    assert len(outs[2].outputs[0].token_ids) == 7 and outs[2].outputs[0].finish_reason == "length"
    assert len(outs[3].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="SamplingParams"):
        real_llm.generate(["a", "b"], [p_seed])


def test_penalties_and_logit_bias_reach_the_sampler(real_llm):
    plain = real_llm.generate("Repeat after me: la la la la", SamplingParams(
        max_tokens=8, temperature=0.0))[0].outputs[0].token_ids
    banned = plain[0]
    biased = real_llm.generate("Repeat after me: la la la la", SamplingParams(
        max_tokens=8, temperature=0.0, logit_bias={banned: -100.0},
        repetition_penalty=1.3))[0].outputs[0].token_ids
    assert banned not in biased
    assert real_llm.engine.check_accounting()["tracked_extras"] == 0


def test_stop_string_real_model(real_llm):
    full = real_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=12,
                                                                temperature=0.0))[0]
    text = full.outputs[0].text
    stop = text.strip()[2:5]
    assert stop and stop in text
    out = real_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=12, temperature=0.0,
                                                               stop=[stop]))[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_chat_and_progress_bar(real_llm, capsys):
    out = real_llm.chat([{"role": "user", "content": "Say hello."}],
                        SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.outputs[0].text and out.prompt_token_ids[0] == 1          # <|im_start|>
    outs = real_llm.generate([f"Number {i}:" for i in range(8)],
                             SamplingParams(max_tokens=1, temperature=0.0))
    assert len(outs) == 8
    assert "Processed prompts" in capsys.readouterr().err


def test_bad_input_is_rejected_before_any_work(real_llm):
    engine = real_llm.engine
    before = engine.counters["accepted"]
    for prompt, params in [("", GREEDY), ([1, 2, 49152], GREEDY), ([5] * 2048, GREEDY),
                           ("hi", SamplingParams(max_tokens=4096))]:
        with pytest.raises(ValueError):
            real_llm.generate(prompt, params)
    assert engine.counters["accepted"] == before
