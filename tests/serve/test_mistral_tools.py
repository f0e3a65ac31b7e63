"""tool_choice "auto" for Mistral models, whose calls follow the `[TOOL_CALLS]` token as a JSON
list (tokenizer v3) or as `name{args}` / `name[ARGS]{args}` (v11 on) (serve/mistral_tools.py):
the parser on finished and streamed text (every way of cutting it), Mistral's nine-character
call ids, and the chat route on FakeCore with its template rendering only the user's text (so
the user message decides what the "model" writes), special tokens kept for such requests."""

from __future__ import annotations

import json
import re

import pytest
from tool_replies import NAMES, WEATHER, cut_streams, echoing_reply, post_chat

from ferrobatch.serve.mistral_tools import (
    BOT,
    MistralStream,
    split_calls,
    template_has_mistral_calls,
)
from ferrobatch.serve.openai_protocol import parse_chat
from ferrobatch.serve.responses_protocol import parse_responses
from ferrobatch.serve.tools import parse_tools, template_tool_parser

V3 = BOT + ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
V11 = BOT + 'get_weather{"city": "Paris"}' + BOT + "now{}"
MISTRAL_LIKE = ("{%- if message.tool_calls %}[TOOL_CALLS][{%- for c in message.tool_calls %}"
                "{{ c | tojson }}{%- endfor %}]{%- endif %}{{ messages }}")


def calls_of(text):
    found = split_calls(text, NAMES, complete=True)
    return None if found is None else (found[0], [(c["function"]["name"], json.loads(
        c["function"]["arguments"])) for c in found[1]])


def test_the_template_decides():
    assert template_has_mistral_calls(MISTRAL_LIKE)
    assert template_tool_parser(MISTRAL_LIKE) == "mistral"
    assert template_tool_parser("{{ messages }}") is None


PARIS = ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("text, want", [
    (V3, ("", [PARIS])),
    ("Let me check. " + V3, ("Let me check.", [PARIS])),
    (BOT + '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}]',
     ("", [PARIS, ("now", {"tz": "UTC"})])),
    (BOT + ' {"name": "now", "arguments": {}}', ("", [("now", {})])),      # one object
    (V11, ("", [PARIS, ("now", {})])),
    (BOT + 'get_weather[ARGS]{"city": "Paris"}', ("", [PARIS])),
    (BOT + ' [{"name": "other", "arguments": {}}]', None),                # not a listed tool
    (V3 + " and then some words", None),                                  # text after it
    (BOT + 'get_weather{"city": "Par', None),                             # cut off
    (BOT + "get_weather", None),
    (BOT + "[]", None),
    (BOT, None),
    ("It is sunny in Paris.", None),
    ('[{"name": "get_weather", "arguments": {}}]', None),                 # no [TOOL_CALLS]
])
def test_whole_replies(text, want):
    assert calls_of(text) == want


def test_call_ids_are_mistrals():
    ids = [c["id"] for c in split_calls(V11, NAMES, complete=True)[1]]
    assert len(ids) == 2 and ids[0] != ids[1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)


@pytest.mark.parametrize("reply", [V3, V11, "Sure. " + V3, "Plain answer, no call.",
                                   "[TOOL is not the token", BOT + "{not json", ""])
def test_any_cut_into_pieces_gives_the_whole_replys_answer(reply):
    want = calls_of(reply)
    for sent, rest, calls in cut_streams(lambda: MistralStream(NAMES), reply):
        if want is not None:
            assert sent.strip() == want[0] and rest == ""
            assert [c["function"]["name"] for c in calls] == [n for n, _ in want[1]]
        else:
            assert calls is None and sent + rest == reply


def test_a_plan_for_mistral_keeps_special_tokens():
    body = {"tools": [WEATHER]}
    assert parse_tools(body, "mistral").keeps_special_tokens
    assert not parse_tools(body, "hermes").keeps_special_tokens
    assert not parse_tools({**body, "tool_choice": "required"}, "mistral").keeps_special_tokens
    chat = {"messages": [{"role": "user", "content": "Weather?"}], **body}
    assert parse_chat(chat, "m", tool_parser="mistral").params.skip_special_tokens is False
    assert parse_chat(chat, "m", tool_parser="hermes").params.skip_special_tokens is True
    assert parse_chat({**chat, "skip_special_tokens": True}, "m",
                      tool_parser="mistral").params.skip_special_tokens is True   # the request's
    responses = {"input": "Weather?", "tools": [{"type": "function", "name": "get_weather",
                                                 "parameters": {"type": "object"}}]}
    assert parse_responses(responses, "m", tool_parser="mistral").params.skip_special_tokens \
        is False


def _echoing(r, content):
    return echoing_reply(r, content, MISTRAL_LIKE, [WEATHER])


async def test_auto_on_the_chat_route_whole_and_streamed(fake_server):
    status, body = await post_chat(fake_server, _echoing(fake_server, "Checking. " + V3))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    call = choice["message"]["tool_calls"][0]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    two = BOT + 'get_weather{"city": "Paris"}' + BOT + 'get_weather[ARGS]{"city": "Rome"}'
    status, events = await post_chat(fake_server, {**_echoing(fake_server, two), "stream": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                       {"city": "Rome"}]
    assert events[-1]["choices"][-1]["finish_reason"] == "tool_calls"
    status, body = await post_chat(fake_server, _echoing(fake_server, "Sunny, 21 C."))
    assert body["choices"][0]["message"]["content"] == "Sunny, 21 C."
    assert body["choices"][0]["finish_reason"] == "stop"
