"""The Responses API's request and response shapes (`POST /v1/responses`, routed by
`responses_api.py`): a body as a ResponsesRequest (the conversation as chat messages, the
sampling, the tool plan, what the response repeats), and the `response` object with its
output items. What is served and what is refused is listed in `responses_api.py`.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ferrobatch.model.generation_defaults import under_door_defaults
from ferrobatch.sampling_params import MAX_LOGPROBS, SamplingParams
from ferrobatch.serve.openai_protocol import check_model, stream_flag
from ferrobatch.serve.protocol import ProtocolError, sampling_params_from
from ferrobatch.serve.tools import ToolPlan, parse_tools

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# fields whose meaning this server cannot honour: refused, not ignored
REFUSED = {"conversation": "conversations are not stored on this server: send the whole "
           "conversation as 'input' (or 'previous_response_id' with "
           "--enable-response-store)",
           "background": "background responses are not run on this server",
           "prompt": "stored prompt templates are not supported"}
NO_STORE = ("nothing is stored on this server (start it with --enable-response-store): send "
            "the whole conversation as 'input'")
# the Responses names of the sampling fields, and the vLLM extras taken as they are
EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "priority",
          "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
          "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "cache_salt",
          "vllm_xargs")


class ResponsesRequest:
    """A parsed `/v1/responses` body: the conversation, the sampling, what is echoed back."""

    def __init__(self, messages: list[dict[str, Any]], params: SamplingParams, stream: bool,
                 model: str, echo: dict[str, Any], tools: ToolPlan | None = None,
                 chat_options: dict[str, Any] | None = None,
                 conversation: list[dict[str, Any]] | None = None, store: bool = False) -> None:
        self.messages = messages
        # the messages without the instructions: what a stored response keeps (response_store)
        self.conversation = messages if conversation is None else conversation
        self.store = store                # keep the finished response (the server has a store)
        self.params = params
        self.tools = tools                # how the output becomes function calls, if it may
        self.chat_options = chat_options  # the chat template's extras (the tools)
        self.stream = stream
        self.model = model
        self.echo = echo                  # request fields the response object repeats
        self.id = f"resp_{secrets.token_hex(12)}"
        self.item_id = f"msg_{secrets.token_hex(12)}"
        self.reasoning_id = f"rs_{secrets.token_hex(12)}"
        self.reasoning_parser: str | None = None   # the reply's <think> part as a reasoning item
        self.created_at = int(time.time())
        self.input_items: list[dict[str, Any]] = []   # `input` as items (GET .../input_items)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or a list of text parts",
                            param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ProtocolError(f"{where}.content[{j}] must be a text part {{'type': "
                                f"'input_text', 'text': ...}} (got type {kind!r}: only text "
                                "input is served)", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _instructions(body: dict[str, Any]) -> list[dict[str, str]]:
    """`instructions` as the system message that leads the conversation (none without)."""
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise ProtocolError("'instructions' must be a string", param="instructions")
    return [{"role": "system", "content": instructions}]


def _messages(body: dict[str, Any],
              messages: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`input` as chat messages, after `messages` (a stored conversation it continues)."""
    given = body.get("input")
    messages = copy.deepcopy(messages or [])       # a stored conversation stays as stored
    if isinstance(given, str):
        if not given:
            raise ProtocolError("'input' must not be empty", param="input")
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ProtocolError("'input' must be a string or a non-empty list of messages",
                            param="input")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"{where} must be a message object", param="input")
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            _tool_turn(messages, item, kind, where)
            continue
        if kind != "message":
            raise ProtocolError(f"{where} is of type {kind!r}: only messages, function calls "
                                "and their outputs are served (no reasoning items or other "
                                "tools)", param="input")
        role = item.get("role")
        if role not in ROLES:
            raise ProtocolError(f"{where}.role must be one of {', '.join(ROLES)}",
                                param="input")
        messages.append({"role": role, "content": _text_of(item.get("content"), where)})
    return messages


def _tool_turn(messages: list[dict[str, Any]], item: dict[str, Any], kind: str,
               where: str) -> None:
    """A function call the model made (joined to the assistant message before it, as one
    turn) or the output the caller got from running it (a tool message), in chat shape."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ProtocolError(f"{where}.call_id must be a non-empty string", param="input")
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = _text_of(output, where)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        return
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ProtocolError(f"{where} must have a 'name' and its 'arguments' as a JSON string",
                            param="input")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _tool_plan(body: dict[str, Any], parser: str | None) -> tuple[ToolPlan | None, list | None]:
    """The Responses API's flat function tools and tool_choice, as the chat route's plan (and
    the chat-shaped tools the template renders)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ProtocolError("'tool_choice' needs 'tools'", param="tool_choice")
        return None, None
    if not isinstance(tools, list):
        raise ProtocolError("'tools' must be a list", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ProtocolError(f"tools[{i}] is of type {kind!r}: only function tools are "
                                "served", param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        chat_tools.append({"type": "function", "function": fn})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ProtocolError("'tool_choice' must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    plan = parse_tools({"tools": chat_tools, "tool_choice": choice,
                        "parallel_tool_calls": body.get("parallel_tool_calls")}, parser)
    return plan, chat_tools


def _text_format(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the guided field for `text.format`, the `text` object the response repeats)."""
    text = body.get("text")
    if text is None:
        return {}, {"format": {"type": "text"}}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return {}, {"format": {"type": "text"}}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}, {"format": fmt}
    if kind == "json_object":
        return {"guided_json": {"type": "object"}}, {"format": fmt}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ProtocolError("'text.format.schema' must be a JSON Schema object",
                                param="text")
        return {"guided_json": schema}, {"format": fmt}
    raise ProtocolError("'text.format' must be {'type': 'text' | 'json_object' | "
                        "'json_schema', ...}", param="text")


def _item_id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else f"{prefix}_{secrets.token_hex(12)}"


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A (valid) request's `input` as the items `GET /v1/responses/{id}/input_items` lists:
    messages with their text parts, function calls and their outputs, each with an id (its
    own, or a new one)."""
    given = body.get("input")
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "function_call":
            items.append({"id": _item_id(item, "fc"), "type": kind, "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"],
                          "status": "completed"})
            continue
        if kind == "function_call_output":
            items.append({"id": _item_id(item, "fco"), "type": kind,
                          "call_id": item["call_id"], "output": item["output"],
                          "status": "completed"})
            continue
        part = "output_text" if item["role"] == "assistant" else "input_text"
        content = item.get("content")
        texts = [content] if isinstance(content, str) else [p["text"] for p in content]
        parts = [{"type": part, "text": t} for t in texts]
        if part == "output_text":
            for p in parts:
                p["annotations"] = []
        items.append({"id": _item_id(item, "msg"), "type": "message", "role": item["role"],
                      "content": parts, "status": "completed"})
    return items


def parse_responses(body: Any, model_name: str | Sequence[str], tool_parser: str | None = None,
                    sampling_defaults: Mapping[str, Any] | None = None,
                    store: Any = None) -> ResponsesRequest:
    """A `/v1/responses` body as a ResponsesRequest; ProtocolError (a 400, 404 for another
    model or an unknown previous response) for anything it cannot serve as asked.
    `tool_parser`: how the model writes its own tool calls (`tools.AUTO_PARSERS`), so
    tool_choice "auto" is served; `store`: the server's `ResponseStore`, or None."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = check_model(body, model_name)
    for key, why in REFUSED.items():
        if body.get(key) not in (None, False, [], {}):
            raise ProtocolError(f"'{key}' is not supported: {why}", param=key)
    keep = body.get("store", True)
    if not isinstance(keep, (bool, type(None))):
        raise ProtocolError("'store' must be a boolean", param="store")
    previous = _previous_conversation(body.get("previous_response_id"), store)
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != LOGPROBS_INCLUDE for x in include):
        raise ProtocolError(f"'include' may only hold {LOGPROBS_INCLUDE!r} here (nothing else "
                            "is kept to include)", param="include")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= MAX_LOGPROBS):
        raise ProtocolError(f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}]",
                            param="top_logprobs")
    if top and not include:
        raise ProtocolError(f"'top_logprobs' needs 'include': [{LOGPROBS_INCLUDE!r}]",
                            param="top_logprobs")
    stream = stream_flag(body)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ProtocolError("'metadata' must be a map of at most 16 string keys to string "
                            "values", param="metadata")
    conversation = _messages(body, previous)
    messages = _instructions(body) + conversation
    guided, text = _text_format(body)
    plan, chat_tools = _tool_plan(body, tool_parser)
    if include and plan is not None:
        raise ProtocolError("logprobs are not served together with tools", param="include")
    if plan is not None and plan.forced:
        if guided:
            raise ProtocolError("a forced tool call cannot be combined with 'text.format'",
                                param="tool_choice")
        guided = {"guided_json": plan.schema}
    fields = {k: body[k] for k in EXTRAS if k in body}
    fields.update(guided)
    if plan is not None and plan.keeps_special_tokens and \
            fields.get("skip_special_tokens") is None:
        fields["skip_special_tokens"] = False
    if include:
        fields["logprobs"] = top or 0
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p")):
        if body.get(theirs) is not None:
            fields[ours] = body[theirs]
    params = sampling_params_from(fields, defaults=under_door_defaults(sampling_defaults or {},
                                                                       {"max_tokens": None}),
                                  output_kind="delta" if stream else "final")
    echo = {"instructions": body.get("instructions"), "metadata": metadata or {},
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": params.temperature, "top_p": params.top_p, "text": text,
            "tools": list(body.get("tools") or []),
            "tool_choice": body.get("tool_choice") or ("auto" if plan else "none"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "store": store is not None and keep is not False}
    req = ResponsesRequest(messages, params, stream, model, echo, plan,
                           {"tools": chat_tools} if chat_tools else None,
                           conversation=conversation, store=echo["store"])
    req.input_items = input_items(body)
    return req


def _previous_conversation(response_id: Any, store: Any) -> list[dict[str, Any]] | None:
    """The conversation `previous_response_id` continues (None without one); ProtocolError for
    a server without a store (400) or an id it does not hold (404)."""
    if response_id is None:
        return None
    if not isinstance(response_id, str) or not response_id:
        raise ProtocolError("'previous_response_id' must be a response id",
                            param="previous_response_id")
    if store is None:
        raise ProtocolError(f"'previous_response_id' is not supported: {NO_STORE}",
                            param="previous_response_id")
    stored = store.get(response_id)
    if stored is None:
        shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
        raise ProtocolError(f"previous response {shown!r} not found (never stored, deleted, "
                            f"or evicted: the store keeps the last {store.max_responses})",
                            code=404, param="previous_response_id")
    return stored.conversation


# -- the response object and the stream's events -------------------------------------------------

def text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(req: ResponsesRequest, text: str | None, status: str,
                  logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "message", "id": req.item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text, logprobs)]}


def reasoning_item(req: ResponsesRequest, text: str | None, status: str) -> dict[str, Any]:
    """The `reasoning` output item (`text` None: opened, no content yet)."""
    return {"type": "reasoning", "id": req.reasoning_id, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """A `function_call` output item from a chat-shaped tool call (`arguments` None: whole;
    "" while its arguments stream)."""
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress"}


def response_object(req: ResponsesRequest, status: str, text: str | None = None,
                    calls: list[dict[str, Any]] | None = None,
                    usage: tuple[int, ...] | None = None,
                    error: str | None = None, logprobs: list | None = None,
                    reasoning: str | None = None) -> dict[str, Any]:
    """The `response` object: `status` "in_progress" (no output yet), "completed",
    "incomplete" (cut by max_output_tokens or the context) or "failed". The output is the
    reasoning item (with a reasoning parser, when the reply had a reasoning part), the message
    (when there is text, or no call) and then one `function_call` item per call. `usage`:
    (input tokens, output tokens, cached input tokens[, reasoning output tokens])."""
    out: dict[str, Any] = {
        "id": req.id, "object": "response", "created_at": req.created_at, "model": req.model,
        "status": status, "output": [], "error": None, "incomplete_details": None,
        "usage": None, **req.echo}
    if text is not None:
        if reasoning is not None:
            out["output"].append(reasoning_item(req, reasoning, "completed"))
        if text or not calls:
            out["output"].append(message_item(req, text, "incomplete" if status == "incomplete"
                                               else "completed", logprobs))
        out["output"] += [call_item(c) for c in calls or ()]
    if status == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    if error is not None:
        out["error"] = {"code": "server_error", "message": error}
    if usage is not None:
        prompt, generated, cached, *thought = usage
        out["usage"] = {"input_tokens": prompt, "output_tokens": generated,
                        "total_tokens": prompt + generated,
                        "input_tokens_details": {"cached_tokens": cached,
                                                 "cache_write_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": thought[0] if thought
                                                  else 0}}
    return out


def status_of(finish_reason: str | None, error: str | None,
            calls: list[dict[str, Any]] | None = None) -> str:
    if error is not None or finish_reason in ("error", "abort"):
        return "failed"
    return "incomplete" if finish_reason == "length" and not calls else "completed"
