"""Anthropic's Messages API (``POST /v1/messages``) read into the chat route's request, and the
chat route's outputs written in its shapes (serve/anthropic_api.py serves it): what the
``anthropic`` SDK and agents built on it send, answered by the model's chat template.

Served: ``model``, ``max_tokens`` (required), ``messages`` (roles user and assistant; content
as text or blocks: ``text``, the assistant's ``tool_use`` and the user's ``tool_result``,
``thinking`` blocks dropped as chat templates drop past reasoning; a last assistant turn is
continued, not answered), ``system`` (text or text blocks), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k`` (and the vLLM extras every route takes: ``min_p``,
``repetition_penalty``, ``seed``, ``ignore_eos``, ...), ``stream``, ``tools`` (custom tools: ``name``,
``description``, ``input_schema``) with ``tool_choice`` (``auto``: the model's own calls, with a
tool-call parser; ``any`` and ``tool``: the output guided to be the call; ``none``;
``disable_parallel_tool_use``), ``thinking`` (``enabled`` / ``adaptive`` / ``disabled``: the
template's ``enable_thinking``; with a reasoning parser the reply's reasoning comes back as a
``thinking`` block). ``metadata`` and ``service_tier`` change nothing and are accepted; images,
documents, server tools, ``mcp_servers`` and ``container`` are refused with a 400 naming them.

The reply: ``{"id": "msg_...", "type": "message", "role": "assistant", "model", "content":
[thinking?, text?, tool_use...], "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" |
"tool_use", "stop_sequence", "usage": {"input_tokens", "output_tokens",
"cache_read_input_tokens", "cache_creation_input_tokens"}}`` (as Anthropic counts: the prompt's
tokens found in the prefix cache are ``cache_read_input_tokens``, the others ``input_tokens``);
errors as ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ferrobatch.serve.openai_protocol import OpenAIRequest, parse_chat
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.responses_protocol import EXTRAS

REFUSED = {"mcp_servers": "MCP servers are not served", "container": "no code containers run "
           "here"}
# an HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def _text_of(content: Any, where: str) -> str:
    """Text, or text blocks joined (a tool result's or a system prompt's)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ProtocolError(f"{where} must be a string or a list of text blocks",
                            param="messages")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise ProtocolError(f"{where}[{j}] must be a text block {{'type': 'text', 'text': "
                                f"...}} (got type {kind!r}: only text is served)",
                                param="messages")
        texts.append(block["text"])
    return "\n".join(texts)


def _user_turn(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message as chat messages: its tool results (tool messages), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise ProtocolError(f"{where}.content must be a string or a non-empty list of blocks",
                            param="messages")
    out, texts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            use_id = block.get("tool_use_id")
            if not isinstance(use_id, str) or not use_id:
                raise ProtocolError(f"{where}.content[{j}].tool_use_id must be a non-empty "
                                    "string", param="messages")
            out.append({"role": "tool", "tool_call_id": use_id,
                        "content": _text_of(block.get("content"),
                                            f"{where}.content[{j}].content")})
        else:
            raise ProtocolError(f"{where}.content[{j}] is of type {kind!r}: a user turn may "
                                "hold text and tool_result blocks (no images or documents)",
                                param="messages")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    """An assistant message as one chat message: its text, and its tool uses as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or a list of blocks",
                            param="messages")
    texts, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            use_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(use_id, str) or not isinstance(name, str) or \
                    not isinstance(args, dict):
                raise ProtocolError(f"{where}.content[{j}] must have a string 'id' and 'name' "
                                    "and an object 'input'", param="messages")
            calls.append({"id": use_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue                   # past reasoning: chat templates leave it out too
        else:
            raise ProtocolError(f"{where}.content[{j}] is of type {kind!r}: an assistant turn "
                                "may hold text, tool_use and thinking blocks",
                                param="messages")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """``system`` and ``messages`` as chat messages, and whether the last one is an assistant
    turn to continue."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if not isinstance(system, (str, list)):
            raise ProtocolError("'system' must be a string or a list of text blocks",
                                param="system")
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            out += _user_turn(message.get("content"), where)
        elif role == "assistant":
            out.append(_assistant_turn(message.get("content"), where))
        else:
            raise ProtocolError(f"{where}.role must be 'user' or 'assistant' (the system "
                                "prompt goes in 'system')", param="messages")
    return out, messages[-1].get("role") == "assistant"


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as the chat route's fields."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice is not None and (not isinstance(choice, dict)
                                   or choice.get("type") not in ("auto", "none")):
            raise ProtocolError("'tool_choice' needs 'tools'", param="tool_choice")
        return {}
    if not isinstance(tools, list):
        raise ProtocolError("'tools' must be a list", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ProtocolError(f"tools[{i}] is of type {kind!r}: only custom tools (name, "
                                "description, input_schema) are served", param="tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"),
                                                                    dict):
            raise ProtocolError(f"tools[{i}] must have a string 'name' and an object "
                                "'input_schema'", param="tools")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        chat_tools.append({"type": "function", "function": fn})
    fields: dict[str, Any] = {"tools": chat_tools}
    if choice is None:
        choice = {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ProtocolError("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | "
                            "'none'}", param="tool_choice")
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ProtocolError("tool_choice {'type': 'tool'} needs the tool's 'name'",
                                param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    single = choice.get("disable_parallel_tool_use")
    if single is not None:
        if not isinstance(single, bool):
            raise ProtocolError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                                param="tool_choice")
        fields["parallel_tool_calls"] = not single
    return fields


def _thinking(body: dict[str, Any]) -> dict[str, Any]:
    """``thinking`` as the chat template's ``enable_thinking`` (nothing when absent)."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise ProtocolError("'thinking' must be {'type': 'enabled' | 'adaptive' | "
                            "'disabled'}", param="thinking")
    return {"enable_thinking": kind != "disabled"}


def parse_messages(body: Any, model_names: str | Sequence[str], tool_parser: str | None = None,
                   sampling_defaults: Mapping[str, Any] | None = None) -> OpenAIRequest:
    """A ``/v1/messages`` body as the chat route's request (a ProtocolError naming the field
    for anything it cannot serve as asked)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    for key, why in REFUSED.items():
        if body.get(key) not in (None, [], {}):
            raise ProtocolError(f"'{key}' is not supported: {why}", param=key)
    if not isinstance(body.get("model"), str):
        raise ProtocolError("'model' is required (a served model's name)", param="model")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ProtocolError("'max_tokens' is required: an integer >= 1", param="max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(s, str) for s in stops)):
        raise ProtocolError("'stop_sequences' must be a list of strings", param="stop_sequences")
    if body.get("tools") and tool_parser is None and (
            not isinstance(body.get("tool_choice"), dict)
            or body["tool_choice"].get("type", "auto") == "auto"):
        raise ProtocolError("tool_choice auto (the default with tools) needs a tool-call format "
                            "this model does not have (serve --tool-call-parser names one); "
                            "send tool_choice {'type': 'any'} or {'type': 'tool', 'name': ...} "
                            "(the call is then guaranteed well-formed), or {'type': 'none'}",
                            param="tool_choice")
    messages, continues = chat_messages(body)
    chat: dict[str, Any] = {"model": body["model"], "messages": messages,
                            "max_tokens": max_tokens, "stream": body.get("stream")}
    for key in ("temperature", "top_p") + EXTRAS:      # (the vLLM extras, as on every route)
        if body.get(key) is not None:
            chat[key] = body[key]
    if stops:
        if chat.get("stop"):
            raise ProtocolError("give 'stop_sequences' or 'stop', not both", param="stop")
        chat["stop"] = stops
    chat.update(_tools(body))
    kwargs = _thinking(body)
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if continues:
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    req = parse_chat(chat, model_names, tool_parser=tool_parser,
                     sampling_defaults=sampling_defaults)
    req.id = f"msg_{secrets.token_hex(12)}"
    return req


# -- the reply ---------------------------------------------------------------------------------

def stop_reason(finish_reason: str | None, stop: str | int | None,
                calls: list | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as a ``tool_use`` block."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"] else {}
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": fn["name"], "input": args}


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` counts the prompt tokens not read from the prefix
    cache, ``cache_read_input_tokens`` those read from it (their sum is the prompt)."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_object(req: OpenAIRequest, content: list[dict[str, Any]], reason: str | None,
                   sequence: str | None, usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": req.id, "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_}


def content_blocks(text: str, calls: list | None, thinking: str | None) -> list[dict[str, Any]]:
    """A finished reply's blocks: its reasoning, its text (none when empty beside tool uses),
    its tool uses."""
    blocks: list[dict[str, Any]] = []
    if thinking is not None:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text or not calls:
        blocks.append({"type": "text", "text": text})
    blocks += [tool_use_block(c) for c in calls or ()]
    return blocks
