"""Anthropic's Messages API on the real SmolLM2 (CPU, one server for the module), driven by the
`anthropic` SDK: `/v1/messages` answers what `/v1/chat/completions` answers for the same
conversation (that route is checked against transformers elsewhere), streamed or whole, with
stop sequences, forced tool uses and their results, a continued assistant turn; token counts
agree; bad requests are Anthropic's errors naming the field; a client that leaves aborts its
request; after every test the engine is idle with every block free."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio
from serve_support import start_watched, stop_server

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"temperature": 0}          # (the SDK no longer takes temperature as an argument)
QUESTION = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real(loaded_smollm2):
    r = await start_watched(loaded_smollm2, served_model_name="smollm2")
    yield r
    await stop_server(r)


@pytest_asyncio.fixture(loop_scope="module")
async def client(real):
    c = anthropic.AsyncAnthropic(base_url=real.base, api_key="unused", max_retries=0)
    yield c
    await c.close()
    await real.engine.check_idle_clean(10.0)


async def _chat(real, messages, **fields) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(real.base + "/v1/chat/completions", json={
                "model": "smollm2", "messages": messages, "temperature": 0, **fields}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


async def test_a_message_answers_what_chat_answers(client, real):
    got = await client.messages.create(model="smollm2", max_tokens=12, system="Be brief.",
                                       messages=QUESTION, extra_body=GREEDY)
    want = await _chat(real, [{"role": "system", "content": "Be brief."}] + QUESTION,
                       max_tokens=12)
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want["choices"][0]["message"]["content"]
    assert got.id.startswith("msg_") and got.model == "smollm2" and got.role == "assistant"
    assert got.stop_reason == "max_tokens" and got.stop_sequence is None
    assert _prompt_tokens(got.usage) == want["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == 12


async def test_a_reply_that_ends_is_an_end_turn(client, real):
    got = await client.messages.create(model="smollm2", max_tokens=200, messages=QUESTION,
                                       extra_body=GREEDY)
    want = await _chat(real, QUESTION, max_tokens=200)
    assert want["choices"][0]["finish_reason"] == "stop"       # the model's EOS
    assert got.stop_reason == "end_turn"
    assert got.content[0].text == want["choices"][0]["message"]["content"]


async def test_a_stream_rebuilds_the_whole_reply(client, real):
    whole = await client.messages.create(model="smollm2", max_tokens=16, messages=QUESTION,
                                         extra_body=GREEDY)
    kinds = []
    async with client.messages.stream(model="smollm2", max_tokens=16, messages=QUESTION,
                                      extra_body=GREEDY) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert kinds.count("content_block_delta") >= 2
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)


async def test_stop_sequences(client, real):
    whole = await client.messages.create(model="smollm2", max_tokens=16, messages=QUESTION,
                                         extra_body=GREEDY)
    word = whole.content[0].text.split()[2]
    cut = await client.messages.create(model="smollm2", max_tokens=16, messages=QUESTION,
                                       stop_sequences=[word], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == whole.content[0].text[:whole.content[0].text.index(word)]


async def test_a_forced_tool_use_and_its_result(client, real):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    got = await client.messages.create(model="smollm2", max_tokens=40, messages=ask,
                                       tools=[WEATHER],
                                       tool_choice={"type": "tool", "name": "get_weather"},
                                       extra_body=GREEDY)
    assert got.stop_reason == "tool_use"
    (use,) = [b for b in got.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    assert use.id.startswith("toolu_")
    async with client.messages.stream(model="smollm2", max_tokens=40, messages=ask,
                                      tools=[WEATHER], tool_choice={"type": "any"},
                                      extra_body=GREEDY) as stream:
        streamed = await stream.get_final_message()
    (suse,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (suse.name, suse.input) == (use.name, use.input) and streamed.stop_reason == "tool_use"
    # the next turn: the tool's result goes back; the reply is the chat route's for the same
    # conversation in OpenAI's shape
    follow = ask + [{"role": "assistant", "content": [use.model_dump(include={
        "type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 C and sunny"}]}]
    reply = await client.messages.create(model="smollm2", max_tokens=12, messages=follow,
                                         tools=[WEATHER], tool_choice={"type": "none"},
                                         extra_body=GREEDY)
    import json
    want = await _chat(real, ask + [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": use.id, "type": "function", "function": {
                "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C and sunny"}], max_tokens=12)
    assert reply.content[0].text == want["choices"][0]["message"]["content"]
    assert _prompt_tokens(reply.usage) == want["usage"]["prompt_tokens"]


async def test_a_last_assistant_turn_is_continued(client, real):
    start = "The three colours are"
    got = await client.messages.create(
        model="smollm2", max_tokens=8, extra_body=GREEDY,
        messages=QUESTION + [{"role": "assistant", "content": start}])
    want = await _chat(real, QUESTION + [{"role": "assistant", "content": start}],
                       max_tokens=8, continue_final_message=True, add_generation_prompt=False)
    assert got.content[0].text == want["choices"][0]["message"]["content"]


async def test_count_tokens_is_the_prompt_a_message_takes(client, real):
    for kw in ({"messages": QUESTION, "system": "Be brief."},
               {"messages": QUESTION, "tools": [WEATHER], "tool_choice": {"type": "any"}}):
        counted = await client.messages.count_tokens(model="smollm2", **kw)
        got = await client.messages.create(model="smollm2", max_tokens=1, extra_body=GREEDY,
                                           **kw)
        assert counted.input_tokens == _prompt_tokens(got.usage) > 0


async def test_bad_requests_are_anthropic_errors_naming_the_field(client, real):
    for kw, error, words in [
            ({"max_tokens": 0}, anthropic.BadRequestError, "'max_tokens' is required"),
            ({"model": "claude-opus"}, anthropic.NotFoundError, "does not exist"),
            ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
             anthropic.BadRequestError, "type 'image'"),
            ({"messages": [{"role": "system", "content": "x"}]}, anthropic.BadRequestError,
             "'system'"),
            ({"tools": [WEATHER]}, anthropic.BadRequestError, "tool-call format"),
            ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
              "tool_choice": {"type": "any"}}, anthropic.BadRequestError, "custom tools"),
            ({"extra_body": {"mcp_servers": [{"url": "x"}]}}, anthropic.BadRequestError,
             "mcp_servers")]:
        args = {"model": "smollm2", "max_tokens": 4, "messages": QUESTION, **kw}
        with pytest.raises(error) as info:
            await client.messages.create(**args)
        assert info.value.body["type"] == "error", info.value.body
        assert words in info.value.body["error"]["message"]
    ok = await client.messages.create(model="smollm2", max_tokens=2, messages=QUESTION,
                                      extra_body=GREEDY)
    assert ok.usage.output_tokens == 2


async def test_a_client_that_leaves_mid_stream_aborts_its_request(client, real):
    finishes = real.engine.finishes.seen
    before = len(finishes)
    async with client.messages.stream(model="smollm2", max_tokens=1500, messages=[
            {"role": "user", "content": "Tell me a long story."}],
            extra_body={"ignore_eos": True}) as stream:
        seen = 0
        async for event in stream:
            seen += event.type == "content_block_delta"
            if seen == 3:
                break
    await asyncio.wait_for(real.engine.wait_idle(), 30.0)
    reason, generated = finishes[before]
    assert reason == "abort" and generated < 1500


async def test_models_in_anthropics_shape(client, real):
    """The SDK's `models.list` / `retrieve` (it sends `anthropic-version`): Anthropic's shape;
    the OpenAI SDK's requests keep OpenAI's."""
    listed = [m async for m in client.models.list()]
    assert [(m.id, m.type) for m in listed] == [("smollm2", "model")]
    one = await client.models.retrieve("smollm2")
    assert one.id == "smollm2" and one.display_name == "smollm2" and one.created_at.year >= 2026
    status, plain = await _get(real, "/v1/models")
    assert status == 200 and plain["object"] == "list" and plain["data"][0]["object"] == "model"


async def _get(real, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(real.base + path) as resp:
            return resp.status, await resp.json()

