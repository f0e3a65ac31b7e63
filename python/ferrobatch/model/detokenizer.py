"""Incremental detokenization for streaming, with stop-string hold-back.

Two ways to turn tokens into text, same result:
- byte-level BPE tokenizers with a proven token byte table (``Tokenizer.token_byte_table``): each
  token's bytes go through an incremental UTF-8 decoder, which holds an incomplete character
  until its last byte arrives — one table look-up per token, no call into the tokenizer;
- any other tokenizer: the prefix/read-offset scheme, where each new token is decoded together with
  a few previous ones and text is released only once it no longer ends in an incomplete UTF-8
  sequence (U+FFFD).
Text that could be the beginning of a stop string is held back until it is disambiguated.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import NamedTuple

_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class DetokenizerStep(NamedTuple):
    """What one token adds: ``text`` is safe to emit now; ``stopped`` means a stop string completed
    (``text`` then ends right before it). A tuple: one is made per generated token."""

    text: str
    stopped: bool = False


_NOTHING = DetokenizerStep("")
_STOPPED = DetokenizerStep("", True)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text pieces that join to the full decode."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        # Stop strings end the output only from token min_tokens + 1 on (vLLM's rule, and the
        # same as EOS and stop token ids): a match that ends earlier is plain text.
        self._min_tokens = min_tokens
        self._num_added = 0
        self._skip_special_tokens = skip_special_tokens
        table_of = getattr(tokenizer, "token_byte_table", None)
        self._byte_table = table_of(skip_special_tokens) if table_of is not None else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._byte_table else None
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
        if self._utf8 is not None:
            if final:
                return self._utf8.decode(b"", True)
            token_id = self._ids[-1]
            table = self._byte_table
            piece = table[token_id] if 0 <= token_id < len(table) else b""
            return self._utf8.decode(piece, False)
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
            return _STOPPED
        self._ids.append(int(token_id))
        self._num_added += 1
        delta = self._decode_new_text(final=False)
        if not delta:
            return _NOTHING
        if not self._stop:                 # nothing to hold back: all new text is safe
            self._text += delta
            self._emitted = len(self._text)
            return DetokenizerStep(delta)
        search_from = max(self._emitted, len(self._text) - self._max_stop_len + 1)
        self._text += delta
        hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0] \
            if self._num_added > self._min_tokens else []
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

    def add_many(self, token_ids: Sequence[int]) -> str:
        """Adds several tokens at once and returns their text (for a detokenizer without stop
        strings: a consumer that only wants the final text). Equal to joining ``add``'s pieces."""
        if self._stop:
            raise ValueError("add_many is for detokenizers without stop strings")
        if not token_ids:
            return ""
        self._num_added += len(token_ids)
        if self._utf8 is not None:
            table, size = self._byte_table, len(self._byte_table)
            data = b"".join(table[t] if 0 <= t < size else b"" for t in token_ids)
            delta = self._utf8.decode(data, False)
        else:
            self._ids.extend(int(t) for t in token_ids)
            delta = self._decode_new_text(final=False)
        self._text += delta
        self._emitted = len(self._text)
        return delta

    def flush(self) -> str:
        """Releases held-back text (and any trailing partial character) when the sequence ends."""
        if self._stopped:
            return ""
        self._text += self._decode_new_text(final=True)
        piece = self._text[self._emitted:]
        self._emitted = len(self._text)
        return piece
