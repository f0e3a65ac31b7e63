"""Reasoning parsers (`serve --reasoning-parser`): a chat reply's `<think>...</think>` part goes
to `reasoning_content`, the rest to `content`, as vLLM's parsers of the same names do.

- `deepseek_r1` (DeepSeek-R1 and its distills, whose template opens `<think>` in the prompt):
  everything before the first `</think>` is reasoning (a `<think>` the output itself opens is
  dropped); a reply cut before `</think>` is all reasoning.
- `qwen3` (Qwen3's hybrid models): a reply that opens with `<think>` is reasoning up to
  `</think>`; one that does not (thinking switched off: `chat_template_kwargs:
  {"enable_thinking": false}`) is all content.

Whitespace between `</think>` and the answer is dropped. `ReasoningSplitter` works on a stream
of text pieces: it holds back only what could still be the start of a tag, so the pieces it
returns, joined, are exactly what `split_reasoning` gives for the whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS = ("deepseek_r1", "qwen3")

_START, _REASONING, _AFTER_END, _CONTENT = range(4)


def _tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one reply, piece by piece, into (reasoning, content) pieces."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        self.parser = parser
        self._state = _START
        self._pending = ""
        self.saw_reasoning = False      # the reply had a reasoning part (even an empty one)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` (the next piece) completes."""
        self._pending += text
        reasoning, content = [], []
        while self._pending:
            if self._state == _START:
                stripped = self._pending.lstrip()
                if stripped.startswith(THINK_START):
                    self._pending = stripped[len(THINK_START):]
                    self._enter_reasoning()
                elif THINK_START.startswith(stripped):
                    break                     # may still become the opening tag
                elif self.parser == "deepseek_r1":
                    self._enter_reasoning()
                else:
                    self._state = _CONTENT
            elif self._state == _REASONING:
                end = self._pending.find(THINK_END)
                if end >= 0:
                    reasoning.append(self._pending[:end])
                    self._pending = self._pending[end + len(THINK_END):]
                    self._state = _AFTER_END
                    continue
                keep = _tag_prefix_len(self._pending, THINK_END)
                reasoning.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            elif self._state == _AFTER_END:
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = _CONTENT
            else:
                content.append(self._pending)
                self._pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the reply has ended."""
        rest, self._pending = self._pending, ""
        if self._state == _START:
            if self.parser == "deepseek_r1" and rest.strip():
                self.saw_reasoning = True
                return rest, ""
            return "", rest
        if self._state == _REASONING:
            return rest, ""
        return "", rest if self._state == _CONTENT else ""

    @property
    def past_reasoning(self) -> bool:
        """The text fed so far has left the reasoning (its `</think>`, or content from the
        start)."""
        return self._state in (_AFTER_END, _CONTENT)

    def _enter_reasoning(self) -> None:
        self._state = _REASONING
        self.saw_reasoning = True


def count_reasoning_tokens(parser: str, tokens: Iterable[Any],
                           text_of: Callable[[Any], str] = str) -> int:
    """How many of a reply's tokens (in order; `text_of` gives each one's text, e.g. a token
    id's) are its reasoning: every token up to and including the one that closes it
    (`</think>`; all of them in a reply cut before that), none in a reply without reasoning.
    OpenAI's `reasoning_tokens`."""
    splitter, count = ReasoningSplitter(parser), 0
    for token in tokens:
        if splitter.past_reasoning:
            break
        splitter.feed(text_of(token))
        count += 1
    return count if splitter.saw_reasoning else 0


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None when the reply has none, content) of a whole reply."""
    splitter = ReasoningSplitter(parser)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.saw_reasoning else None), c1 + c2
