"""AsyncEngine semantics on FakeCore: outputs, stop strings, n > 1, aborts, failures, accounting."""

from __future__ import annotations

import asyncio

import pytest
from fake_core import EOS

from ferrobatch.engine.errors import EngineDeadError, QueueFullError
from ferrobatch.sampling_params import SamplingParams


async def run(engine, prompt, rid=None, **kw):
    outs = []
    async for out in engine.generate(prompt, SamplingParams(**kw), request_id=rid):
        outs.append(out)
    return outs


async def test_cumulative_output(fake_engine):
    outs = await run(fake_engine, "hello", max_tokens=7, temperature=0.0)
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == "hellohe"
    assert final.outputs[0].token_ids == [ord(c) for c in "hellohe"]
    assert final.prompt_token_ids == [ord(c) for c in "hello"]
    assert all(not o.finished for o in outs[:-1])


async def test_delta_and_final_kinds(fake_engine):
    deltas = await run(fake_engine, "abc", max_tokens=5, output_kind="delta")
    assert "".join(o.outputs[0].text for o in deltas) == "abcab"
    assert sum(len(o.outputs[0].token_ids) for o in deltas) == 5
    finals = await run(fake_engine, "abc", max_tokens=5, output_kind="final")
    assert len(finals) == 1 and finals[0].outputs[0].text == "abcab"


async def test_stop_string_never_streamed(fake_engine):
    deltas = await run(fake_engine, "abcXYZdef", max_tokens=50, stop=["XYZ", "nope"],
                       output_kind="delta")
    pieces = [o.outputs[0].text for o in deltas]
    assert "".join(pieces) == "abc"
    assert not any("X" in p for p in pieces)
    last = deltas[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == "XYZ"


async def test_stop_prefix_released_when_no_match(fake_engine):
    outs = await run(fake_engine, "abXY", max_tokens=4, stop=["XYZ"], output_kind="delta")
    assert "".join(o.outputs[0].text for o in outs) == "abXY"
    assert outs[-1].outputs[0].finish_reason == "length"


async def test_include_stop_str(fake_engine):
    outs = await run(fake_engine, "abcXYZdef", max_tokens=50, stop=["XYZ"],
                     include_stop_str_in_output=True)
    assert outs[-1].outputs[0].text == "abcXYZ"


async def test_n_greater_than_one(fake_engine):
    outs = await run(fake_engine, "abcd", max_tokens=3, n=3)
    final = outs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == ["abc", "bcd", "cda"]
    assert all(c.finish_reason == "length" for c in final.outputs)


async def test_eos_ignore_eos_and_stop_token_ids(fake_engine):
    outs = await run(fake_engine, "ab" + chr(EOS) + "cd", max_tokens=10)
    c = outs[-1].outputs[0]
    assert c.finish_reason == "stop" and c.text == "ab" and c.token_ids[-1] == EOS
    outs = await run(fake_engine, "ab" + chr(EOS) + "cd", max_tokens=6, ignore_eos=True)
    assert outs[-1].outputs[0].finish_reason == "length"
    # a stop token id stays in token_ids, but its text is left out unless
    # include_stop_str_in_output (as vLLM), in every output kind
    for kind in ("cumulative", "delta", "final"):
        outs = await run(fake_engine, "abcd", max_tokens=10, stop_token_ids=[ord("c")],
                         output_kind=kind)
        text = "".join(o.outputs[0].text for o in outs) if kind == "delta" \
            else outs[-1].outputs[0].text
        c = outs[-1].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == ord("c")
        assert text == "ab", kind
        assert (c.token_ids if kind != "delta" else
                [t for o in outs for t in o.outputs[0].token_ids])[-1] == ord("c")
        outs = await run(fake_engine, "abcd", max_tokens=10, stop_token_ids=[ord("c")],
                         include_stop_str_in_output=True, output_kind=kind)
        text = "".join(o.outputs[0].text for o in outs) if kind == "delta" \
            else outs[-1].outputs[0].text
        assert text == "abc", kind


async def test_abort_frees_and_reports(fake_engine):
    stream = fake_engine.add_request("x" * 10, SamplingParams(max_tokens=200), "long")
    first = await stream.__anext__()
    assert not first.finished
    assert fake_engine.abort("long")
    outs = [o async for o in stream]
    assert outs[-1].outputs[0].finish_reason == "abort"
    await fake_engine.check_idle_clean()
    assert fake_engine.counters["abort"] == 1
    assert not fake_engine.abort("long")           # unknown afterwards


async def test_leaving_generate_aborts(fake_engine):
    agen = fake_engine.generate("y" * 5, SamplingParams(max_tokens=250), request_id="gone")
    async for _ in agen:
        break
    await agen.aclose()
    await fake_engine.check_idle_clean()
    assert fake_engine.counters["abort"] == 1


@pytest.mark.parametrize("prompt,kw,match", [
    ("", {}, "empty"),
    ([], {}, "empty"),
    ([1, 2, 100000], {}, "vocabulary"),
    ([1, True], {}, "integers"),
    ("a" * 300, {}, "context window"),
    ("abc", {"max_tokens": 254}, "exceeds"),
    ("abc", {"n": 17}, "n must be"),
    ("abc", {"stop": ["s"] * 17}, "stop strings"),
    ("abc", {"stop_token_ids": [600]}, "vocabulary"),
])
async def test_validation_before_allocation(fake_engine, prompt, kw, match):
    core = fake_engine._core
    before = core.submitted
    with pytest.raises(ValueError, match=match):
        fake_engine.add_request(prompt, SamplingParams(**kw))
    assert core.submitted == before
    assert fake_engine.check_accounting()["open"] == 0


@pytest.mark.parametrize("kw", [
    {"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_p": 1.5},
    {"top_k": -2}, {"max_tokens": 0}, {"n": 0}, {"min_tokens": 5, "max_tokens": 2},
    {"seed": -2}, {"stop": [""]}, {"repetition_penalty": 0}, {"max_tokens": 1.5},
    # positive, but 0 once stored as float32 (the Rust core's type)
    {"top_p": 1e-300}, {"repetition_penalty": 1e-300},
    # a token id is an int or its decimal text, not a float or a bool that int() would take
    {"logit_bias": {1.7: 1}}, {"logit_bias": {True: 1}}, {"logit_bias": {"1.5": 1}},
    {"logit_bias": {"-3": 1}}, {"logit_bias": {"٣": 1}}, {"logit_bias": {"+-5": 1}},
    # an int past a double's range (JSON allows it): refused, not a struct.error
    {"top_p": 10**400}, {"repetition_penalty": 10**400},
])
def test_sampling_params_reject(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_logit_bias_keys_may_be_ids_or_their_text():
    assert SamplingParams(logit_bias={"7": 1, 9: -2.5}).logit_bias == {7: 1.0, 9: -2.5}


async def test_duplicate_request_id(fake_engine):
    s = fake_engine.add_request("abc", SamplingParams(max_tokens=100), "dup")
    with pytest.raises(ValueError, match="already in flight"):
        fake_engine.add_request("abc", SamplingParams(max_tokens=1), "dup")
    s.abort()
    async for _ in s:
        pass


async def test_queue_full(fake_engine):
    fake_engine.config = fake_engine.config.replace(max_queued_requests=2)
    streams = [fake_engine.add_request("abc", SamplingParams(max_tokens=3)) for _ in range(2)]
    with pytest.raises(QueueFullError):
        fake_engine.add_request("abc", SamplingParams(max_tokens=3))
    for s in streams:
        async for _ in s:
            pass
    assert fake_engine.counters["rejected"] == 1


@pytest.mark.parametrize("kind,max_tokens,kept", [
    ("cumulative", 50, None),    # streamed: the token in flight fails at once
    ("final", 20, 20),           # deferred text: fails when the text is made, tokens kept
])
async def test_detokenizer_failure_fails_one_request(fake_engine, kind, max_tokens, kept):
    bad = fake_engine.add_request("abcdef", SamplingParams(max_tokens=max_tokens,
                                                           output_kind=kind), "bad")
    good = fake_engine.add_request("abcdef", SamplingParams(max_tokens=5, output_kind=kind),
                                   "good")

    class Boom:
        def add(self, tok):
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "boom")

        add_many = add

    bad._state.seqs[0].detok = Boom()
    bad_outs = [o async for o in bad]
    good_outs = [o async for o in good]
    assert bad_outs[-1].outputs[0].finish_reason == "error"
    assert "detokenization failed" in bad_outs[-1].error
    if kept is not None:
        assert len(bad_outs[-1].outputs[0].token_ids) == kept     # the tokens are not lost
    assert good_outs[-1].outputs[0].text == "abcde"
    await fake_engine.check_idle_clean()
    assert fake_engine.is_running and fake_engine.counters["error"] == 1


@pytest.mark.parametrize("exc", [RuntimeError("kaput"), type("PanicException",
                                                               (BaseException,), {})("panic")])
async def test_fatal_error_ends_every_stream(fake_engine, exc):
    streams = [fake_engine.add_request("abc", SamplingParams(max_tokens=200)) for _ in range(3)]
    await asyncio.sleep(0.02)
    fake_engine._core.fail_next_step = exc
    fake_engine._core.wake()
    for s in streams:
        outs = [o async for o in s]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
        assert "engine failure" in outs[-1].error
    assert not fake_engine.is_running
    assert "kaput" in fake_engine.dead_reason or "panic" in fake_engine.dead_reason
    with pytest.raises(EngineDeadError):
        fake_engine.add_request("abc")
    assert not await fake_engine.check_ready(1.0)
    assert fake_engine.check_accounting()["open"] == 0


async def test_ready_and_many_concurrent(fake_engine):
    assert await fake_engine.check_ready(5.0)

    async def one(i):
        outs = await run(fake_engine, f"p{i:03d}", max_tokens=4 + i % 5, output_kind="delta")
        return "".join(o.outputs[0].text for o in outs), outs[-1].outputs[0].num_output_tokens

    results = await asyncio.gather(*(one(i) for i in range(60)))
    for i, (text, ntok) in enumerate(results):
        want = (f"p{i:03d}" * 3)[:4 + i % 5]
        assert text == want and ntok == len(want)
    await fake_engine.check_idle_clean()
    assert fake_engine.counters["length"] == 61


# -- "final" consumers: deferred text, no per-step wake-ups ---------------------------------

async def test_final_kind_defers_text_and_matches_streamed_text(fake_engine):
    streamed = await run(fake_engine, "hello world", max_tokens=30, n=2, seed=3,
                         temperature=1.0, output_kind="cumulative")
    final = await run(fake_engine, "hello world", max_tokens=30, n=2, seed=3,
                      temperature=1.0, output_kind="final")
    assert len(final) == 1
    for a, b in zip(streamed[-1].outputs, final[0].outputs):
        assert a.text == b.text and a.token_ids == b.token_ids and len(b.token_ids) == 30
        assert b.text == "".join(chr(t) for t in b.token_ids)


async def test_final_consumer_is_woken_once(fake_engine):
    stream = fake_engine.add_request("abc", SamplingParams(max_tokens=40, output_kind="final"))
    state = stream._state
    assert state.defer_text
    sets = []
    real_set = state.event.set
    state.event.set = lambda: (sets.append(1), real_set())
    outs = [o async for o in stream]
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 40
    assert len(sets) == 1                       # woken at its finish, not on each of 40 steps
    assert state.seqs[0].num_detokenized == 40


async def test_aborted_final_request_carries_its_text(fake_engine):
    stream = fake_engine.add_request("x" * 10, SamplingParams(max_tokens=200,
                                                              output_kind="final"), "fin")
    while not stream._state.seqs[0].token_ids:
        await asyncio.sleep(0.001)
    assert fake_engine.abort("fin")
    outs = [o async for o in stream]
    out = outs[-1].outputs[0]
    assert out.finish_reason == "abort" and out.token_ids
    assert out.text == "".join(chr(t) for t in out.token_ids)
    await fake_engine.check_idle_clean()


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_build_output_sees_every_change_and_nothing_else(kind):
    # build_output skips its work when nothing changed (RequestState.version); every change a
    # consumer can see must still produce an output
    from fake_core import CharTokenizer

    from ferrobatch.engine.request_state import RequestState
    from ferrobatch.model.detokenizer import IncrementalDetokenizer

    tok = CharTokenizer()
    params = SamplingParams(max_tokens=8, n=2, output_kind=kind)
    st = RequestState(1, "r", "ab", [97, 98], params, 8,
                      [IncrementalDetokenizer(tok, [97, 98]) for _ in range(2)], 0.0)
    assert st.build_output() is None                       # nothing yet
    st.add_token(0, ord("x"))
    out = st.build_output()
    assert out is not None and out.outputs[0].text == "x"
    assert st.build_output() is None                       # asked again: nothing new
    st.add_token(1, ord("y"))
    assert st.build_output().outputs[-1].text == "y"
    st.finish_seq_locally(1, "error", "boom")              # a local finish, no new token
    out = st.build_output()
    assert out is not None and out.outputs[-1].finish_reason == "error"
    st.terminal_event(0, 2, None)                          # the scheduler's finish ("length")
    out = st.build_output()
    assert out is not None and out.finished and out.outputs[0].finish_reason == "length"
    assert st.build_output() is None


async def test_a_step_thread_call_given_up_on_does_not_kill_the_engine(fake_engine):
    """`check_idle_clean` waits on a call to the step thread with a timeout; a timed-out
    (cancelled) call used to raise InvalidStateError there, which took the engine down."""
    import threading

    release = threading.Event()
    blocker = fake_engine._loop_thread.call(lambda: release.wait(10))
    given_up = fake_engine._loop_thread.call(lambda: "never needed")
    assert given_up.cancel()
    release.set()
    assert await asyncio.wrap_future(blocker) is True
    out = [o async for o in fake_engine.generate("abc", SamplingParams(max_tokens=3))][-1]
    assert out.outputs[0].finish_reason == "length"
    assert fake_engine.is_running
