"""Guided decoding after the reasoning: a reasoning model thinks freely, then its answer follows
the grammar (vLLM's structured outputs with a reasoning parser).

`AfterReasoning` wraps one sequence's `GuidedSequence` (the grammar at its start) and has the
same face (`advance`, `write_mask`, `num_allowed`, `is_finished`, `copy`), so the sampler and
`EngineCore` use it as they use a guide:

- `deepseek_r1` (the template opened `<think>` in the prompt): every token is allowed until the
  output's bytes contain `</think>`; the grammar applies from the next token on.
- `qwen3`: the first token may be `<think>` (then as above) or any token the grammar allows
  (thinking switched off: the grammar applies from the start).

Tokens are read as their bytes (the guided vocabulary's table), so `</think>` is found whether
the model writes it as one added token or in pieces. A token that carries bytes after `</think>`
(never an added `</think>` token) starts the grammar after it; those bytes are not checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

THINK_START = b"<think>"
THINK_END = b"</think>"
PARSERS = ("deepseek_r1", "qwen3")

_OPENING, _REASONING, _GUIDED = range(3)


class AfterReasoning:
    """One sequence's grammar, dormant while the reply reasons (see the module doc)."""

    __slots__ = ("_guide", "_bytes", "_open_ids", "_state", "_tail")

    def __init__(self, guide: Any, parser: str, token_bytes: Sequence[bytes],
                 open_ids: np.ndarray | None = None) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        self._guide = guide
        self._bytes = token_bytes
        self._open_ids = open_ids if open_ids is not None else np.asarray(
            [i for i, b in enumerate(token_bytes) if b == THINK_START], dtype=np.int64)
        self._state = _OPENING if parser == "qwen3" else _REASONING
        self._tail = b""          # the last bytes of the reasoning (a `</think>` split up)

    def copy(self) -> AfterReasoning:
        other = object.__new__(AfterReasoning)
        other._guide = self._guide.copy()
        other._bytes, other._open_ids = self._bytes, self._open_ids
        other._state, other._tail = self._state, self._tail
        return other

    @property
    def reasoning(self) -> bool:
        """True while the grammar waits for the reasoning to end."""
        return self._state != _GUIDED

    @property
    def num_allowed(self) -> int:
        if self._state == _REASONING:
            return len(self._bytes)
        return self._guide.num_allowed + (len(self._open_ids) if self._state == _OPENING else 0)

    @property
    def is_accepting(self) -> bool:
        """The answer so far is a full match (never while reasoning)."""
        return self._state == _GUIDED and self._guide.is_accepting

    @property
    def is_finished(self) -> bool:
        """An end-of-sequence token was accepted after the reasoning."""
        return self._state == _GUIDED and self._guide.is_finished

    def write_mask(self, out: np.ndarray) -> None:
        """Marks the allowed next tokens in `out` (bool, one per vocabulary id)."""
        if self._state == _REASONING:
            out[:] = True
            return
        self._guide.write_mask(out)
        if self._state == _OPENING:
            out[self._open_ids] = True

    def advance(self, token_id: int) -> bool:
        """Moves past `token_id`; False when the grammar does not allow it."""
        if self._state == _GUIDED:
            return self._guide.advance(token_id)
        raw = self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
        if self._state == _OPENING:
            if raw == THINK_START:
                self._state = _REASONING
                return True
            self._state = _GUIDED
            return self._guide.advance(token_id)
        seen = self._tail + raw
        if THINK_END in seen:
            self._state, self._tail = _GUIDED, b""
        else:
            self._tail = seen[-(len(THINK_END) - 1):]
        return True

