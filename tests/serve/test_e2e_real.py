"""Every door end to end on the real SmolLM2 + Rust scheduler, one server for the module (CPU).

The official `openai` SDK talks to the HTTP door on loopback; the package's own clients talk to
the WebSocket (JSON and msgpack) and TCP doors. After each test the engine must be idle with
every KV block free and the request tables empty.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import openai
import pytest
import pytest_asyncio
from engine_support import REAL_ENGINE_OPTIONS
from serve_support import sdk_client, start_server, stop_server

from ferrobatch.client import TCPClient, WSClient
from ferrobatch.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

OPTIONS = REAL_ENGINE_OPTIONS


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real(loaded_smollm2):
    engine = AsyncEngine(loaded_model=loaded_smollm2, **OPTIONS)
    r = await start_server(engine, served_model_name="smollm2")
    yield r
    await stop_server(r)


@pytest_asyncio.fixture(loop_scope="module")
async def sdk(real):
    async with sdk_client(real) as client:
        yield client


async def test_sdk_models_and_completion(real, sdk):
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert (await sdk.models.retrieve("smollm2")).id == "smollm2"
    c = await sdk.completions.create(model="smollm2", prompt="The capital of France is",
                                     max_tokens=6, temperature=0)
    assert c.object == "text_completion" and "Paris" in c.choices[0].text
    assert c.usage.completion_tokens <= 6 and c.usage.prompt_tokens == 5
    stream = await sdk.completions.create(model="smollm2", prompt="The capital of France is",
                                          max_tokens=6, temperature=0, stream=True,
                                          stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert text == c.choices[0].text and usage.completion_tokens == c.usage.completion_tokens


async def test_sdk_chat_stream_and_non_stream(real, sdk):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                             temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    parts, reasons, usage = [], [], None
    async for chunk in stream:
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
        usage = chunk.usage or usage
    assert "".join(parts) == full.choices[0].message.content
    assert reasons == [full.choices[0].finish_reason]
    assert usage.completion_tokens == full.usage.completion_tokens
    n3 = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                           n=3, temperature=1.0, seed=3)
    assert sorted(ch.index for ch in n3.choices) == [0, 1, 2]
    assert n3.usage.completion_tokens <= 12


async def test_responses_api_matches_chat_on_the_real_model(real, sdk):
    """`client.responses.create` / `.stream` give the text chat completions gives for the same
    conversation (greedy), with the instructions as its system message."""
    msgs = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"}]
    chat = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12,
                                             temperature=0)
    resp = await sdk.responses.create(model="smollm2", instructions=msgs[0]["content"],
                                      input=msgs[1]["content"], max_output_tokens=12,
                                      temperature=0)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.status == ("completed" if chat.choices[0].finish_reason == "stop"
                           else "incomplete")
    async with sdk.responses.stream(model="smollm2", input=msgs[1:], instructions=msgs[0][
            "content"], max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == resp.output_text


async def test_usage_reports_prefix_cache_hits(real, sdk):
    """`usage.prompt_tokens_details.cached_tokens` (chat, completions) and the Responses API's
    `input_tokens_details.cached_tokens`: 0 for a new prompt, the shared blocks' tokens for a
    prompt seen before."""
    system = "You answer questions about a made-up kingdom of seven rivers. " * 4
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name one."}]
    first = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = await sdk.chat.completions.create(model="smollm2", messages=msgs[:1] + [
        {"role": "user", "content": "Name two."}], max_tokens=2)
    hits = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= hits < second.usage.prompt_tokens and hits % 16 == 0
    stream = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2,
                                               stream=True, stream_options={"include_usage": True})
    usage = [c.usage async for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens >= hits
    for tail, least in ((" One", 0), (" Two", 16)):      # no chat template: its own prefix
        comp = await sdk.completions.create(model="smollm2", prompt=system + tail, max_tokens=2)
        assert comp.usage.prompt_tokens_details.cached_tokens >= least
    resp = await sdk.responses.create(model="smollm2", instructions=system, input="Name three.",
                                      max_output_tokens=2)
    assert resp.usage.input_tokens_details.cached_tokens >= hits


async def test_return_token_ids_whole_and_streamed(real):
    """vLLM's `return_token_ids`: a choice's `token_ids` are its text's tokens (a stream's
    chunks carry them piece by piece, together the same), the prompt's `prompt_token_ids` are
    what the engine computed (completions: per choice; chat: on the response, the stream's
    first chunk)."""
    tok = real.engine.tokenizer
    prompt = "Write the numbers from one to five:"
    messages = [{"role": "user", "content": "Say hello twice."}]

    async def post(path, body):
        async with aiohttp.ClientSession() as s:
            async with s.post(real.base + path, json={"model": "smollm2", "temperature": 0.0,
                                                      "return_token_ids": True, **body}) as r:
                assert r.status == 200, await r.text()
                if not body.get("stream"):
                    return await r.json()
                return [json.loads(line[6:]) async for line in r.content
                        if line.startswith(b"data: {")]

    whole = await post("/v1/completions", {"prompt": prompt, "max_tokens": 12})
    ch = whole["choices"][0]
    assert ch["prompt_token_ids"] == tok.encode(prompt)
    assert len(ch["token_ids"]) == whole["usage"]["completion_tokens"]
    assert tok.decode(ch["token_ids"]) == ch["text"]
    chunks = await post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "stream": True})
    got = [c for e in chunks for c in e["choices"]]
    assert [t for c in got for t in c.get("token_ids", [])] == ch["token_ids"]
    assert [c["prompt_token_ids"] for c in got if "prompt_token_ids" in c] == \
        [ch["prompt_token_ids"]]
    chat = await post("/v1/chat/completions", {"messages": messages, "max_tokens": 10})
    assert chat["prompt_token_ids"][-4:] == tok.encode("<|im_start|>assistant\n")
    ids = chat["choices"][0]["token_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == chat["choices"][0]["message"]["content"]
    events = await post("/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                 "stream": True})
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == ids
    async with aiohttp.ClientSession() as s:
        async with s.post(real.base + "/v1/completions", json={
                "prompt": prompt, "return_token_ids": "yes"}) as r:
            assert r.status == 400
    # return_tokens_as_token_ids: logprobs name each token by id, the ids `token_ids` lists
    as_ids = await post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "logprobs": 2,
                                            "return_tokens_as_token_ids": True})
    lp = as_ids["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp["top_logprobs"] for t in top)
    chat_ids = await post("/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                   "logprobs": True, "top_logprobs": 2,
                                                   "return_tokens_as_token_ids": True})
    content = chat_ids["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
    assert content[0]["bytes"] == list(content[0]["token"].encode())


async def test_reset_prefix_cache_route(real, sdk):
    """`POST /reset_prefix_cache`: a prompt seen before hits the cache, after the reset it
    does not (and gives the same reply)."""
    prompt = "A prompt about the prefix cache being reset between two runs. " * 4
    first = await sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=4,
                                         temperature=0.0)
    again = await sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=4,
                                         temperature=0.0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    async with aiohttp.ClientSession() as s:
        async with s.post(real.base + "/reset_prefix_cache") as resp:
            assert resp.status == 200
            assert (await resp.json())["num_blocks_dropped"] > 0
    cold = await sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=4,
                                        temperature=0.0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].text == again.choices[0].text == first.choices[0].text


async def test_sdk_errors_are_openai_errors(real, sdk):
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.completions.create(model="smollm2", prompt="hi", max_tokens=5000)
    assert "context window" in e.value.message
    with pytest.raises(openai.BadRequestError):
        await sdk.completions.create(model="smollm2", prompt=[1, 2, 999999], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await sdk.chat.completions.create(model="smollm2", messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await sdk.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await sdk.completions.create(model="smollm2", prompt="hi", temperature=-1)


async def test_stop_string_never_streamed(real, sdk):
    prompt = "List the days of the week: Monday, Tuesday,"
    base = await sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=12,
                                        temperature=0)
    text = base.choices[0].text
    words = re.findall(r"[A-Za-z]{4,}", text)
    assert words, text
    stop = words[0][:-1]
    stream = await sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=12,
                                          temperature=0, stop=[stop], stream=True)
    pieces = [ch.choices[0].text async for ch in stream if ch.choices]
    got = "".join(pieces)
    assert got == text[:text.index(stop)]
    assert stop not in got


async def test_fifty_concurrent_streams_across_doors(real, sdk):
    async def http(i):
        s = await sdk.completions.create(model="smollm2", prompt=f"Item {i}:", max_tokens=4,
                                         temperature=0.7, seed=i, stream=True, extra_body={
                                             "ignore_eos": True},
                                         stream_options={"include_usage": True})
        usage = None
        async for ch in s:
            usage = ch.usage or usage
        return usage.completion_tokens

    async def door(client, i):
        res = await client.complete(f"Item {i}:", max_tokens=4, ignore_eos=True,
                                    temperature=0.7, seed=i)
        assert len(res["token_ids"]) == 4
        return res["usage"]["completion_tokens"]

    ws = await WSClient.connect(real.ws_url)
    wsb = await WSClient.connect(real.ws_url, binary=True)
    tcp = await TCPClient.connect("127.0.0.1", real.tcp_port)
    try:
        jobs = [http(i) for i in range(20)] + [door(ws, i) for i in range(12)] + \
               [door(wsb, i) for i in range(12)] + [door(tcp, i) for i in range(12)]
        counts = await asyncio.wait_for(asyncio.gather(*jobs), 240)
    finally:
        for c in (ws, wsb, tcp):
            await c.close()
    assert counts == [4] * 56


async def test_cancel_and_disconnect_free_blocks_on_every_door(real, sdk):
    engine = real.engine

    async def idle_and_free():
        await engine.check_idle_clean(10.0)
        assert engine.stats()["num_used_blocks"] == 0

    before = engine.counters["abort"]
    # HTTP: drop the connection mid-stream
    async with aiohttp.ClientSession() as s:
        resp = await s.post(real.base + "/v1/completions", json={
            "prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True,
            "stream": True})
        await resp.content.readline()
        resp.close()
    await idle_and_free()
    # WS and TCP: cancel, then close with work in flight
    for make in (lambda: WSClient.connect(real.ws_url),
                 lambda: TCPClient.connect("127.0.0.1", real.tcp_port)):
        c = await make()
        kinds = []
        async for m in c.generate("Tell me a story.", id="s", max_tokens=300, ignore_eos=True):
            kinds.append(m["type"])
            if len(kinds) == 1:
                await c.cancel("s")
        assert kinds[-1] == "cancelled"
        assert engine.check_accounting()["open"] == 0          # released before "cancelled"
        assert engine.stats()["num_used_blocks"] == 0
        g = c.generate("Another story.", max_tokens=300, ignore_eos=True)
        await g.__anext__()
        await c.close()
        await idle_and_free()
    assert engine.counters["abort"] - before == 5


async def test_continuous_batching_short_request_finishes_first(real):
    done_order = []
    async with aiohttp.ClientSession() as s:
        async def run(name, max_tokens):
            async with s.post(real.base + "/v1/completions", json={
                    "prompt": f"{name}: tell me everything", "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0}) as resp:
                assert resp.status == 200
                await resp.json()
            done_order.append(name)

        longs = [asyncio.create_task(run(f"long{i}", 32)) for i in range(3)]
        deadline = time.monotonic() + 60
        while real.engine.stats().get("num_running", 0) < 3:
            assert time.monotonic() < deadline, "the three long requests never ran together"
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await run("short", 2)
        short_s = time.monotonic() - t0
        await asyncio.gather(*longs)
    assert done_order[0] == "short", done_order
    assert short_s < 30


async def test_health_ready_metrics(real, sdk):
    await sdk.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
    async with aiohttp.ClientSession() as s:
        async with s.get(real.base + "/health") as r:
            assert r.status == 200
        async with s.get(real.base + "/ready") as r:
            assert r.status == 200 and (await r.json())["status"] == "ready"
        async with s.get(real.base + "/metrics") as r:
            text = await r.text()

    def value(name):
        m = re.search(rf"^ferrobatch_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    assert value("generation_tokens_total") > 0 and value("prompt_tokens_total") > 0
    assert value("time_to_first_token_seconds_count") > 0
    assert value("e2e_request_latency_seconds_count") > 0
    assert value("inter_token_latency_seconds_count") > 0
    finished = value("e2e_request_latency_seconds_count")
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_params_n",
                 "request_inference_time_seconds"):
        assert value(f"{name}_count") == finished, name
    # every generated token came out of a step, and the prompts' uncached tokens went in one
    assert value("iteration_tokens_total_sum") >= value("generation_tokens_total")
    assert 0 < value("iteration_tokens_total_count") <= value("iteration_tokens_total_sum")
    assert value("prefix_cache_queries_total") >= value("prefix_cache_hits_total")
    assert value("spec_decode_num_draft_tokens_total") >= \
        value("spec_decode_num_accepted_tokens_total")
    assert 0.0 <= value("kv_cache_usage_perc") <= 1.0
    assert value("num_requests_running") == 0
    assert 'finished_reason="abort"' in text
    value("guided_requests_total"), value("guided_grammars_cached")    # present (values: below)
    info = re.search(r'^ferrobatch_cache_config_info\{[^}]*block_size="16",'
                     r'cache_dtype="float32"[^}]*num_blocks="(\d+)"\} 1\.0$', text, re.M)
    assert info and int(info.group(1)) == real.engine.stats()["num_blocks"], text


async def test_readiness_probes_leave_the_metrics_alone(real):
    """A probe runs a real one-token request; no counter, histogram or gauge may show it (the
    prefix-cache lookups counted its prompt). No `_created` series beside the counters."""
    async with aiohttp.ClientSession() as s:
        async def scrape():
            await real.engine.check_idle_clean()
            async with s.get(real.base + "/metrics") as r:
                return await r.text()

        before = await scrape()
        for _ in range(3):
            async with s.get(real.base + "/ready") as r:
                assert r.status == 200
        after = await scrape()
    assert re.search(r"^ferrobatch_prefix_cache_queries_total\{", after, re.M)
    assert after == before
    assert "_created" not in after


async def test_lm_eval_style_loglikelihood_through_the_sdk(real, sdk):
    """lm-eval's remote-tokenizer probe and loglikelihood request on the real model: /tokenize
    agrees with the tokenizer, and the echoed prompt's logprob of a continuation equals the
    logprob the sampler reported when the model generated that continuation (two code paths:
    prefill hidden states vs the decode step's sampler)."""
    tok = real.engine.tokenizer
    async with aiohttp.ClientSession() as s:
        async with s.get(real.base + "/tokenizer_info") as resp:
            info = await resp.json()
        async with s.post(real.base + "/tokenize",
                          json={"prompt": "The capital of France is",
                                "add_special_tokens": False}) as resp:
            context = (await resp.json())["tokens"]
        async with s.post(real.base + "/detokenize", json={"tokens": context}) as resp:
            text = (await resp.json())["prompt"]
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert context == tok.encode("The capital of France is")
    assert text == "The capital of France is"
    from ferrobatch.sampling_params import SamplingParams
    outs = [o async for o in real.engine.generate(context, SamplingParams(
        max_tokens=3, temperature=0.0, logprobs=2))]
    gen = outs[-1].outputs[0]
    continuation = gen.token_ids[:2]
    generated = [e.logprob for e in gen.logprobs[:2]]
    scored = await sdk.completions.create(model="smollm2", prompt=context + continuation,
                                          max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(context) + 2 + 1 and lp.token_logprobs[0] is None
    ctxlen = len(context)
    assert lp.token_logprobs[ctxlen:-1] == pytest.approx(generated, abs=1e-4)
    is_greedy = all(t == max(top.values()) for t, top in
                    zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
    assert is_greedy                                  # the model generated it greedily
    assert scored.choices[0].text.startswith("The capital of France is")


CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "country": {"type": "string", "enum": ["France", "Japan", "Peru"]},
    "population_millions": {"type": "number"}},
    "required": ["city", "country"]}


async def test_structured_outputs_on_every_door(real, sdk):
    import json
    msgs = [{"role": "user", "content": "Describe the capital of France as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    full = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=60,
                                             temperature=0, response_format=fmt)
    obj = json.loads(full.choices[0].message.content)
    assert full.choices[0].finish_reason == "stop"
    assert set(obj) <= set(CITY["properties"]) and obj["country"] in ("France", "Japan", "Peru")
    stream = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=60,
                                               temperature=0, response_format=fmt, stream=True)
    parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
    assert "".join(parts) == full.choices[0].message.content
    anyobj = await sdk.completions.create(model="smollm2", prompt="A JSON object about cats:",
                                          max_tokens=80, temperature=0.5, seed=1,
                                          extra_body={"response_format": {"type": "json_object"}})
    choice = anyobj.choices[0]
    assert choice.text.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:                       # cut by max_tokens: a prefix of an object
        assert choice.finish_reason == "length"
    guided_before = real.engine.counters["guided"]
    picked = await sdk.completions.create(model="smollm2", prompt="The best season is",
                                          max_tokens=8, n=3, temperature=1.0, seed=2,
                                          extra_body={"guided_choice": ["summer", "winter"]})
    assert len(picked.choices) == 3
    assert {c.text for c in picked.choices} <= {"summer", "winter"}
    assert real.engine.counters["guided"] == guided_before + 1
    async with aiohttp.ClientSession() as s:
        async with s.get(real.base + "/metrics") as r:
            text = await r.text()
    m = re.search(r"^ferrobatch_guided_requests_total\{[^}]*\} (\S+)$", text, re.M)
    assert m and float(m.group(1)) == real.engine.counters["guided"]
    m = re.search(r"^ferrobatch_guided_grammars_cached\{[^}]*\} (\S+)$", text, re.M)
    assert m and float(m.group(1)) >= 2      # the city schema, json_object, the choice
    for client in (await WSClient.connect(real.ws_url),
                   await TCPClient.connect("127.0.0.1", real.tcp_port)):
        try:
            res = await client.complete("My lucky number is", max_tokens=8, temperature=0,
                                        guided_regex="[0-9]{2}")
            assert re.fullmatch("[0-9]{2}", res["text"]) and res["finish_reason"] == "stop"
            res = await client.complete("The best season is", max_tokens=8, temperature=0,
                                        structured_outputs={"choice": ["summer", "winter"]})
            assert res["text"] in ("summer", "winter")
            with pytest.raises(RuntimeError, match="(?s)400.*unclosed group"):
                await client.complete("x", guided_regex="(ab")
        finally:
            await client.close()


async def test_vllm_structured_outputs_and_ascii_regex_classes(real, sdk):
    """vLLM's `structured_outputs` object works like its guided_* fields; a guided regex's
    `\\d` is an ASCII digit (Unicode's let greedy output pick segmented digits, U+1FBF8)."""
    msgs = [{"role": "user", "content": "Is this review positive or negative? 'Great!'"}]
    for spec in ({"choice": ["positive", "negative"]}, {"regex": "(positive|negative)"}):
        r = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                              temperature=0, extra_body={"structured_outputs": spec})
        assert r.choices[0].message.content in ("positive", "negative"), spec
    r = await sdk.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "phone"}], max_tokens=24,
        temperature=0, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].message.content), r.choices[0]


async def test_bad_structured_output_requests_are_400_and_never_stall_streams(real, sdk):
    # a pattern whose automaton is too large is refused after ~1 s of compiling, off the
    # event loop: a stream running meanwhile finishes, and the refusal is a 400
    flowing = asyncio.create_task(sdk.completions.create(
        model="smollm2", prompt="Count: one, two,", max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True}))
    with pytest.raises(openai.BadRequestError, match="larger than"):
        await sdk.completions.create(model="smollm2", prompt="x", max_tokens=4,
                                     extra_body={"guided_regex": "[ab]*a[ab]{20}"})
    assert (await flowing).usage.completion_tokens == 24
    bad = [
        dict(response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "patternProperties": {}}}}),
        dict(response_format={"type": "xml"}),
        dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
        dict(extra_body={"guided_choice": ["a"], "ignore_eos": True}),
        dict(extra_body={"guided_grammar": 'root ::= undefined'}),
        dict(extra_body={"structured_outputs": {"grammar": 'answer ::= "a"'}}),   # no root
        dict(extra_body={"structured_outputs": {"structural_tag": "a"}}),       # never ignored
        dict(extra_body={"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}),
        dict(response_format={"type": "json_object"},
             extra_body={"structured_outputs": {"regex": "a"}}),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            await sdk.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                **kw)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["timezone"],
                                       "properties": {"timezone": {"type": "string",
                                                                   "maxLength": 40}}}}}


async def test_forced_tool_calls_through_the_sdk(real, sdk):
    import json
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        full = await sdk.chat.completions.create(
            model="smollm2", messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=tool_choice, max_tokens=80, temperature=0)
        c = full.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls, c
        for call in c.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.type == "function" and call.id.startswith("call_")
            if call.function.name == "get_weather":
                assert isinstance(args["city"], str) and set(args) <= {"city", "unit"}
            else:
                assert call.function.name == "get_time" and isinstance(args["timezone"], str)
        stream = await sdk.chat.completions.create(
            model="smollm2", messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=tool_choice, max_tokens=80, temperature=0, stream=True)
        streamed, reasons = [], []
        async for chunk in stream:
            for ch in chunk.choices:
                streamed += ch.delta.tool_calls or []
                reasons += [ch.finish_reason] if ch.finish_reason else []
        assert reasons == ["tool_calls"]
        assert [(t.function.name, t.function.arguments) for t in streamed] == \
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        # the SDK's stream helper: the finish comes in a chunk of its own, after the calls, so
        # each call is closed with its parsed arguments; the message's content stays None
        async with sdk.chat.completions.stream(
                model="smollm2", messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice=tool_choice, max_tokens=80, temperature=0) as helper:
            done = [e.name async for e in helper if e.type == "tool_calls.function.arguments.done"]
            final = await helper.get_final_completion()
        assert done == [t.function.name for t in c.message.tool_calls]
        assert final.choices[0].message.content is None
    # parallel_tool_calls=False: at most one call
    for seed in range(3):
        one = await sdk.chat.completions.create(
            model="smollm2", messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
            parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
        assert one.choices[0].finish_reason != "tool_calls" or len(one.choices[0].message.tool_calls) == 1
    # cut by max_tokens: no call, the partial text as content, finish "length"
    cut = await sdk.chat.completions.create(
        model="smollm2", messages=msgs, tools=[WEATHER_TOOL], tool_choice="required",
        max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("[")
    with pytest.raises(openai.BadRequestError, match="auto"):
        await sdk.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER_TOOL],
                                          max_tokens=8)


async def test_responses_api_forced_function_calls(real, sdk):
    """/v1/responses with function tools on SmolLM2: a forced choice gives `function_call`
    items (the same calls chat gives, greedy), streamed as their events; the call's output sent
    back as a `function_call_output` item reaches the template and the model answers in text."""
    import json
    flat = [{"type": "function", **t["function"]} for t in (WEATHER_TOOL, TIME_TOOL)]
    question = "What's the weather in Paris?"
    chat = await sdk.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=80, temperature=0)
    want = [(t.function.name, json.loads(t.function.arguments))
            for t in chat.choices[0].message.tool_calls]
    resp = await sdk.responses.create(model="smollm2", input=question, tools=flat,
                                      tool_choice="required", max_output_tokens=80,
                                      temperature=0)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed" and [o.type for o in resp.output] == ["function_call"] * len(
        calls)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    async with sdk.responses.stream(model="smollm2", input=question, tools=flat,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=80, temperature=0) as stream:
        done = [e.arguments async for e in stream
                if e.type == "response.function_call_arguments.done"]
        final = await stream.get_final_response()
    assert len(done) == 1 and json.loads(done[0])["city"]
    assert final.output[0].type == "function_call" and final.output[0].arguments == done[0]
    # the next turn: the call and its output go back; no tool_choice -> "auto" is refused for
    # SmolLM2, so the follow-up says "none" and gets text
    follow = await sdk.responses.create(model="smollm2", tools=flat, tool_choice="none",
                                        max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": question},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow.output[0].type == "message" and follow.output_text
    with pytest.raises(openai.BadRequestError, match="tool_choice 'auto'"):
        await sdk.responses.create(model="smollm2", input=question, tools=flat)


async def test_gbnf_grammars_on_every_door(real, sdk):
    """A GBNF grammar (`guided_grammar`, `structured_outputs.grammar`) constrains the output on
    HTTP, WS and TCP alike; a bad one is a 400 that says where."""
    grammar = 'root ::= "Answer: " ("yes" | "no") "."'
    msgs = [{"role": "user", "content": "Is water wet?"}]
    for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        r = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20,
                                              temperature=0, extra_body=extra)
        assert r.choices[0].message.content in ("Answer: yes.", "Answer: no.")
        assert r.choices[0].finish_reason == "stop"
    from ferrobatch.client import TCPClient, WSClient
    for client in (await WSClient.connect(real.ws_url),
                   await TCPClient.connect("127.0.0.1", real.tcp_port)):
        try:
            out = await client.complete(messages=msgs, max_tokens=20, guided_grammar=grammar)
            assert out["text"] in ("Answer: yes.", "Answer: no."), out
        finally:
            await client.close()
    with pytest.raises(openai.BadRequestError, match="undefined rule 'nope' at line 1"):
        await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                          extra_body={"guided_grammar": "root ::= nope"})


async def test_token_restrictions_and_truncation_on_every_door(real, sdk):
    """vLLM's `bad_words`, `allowed_token_ids` and `truncate_prompt_tokens` as extra fields on
    completions and chat, and as params on WS and TCP: each door's greedy output equals the
    engine's own for the same params."""
    from ferrobatch.sampling_params import SamplingParams
    prompt = "The capital of France is"
    extra = {"bad_words": ["Paris"], "ignore_eos": True}
    params = SamplingParams(max_tokens=8, temperature=0.0, bad_words=("Paris",), ignore_eos=True,
                            output_kind="final")
    expect = [o async for o in real.engine.generate(prompt, params)][-1].outputs[0].text
    assert expect and "Paris" not in expect
    comp = await sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                        temperature=0, extra_body=extra)
    assert comp.choices[0].text == expect
    ws = await WSClient.connect(real.ws_url)
    tcp = await TCPClient.connect("127.0.0.1", real.tcp_port)
    try:
        for client in (ws, tcp):
            res = await client.complete(prompt, max_tokens=8, temperature=0.0, **extra)
            assert res["text"] == expect
    finally:
        await ws.close()
        await tcp.close()
    tok = real.engine.tokenizer
    allowed = tok.encode(" yes no maybe Yes No", add_special_tokens=False)
    chat = await sdk.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=4, temperature=0, extra_body={"allowed_token_ids": allowed})
    text = chat.choices[0].message.content
    assert text and set(tok.encode(text, add_special_tokens=False)) <= set(allowed)
    long_prompt = "one two three " * 1000                       # > 2048 tokens
    with pytest.raises(openai.BadRequestError, match="context window"):
        await sdk.completions.create(model="smollm2", prompt=long_prompt, max_tokens=4)
    cut = await sdk.completions.create(model="smollm2", prompt=long_prompt, max_tokens=4,
                                       extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100


async def test_beam_search_on_completions_and_chat(real, sdk):
    """`use_beam_search` (vLLM's): `n` beams, best first, the same as the engine's own
    `beam_search`; chat renders the template first; fields it cannot honour are 400s by name."""
    from ferrobatch.engine.beam_search import BeamSearchParams
    prompt = "The best way to learn a new language is"
    expect = await real.engine.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8))
    comp = await sdk.completions.create(model="smollm2", prompt=[prompt, prompt], max_tokens=8,
                                        n=3, extra_body={"use_beam_search": True})
    assert [c.text for c in comp.choices] == [s.text for s in expect.sequences] * 2
    assert [c.index for c in comp.choices] == list(range(6))
    assert comp.usage.completion_tokens == 2 * sum(len(s.output_token_ids)
                                                   for s in expect.sequences)
    msgs = [{"role": "user", "content": "What colour is the sky? Answer in three words."}]
    expect = await real.engine.beam_search(None, BeamSearchParams(
        beam_width=2, max_tokens=24, length_penalty=0.5, early_stopping=True), messages=msgs)
    chat = await sdk.chat.completions.create(
        model="smollm2", messages=msgs, n=2, max_completion_tokens=24,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True})
    assert [c.message.content for c in chat.choices] == [s.text for s in expect.sequences]
    assert [c.finish_reason for c in chat.choices] == [s.finish_reason for s in expect.sequences]
    for extra, param in (({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"),
                         ({"stop": ["x"]}, "stop"), ({"length_penalty": 1.0}, "length_penalty"),
                         ({"early_stopping": "no"}, "early_stopping"),
                         ({"n": 11}, None), ({"seed": 3}, "seed")):
        body = {"use_beam_search": "length_penalty" not in extra, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=4,
                                         extra_body=body)
        assert info.value.body.get("param") == param, (extra, info.value.body)


async def test_a_client_leaving_a_beam_search_aborts_its_requests(real):
    """The handler is cancelled when the client goes: the step's requests are aborted, the
    engine ends idle with every block free (the `sdk` fixture's check, done here by hand)."""
    body = {"model": "smollm2", "prompt": "Tell me a long story about a dragon.",
            "max_tokens": 200, "n": 4, "use_beam_search": True, "ignore_eos": True}
    before = real.engine.check_accounting()["released"]
    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(session.post(real.base + "/v1/completions", json=body))
        for _ in range(400):                       # until the search is a few steps in
            await asyncio.sleep(0.05)
            if real.engine.check_accounting()["released"] - before > 12:
                break
        # a few steps in (a search of 200 steps x 4 beams is far from done; between two of
        # its steps no request of it may be open, so that is not asserted)
        assert real.engine.check_accounting()["released"] - before > 12
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await real.engine.check_idle_clean(10.0)
    done = real.engine.check_accounting()["released"]
    await asyncio.sleep(1.0)                 # a search still running would send more steps
    assert real.engine.check_accounting()["released"] == done
    assert done - before < 4 * 200 // 2


async def test_reasoning_parser_on_the_real_model(real, sdk):
    """A second server on the same engine with `reasoning_parser="deepseek_r1"`: SmolLM2 never
    closes a <think>, so a reply is all reasoning (content null), the same text the plain
    server gives as content; a guided reply reasons freely too (its grammar waits for
    `</think>`, which never comes), while with `qwen3` (a reply that does not open with
    <think> has no reasoning) its grammar applies from the first token."""
    from ferrobatch.serve.server import Server
    server = Server(real.engine, served_model_name="smollm2", reasoning_parser="deepseek_r1")
    await server.start("127.0.0.1", 0, tcp_port=None)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1",
                                    api_key="unused", max_retries=0)
        plain = await sdk.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                                  temperature=0)
        parsed = await client.chat.completions.create(model="smollm2", messages=msgs,
                                                      max_tokens=8, temperature=0)
        message = parsed.choices[0].message
        assert message.content is None
        assert message.model_extra["reasoning_content"] == plain.choices[0].message.content
        guided = await client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=8, temperature=0,
            extra_body={"guided_choice": ["four", "five"]})
        assert guided.choices[0].message.content is None
        assert guided.choices[0].message.model_extra["reasoning_content"] == \
            plain.choices[0].message.content           # not held to the grammar
        qwen3 = Server(real.engine, served_model_name="smollm2", reasoning_parser="qwen3")
        await qwen3.start("127.0.0.1", 0, tcp_port=None)
        try:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{qwen3.port}/v1",
                                          api_key="unused", max_retries=0) as q:
                guided = await q.chat.completions.create(
                    model="smollm2", messages=msgs, max_tokens=4, temperature=0,
                    extra_body={"guided_choice": ["four", "five"]})
        finally:
            await qwen3.stop()
        assert guided.choices[0].message.content in ("four", "five")
        assert guided.choices[0].message.model_extra.get("reasoning_content") is None
        from ferrobatch.engine.beam_search import BeamSearchParams
        beams = await client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=6, n=2,
            extra_body={"use_beam_search": True})
        expect = await real.engine.beam_search(None, BeamSearchParams(beam_width=2, max_tokens=6),
                                               messages=msgs)
        assert [c.message.model_extra["reasoning_content"] for c in beams.choices] == \
            [s.text for s in expect.sequences]
        await client.close()
    finally:
        await server.stop()


async def test_embeddings_route_through_the_sdk(real, sdk):
    """`/v1/embeddings` as the `openai` SDK calls it (base64, decoded by the SDK) and as floats:
    the engine's own `embed` vectors, in input order, with the usage of the prompts."""
    import numpy as np

    from ferrobatch.pooling_params import PoolingParams
    texts = ["The capital of France is Paris.", "A cat sat on the mat."]
    want = [np.asarray((await real.engine.embed(t)).outputs.embedding) for t in texts]

    async def metric(name):
        async with aiohttp.ClientSession() as s, s.get(real.base + "/metrics") as r:
            m = re.search(rf"^ferrobatch_{name}(?:{{[^}}]*}})? (\S+)$", await r.text(), re.M)
        return float(m.group(1))

    generated, prompts = await metric("generation_tokens_total"), \
        await metric("prompt_tokens_total")
    res = await sdk.embeddings.create(model="smollm2", input=texts)
    # an embedding reads its prompt and generates nothing
    assert await metric("generation_tokens_total") == generated
    assert await metric("prompt_tokens_total") == prompts + res.usage.prompt_tokens
    assert [d.index for d in res.data] == [0, 1]
    for d, w in zip(res.data, want):
        np.testing.assert_allclose(np.asarray(d.embedding), w, atol=1e-6)
    tok = real.engine.tokenizer
    assert res.usage.prompt_tokens == sum(len(tok.encode(t, add_special_tokens=True))
                                          for t in texts)
    ids = tok.encode(texts[0], add_special_tokens=True)
    short = await sdk.embeddings.create(model="smollm2", input=[ids], dimensions=32,
                                        encoding_format="float")
    cut = (await real.engine.embed(ids,
                                   PoolingParams(dimensions=32))).outputs.embedding
    np.testing.assert_allclose(short.data[0].embedding, cut, atol=1e-6)
    assert len(short.data[0].embedding) == 32
    for bad, param in ((dict(input=""), None), (dict(input=[]), "input"),
                       (dict(input="x", encoding_format="hex"), "encoding_format"),
                       (dict(input="x", dimensions=0), "dimensions"),
                       (dict(input="x", dimensions=577), "dimensions")):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.embeddings.create(model="smollm2", **bad)
        assert info.value.body.get("param") == param, (bad, info.value.body)


async def test_a_client_leaving_an_embeddings_call_cancels_its_inputs(real):
    """400 inputs, the client gone after a few are embedded: the rest never run, the engine
    ends idle with every block free and its request tables empty."""
    body = {"model": "smollm2", "input": [f"sentence number {i} " * 20 for i in range(400)]}
    before = real.engine.check_accounting()["released"]
    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(session.post(real.base + "/v1/embeddings", json=body))
        for _ in range(400):
            await asyncio.sleep(0.05)
            if real.engine.check_accounting()["released"] - before > 8:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await real.engine.check_idle_clean(10.0)
    done = real.engine.check_accounting()["released"] - before
    await asyncio.sleep(0.5)
    assert real.engine.check_accounting()["released"] - before == done < 400


async def test_embed_messages_on_ws_and_tcp(real):
    """WS (JSON, msgpack) and TCP `embed`: the engine's own vector; bad fields are `error`
    messages, and the connection keeps serving."""
    import numpy as np

    from ferrobatch.pooling_params import PoolingParams
    text = "The capital of France is Paris."
    want = (await real.engine.embed(text, PoolingParams(dimensions=48))).outputs.embedding
    for client in (await WSClient.connect(real.ws_url),
                   await WSClient.connect(real.ws_url, binary=True),
                   await TCPClient.connect("127.0.0.1", real.tcp_port)):
        try:
            got = await client.embed(text, dimensions=48)
            np.testing.assert_allclose(got, want, atol=1e-6)
            with pytest.raises(RuntimeError, match="dimensions"):
                await client.embed(text, dimensions=0)
            with pytest.raises(RuntimeError, match="unknown embedding field"):
                await client.embed(text, temperature=0.5)
            assert len(await client.embed(list(range(10, 40)))) == 576
        finally:
            await client.close()


async def test_beam_search_on_the_websocket_and_tcp_doors(real):
    """`use_beam_search` in a `generate`'s params: each beam, best first, as one delta of its
    index, then `done` with their finish reasons; what the engine's own search gives. A field
    it cannot honour is an error by name; a cancelled search ends as `cancelled` and leaves
    the engine idle and clean."""
    from ferrobatch.engine.beam_search import BeamSearchParams
    prompt = "The best way to learn a new language is"
    expect = await real.engine.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8))
    ws = await WSClient.connect(real.ws_url)
    tcp = await TCPClient.connect("127.0.0.1", real.tcp_port)
    try:
        for client in (ws, tcp):
            got = await client.complete(prompt, max_tokens=8, n=3, use_beam_search=True)
            assert got["texts"] == [s.text for s in expect.sequences]
            assert got["finish_reasons"] == [s.finish_reason for s in expect.sequences]
            assert got["usage"]["completion_tokens"] == sum(len(s.output_token_ids)
                                                            for s in expect.sequences)
            with pytest.raises(RuntimeError, match="'stop' cannot be combined"):
                await client.complete(prompt, max_tokens=4, use_beam_search=True, stop=["x"])
            with pytest.raises(RuntimeError, match="'length_penalty' needs"):
                await client.complete(prompt, max_tokens=4, length_penalty=0.5)
            async def story(client=client):
                return [m async for m in client.generate(
                    "Tell me a long story about a dragon.", id="b", max_tokens=200, n=4,
                    use_beam_search=True, ignore_eos=True)]
            before = real.engine.check_accounting()["released"]
            task = asyncio.ensure_future(story())
            while real.engine.check_accounting()["released"] - before < 12:   # a few steps in
                await asyncio.sleep(0.02)
            await client.cancel("b")
            assert [m["type"] for m in await task] == ["cancelled"]
            await real.engine.check_idle_clean(10.0)
    finally:
        await ws.close()
        await tcp.close()
    await real.engine.check_idle_clean(10.0)
