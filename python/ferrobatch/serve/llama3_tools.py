"""Tool calls the model writes on its own in Llama 3's JSON format (tool_choice "auto").

Llama 3.1 / 3.2 / 3.3 Instruct, whose chat template asks for "the format {"name": function
name, "parameters": dictionary of argument name and its value}", answer a tool request with the
call(s) as the whole reply, optionally after `<|python_tag|>`, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

`split_calls` turns a finished output into the OpenAI `tool_calls` when the whole reply is such
a list of calls of listed tools (else it is plain content, unchanged); `Llama3Stream` holds a
streamed reply from its first character when that is `{` or the start of `<|python_tag|>`, and
passes any other reply through as content as it comes. Nothing is guided here.
"""

from __future__ import annotations

import json
from typing import Any

from ferrobatch.serve.hermes_tools import openai_call

PYTHON_TAG = "<|python_tag|>"
TEMPLATE_MARK = '"parameters": dictionary of argument name'


def template_has_llama3_calls(chat_template: str | None) -> bool:
    """True when the model's chat template asks for Llama 3's JSON tool calls."""
    return bool(chat_template) and TEMPLATE_MARK in chat_template


def split_calls(text: str, names: tuple[str, ...],
                complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
    """("", the calls) when `text` is nothing but one or more JSON calls of tools in `names`
    (after an optional `<|python_tag|>`, separated by `;`); None otherwise. `complete` is
    accepted for the same face as the Hermes parser: a JSON value is whole or it is not."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return None
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = openai_call(value, names)
        if call is None:
            return None
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None                     # text after a call: not a clean call list
        pos = len(body) - len(rest)
    return "", calls


class Llama3Stream:
    """One choice's streamed deltas (the same face as `HermesStream`): a reply that starts
    like a call is held whole and decided at the end; any other goes out as it comes."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.held = ""
        self.holding: bool | None = None      # None: not decided (only whitespace so far)

    def starts_calls(self, start: str) -> bool | None:
        """Whether a reply beginning with `start` (no leading whitespace) is held as calls:
        True, False, or None while it may still become the tag."""
        if start.startswith("{") or start.startswith(PYTHON_TAG):
            return True
        return None if PYTHON_TAG.startswith(start) else False

    def split(self, text: str, complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
        return split_calls(text, self.names, complete)

    def feed(self, delta: str) -> str:
        if self.holding is False:
            return delta
        self.held += delta
        start = self.held.lstrip()
        if not start:
            return ""
        decided = self.starts_calls(start)
        if decided is None:
            return ""
        self.holding = decided
        if decided:
            return ""                         # a call, or the tag: held to the end
        out, self.held = self.held, ""
        return out

    def finish(self, complete: bool) -> tuple[str, list[dict[str, Any]] | None]:
        """(content still to send, the calls or None)."""
        held, self.held = self.held, ""
        if held.strip():
            found = self.split(held, complete)
            if found is not None:
                return "", found[1]
        return held, None
