"""tool_choice "auto" for models that write their calls as a Python list (serve/pythonic_tools.py,
vLLM's `pythonic`: Llama 3.2's lightweight models, Llama 4): the parser on finished and streamed
text (every way of cutting it), never evaluating anything, and the chat route on FakeCore with
its template rendering only the user's text (so the user message decides what the "model"
writes)."""

from __future__ import annotations

import json

import pytest
from tool_replies import NAMES, check_auto_route, cut_streams

from ferrobatch.serve.pythonic_tools import (
    END,
    START,
    PythonicStream,
    split_calls,
    template_has_pythonic_calls,
)
from ferrobatch.serve.tools import template_tool_parser

CALL = '[get_weather(city="Paris")]'
PYTHONIC_LIKE = ("If you decide to invoke any of the function(s), you MUST put it in the format "
                 "of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
                 "func_name2(params)] {{ messages }}")


def calls_of(text):
    found = split_calls(text, NAMES, complete=True)
    return None if found is None else [(c["function"]["name"], json.loads(c["function"][
        "arguments"])) for c in found[1]]


def test_the_template_decides():
    assert template_has_pythonic_calls(PYTHONIC_LIKE)
    assert template_tool_parser(PYTHONIC_LIKE) == "pythonic"
    assert template_tool_parser("{{ messages }}") is None


@pytest.mark.parametrize("text, want", [
    (CALL, [("get_weather", {"city": "Paris"})]),
    ("  " + START + CALL + END + "\n", [("get_weather", {"city": "Paris"})]),
    ('[get_weather(city="Paris"), now()]', [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("[now(tz='UTC', offset=-2.5, dst=False, extra=None, hours=[1, 2], opts={'a': true})]",
     [("now", {"tz": "UTC", "offset": -2.5, "dst": False, "extra": None, "hours": [1, 2],
               "opts": {"a": True}})]),
    ('[get_weather(city="Paris\\n\\u00e9")]', [("get_weather", {"city": "Paris\né"})]),
    ("[other(x=1)]", None),                          # not a listed tool
    ('[get_weather("Paris")]', None),                # positional: not how tools are called
    ("[now(**kw)]", None),
    ("[now(tz=__import__('os').system('true'))]", None),   # a call as a value: never run
    ("[now(tz=x)]", None),                           # a name
    ("[now(tz=1+1j)]", None),
    ("[now(tz={**a})]", None),
    ("[]", None),
    (CALL + " and some words", None),
    ('[get_weather(city="Pa', None),                 # cut off
    ("[1, 2, 3]", None),
    ("It is sunny in Paris.", None),
    ("", None),
    ("[" * 5000 + "]" * 5000, None),                 # too deep for the parser: plain text
])
def test_whole_replies(text, want):
    assert calls_of(text) == want


@pytest.mark.parametrize("reply", [CALL, START + CALL + END, " \n" + CALL,
                                   "Plain answer, no call.", "<|python_st is not the tag",
                                   "[not a call", ""])
def test_any_cut_into_pieces_gives_the_whole_replys_answer(reply):
    want = calls_of(reply)
    for sent, rest, calls in cut_streams(lambda: PythonicStream(NAMES), reply):
        if want is not None:
            assert sent == rest == "" and [c["function"]["name"] for c in calls] == \
                [name for name, _ in want]
        else:
            assert calls is None and sent + rest == reply
    plain = PythonicStream(NAMES)
    assert plain.feed("Hello") == "Hello" and plain.feed(" there") == " there"


async def test_auto_on_the_chat_route_whole_and_streamed(fake_server):
    await check_auto_route(fake_server, PYTHONIC_LIKE, CALL)
