"""Prompt inputs: text, token ids or chat messages, checked before anything is allocated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 1 << 20
# message fields besides role and content that reach the chat template, with their types
MESSAGE_EXTRAS = {"name": str, "tool_calls": list, "tool_call_id": str, "reasoning_content": str}


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI-style chat messages -> [{"role", "content": str, ...}]; ValueError on anything odd.

    `content` may be a string or a list of `{"type": "text", "text": ...}` parts (joined with
    newlines, as vLLM does); `developer` is rendered as `system`, as the model's template knows
    no developer role. A message's `name`, an assistant's `tool_calls` and
    `reasoning_content` (a reasoning model's earlier thinking, as `--reasoning-parser` serves
    it) and a tool message's `tool_call_id` are kept for templates that render them.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages are allowed")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            # echo only a short role-like name: never reflect arbitrary client text
            shown = (repr(role) if isinstance(role, str) and len(role) <= 16
                     and role.isidentifier() else f"a {type(role).__name__}")
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {shown}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}] must be a text part "
                                     "{'type': 'text', 'text': ...}")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        if len(content) > MAX_PROMPT_CHARS:
            raise ValueError(f"messages[{i}].content is too long")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": content}
        for key, kind in MESSAGE_EXTRAS.items():
            value = m.get(key)
            if value is None:
                continue
            if not isinstance(value, kind):
                raise ValueError(f"messages[{i}].{key} must be a {kind.__name__}")
            msg[key] = value
        out.append(msg)
    return out


def check_prompt_text(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise ValueError("prompt must be a string or a list of token ids")
    if not prompt:
        raise ValueError("prompt must not be empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt is longer than {MAX_PROMPT_CHARS} characters")
    return prompt


def check_token_ids(ids: Sequence[Any], vocab_size: int, max_len: int) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError("prompt token ids must be a list of integers")
    if not ids:
        raise ValueError("prompt must not be empty")
    if len(ids) >= max_len:
        raise ValueError(f"the prompt is {len(ids)} tokens long; this model's context window "
                         f"is {max_len} tokens (prompt + output)")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError("prompt token ids must be integers")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t} is outside the vocabulary (0..{vocab_size - 1})")
        out.append(t)
    return out
