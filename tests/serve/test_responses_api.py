"""`POST /v1/responses` on FakeCore (which echoes its rendered prompt `<role>content\\n...`
`<assistant>`, so the output is known), through the `openai` SDK: its typed objects and its
stream helper (which checks the events' order) are the oracle for the wire shapes."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.responses_protocol import parse_responses

EOS = "\x03"        # FakeCore's end of sequence: the output stops there, as a model does


@pytest.fixture
async def client(fake_server):
    c = openai.AsyncOpenAI(base_url=fake_server.base + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def raw_post(r, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + "/v1/responses", json=body) as resp:
            return resp.status, await resp.json()


async def test_create_returns_a_response_object(fake_server, client):
    resp = await client.responses.create(model="fake", input="hello", max_output_tokens=7)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "<user>h"                   # the echo, cut at 7 tokens
    prompt = "<user>hello\n<assistant>"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (len(prompt), 7)
    assert resp.usage.total_tokens == len(prompt) + 7
    # ended by the model: completed; the raw JSON validates against the SDK's model (every
    # field it requires is there, of its type)
    status, body = await raw_post(fake_server, {"input": "hi" + EOS, "metadata": {"k": "v"}})
    assert status == 200
    strict = Response.model_validate(body)
    assert strict.status == "completed" and strict.incomplete_details is None
    assert strict.output_text == "<user>hi" and body["metadata"] == {"k": "v"}
    assert body["output"][0]["status"] == "completed" and body["output"][0]["role"] == "assistant"


async def test_instructions_and_message_list_render_through_the_template(client):
    resp = await client.responses.create(
        model="fake", instructions="Be brief.", max_output_tokens=150,
        input=[{"role": "user", "content": "q1"},
               {"role": "assistant", "content": [{"type": "output_text", "text": "a1"}]},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "q2"},
                            {"type": "input_text", "text": "more" + EOS}]}])
    assert resp.output_text == "<system>Be brief.\n<user>q1\n<assistant>a1\n<user>q2\nmore"
    assert resp.status == "completed"


async def test_stream_events_in_order(client):
    kinds, deltas = [], []
    async with client.responses.stream(model="fake", input="abc" + EOS) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    assert "".join(deltas) == "<user>abc" == final.output_text
    assert final.status == "completed" and final.usage.output_tokens == len("<user>abc") + 1


async def test_stream_cut_by_max_output_tokens_ends_incomplete(fake_server):
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/responses", json={
                "input": "hello", "max_output_tokens": 5, "stream": True}) as resp:
            raw = (await resp.read()).decode()
    events = [b for b in raw.split("\n\n") if b]
    kinds = [b.split("\n")[0].removeprefix("event: ") for b in events]
    datas = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in events]
    assert kinds[-1] == "response.incomplete" and "[DONE]" not in raw
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert all(d["type"] == k for d, k in zip(datas, kinds))
    event = TypeAdapter(ResponseStreamEvent)
    for d in datas:                        # every event validates against the SDK's union
        assert event.validate_python(d).type == d["type"]
    assert datas[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert datas[-1]["response"]["output"][0]["content"][0]["text"] == "<user"


@pytest.mark.parametrize("fake_server", [{"core": {"step_delay_s": 0.02}}], indirect=True)
async def test_a_client_that_leaves_mid_stream_aborts_its_request(fake_server):
    engine = fake_server.engine
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/responses", json={
                "input": "x", "max_output_tokens": 200, "stream": True}) as resp:
            async for line in resp.content:
                if b"output_text.delta" in line:
                    break                       # one token seen: leave
    await engine.check_idle_clean(5.0)
    assert engine.counters["abort"] == 1


@pytest.mark.parametrize("body, param, status", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", 400),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice", 400),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", 400),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]},
     "input", 400),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", 400),
    ({"input": "x", "background": True}, "background", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", 400),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", 400),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", 400),
    ({"input": ""}, "input", 400),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", 400),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", 400),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", 400),
    ({"input": "x", "top_logprobs": 21, "include": ["message.output_text.logprobs"]},
     "top_logprobs", 400),
    ({"input": "x", "max_output_tokens": 0}, "max_tokens", 400),
    ({"input": "x", "model": "other"}, "model", 404),
])
async def test_what_cannot_be_served_is_refused_by_name(fake_server, body, param, status):
    got, err = await raw_post(fake_server, body)
    assert got == status and err["error"]["param"] == param, err
    assert err["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_text_format_becomes_guided_decoding():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_responses({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}}, "m")
    assert req.params.guided_json == schema
    assert req.echo["text"]["format"]["name"] == "thing"
    req = parse_responses({"input": "x", "text": {"format": {"type": "json_object"}}}, "m")
    assert req.params.guided_json == {"type": "object"}
    req = parse_responses({"input": "x", "temperature": 0, "top_p": 0.5, "top_k": 3}, "m")
    assert (req.params.temperature, req.params.top_p, req.params.top_k) == (0.0, 0.5, 3)
    assert req.params.max_tokens is None                  # the context's room, as chat
    with pytest.raises(ProtocolError, match="metadata"):
        parse_responses({"input": "x", "metadata": {"k": 1}}, "m")


async def test_concurrent_responses_do_not_mix(client):
    outs = await asyncio.gather(*(client.responses.create(
        model="fake", input=f"n{i}" + EOS) for i in range(8)))
    assert [o.output_text for o in outs] == [f"<user>n{i}" for i in range(8)]
    assert len({o.id for o in outs}) == 8


# -- function tools --------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TEMPLATE = "{{ tools }} answer with <tool_call>{...}</tool_call>"


def test_tool_turns_become_chat_messages_and_forced_choices_guide():
    req = parse_responses({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                               "name": "get_weather"},
                           "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]}]}, "m")
    assert req.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    assert req.tools.mode == "named" and req.params.guided_json == WEATHER["parameters"]
    assert req.chat_options["tools"][0]["function"]["name"] == "get_weather"
    assert req.echo["tools"] == [WEATHER] and req.echo["tool_choice"]["name"] == "get_weather"
    with pytest.raises(ProtocolError, match="text.format"):
        parse_responses({"input": "x", "tools": [WEATHER], "tool_choice": "required",
                         "text": {"format": {"type": "json_object"}}}, "m")
    auto = parse_responses({"input": "x", "tools": [WEATHER]}, "m", tool_parser="hermes")
    assert auto.tools.mode == "auto" and auto.params.guided_json is None


async def test_auto_calls_as_function_call_items(fake_server, client):
    fake_server.engine.tokenizer.chat_template = HERMES_TEMPLATE
    resp = await client.responses.create(model="fake", tools=[WEATHER],
                                         input="Sure." + CALL + EOS, max_output_tokens=150)
    assert resp.status == "completed"
    assert [o.type for o in resp.output] == ["message", "function_call"]
    assert resp.output_text == "<user>Sure."
    call = resp.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    # no block: a plain message, no call
    resp = await client.responses.create(model="fake", tools=[WEATHER], input=[
        {"role": "user", "content": "x"}], instructions=None, max_output_tokens=150)
    assert [o.type for o in resp.output] == ["message"]     # plain text: no call


async def test_auto_calls_stream_as_items(fake_server, client):
    fake_server.engine.tokenizer.chat_template = HERMES_TEMPLATE
    kinds = []
    async with client.responses.stream(model="fake", tools=[WEATHER],
                                       input="Sure." + CALL + EOS) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-8:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.output_item.added",
                          "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert final.output_text == "<user>Sure."
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    # the same on the wire: every event validates against the SDK's union, in order
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/responses", json={
                "tools": [WEATHER], "input": "Sure." + CALL + EOS, "stream": True}) as resp:
            raw = (await resp.read()).decode()
    datas = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in raw.split("\n\n")
             if b]
    event = TypeAdapter(ResponseStreamEvent)
    assert [event.validate_python(d).sequence_number for d in datas] == list(range(len(datas)))
    added = [d for d in datas if d["type"] == "response.output_item.added"]
    assert [d["output_index"] for d in added] == [0, 1]
    assert added[1]["item"]["type"] == "function_call" and added[1]["item"]["arguments"] == ""


async def test_stored_responses_are_a_clear_404(client):
    resp = await client.responses.create(model="fake", input="hi" + EOS)
    for call in (client.responses.retrieve(resp.id), client.responses.delete(resp.id),
                 client.responses.cancel(resp.id)):
        with pytest.raises(openai.NotFoundError, match="not stored"):
            await call


async def test_logprobs_through_include(fake_server):
    body = {"input": "hello" + EOS, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2}
    status, resp = await raw_post(fake_server, body)
    assert status == 200
    part = Response.model_validate(resp).output[0].content[0]
    # one entry per generated token, the end-of-sequence one included (as chat's logprobs)
    assert len(part.logprobs) == resp["usage"]["output_tokens"]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs).startswith(part.text)
    # streamed: each delta carries its tokens' entries, the done events all of them
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/responses",
                          json={**body, "stream": True}) as r:
            raw = (await r.read()).decode()
    datas = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in raw.split("\n\n")
             if b]
    event = TypeAdapter(ResponseStreamEvent)
    for d in datas:
        event.validate_python(d)
    streamed = [x for d in datas if d["type"] == "response.output_text.delta"
                for x in d["logprobs"]]
    done = next(d for d in datas if d["type"] == "response.output_text.done")
    final = datas[-1]["response"]["output"][0]["content"][0]
    assert streamed == done["logprobs"] == final["logprobs"] == resp["output"][0]["content"][0][
        "logprobs"]


# -- the response store (serve --enable-response-store) ------------------------------------

STORE = pytest.mark.parametrize("fake_server", [{"response_store": 4}], indirect=True)


@STORE
async def test_previous_response_id_continues_the_stored_conversation(client):
    """The echo shows what the model was given: the stored turns (the first response's input
    and output) before the new input; the first response's instructions do not carry over,
    the new request's lead."""
    first = await client.responses.create(model="fake", input="q1", instructions="Be brief.",
                                          max_output_tokens=3)
    assert first.output_text == "<sy" and first.store is True
    second = await client.responses.create(model="fake", input="q2" + EOS,
                                           previous_response_id=first.id,
                                           max_output_tokens=100)
    assert second.output_text == "<user>q1\n<assistant><sy\n<user>q2"
    assert second.previous_response_id == first.id
    third = await client.responses.create(model="fake", input="q3" + EOS, instructions="New.",
                                          previous_response_id=second.id,
                                          max_output_tokens=100)
    # (the echo stops at q2's end-of-sequence mark, before the second response's turn)
    assert third.output_text == "<system>New.\n<user>q1\n<assistant><sy\n<user>q2"
    got = await client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


@STORE
async def test_a_streamed_response_is_stored_too(client):
    async with client.responses.stream(model="fake", input="hi" + EOS) as stream:
        final = await stream.get_final_response()
    got = await client.responses.retrieve(final.id)
    assert got.output_text == final.output_text == "<user>hi"


@STORE
async def test_store_false_delete_cancel_and_eviction(client):
    kept = await client.responses.create(model="fake", input="a" + EOS)
    unkept = await client.responses.create(model="fake", input="b" + EOS, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError, match="not stored"):
        await client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        await client.responses.cancel(kept.id)
    await client.responses.delete(kept.id)
    for call in (client.responses.retrieve(kept.id), client.responses.create(
            model="fake", input="c", previous_response_id=kept.id)):
        with pytest.raises(openai.NotFoundError, match="not"):
            await call
    ids = [(await client.responses.create(model="fake", input=f"{i}" + EOS)).id
           for i in range(5)]                  # a store of 4: the first goes
    with pytest.raises(openai.NotFoundError, match="keeps the last 4"):
        await client.responses.retrieve(ids[0])
    assert (await client.responses.retrieve(ids[4])).id == ids[4]


@STORE
async def test_input_items_list_what_the_input_held_a_page_at_a_time(client):
    """`GET /v1/responses/{id}/input_items` (the SDK's `responses.input_items.list`): the
    input's messages, function calls and outputs as typed items, the last first by default,
    paged with `limit` / `after` (the SDK follows the cursor)."""
    one = await client.responses.create(model="fake", input="hi" + EOS)
    items = [item async for item in client.responses.input_items.list(one.id)]
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", "user", "hi" + EOS)]
    given = [{"role": "system", "content": "Be brief."},
             {"type": "message", "role": "user", "id": "msg_mine",
              "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
             {"role": "assistant", "content": "It is 21 C."},
             {"role": "user", "content": "thanks" + EOS}]
    many = await client.responses.create(model="fake", input=given, max_output_tokens=2)
    newest_first = [item async for item in client.responses.input_items.list(many.id,
                                                                               limit=2)]
    assert [i.type for i in newest_first] == ["message", "message", "function_call_output",
                                              "function_call", "message", "message"]
    oldest_first = [item async for item in client.responses.input_items.list(
        many.id, order="asc")]
    assert [i.id for i in oldest_first] == [i.id for i in newest_first][::-1]
    assert oldest_first[1].id == "msg_mine" and oldest_first[2].name == "get_weather"
    assert oldest_first[3].output == "21 C" and oldest_first[4].role == "assistant"
    assert oldest_first[4].content[0].type == "output_text"
    page = await client.responses.input_items.list(many.id, order="asc", limit=2,
                                                    after="msg_mine")
    assert [i.id for i in page.data] == [oldest_first[2].id, oldest_first[3].id]
    assert page.has_more is True
    with pytest.raises(openai.BadRequestError, match="names no input item"):
        await client.responses.input_items.list(many.id, after="msg_nope")
    with pytest.raises(openai.BadRequestError, match="'limit'"):
        await client.responses.input_items.list(many.id, limit=101)
    with pytest.raises(openai.NotFoundError):
        await client.responses.input_items.list("resp_unknown")


async def test_without_a_store_previous_response_id_says_how_to_get_one(fake_server):
    status, body = await raw_post(fake_server, {"input": "x", "previous_response_id": "r"})
    assert status == 400 and "--enable-response-store" in body["error"]["message"]
    status, body = await raw_post(fake_server, {"input": "x" + EOS})
    assert status == 200 and body["store"] is False


def test_a_stored_function_call_and_its_output_make_the_next_turn():
    """The stored assistant turn keeps its tool calls; the next input's function_call_output
    becomes the tool message after it; storing never lets a later request change the stored
    conversation."""
    from ferrobatch.serve.response_store import ResponseStore, assistant_turn

    store = ResponseStore(2)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    store.put({"id": "resp_a"}, conversation + [assistant_turn("", [call])])
    body = {"previous_response_id": "resp_a", "instructions": "Use tools.",
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
                      {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                       "arguments": "{}"}]}
    req = parse_responses(body, "m", store=store)
    assert req.messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]}]
    assert req.conversation == req.messages[1:] and req.store
    assert store.get("resp_a").conversation[-1] == {"role": "assistant", "content": "",
                                                    "tool_calls": [call]}
    with pytest.raises(ProtocolError, match="not found") as err:
        parse_responses({**body, "previous_response_id": "resp_zz"}, "m", store=store)
    assert err.value.code == 404
    with pytest.raises(ProtocolError, match="'store' must be a boolean"):
        parse_responses({"input": "x", "store": "yes"}, "m", store=store)
