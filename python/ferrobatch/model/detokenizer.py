"""Incremental detokenization for streaming, with stop-string hold-back.

Uses the prefix/read-offset scheme: each new token is decoded together with a few previous ones,
and text is released only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD). Text
that could be the beginning of a stop string is held back until it is disambiguated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizerStep:
    """What one token adds: ``text`` is safe to emit now; ``stopped`` means a stop string completed
    (``text`` then ends right before it)."""

    text: str
    stopped: bool = False


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text pieces that join to the full decode."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._text = ""  # decoded output text so far
        self._emitted = 0  # chars of _text already handed out
        self._stopped = False

    @property
    def output_text(self) -> str:
        """All output text decoded so far (including held-back text)."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _held_back_chars(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        for length in range(min(self._max_stop_len - 1, len(text) - self._emitted), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self._stop):
                return length
        return 0

    def add(self, token_id: int) -> DetokenizerStep:
        """Adds one generated token; returns the text that became safe to emit."""
        if self._stopped:
            return DetokenizerStep("", True)
        self._ids.append(int(token_id))
        delta = self._decode_new_text(final=False)
        if not delta:
            return DetokenizerStep("")
        search_from = max(self._emitted, len(self._text) - self._max_stop_len + 1)
        self._text += delta
        if self._stop:
            hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                end = min(hits)
                piece = self._text[self._emitted:end]
                self._emitted = len(self._text)
                self._stopped = True
                return DetokenizerStep(piece, True)
        safe_end = len(self._text) - self._held_back_chars()
        piece = self._text[self._emitted:safe_end]
        self._emitted = safe_end
        return DetokenizerStep(piece)

    def flush(self) -> str:
        """Releases held-back text (and any trailing partial character) when the sequence ends."""
        if self._stopped:
            return ""
        self._text += self._decode_new_text(final=True)
        piece = self._text[self._emitted:]
        self._emitted = len(self._text)
        return piece
