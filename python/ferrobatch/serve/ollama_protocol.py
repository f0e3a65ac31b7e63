"""Ollama's API (``/api/chat``, ``/api/generate``) read into the chat and completions routes'
requests, and their outputs written in Ollama's shapes (serve/ollama_api.py serves them), so
the ``ollama`` CLI and library, and the tools written for Ollama, run on ferrobatch.

Requests: ``model`` (a served name, ``:latest`` allowed), ``stream`` (true unless false, as
Ollama), ``format`` (``"json"`` or a JSON Schema: guided decoding), ``think`` (the template's
``enable_thinking``; with a reasoning parser the reasoning comes back as ``thinking``),
``options``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
``num_predict`` (-1 / -2: fill the context), ``repeat_penalty``, ``presence_penalty``,
``frequency_penalty``; the load-time options (``num_ctx``, ``num_gpu``, ``num_thread``, ...) and
``keep_alive`` change nothing here and are accepted; sampling options ferrobatch does not have
(``mirostat``, ``tfs_z``, ``typical_p``, ``repeat_last_n`` other than -1 beside a penalty) are
refused when set to anything but their no-op value.
``/api/chat``: ``messages`` (system, user, assistant with ``tool_calls``, tool), ``tools``
(OpenAI's function shape; the model's own calls, with a tool-call parser). ``/api/generate``:
``prompt`` and ``system`` through the chat template, or ``raw`` (the prompt as is); an empty
prompt only loads (``done_reason: "load"``). Images, ``suffix``, ``template`` and ``context``
are refused with a 400 naming them. Errors are Ollama's ``{"error": "..."}``.
"""

from __future__ import annotations

import datetime
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ferrobatch.serve.openai_protocol import OpenAIRequest, parse_chat, parse_completion
from ferrobatch.serve.protocol import ProtocolError

# Ollama option -> the OpenAI / vLLM field it sets
OPTION_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "min_p": "min_p", "seed": "seed", "stop": "stop", "num_predict": "max_tokens",
                "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty"}
# options about loading and running the model: nothing to change here
LOAD_OPTIONS = frozenset({"numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram",
                          "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock",
                          "embedding_only", "num_thread", "num_keep"})
# sampling options ferrobatch does not have: accepted only at the value that turns them off
NO_OP_OPTIONS = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "penalize_newline": None}
LATEST = ":latest"


def model_name(body: dict, served: Sequence[str]) -> str:
    """The served name a body's ``model`` names (``name:latest`` is ``name``); 404 otherwise."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError("'model' is required (a served model's name)", param="model")
    if model not in served and model.endswith(LATEST) and model[:-len(LATEST)] in served:
        model = model[:-len(LATEST)]
    if model not in served:
        raise ProtocolError(f"model '{body['model']}' not found; this server serves "
                            f"'{served[0]}'", code=404, param="model")
    return model


def _options(body: dict) -> dict[str, Any]:
    """``options`` (and ``format``) as OpenAI / vLLM sampling fields."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ProtocolError("'options' must be an object", param="options")
    fields: dict[str, Any] = {}
    for key, value in options.items():
        if value is None or key in LOAD_OPTIONS:
            continue
        if key in OPTION_NAMES:
            fields[OPTION_NAMES[key]] = value
        elif key in NO_OP_OPTIONS:
            if value != NO_OP_OPTIONS[key] and NO_OP_OPTIONS[key] is not None:
                raise ProtocolError(f"option '{key}' is not supported (only "
                                    f"{NO_OP_OPTIONS[key]!r}, its off value)", param=key)
        elif key == "repeat_last_n":
            if value != -1 and options.get("repeat_penalty") not in (None, 1, 1.0):
                raise ProtocolError("option 'repeat_last_n' must be -1 (the penalty looks at "
                                    "every token) when 'repeat_penalty' is set", param=key)
        else:
            raise ProtocolError(f"unknown option {key!r}", param=key)
    if isinstance(fields.get("max_tokens"), int) and fields["max_tokens"] < 0:
        fields["max_tokens"] = None                       # -1 / -2: fill the context
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    fmt = body.get("format")
    if fmt == "json":
        fields["guided_json"] = {"type": "object"}
    elif isinstance(fmt, dict):
        fields["guided_json"] = fmt
    elif fmt not in (None, ""):
        raise ProtocolError("'format' must be \"json\" or a JSON Schema object", param="format")
    return fields


def _stream(body: dict) -> bool:
    stream = body.get("stream", True)
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise ProtocolError("'stream' must be a boolean", param="stream")
    return stream


def _refuse(body: dict, keys: Sequence[str]) -> None:
    for key in keys:
        if body.get(key) not in (None, "", [], False):
            raise ProtocolError(f"'{key}' is not supported", param=key)


def _think(body: dict, chat: dict[str, Any]) -> None:
    think = body.get("think")
    if think is None:
        return
    if isinstance(think, str) and think in ("low", "medium", "high"):
        think = True
    if not isinstance(think, bool):
        raise ProtocolError("'think' must be a boolean (or low / medium / high)",
                            param="think")
    chat["chat_template_kwargs"] = {"enable_thinking": think}


def _message(message: Any, where: str) -> dict[str, Any]:
    """An Ollama chat message in OpenAI's shape."""
    if not isinstance(message, dict):
        raise ProtocolError(f"{where} must be a message object", param="messages")
    _refuse(message, ("images",))
    role, content = message.get("role"), message.get("content", "")
    if role not in ("system", "user", "assistant", "tool"):
        raise ProtocolError(f"{where}.role must be system, user, assistant or tool",
                            param="messages")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ProtocolError(f"{where}.content must be a string", param="messages")
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise ProtocolError(f"{where}.tool_calls must be an assistant's list of calls",
                                param="messages")
        out["tool_calls"] = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ProtocolError(f"{where}.tool_calls must be {{'function': {{'name', "
                                    "'arguments'}}}} objects", param="messages")
            args = fn.get("arguments", {})
            out["tool_calls"].append({
                "id": f"call_{secrets.token_hex(8)}", "type": "function",
                "function": {"name": fn["name"], "arguments": args if isinstance(args, str)
                             else json.dumps(args, ensure_ascii=False)}})
    if role == "tool" and isinstance(message.get("tool_name"), str):
        out["name"] = message["tool_name"]
    return out


def parse_ollama_chat(body: Any, served: Sequence[str], tool_parser: str | None = None,
                      sampling_defaults: Mapping[str, Any] | None = None) -> OpenAIRequest:
    """An ``/api/chat`` body as the chat route's request."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _refuse(body, ("logprobs",))
    model = model_name(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    chat: dict[str, Any] = {"model": model, "stream": _stream(body),
                            "messages": [_message(m, f"messages[{i}]")
                                         for i, m in enumerate(messages)],
                            **_options(body)}
    chat.setdefault("max_tokens", None)
    if body.get("tools"):
        chat["tools"] = body["tools"]
        chat["tool_choice"] = "auto"
    _think(body, chat)
    return parse_chat(chat, served, tool_parser=tool_parser, sampling_defaults=sampling_defaults)


def parse_ollama_generate(body: Any, served: Sequence[str],
                          sampling_defaults: Mapping[str, Any] | None = None
                          ) -> OpenAIRequest | None:
    """An ``/api/generate`` body as the chat route's request (or, ``raw``, the completions
    route's); None for an empty prompt (Ollama's "load the model" request)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _refuse(body, ("images", "suffix", "template", "context", "logprobs"))
    model = model_name(body, served)
    prompt, system = body.get("prompt", ""), body.get("system")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise ProtocolError("'prompt' must be a string", param="prompt")
    if system is not None and not isinstance(system, str):
        raise ProtocolError("'system' must be a string", param="system")
    raw = body.get("raw", False)
    if not isinstance(raw, (bool, type(None))):
        raise ProtocolError("'raw' must be a boolean", param="raw")
    fields = {"model": model, "stream": _stream(body), **_options(body)}
    if not prompt:
        return None
    if raw:
        if system:
            raise ProtocolError("'system' has no place in a raw prompt", param="system")
        fields.setdefault("max_tokens", None)
        return parse_completion({**fields, "prompt": prompt}, served,
                                sampling_defaults=sampling_defaults)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    chat = {**fields, "messages": messages}
    chat.setdefault("max_tokens", None)
    _think(body, chat)
    return parse_chat(chat, served, sampling_defaults=sampling_defaults)


# -- the reply ---------------------------------------------------------------------------------

def created_at() -> str:
    """Ollama's timestamp: RFC 3339, UTC, with fractions of a second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI tool calls in Ollama's shape (the arguments an object)."""
    out = []
    for call in calls or ():
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"]) if fn["arguments"] else {}
        except ValueError:
            args = {}
        out.append({"function": {"name": fn["name"], "arguments": args}})
    return out


def timings(prompt_tokens: int, generated: int, started: float, first: float | None,
            ended: float) -> dict[str, int]:
    """Ollama's counts and durations (nanoseconds; the prompt's until the first token)."""
    first = ended if first is None else first
    return {"total_duration": int((ended - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": int((first - started) * 1e9),
            "eval_count": generated, "eval_duration": int((ended - first) * 1e9)}
