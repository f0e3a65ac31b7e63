"""Chat templates rendered in a sandboxed Jinja2 environment (templates come from model files)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_ALLOWED_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles (and caches) a chat template in an immutable sandbox; ValueError on syntax errors."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validates chat messages and flattens text-part lists into strings (other keys kept)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")  # noqa: TRY004 (user input)
        role = message.get("role")
        if role not in _ALLOWED_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(_ALLOWED_ROLES)}, got {role!r}")
        content = message.get("content")
        kept = {k: v for k, v in message.items() if k not in ("role", "content")}
        normalized.append({**kept, "role": role, "content": _content_text(content, i)})
    return normalized


def render_chat_template(
    source: str,
    messages: Any,
    /,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Renders ``messages`` with the template ``source``; ValueError on bad messages or template errors."""
    template = compile_chat_template(source)
    try:
        # one dict, not keywords: an extra variable may be called anything ("self" included)
        return template.render({
            **extra,
            "messages": normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
        })
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template rejected the messages: {exc}") from exc
