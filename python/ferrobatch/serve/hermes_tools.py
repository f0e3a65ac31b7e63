"""Tool calls the model writes on its own, in the Hermes format (tool_choice "auto").

Models whose chat template speaks of `<tool_call>` (Qwen2 / Qwen2.5, Hermes 2 Pro and 3,
SmolLM3, ...) answer a tool request with one block per call after any text:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`split_calls` turns a finished output into its text before the first block and the OpenAI
`tool_calls`; `HermesStream` does the same for a stream of deltas, passing the text before
a block through as it comes and holding everything from the block's first character on.
Nothing is guided here: a block that is not a call to a listed tool leaves the whole output
as plain content (what the model wrote, unchanged).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)


def template_has_hermes_calls(chat_template: str | None) -> bool:
    """True when the model's chat template uses the Hermes `<tool_call>` blocks."""
    return bool(chat_template) and OPEN in chat_template and CLOSE in chat_template


def _call(block: str, names: tuple[str, ...]) -> dict[str, Any] | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    return openai_call(value, names)


def openai_call(value: Any, names: tuple[str, ...]) -> dict[str, Any] | None:
    """A decoded `{"name", "arguments" | "parameters"}` call of a tool in `names` as an OpenAI
    `tool_calls` entry (arguments as JSON text); None for anything else."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):                  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(args,
                                                                        ensure_ascii=False)}}


def split_calls(text: str, names: tuple[str, ...],
                complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
    """(the text before the first block, stripped; the calls) when `text` holds one or more
    blocks, each a call of a tool in `names`, with nothing but whitespace between and after
    them; None otherwise (the output is then plain content). `complete`: the model ended the
    output itself, so a last block missing its `</tool_call>` counts if its JSON is whole."""
    start = text.find(OPEN)
    if start < 0:
        return None
    calls, pos = [], start
    for m in _BLOCK.finditer(text, start):
        if text[pos:m.start()].strip():
            return None                        # text between blocks: not a clean call list
        closed = m.group(0).endswith(CLOSE)
        if not closed and not complete:
            return None                        # cut off inside a call
        call = _call(m.group(1).strip(), names)
        if call is None:
            return None
        calls.append(call)
        pos = m.end()
    if text[pos:].strip():
        return None
    return text[:start].strip(), calls


class HermesStream:
    """One choice's streamed deltas: `feed` returns the text that can go out as content now
    (never a piece of a block, nor a prefix of `<tool_call>` that may still become one);
    `finish` returns what is left: the calls (with the withheld text before them) or, if the
    held text is not a clean call list, that text as content."""

    opening = OPEN                            # what starts the calls (a subclass's own)

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.sent = ""           # content released so far
        self.held = ""           # text not released: a block (or a possible start of one) on
        self.in_block = False

    def split(self, text: str, complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
        """The format's `split_calls`."""
        return split_calls(text, self.names, complete)

    def feed(self, delta: str) -> str:
        self.held += delta
        if self.in_block:
            return ""
        opening = self.opening
        start = self.held.find(opening)
        if start >= 0:
            self.in_block = True
            out, self.held = self.held[:start], self.held[start:]
        else:
            keep = next((k for k in range(min(len(opening) - 1, len(self.held)), 0, -1)
                         if opening.startswith(self.held[-k:])), 0)
            cut = len(self.held) - keep
            out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def finish(self, complete: bool) -> tuple[str, list[dict[str, Any]] | None]:
        """(content still to send, the calls or None). With calls, the content is empty: the
        text before the block already went out."""
        held, self.held = self.held, ""
        if self.in_block:
            found = self.split(held, complete)
            if found is not None:
                return "", found[1]
        return held, None
