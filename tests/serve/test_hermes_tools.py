"""tool_choice "auto" for models that write Hermes `<tool_call>` blocks (serve/hermes_tools.py):
the parser on finished and streamed text, and the chat route on FakeCore (which echoes its
prompt, so the user message decides what the "model" writes)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from tool_replies import NAMES, WEATHER

from ferrobatch.serve.hermes_tools import (
    OPEN,
    HermesStream,
    split_calls,
    template_has_hermes_calls,
)
from ferrobatch.serve.openai_protocol import parse_chat
from ferrobatch.serve.protocol import ProtocolError

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN_LIKE = ("{%- if tools %}<tools>{{ tools }}</tools> For each function call, return "
             "<tool_call>{...}</tool_call>{%- endif %}")


def args(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_the_template_decides():
    assert template_has_hermes_calls(QWEN_LIKE)
    assert not template_has_hermes_calls("{{ messages }}") and not template_has_hermes_calls(None)
    msgs = [{"role": "user", "content": "hi"}]
    req = parse_chat({"messages": msgs, "tools": [WEATHER]}, "m", tool_parser="hermes")
    assert req.tools.mode == "auto" and not req.tools.forced
    assert req.params.guided_json is None                 # the output is the model's own
    assert req.chat_template["tools"] == [WEATHER]        # ... and the template sees the tools
    req = parse_chat({"messages": msgs, "tools": [WEATHER], "tool_choice": "auto",
                      "response_format": {"type": "json_object"}}, "m", tool_parser="hermes")
    assert req.tools.mode == "auto"                       # no clash: nothing is forced
    with pytest.raises(ProtocolError,
                       match="no <tool_call> blocks, Llama 3 JSON calls or \\[TOOL_CALLS\\]"):
        parse_chat({"messages": msgs, "tools": [WEATHER]}, "m")


def test_split_calls_on_finished_text():
    content, calls = split_calls("Let me check.\n" + CALL, NAMES, complete=True)
    assert content == "Let me check." and [args(c) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    two = CALL + "\n" + '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>\n'
    assert [args(c) for c in split_calls(two, NAMES, True)[1]] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    # the model ended right after the JSON without closing the block: a call when it stopped
    # by itself, not when max_tokens cut it
    open_ended = CALL[:-len("</tool_call>")]
    assert split_calls(open_ended, NAMES, complete=True)[1]
    assert split_calls(open_ended, NAMES, complete=False) is None
    for not_calls in ("no tools needed", CALL.replace("get_weather", "rm_rf"),
                      CALL.replace('"arguments"', '"args": 1, "arguments": [1], "x"'),
                      CALL + " and then some text", "<tool_call>{\"name\": \"now\"",
                      CALL.replace("{\"city\": \"Paris\"}", "[1, 2]")):
        assert split_calls(not_calls, NAMES, complete=True) is None, not_calls
    assert split_calls('<tool_call>{"name": "now"}</tool_call>', NAMES, True)[1]   # no args


@pytest.mark.parametrize("pieces", [
    ["Let me ", "check.\n", CALL],                       # the block in one delta
    list("Let me check.\n" + CALL),                      # character by character
    ["Let me check.\n<tool", "_call>\n{\"name\": \"get_weather\", \"arguments\": ",
     "{\"city\": \"Paris\"}}\n</tool_call>"],
])
def test_stream_passes_text_through_and_holds_the_block(pieces):
    parser = HermesStream(NAMES)
    sent = "".join(parser.feed(p) for p in pieces)
    assert sent == "Let me check.\n"                      # never a piece of the block
    rest, calls = parser.finish(complete=True)
    assert rest == "" and [args(c) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_stream_releases_a_false_start_and_a_bad_block():
    parser = HermesStream(NAMES)
    assert parser.feed("a <tool") == "a "                 # may still become a block: held
    assert parser.feed("box> b") == "<toolbox> b"         # it did not
    assert parser.finish(complete=True) == ("", None)
    parser = HermesStream(NAMES)
    assert parser.feed("x " + CALL.replace("get_weather", "nope")) == "x "
    rest, calls = parser.finish(complete=True)            # not a call: the text, as written
    assert calls is None and rest == CALL.replace("get_weather", "nope")


# -- the chat route on FakeCore -------------------------------------------------------------------

async def chat(r, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + "/v1/chat/completions", json=body) as resp:
            if not body.get("stream"):
                return resp.status, await resp.json()
            events = []
            async for line in resp.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
            return resp.status, events


def echoing(r, content):
    """The request FakeCore answers with `<user>` + `content` (it echoes the rendered prompt),
    ending at the EOS character as a model stops by itself."""
    r.engine.tokenizer.chat_template = QWEN_LIKE       # this "model" writes Hermes blocks
    return {"messages": [{"role": "user", "content": content + "\x03"}], "tools": [WEATHER],
            "max_tokens": 140}


async def test_auto_tool_call_non_streaming(fake_server):
    status, body = await chat(fake_server, echoing(fake_server, "Sure." + CALL))
    assert status == 200, body
    c = body["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    assert c["message"]["content"] == "<user>Sure."      # what came before the block
    assert [args(x) for x in c["message"]["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    # no block: a plain answer, finish "stop"
    status, body = await chat(fake_server, echoing(fake_server, "It is sunny."))
    c = body["choices"][0]
    assert c["finish_reason"] == "stop" and c["message"] == {"role": "assistant",
                                                             "content": "<user>It is sunny."}


async def test_auto_tool_call_streaming(fake_server):
    status, events = await chat(fake_server, {**echoing(fake_server, "Sure." + CALL),
                                              "stream": True})
    assert status == 200
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "<user>Sure." and OPEN not in content
    calls = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert args(calls[0][0]) == ("get_weather", {"city": "Paris"})
    finishes = [e["choices"][0]["finish_reason"] for e in events
                if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]
    # the finish comes in a chunk of its own, after the calls (the SDK closes a call there)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not events[-1]["choices"][0]["delta"].get("tool_calls")


async def test_auto_without_a_hermes_template_is_still_a_400(fake_server):
    status, body = await chat(fake_server, {"messages": [{"role": "user", "content": "x"}],
                                            "tools": [WEATHER]})
    assert status == 400 and "tool_choice 'auto'" in body["error"]["message"]


async def test_auto_streaming_keeps_every_token_logprob(fake_server):
    """Each token's logprob goes out once: with its text's chunk, or with the calls."""
    status, events = await chat(fake_server, {
        **echoing(fake_server, "Sure." + CALL), "stream": True, "logprobs": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    entries = [x for e in events for c in e["choices"] if c.get("logprobs")
               for x in c["logprobs"]["content"]]
    assert len(entries) == events[-1]["usage"]["completion_tokens"]
    assert "".join(x["token"] for x in entries).startswith("<user>Sure." + OPEN)


def test_a_calls_chunk_keeps_the_text_that_came_with_it():
    """The last delta may hold both the end of the text and the block: the chunk carries both."""
    from ferrobatch.serve.openai_protocol import choice
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                      "stream": True}, "m", tool_parser="hermes")
    _, calls = split_calls("Sure." + CALL, NAMES, complete=True)
    c = choice(req, 0, "Sure.", None, stream=True, tool_calls=calls)
    assert c["delta"]["content"] == "Sure." and c["delta"]["tool_calls"][0]["index"] == 0
    assert "content" not in choice(req, 0, "", None, stream=True, tool_calls=calls)["delta"]


async def test_auto_tool_calls_on_the_anthropic_and_ollama_doors(fake_server):
    """The same model's own call on `/v1/messages` (a `tool_use` block after the text, whole
    and streamed as Anthropic's events) and on Ollama's `/api/chat` (its `tool_calls`, the
    arguments an object)."""
    body = echoing(fake_server, "Sure." + CALL)
    fn = WEATHER["function"]
    anthropic_body = {"model": "fake", "max_tokens": 140, "messages": body["messages"],
                      "tools": [{"name": fn["name"], "description": fn.get("description", ""),
                                 "input_schema": fn["parameters"]}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/messages", json=anthropic_body) as resp:
            message = await resp.json()
        async with s.post(fake_server.base + "/v1/messages",
                          json={**anthropic_body, "stream": True}) as resp:
            raw = (await resp.read()).decode()
        async with s.post(fake_server.base + "/api/chat", json={
                "model": "fake", "messages": body["messages"], "tools": body["tools"],
                "stream": False, "options": {"num_predict": 140}}) as resp:
            ollama = await resp.json()
    assert message["stop_reason"] == "tool_use", message
    assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
    assert message["content"][0]["text"] == "<user>Sure."
    assert (message["content"][1]["name"], message["content"][1]["input"]) == (
        "get_weather", {"city": "Paris"})
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in raw.split("\n\n") if block]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "input_json_delta")
    assert text == "<user>Sure." and OPEN not in text
    assert json.loads(partial) == {"city": "Paris"}
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == [
        "tool_use"]
    assert ollama["message"]["content"] == "<user>Sure."
    assert ollama["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
