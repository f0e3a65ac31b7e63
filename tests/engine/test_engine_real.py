"""The synchronous LLM on the real SmolLM2 with the Rust scheduler, end to end on CPU."""

from __future__ import annotations

import math
import re

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


def test_seeded_n_sequences_differ_and_repeat(real_llm):
    """A seeded request with n=3 draws three different samples (each sequence keys its own
    draws), and the same seed gives the same three again."""
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=11, ignore_eos=True)
    first = real_llm.generate("Write a short poem about the sea.", params)[0]
    again = real_llm.generate("Write a short poem about the sea.", params)[0]
    seqs = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(seqs)) == 3
    assert seqs == [tuple(c.token_ids) for c in again.outputs]


def test_logprobs_with_sampling_n_and_a_shared_prefix(real_llm):
    """Sampled (not greedy) tokens with logprobs, n=2 forked from one prefill, next to a greedy
    request on the same prompt (a prefix-cache hit): every token has its entry, the entry's
    alternatives are the top 3 in order, the sampled token's own logprob is the entry's, and
    the greedy request's first token is the best of its first entry."""
    prompt = "The three primary colours are"
    sampled, greedy = real_llm.generate([prompt, prompt], [
        SamplingParams(max_tokens=10, temperature=1.0, n=2, seed=5, logprobs=3,
                       ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)])
    for c in sampled.outputs + greedy.outputs:
        assert [e.token_id for e in c.logprobs] == c.token_ids
        for e in c.logprobs:
            assert len(e.top) == 3 and e.logprob <= 0.0
            assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
            assert e.logprob <= e.top[0][1] + 1e-6
            assert sum(math.exp(lp) for _, lp in e.top) <= 1.0 + 1e-5
            if e.token_id in dict(e.top):
                assert abs(dict(e.top)[e.token_id] - e.logprob) < 1e-6
        assert abs(c.cumulative_logprob - sum(e.logprob for e in c.logprobs)) < 1e-4
    for e in greedy.outputs[0].logprobs:
        assert e.top[0][0] == e.token_id
    # both sampled sequences start from the same distribution (one prefill, then a fork)
    assert sampled.outputs[0].logprobs[0].top == sampled.outputs[1].logprobs[0].top
    g_top, s_top = greedy.outputs[0].logprobs[0].top, sampled.outputs[0].logprobs[0].top
    assert [t for t, _ in g_top] == [t for t, _ in s_top]
    assert [lp for _, lp in g_top] == pytest.approx([lp for _, lp in s_top], abs=1e-4)


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


def test_min_tokens_holds_back_stop_strings_and_stop_token_ids(real_llm):
    """Below `min_tokens` neither a stop string nor a stop token id ends the output (vLLM's
    rule, as for EOS): the stop token is never sampled there, a stop string is plain text."""
    prompt = "Once upon a time in a small village there lived"
    full = real_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                    ignore_eos=True))[0].outputs[0]
    second = full.token_ids[1]                       # greedy's second token
    word = real_llm.engine.tokenizer.decode([second]).strip()
    assert word and word in full.text
    out = real_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                   ignore_eos=True, stop=[word]))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 2     # without min_tokens
    out = real_llm.generate(prompt, SamplingParams(max_tokens=10, min_tokens=6, temperature=0.0,
                                                   stop=[word]))[0].outputs[0]
    assert len(out.token_ids) >= 6 and out.token_ids[:6] == full.token_ids[:6]
    out = real_llm.generate(prompt, SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0,
                                                   stop_token_ids=[second]))[0].outputs[0]
    assert second not in out.token_ids[:4] and len(out.token_ids) >= 4


def test_chat_and_progress_bar(real_llm, capsys):
    out = real_llm.chat([{"role": "user", "content": "Say hello."}],
                        SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.outputs[0].text and out.prompt_token_ids[0] == 1          # <|im_start|>
    outs = real_llm.generate([f"Number {i}:" for i in range(8)],
                             SamplingParams(max_tokens=1, temperature=0.0))
    assert len(outs) == 8
    err = capsys.readouterr().err
    assert "Processed prompts" in err
    # the bar's last state: all 8, with the speed of what finished (8 one-token outputs)
    assert re.search(r"8/8 .*est\. speed input: \d+\.\d toks/s, output: \d+\.\d toks/s",
                     err), err


def test_chat_takes_vllms_rendering_options(real_llm):
    """continue_final_message: the prompt ends inside the last assistant message (no
    <|im_end|> after it, no new assistant turn); bad options are errors before any work."""
    convo = [{"role": "user", "content": "Count to five."},
             {"role": "assistant", "content": "One, two,"}]
    out = real_llm.chat(convo, SamplingParams(max_tokens=4, temperature=0.0),
                        add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nOne, two,")
    plain = real_llm.chat(convo, SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        real_llm.chat(convo, continue_final_message=True)
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool"):
        real_llm.chat(convo, add_generation_prompt="no")


def test_bad_input_is_rejected_before_any_work(real_llm):
    engine = real_llm.engine
    before = engine.counters["accepted"]
    for prompt, params in [("", GREEDY), ([1, 2, 49152], GREEDY), ([5] * 2048, GREEDY),
                           ("hi", SamplingParams(max_tokens=4096))]:
        with pytest.raises(ValueError):
            real_llm.generate(prompt, params)
    assert engine.counters["accepted"] == before
    for priority in ([1], [1, "2"], "12", [2**40, 0]):       # one 32-bit integer per prompt
        with pytest.raises(ValueError, match="priority"):
            real_llm.generate(["a", "b"], GREEDY, priority=priority)
    assert engine.counters["accepted"] == before
    outs = real_llm.generate(["a", "b"], GREEDY, priority=[3, -3])
    assert [len(o.outputs) for o in outs] == [1, 1]


def test_an_llm_used_after_close_says_so(loaded_smollm2, recwarn):
    from engine_support import REAL_ENGINE_OPTIONS

    from ferrobatch import LLM
    llm = LLM("smollm2", loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS)
    llm.close()
    llm.close()                                     # twice is fine
    with pytest.raises(RuntimeError, match="LLM is closed"):
        llm.generate("Hi", GREEDY)
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_wrong_argument_types_are_named(real_llm):
    with pytest.raises(TypeError, match="SamplingParams"):
        real_llm.generate("Hi", {"max_tokens": 2})
    with pytest.raises(TypeError, match="SamplingParams"):
        real_llm.generate(["Hi", "Yo"], [GREEDY, {"max_tokens": 2}])
    with pytest.raises(TypeError, match="SamplingParams"):
        real_llm.chat([{"role": "user", "content": "Hi"}], [{"max_tokens": 2}])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 conversations"):
        real_llm.chat([{"role": "user", "content": "Hi"}], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="needs a prompt"):
        real_llm.generate(None)

    async def async_generate():
        async for _ in real_llm.engine.generate("Hi", {"max_tokens": 2}):
            pass

    with pytest.raises(TypeError, match="SamplingParams"):
        real_llm._run(async_generate())


def test_a_generated_name_never_takes_a_callers_name(real_llm):
    """Requests given no id are named req-<n>; a caller may have chosen that very name."""
    engine = real_llm.engine
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def scenario():
        first = engine.add_request("Hi", long)
        n = first._state.req_id
        chosen = engine.add_request("Hi", long, request_id=f"req-{n + 2}")
        auto = engine.add_request("Hi", long)
        assert auto._state.req_id == n + 2 and auto._state.request_id != f"req-{n + 2}"
        assert engine.check_accounting()["open"] == 3
        assert engine.abort(f"req-{n + 2}")
        outs = {}
        for name, stream in (("chosen", chosen), ("auto", auto), ("first", first)):
            if name != "chosen":
                stream.abort()
            outs[name] = [o async for o in stream][-1].outputs[0].finish_reason
        return outs

    assert real_llm._run(scenario()) == {"chosen": "abort", "auto": "abort", "first": "abort"}


class _Interrupted(Exception):
    pass


def test_an_interrupted_generate_aborts_its_requests(real_llm):
    """Ctrl-C while `generate` waits must not leave its requests decoding in the background."""
    import os
    import signal
    import threading
    import time

    def raise_interrupted(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGINT, raise_interrupted)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(_Interrupted):
            real_llm.generate(["Tell me a story."] * 4,
                              SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 10
    while real_llm.engine.stats()["num_open_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert real_llm.engine.stats()["num_open_requests"] == 0


def test_num_cached_tokens_counts_the_prefix_cache_hits(real_llm):
    """RequestOutput.num_cached_tokens (vLLM's field): the prompt tokens found in the prefix
    cache at the first schedule: whole blocks of a prompt seen before, none for a new one."""
    block = real_llm.engine.kv_cache_config()["block_size"]
    tok = real_llm.engine.tokenizer
    shared = tok.encode("A long shared preamble about the weather in many cities. " * 5)
    p = SamplingParams(max_tokens=2, temperature=0.0)
    fresh = real_llm.generate([[7, 8, 9] + shared + [11]], p)[0]
    assert fresh.num_cached_tokens == 0
    again = real_llm.generate([[7, 8, 9] + shared + [12, 13]], p)[0]
    cached = again.num_cached_tokens
    assert cached % block == 0 and len(shared) + 3 - block < cached <= len(shared) + 3


def _first_completion(history: list[int], seq: tuple[int, ...]) -> int | None:
    """The first index at which `history` completes `seq` (its last token's index)."""
    for end in range(len(seq), len(history) + 1):
        if tuple(history[end - len(seq):end]) == seq:
            return end - 1
    return None


def test_bad_words_change_greedy_output_exactly_where_the_word_would_end(real_llm):
    """Greedy with `bad_words=["Paris"]` equals plain greedy up to the token that would finish
    a spelling of the word, takes another token there, and never writes either spelling."""
    from ferrobatch.runtime.token_restrictions import bad_word_sequences
    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = real_llm.generate(prompt, greedy)[0].outputs[0].token_ids
    spellings = bad_word_sequences(real_llm.engine.tokenizer, ["Paris"])
    ends = [e for e in (_first_completion(plain, s) for s in spellings) if e is not None]
    assert ends, "the plain greedy text should name Paris"
    cut = min(ends)
    out = real_llm.generate(prompt, greedy.replace(bad_words=("Paris",)))[0].outputs[0]
    assert out.token_ids[:cut] == plain[:cut] and out.token_ids[cut] != plain[cut]
    assert all(_first_completion(out.token_ids, s) is None for s in spellings)
    assert real_llm.engine.check_accounting()["tracked_extras"] == 0


def test_allowed_token_ids_take_the_best_allowed_token(real_llm):
    """With the plain run's 2nd..5th best first tokens allowed, the first token is the 2nd best
    (the raw logits' order, from logprobs) and every token is one of the allowed."""
    prompt = "My favourite fruit is"
    base = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    top = real_llm.generate(prompt, base)[0].outputs[0].logprobs[0].top
    allowed = [t for t, _ in top[1:5]]
    out = real_llm.generate(prompt, base.replace(allowed_token_ids=tuple(allowed)))[0]
    assert out.outputs[0].token_ids[0] == top[1][0]
    assert set(out.outputs[0].token_ids) <= set(allowed)
    sampled = real_llm.generate(prompt, SamplingParams(
        max_tokens=6, temperature=1.5, seed=3, allowed_token_ids=allowed, ignore_eos=True))[0]
    assert set(sampled.outputs[0].token_ids) <= set(allowed)


def test_truncate_prompt_tokens_equals_the_shortened_prompt(real_llm):
    """A prompt cut by `truncate_prompt_tokens` gives what its last tokens give alone; a prompt
    longer than the context window is accepted when cut, refused when not."""
    tok = real_llm.engine.tokenizer
    ids = tok.encode("One two three four five six seven eight nine ten. " * 30)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cut = real_llm.generate({"prompt_token_ids": ids},
                            params.replace(truncate_prompt_tokens=40))[0]
    alone = real_llm.generate({"prompt_token_ids": ids[-40:]}, params)[0]
    assert cut.prompt_token_ids == ids[-40:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    long_text = "word " * 3000                  # > max_model_len (2048) tokens
    with pytest.raises(ValueError, match="context window"):
        real_llm.generate(long_text, params)
    out = real_llm.generate(long_text, params.replace(truncate_prompt_tokens=-1))[0]
    assert len(out.prompt_token_ids) == 2048 - 8
    assert out.prompt == tok.decode(out.prompt_token_ids, skip_special_tokens=False)


def test_reset_prefix_cache_forgets_free_blocks_only(real_llm):
    """After a reset a prompt seen before finds nothing cached (and gives the same tokens);
    blocks a running request holds are kept: a reset in the middle of a request changes
    nothing for it, and the accounting stays whole."""
    prompt = "The prefix cache keeps full blocks of prompts it has seen. " * 6
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = real_llm.generate(prompt, params)[0]
    assert real_llm.generate(prompt, params)[0].num_cached_tokens > 0
    assert real_llm.reset_prefix_cache() > 0
    cold = real_llm.generate(prompt, params)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    assert real_llm.reset_prefix_cache() > 0          # what `cold` left behind

    async def reset_midway():
        engine = real_llm.engine
        long = params.replace(max_tokens=40, output_kind="delta")
        tokens, resets = [], []
        async for out in engine.generate(prompt, long):
            tokens.extend(out.outputs[0].token_ids)
            if len(tokens) >= (3, 20, 41)[len(resets)]:   # twice, drafts may jump ahead
                resets.append(await engine.reset_prefix_cache())
        return tokens, resets

    tokens, resets = real_llm._run(reset_midway())
    solo = real_llm.generate(prompt, params.replace(max_tokens=40))[0].outputs[0].token_ids
    assert tokens == solo and resets == [0, 0]        # its own blocks are in use, not free
    real_llm._run(real_llm.engine.check_idle_clean())


def test_cache_salt_keeps_prefix_cache_hits_within_a_tenant(real_llm):
    """The same prompt: a hit for a second request of the same salt (or both unsalted), none
    across salts; vLLM's `{"prompt": ..., "cache_salt": ...}` dict says the same."""
    prompt = "Tenant isolation matters when many users share one server. " * 6
    params = SamplingParams(max_tokens=1)

    def cached(p, salt=None):
        return real_llm.generate(p, params.replace(cache_salt=salt))[0].num_cached_tokens

    assert cached(prompt, "alice") == 0
    assert cached(prompt, "alice") > 0            # the same tenant shares its blocks
    assert cached(prompt, "bob") == 0             # another tenant does not see them
    assert cached(prompt) == 0                    # nor does an unsalted request
    assert cached(prompt) > 0
    out = real_llm.generate({"prompt": prompt, "cache_salt": "bob"}, params)[0]
    assert out.num_cached_tokens > 0              # bob's own blocks, from above
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")
