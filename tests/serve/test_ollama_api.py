"""Ollama's API on the real SmolLM2 (CPU, one server for the module), driven by the `ollama`
library: `/api/chat` and `/api/generate` answer what `/v1/chat/completions` and
`/v1/completions` answer for the same request (those routes are checked against transformers
elsewhere), streamed as NDJSON or whole, with Ollama's options, `format`, `raw` and stops;
the listing routes; bad requests are Ollama's `{"error"}` naming the field; a client that
leaves aborts its request; after every test the engine is idle with every block free. And the
protocol's conversions on their own."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio
from serve_support import start_watched, stop_server

from ferrobatch.serve.ollama_protocol import parse_ollama_chat, tool_calls
from ferrobatch.serve.protocol import ProtocolError

ollama = pytest.importorskip("ollama")
pytestmark = pytest.mark.asyncio(loop_scope="module")

QUESTION = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real(loaded_smollm2):
    r = await start_watched(loaded_smollm2, served_model_name="smollm2")
    yield r
    await stop_server(r)


@pytest_asyncio.fixture(loop_scope="module")
async def client(real):
    yield ollama.AsyncClient(host=real.base)
    await real.engine.check_idle_clean(10.0)


async def _post(real, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(real.base + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def _chat(real, messages, **fields) -> dict:
    status, got = await _post(real, "/v1/chat/completions", {
        "model": "smollm2", "messages": messages, "temperature": 0, **fields})
    assert status == 200, got
    return got


async def test_chat_answers_what_chat_completions_answers(client, real):
    got = await client.chat(model="smollm2:latest", messages=QUESTION, options=GREEDY)
    want = await _chat(real, QUESTION, max_tokens=12)
    assert got.message.role == "assistant"
    assert got.message.content == want["choices"][0]["message"]["content"]
    assert got.model == "smollm2:latest" and got.done and got.done_reason == "length"
    assert got.prompt_eval_count == want["usage"]["prompt_tokens"] and got.eval_count == 12
    assert got.total_duration >= got.eval_duration > 0


async def test_a_chat_stream_rebuilds_the_whole_answer(client, real):
    whole = await client.chat(model="smollm2", messages=QUESTION, options=GREEDY)
    chunks = [c async for c in await client.chat(model="smollm2", messages=QUESTION,
                                                   options=GREEDY, stream=True)]
    assert len(chunks) >= 3
    assert not any(c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].done_reason == "length" and chunks[-1].eval_count == 12


async def test_generate_templated_raw_and_loading(client, real):
    templated = await client.generate(model="smollm2", prompt="Name three colours.",
                                      system="Be brief.", options=GREEDY)
    want = await _chat(real, [{"role": "system", "content": "Be brief."}] + QUESTION,
                       max_tokens=12)
    assert templated.response == want["choices"][0]["message"]["content"]
    raw = await client.generate(model="smollm2", prompt="The capital of France is", raw=True,
                                options={"temperature": 0, "num_predict": 8})
    status, cmpl = await _post(real, "/v1/completions", {
        "model": "smollm2", "prompt": "The capital of France is", "temperature": 0,
        "max_tokens": 8})
    assert raw.response == cmpl["choices"][0]["text"]
    streamed = [c async for c in await client.generate(
        model="smollm2", prompt="The capital of France is", raw=True, stream=True,
        options={"temperature": 0, "num_predict": 8})]
    assert "".join(c.response for c in streamed) == raw.response
    loaded = await client.generate(model="smollm2", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


async def test_options_format_and_an_unlimited_reply(client, real):
    # num_predict -1: no limit but the context, so the reply ends at the model's EOS
    whole = await client.chat(model="smollm2", messages=QUESTION,
                              options={"temperature": 0, "num_predict": -1})
    want = await _chat(real, QUESTION)
    assert want["choices"][0]["finish_reason"] == "stop"
    assert whole.message.content == want["choices"][0]["message"]["content"]
    assert whole.done_reason == "stop"
    penalised = await client.chat(model="smollm2", messages=QUESTION,
                                  options={**GREEDY, "repeat_penalty": 1.3, "top_k": 5})
    want = await _chat(real, QUESTION, max_tokens=12, repetition_penalty=1.3, top_k=5)
    assert penalised.message.content == want["choices"][0]["message"]["content"]
    word = whole.message.content.split()[2]
    cut = await client.chat(model="smollm2", messages=QUESTION,
                            options={"temperature": 0, "stop": [word]})
    assert cut.message.content == whole.message.content[:whole.message.content.index(word)]
    as_json = await client.chat(model="smollm2", messages=QUESTION, format="json",
                                options=GREEDY)
    want = await _chat(real, QUESTION, max_tokens=12,
                       response_format={"type": "json_object"})
    assert as_json.message.content == want["choices"][0]["message"]["content"]
    assert as_json.message.content.startswith("{")


async def test_listing_routes(client, real):
    listed = await client.list()
    assert [m.model for m in listed.models] == ["smollm2"]
    assert [m.model for m in (await client.ps()).models] == ["smollm2"]
    shown = await client.show("smollm2:latest")
    assert shown.capabilities == ["completion"]
    assert shown.modelinfo["llama.context_length"] == real.engine.max_model_len
    async with aiohttp.ClientSession() as s:
        async with s.get(real.base + "/api/version") as resp:
            assert (await resp.json())["version"]
        async with s.head(real.base + "/") as resp:
            assert resp.status == 200


async def test_models_are_not_pulled_or_changed_here(client, real):
    """Tools pull a model before they chat: pulling a served one succeeds at once; another
    is a 404, and pushing, creating, copying or deleting a 400 saying why."""
    assert (await client.pull("smollm2")).status == "success"
    assert [p.status async for p in await client.pull("smollm2:latest", stream=True)] == [
        "success"]
    with pytest.raises(ollama.ResponseError) as info:
        await client.pull("llama3")
    assert info.value.status_code == 404
    for call in (client.delete("smollm2"), client.copy("smollm2", "other")):
        with pytest.raises(ollama.ResponseError) as info:
            await call
        assert info.value.status_code == 400 and "started with" in info.value.error


async def test_bad_requests_are_ollama_errors(client, real):
    for kw, status, words in [
            ({"model": "llama3"}, 404, "model 'llama3' not found"),
            ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400,
             "'images'"),
            ({"options": {"mirostat": 2}}, 400, "'mirostat'"),
            ({"options": {"banana": 1}}, 400, "unknown option 'banana'"),
            ({"options": {"temperature": "hot"}}, 400, "'temperature' must be a number"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
             400, "tool-call format"),
            ({"format": "yaml"}, 400, "'format'")]:
        body = {"model": "smollm2", "messages": QUESTION, "stream": False, **kw}
        got_status, err = await _post(real, "/api/chat", body)
        assert got_status == status and words in err["error"], err
    status, err = await _post(real, "/api/generate", {"model": "smollm2", "prompt": "x",
                                                      "suffix": "y"})
    assert status == 400 and "'suffix'" in err["error"]
    with pytest.raises(ollama.ResponseError) as info:
        await client.chat(model="nope", messages=QUESTION)
    assert info.value.status_code == 404
    ok = await client.chat(model="smollm2", messages=QUESTION,
                           options={"temperature": 0, "num_predict": 2})
    assert ok.eval_count == 2


async def test_a_client_that_leaves_mid_stream_aborts_its_request(client, real):
    finishes = real.engine.finishes.seen
    before = len(finishes)
    async with aiohttp.ClientSession() as s:
        async with s.post(real.base + "/api/generate", json={
                "model": "smollm2", "prompt": "Once upon a time", "raw": True,
                "options": {"num_predict": 1500}}) as resp:
            seen = 0
            async for _ in resp.content:
                seen += 1
                if seen == 3:
                    break
    await asyncio.wait_for(real.engine.wait_idle(), 30.0)
    reason, generated = finishes[before]
    assert reason == "abort" and generated < 1500


async def test_tool_calls_go_both_ways_in_ollamas_shape():
    """Ollama's calls carry their arguments as an object, OpenAI's as JSON text: an assistant
    turn's calls become the chat template's, and the model's calls come back as Ollama's."""
    req = parse_ollama_chat({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_name": "get_weather"}]}, ["m"])
    call = req.messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert req.messages[2] == {"role": "tool", "content": "18 C", "name": "get_weather"}
    assert tool_calls([call]) == [{"function": {"name": "get_weather",
                                                "arguments": {"city": "Paris"}}}]
    assert req.stream and req.params.max_tokens is None      # Ollama's defaults
    with pytest.raises(ProtocolError, match="tool_calls"):
        parse_ollama_chat({"model": "m", "messages": [
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
            ["m"])


async def test_embeddings_are_the_embeddings_routes(client, real):
    texts = ["The capital of France is Paris.", "Colours: red, green, blue."]
    got = await client.embed(model="smollm2", input=texts)
    status, want = await _post(real, "/v1/embeddings", {"model": "smollm2", "input": texts})
    assert status == 200 and len(got.embeddings) == 2
    for vector, item in zip(got.embeddings, want["data"]):
        assert vector == pytest.approx(item["embedding"], abs=1e-6)
    assert got.prompt_eval_count == want["usage"]["prompt_tokens"]
    cut = await client.embed(model="smollm2", input=texts[0], dimensions=8)
    assert len(cut.embeddings[0]) == 8
    legacy = await client.embeddings(model="smollm2", prompt=texts[0])
    status, raw = await _post(real, "/v1/embeddings", {"model": "smollm2", "input": texts[0],
                                                       "normalize": False})
    assert legacy.embedding == pytest.approx(raw["data"][0]["embedding"], abs=1e-5)
    # too long for the context: truncate (Ollama's default) keeps its beginning, else a 400
    long = "word " * (real.engine.max_model_len + 100)
    ids = real.engine.tokenizer.encode(long, True)[:real.engine.max_model_len - 1]
    kept = await client.embed(model="smollm2", input=long)
    status, first = await _post(real, "/v1/embeddings", {"model": "smollm2", "input": ids})
    assert kept.embeddings[0] == pytest.approx(first["data"][0]["embedding"], abs=1e-5)
    status, err = await _post(real, "/api/embed", {"model": "smollm2", "input": long,
                                                   "truncate": False})
    assert status == 400 and err["error"]
