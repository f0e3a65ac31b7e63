"""tool_choice "auto" for Llama 3 models, whose calls are the whole reply as JSON
(serve/llama3_tools.py): the parser on finished and streamed text (every way of cutting it),
and the chat route on FakeCore with its template rendering only the user's text (so the user
message decides what the "model" writes)."""

from __future__ import annotations

import json

import pytest
from tool_replies import NAMES, check_auto_route, cut_streams

from ferrobatch.serve.llama3_tools import (
    PYTHON_TAG,
    Llama3Stream,
    split_calls,
    template_has_llama3_calls,
)
from ferrobatch.serve.tools import template_tool_parser

CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_LIKE = ('Respond in the format {"name": function name, "parameters": dictionary of '
              'argument name and its value}. Do not use variables. {{ messages }}')


def calls_of(text):
    found = split_calls(text, NAMES, complete=True)
    return None if found is None else [(c["function"]["name"], json.loads(c["function"][
        "arguments"])) for c in found[1]]


def test_the_template_decides():
    assert template_has_llama3_calls(LLAMA_LIKE) and template_tool_parser(LLAMA_LIKE) == \
        "llama3_json"
    assert template_tool_parser("<tool_call>x</tool_call>") == "hermes"
    assert template_tool_parser("{{ messages }}") is None and template_tool_parser(None) is None


@pytest.mark.parametrize("text, want", [
    (CALL, [("get_weather", {"city": "Paris"})]),
    ("  " + PYTHON_TAG + CALL + "\n", [("get_weather", {"city": "Paris"})]),
    (CALL + "; " + '{"name": "now", "arguments": {}}', [("get_weather", {"city": "Paris"}),
                                                         ("now", {})]),
    ('{"name": "now", "parameters": "{\\"tz\\": \\"UTC\\"}"}', [("now", {"tz": "UTC"})]),
    ('{"name": "other", "parameters": {}}', None),          # not a listed tool
    (CALL + " and some words", None),                       # text after the call
    ('{"name": "now", "parameters": {', None),              # cut off
    ("It is sunny in Paris.", None),
    ("", None),
])
def test_whole_replies(text, want):
    assert calls_of(text) == want


@pytest.mark.parametrize("reply", [CALL, PYTHON_TAG + CALL, " \n" + CALL + ";" + CALL,
                                   "Plain answer, no call.", "<|pyramid|> is not the tag",
                                   "{not json at all", ""])
def test_any_cut_into_pieces_gives_the_whole_replys_answer(reply):
    want = calls_of(reply)
    for sent, rest, calls in cut_streams(lambda: Llama3Stream(NAMES), reply):
        if want is not None:
            assert sent == rest == "" and [c["function"]["name"] for c in calls] == \
                [name for name, _ in want]
        else:
            assert calls is None and sent + rest == reply
    plain = Llama3Stream(NAMES)
    assert plain.feed("Hello") == "Hello" and plain.feed(" there") == " there"


async def test_auto_on_the_chat_route_whole_and_streamed(fake_server):
    body = await check_auto_route(fake_server, LLAMA_LIKE, CALL)
    assert body["choices"][0]["finish_reason"] == "stop"
