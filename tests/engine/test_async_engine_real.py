"""AsyncEngine on the real SmolLM2 with the Rust scheduler: streaming, abort, shutdown, and
per-request failure isolation (CPU)."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_support import REAL_ENGINE_OPTIONS

from ferrobatch.config import EngineConfig
from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.sampling_params import SamplingParams


async def test_async_engine_stream_abort_and_shutdown(loaded_smollm2):
    async with AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as engine:
        deltas = []
        async for out in engine.generate("Write a long story about a dragon.",
                                         SamplingParams(max_tokens=40, ignore_eos=True,
                                                        output_kind="delta"),
                                         request_id="dragon"):
            deltas.append(out)
            if len(deltas) == 3:
                assert engine.abort("dragon")
        assert deltas[-1].outputs[0].finish_reason == "abort"
        assert len(deltas) < 40
        await engine.check_idle_clean()
        assert engine.stats()["num_used_blocks"] == 0
        stream = engine.add_request("Hello", SamplingParams(max_tokens=100, ignore_eos=True))
        await stream.__anext__()
    # shutdown aborted the open request and joined the step thread
    assert not engine.is_running and engine.check_accounting()["open"] == 0
    await asyncio.sleep(0)


async def test_non_finite_logits_fail_only_that_request(loaded_smollm2):
    async with AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as engine:
        runner = engine._core.runner
        poisoned: set[int] = set()
        execute = runner.execute

        def poisoning_execute(batch):
            logits = execute(batch).clone()
            for row, rid in enumerate(batch.sample_req_ids.tolist()):
                if rid in poisoned:
                    logits[row] = float("nan")
            return logits

        runner.execute = poisoning_execute
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        bad = engine.add_request("Hello there", params)
        poisoned.add(bad._state.req_id)
        good = engine.add_request("Hello there", params)
        bad_out = [o async for o in bad][-1]
        good_out = [o async for o in good][-1]
        assert bad_out.outputs[0].finish_reason == "error" and "non-finite" in bad_out.error
        assert bad_out.outputs[0].token_ids == []
        assert good_out.outputs[0].finish_reason == "length"
        assert len(good_out.outputs[0].token_ids) == 6
        await engine.check_idle_clean()
        assert engine.counters["error"] == 1 and engine.is_running


async def test_priority_policy_orders_waiting_requests(loaded_smollm2):
    options = dict(REAL_ENGINE_OPTIONS, max_num_seqs=1, scheduling_policy="priority")
    async with AsyncEngine(loaded_model=loaded_smollm2, **options) as engine:
        finished: list[str] = []

        async def run(name: str, priority: int, max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                    priority=priority)
            async for _ in engine.generate(f"{name} says", params, request_id=name):
                pass
            finished.append(name)

        first = asyncio.create_task(run("first", 0, 6))
        deadline = time.monotonic() + 60
        while engine.stats().get("num_running", 0) < 1:
            assert time.monotonic() < deadline, "the first request never ran"
            await asyncio.sleep(0.005)
        later = [asyncio.create_task(run("low", 10, 2)), asyncio.create_task(run("high", -5, 2))]
        await asyncio.gather(first, *later)
        assert finished == ["first", "high", "low"]
        await engine.check_idle_clean()


def test_rows_all_finite_catches_one_bad_element_anywhere():
    import torch

    from ferrobatch.engine.core import rows_all_finite

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(37, 1000, generator=gen) * 30).to(dtype)
        assert rows_all_finite(logits)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for _ in range(5):
                r = int(torch.randint(37, (1,), generator=gen))
                c = int(torch.randint(1000, (1,), generator=gen))
                poisoned = logits.clone()
                poisoned[r, c] = bad
                assert not rows_all_finite(poisoned), (dtype, bad, r, c)
    # finite values whose sum overflows: reported as "check exactly", never as finite-and-bad
    huge = torch.full((2, 8), 3e38)
    assert not rows_all_finite(huge) and bool(torch.isfinite(huge).all())


async def test_long_prompts_are_tokenized_off_the_event_loop(loaded_smollm2):
    """A long prompt is tokenized on a worker thread by `prepare` (every door calls it before
    `add_request`), so the event loop never runs a ~0.7 s encode; `add_request` then uses those
    ids, which equal the inline encode's."""
    import threading

    from ferrobatch.model.tokenizer import LONG_TEXT_CHARS

    async with AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as engine:
        tok = engine.tokenizer
        encode, threads = tok.encode, []

        def recording_encode(text, *a, **kw):
            threads.append((len(text), threading.current_thread() is threading.main_thread()))
            return encode(text, *a, **kw)

        tok.encode = recording_encode
        try:
            # long in characters, short in tokens (runs of '=' are few tokens), under the
            # test engine's 2048-token context
            long_text = ("=" * 39 + " The sea.\n") * (LONG_TEXT_CHARS // 48 + 1)
            params = SamplingParams(max_tokens=2, temperature=0.0)
            outs = [o async for o in engine.generate(long_text, params)]
            assert threads == [(len(long_text), False)]         # once, on a worker thread
            assert outs[-1].prompt_token_ids == encode(long_text)
            threads.clear()
            [o async for o in engine.generate("short prompt", params)]
            assert threads == [(12, True)]                       # short: inline, no hand-off
            threads.clear()
            for content in (long_text, [{"type": "text", "text": long_text}]):
                threads.clear()
                chat = [{"role": "user", "content": content}]
                [o async for o in engine.generate(None, params, messages=chat)]
                assert len(threads) == 1 and threads[0][1] is False
            assert engine._pretokenized == {}
        finally:
            tok.encode = encode
        await engine.check_idle_clean()


async def test_a_compiled_grammar_does_not_wait_behind_another_compile(loaded_smollm2):
    """Compiles run one at a time; a request whose grammar is cached must not queue behind a
    slow compile of a different schema (a client sending big new schemas would else stall
    everyone's guided requests)."""
    import threading

    async with AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as engine:
        compiler = engine._core.guided
        known = SamplingParams(max_tokens=2, temperature=0.0, guided_choice=["yes", "no"])
        compiler.grammar_for(known)                      # compiled earlier
        release, started = threading.Event(), threading.Event()
        compile_pattern = compiler.grammar

        def slow_grammar(pattern):
            if pattern == "left|right":
                started.set()
                assert release.wait(30)
            return compile_pattern(pattern)

        compiler.grammar = slow_grammar
        slow = asyncio.ensure_future(engine.prepare(
            SamplingParams(max_tokens=2, guided_regex="left|right")))
        try:
            assert await asyncio.to_thread(started.wait, 30)
            await asyncio.wait_for(engine.prepare(known), 5)    # not held by the slow compile
            assert not slow.done()
            out = [o async for o in engine.generate("Answer yes or no.", known)][-1]
            assert out.outputs[0].text in ("yes", "no")
        finally:
            release.set()
            await slow
        await engine.check_idle_clean()


async def test_an_operator_chat_template_replaces_the_models(loaded_smollm2):
    """EngineConfig(chat_template=...) / --chat-template: chat requests render with it (and the
    model loaded once for every test keeps its own template)."""
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    original = loaded_smollm2.tokenizer.chat_template
    async with AsyncEngine(loaded_model=loaded_smollm2, chat_template=template,
                           **REAL_ENGINE_OPTIONS) as engine:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert engine.render_chat(msgs) == "[system] Be brief.\n[user] Hi\n[assistant] "
        stream = engine.add_request(None, SamplingParams(max_tokens=2, temperature=0.0),
                                    messages=msgs)
        async for _ in stream:
            pass
        want = engine.tokenizer.encode("[system] Be brief.\n[user] Hi\n[assistant] ")
        assert stream.prompt_token_ids == want
    assert loaded_smollm2.tokenizer.chat_template == original


def test_a_chat_template_that_does_not_compile_is_refused_before_loading():
    with pytest.raises(ValueError, match="invalid chat template"):
        EngineConfig(chat_template="{% for %}")
    with pytest.raises(ValueError, match="non-empty"):
        EngineConfig(chat_template=" ")


async def test_cpu_threads_sets_the_kernels_thread_count(loaded_smollm2):
    """EngineConfig(cpu_threads=N) / --threads N: the runner's kernels run on N threads."""
    import torch
    before = torch.get_num_threads()
    try:
        async with AsyncEngine(loaded_model=loaded_smollm2, cpu_threads=1,
                               **REAL_ENGINE_OPTIONS) as engine:
            assert engine._core.runner.kernel_threads == 1
            outs = [o async for o in engine.generate("Hello", SamplingParams(
                max_tokens=4, temperature=0.0))]
            assert len(outs[-1].outputs[0].token_ids) == 4
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineConfig(cpu_threads=0)


async def test_a_per_call_chat_template_and_kwargs_that_may_not_replace_it(loaded_smollm2):
    """render_chat / LLM.chat(chat_template=...) use the given template for that conversation;
    chat_template_kwargs (what network clients send) can never swap the template in."""
    async with AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as engine:
        msgs = [{"role": "user", "content": "Hi"}]
        own = engine.render_chat(msgs)
        assert engine.render_chat(msgs, chat_template="<{{ messages[0].content }}>") == "<Hi>"
        assert engine.render_chat(msgs) == own                 # the model's, unchanged
        for key in ("chat_template", "tokenize", "messages"):
            with pytest.raises(ValueError, match="may not set"):
                engine.render_chat(msgs, template_kwargs={key: "{{ 1 }}"})
        stream = engine.add_request(None, SamplingParams(max_tokens=1), messages=msgs,
                                    chat_options={"chat_template": "<{{ messages[0].content }}>"})
        async for _ in stream:
            pass
        assert stream.prompt_token_ids == engine.tokenizer.encode("<Hi>")
