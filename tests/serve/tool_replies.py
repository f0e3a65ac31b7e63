"""FakeCore as a model that writes a reply the test chooses, for the tool-call parsers' route
tests: FakeCore echoes its rendered prompt, and the chat template set here renders the user's
text alone, so the user message is the "model's" reply (ending at the EOS character, as a model
stops by itself)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp

EOS_CHAR = "\x03"
# the tool the parser tests offer, and the names their replies call (one of them not offered)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}
NAMES = ("get_weather", "now")


def echoing_reply(r: Any, reply: str, chat_template: str, tools: list[dict]) -> dict:
    """A chat body whose output on `r`'s FakeCore server is `reply`, the model's template
    (`chat_template`, which decides the tool-call format) in place."""
    tok = r.engine.tokenizer
    tok.chat_template = chat_template
    tok.apply_chat_template = lambda messages, add_generation_prompt=True, **extra: \
        messages[-1]["content"]
    return {"messages": [{"role": "user", "content": reply + EOS_CHAR}], "tools": tools,
            "max_tokens": 140}


def cut_streams(make_stream: Callable[[], Any], reply: str,
                tries: int = 30) -> Iterator[tuple[str, str, Any]]:
    """(the deltas sent, joined; what `finish` still sends; the calls) of `tries` streams of
    `reply`, each fed in random pieces of 1..5 characters (seeded by the reply's length)."""
    rng = random.Random(len(reply))
    for _ in range(tries):
        stream, sent, at = make_stream(), [], 0
        while at < len(reply):
            step = rng.randint(1, 5)
            sent.append(stream.feed(reply[at:at + step]))
            at += step
        rest, calls = stream.finish(complete=True)
        yield "".join(sent), rest, calls


async def check_auto_route(r: Any, chat_template: str, call: str) -> dict:
    """tool_choice "auto" on `r`'s chat route with the model's `chat_template`: a reply that
    is `call` (get_weather for Paris) comes back as tool_calls, whole and streamed; a plain
    reply as content. Returns the plain reply's body."""
    def echoing(content):
        return echoing_reply(r, content, chat_template, [WEATHER])

    status, body = await post_chat(r, echoing(call))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == \
        {"city": "Paris"}
    status, events = await post_chat(r, {**echoing(call), "stream": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert events[-1]["choices"][-1]["finish_reason"] == "tool_calls"
    status, body = await post_chat(r, echoing("Sunny, 21 C."))
    assert body["choices"][0]["message"]["content"] == "Sunny, 21 C."
    return body


async def post_chat(r: Any, body: dict) -> tuple[int, Any]:
    """(status, the response's JSON), or with `stream` (status, every chunk's JSON)."""
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + "/v1/chat/completions", json=body) as resp:
            if not body.get("stream"):
                return resp.status, await resp.json()
            return resp.status, [json.loads(line[6:]) async for line in resp.content
                                 if line.startswith(b"data: {")]
