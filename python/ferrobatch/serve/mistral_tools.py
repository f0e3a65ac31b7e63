"""Tool calls the model writes on its own in Mistral's format (tool_choice "auto").

Mistral models (Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct, Mistral-Nemo, Mistral-Small,
Devstral, ...) start their calls with the `[TOOL_CALLS]` control token, after any text. Older
chat formats (tokenizer v3) follow it with a JSON list of calls, newer ones (v11 on) with each
call's name and its arguments, `[ARGS]` between them on some, the token again before each call:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

`[TOOL_CALLS]` is a special token, so a request with tools keeps special tokens in its text
(`skip_special_tokens` false unless the request says otherwise, as vLLM does). The calls get
Mistral's ids, nine letters and digits (its chat templates refuse any other id when the call
comes back in the conversation). As for the other formats, a reply whose calls are not a clean
list of calls of listed tools is plain content, unchanged; nothing is guided here.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from ferrobatch.serve.hermes_tools import HermesStream, openai_call

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


def template_has_mistral_calls(chat_template: str | None) -> bool:
    """True when the model's chat template writes Mistral's `[TOOL_CALLS]`."""
    return bool(chat_template) and BOT in chat_template


def mistral_call_id() -> str:
    """A tool call id as Mistral's templates want it: nine letters or digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def split_calls(text: str, names: tuple[str, ...],
                complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
    """(the text before `[TOOL_CALLS]`, stripped; the calls) when everything after it is a clean
    list of calls of tools in `names`, in either format; None otherwise. `complete` is accepted
    for the same face as the other parsers: a JSON value is whole or it is not."""
    start = text.find(BOT)
    if start < 0:
        return None
    body = text[start + len(BOT):].lstrip()
    calls = _json_list(body, names) if body[:1] in ("[", "{") else _named_calls(body, names)
    if not calls:
        return None
    for call in calls:
        call["id"] = mistral_call_id()
    return text[:start].strip(), calls


def _json_list(body: str, names: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """`[{"name", "arguments"}, ...]` (or one such object), nothing after it."""
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    if body[end:].strip():
        return None
    values = value if isinstance(value, list) else [value]
    calls = [openai_call(v, names) for v in values]
    return None if not calls or any(c is None for c in calls) else calls


def _named_calls(body: str, names: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """`name{args}` or `name[ARGS]{args}` calls, `[TOOL_CALLS]` between them."""
    decoder, calls = json.JSONDecoder(), []
    for part in body.split(BOT):
        part = part.strip()
        brace = part.find("{")
        if brace <= 0:
            return None
        name = part[:brace].strip()
        if name.endswith(ARGS):
            name = name[:-len(ARGS)].strip()
        try:
            args, end = decoder.raw_decode(part, brace)
        except ValueError:
            return None
        if part[end:].strip():
            return None
        call = openai_call({"name": name, "arguments": args}, names)
        if call is None:
            return None
        calls.append(call)
    return calls


class MistralStream(HermesStream):
    """One choice's streamed deltas: the text before `[TOOL_CALLS]` goes out as it comes; from
    the token on everything is held and decided at the end (`HermesStream`'s face)."""

    opening = BOT

    def split(self, text: str, complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
        return split_calls(text, self.names, complete)
