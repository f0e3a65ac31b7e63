"""Logprobs on the wire: each token id's string and bytes, and the shapes every door sends.

- OpenAI completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
  ``top_logprobs[i]`` maps the N most likely tokens' strings to their logprobs and always holds
  the sampled token too (so up to N + 1 entries); ``text_offset`` counts characters of the token
  strings from the start of the choice's text.
- OpenAI chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` with
  exactly N alternatives per position.
- WebSocket / TCP: ``[{"token_id", "logprob", "top_logprobs": [[id, logprob], ...]}]``.
- vLLM's ``prompt_logprobs`` (HTTP): per prompt position null or ``{"<id>": {"logprob",
  "rank", "decoded_token"}}``.

A token's string is its bytes read as UTF-8; a token that is only part of a character (byte-level
BPE splits emoji and CJK characters) shows its bytes escaped (``"\\xe2\\x80"``), and ``bytes``
carries them exactly. A logprob of -inf (a token the model rules out) is sent as -9999.0: JSON
has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LOGPROB_FLOOR = -9999.0


def wire_logprob(value: float) -> float:
    """A finite float for JSON: -inf (and NaN) become LOGPROB_FLOOR."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenStrings:
    """Each token id's bytes and display string, computed once per id and cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        table = getattr(tokenizer, "token_byte_table", None)
        self._table = table(False) if table is not None else None   # specials keep their text
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self._table is not None and 0 <= token_id < len(self._table):
            raw = self._table[token_id]
        else:
            raw = self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        hit = (raw.decode("utf-8", "backslashreplace"), raw)
        if len(self._cache) < 1 << 20:
            self._cache[token_id] = hit
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


class TokenIdStrings:
    """`TokenStrings`' face for vLLM's `return_tokens_as_token_ids`: every token shows as
    ``token_id:<id>`` (its bytes that text's), so a client gets ids even for tokens that are
    not valid UTF-8 on their own."""

    def get(self, token_id: int) -> tuple[str, bytes]:
        text = f"token_id:{int(token_id)}"
        return text, text.encode()

    def text(self, token_id: int) -> str:
        return f"token_id:{int(token_id)}"


def completion_logprobs(entries: Sequence[Any], strings: TokenStrings,
                        text_offset: int = 0) -> tuple[dict[str, list], int]:
    """The completions ``logprobs`` object of `entries` (``TokenLogprob``s) and the text offset
    after them (a stream continues from it in its next chunk)."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for e in entries:
        text = strings.text(e.token_id)
        logprob = wire_logprob(e.logprob)
        top = {strings.text(t): wire_logprob(lp) for t, lp in e.top}
        top.setdefault(text, logprob)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)


def echo_completion_logprobs(prompt_ids: Sequence[int], entries: Sequence[Any] | None,
                             strings: TokenStrings) -> tuple[dict[str, list], int]:
    """The completions ``logprobs`` object of an echoed prompt: the first token (nothing predicts
    it) and any position without an entry have null logprobs; returns the offset after it too."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for k, token in enumerate(prompt_ids):
        e = entries[k] if entries is not None and k < len(entries) else None
        if e is None:
            text = strings.text(token)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            one, _ = completion_logprobs([e], strings)
            text = one["tokens"][0]
            token_logprobs.append(one["token_logprobs"][0])
            top_logprobs.append(one["top_logprobs"][0])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, offset)


def joined(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    """Two completions ``logprobs`` objects, one after the other."""
    return {key: first[key] + second[key] for key in first}


def _chat_token(strings: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = strings.get(token_id)
    return {"token": text, "logprob": wire_logprob(logprob), "bytes": list(raw)}


def chat_logprobs(entries: Sequence[Any], strings: TokenStrings) -> dict[str, list]:
    """The chat ``logprobs`` object of `entries` (``TokenLogprob``s)."""
    content = []
    for e in entries:
        item = _chat_token(strings, e.token_id, e.logprob)
        item["top_logprobs"] = [_chat_token(strings, t, lp) for t, lp in e.top]
        content.append(item)
    return {"content": content}


def message_logprobs(entries: Sequence[Any]) -> list[dict[str, Any]]:
    """The WebSocket / TCP ``logprobs`` field of a ``delta`` message (ids, no strings)."""
    return [{"token_id": e.token_id, "logprob": wire_logprob(e.logprob),
             "top_logprobs": [[t, wire_logprob(lp)] for t, lp in e.top]} for e in entries]


def vllm_prompt_logprobs(prompt_ids: Sequence[int], entries: Sequence[Any] | None,
                         strings: TokenStrings) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's HTTP ``prompt_logprobs``: per prompt position, null for the first (nothing
    predicts it), else the prompt token and the most likely ones as ``{"<token id>":
    {"logprob", "rank", "decoded_token"}}``; ``rank`` is null for a prompt token outside them
    (its rank is not computed)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for k in range(len(prompt_ids)):
        e = entries[k] if entries is not None and k < len(entries) else None
        if e is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": wire_logprob(lp.logprob), "rank": lp.rank,
                             "decoded_token": strings.text(t)} for t, lp in e.items()})
    return out
