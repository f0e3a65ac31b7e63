"""`POST /v1/responses`: OpenAI's Responses API for text generation (what `client.responses
.create` sends), on the chat path: the input is rendered by the model's chat template.

Served: `input` as text or a list of messages (roles user, system, developer, assistant; content
as text or `input_text` / `output_text` parts), `instructions` (a system message first),
`max_output_tokens`, `temperature`, `top_p`, `text.format` (`text`, `json_object`,
`json_schema`: guided decoding), `metadata` (echoed), `stream` (the typed events:
`response.created` ... `response.output_text.delta` ... `response.completed`), and the vLLM
sampling extras the other routes take (`top_k`, `min_p`, `repetition_penalty`, `seed`, `stop`,
...). Nothing is stored: `previous_response_id`, `conversation` and `background` are refused,
as are tools, reasoning items and non-text input (images, files), each with a 400 naming the
field, rather than silently ignored.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from aiohttp import web

from ferrobatch.sampling_params import SamplingParams
from ferrobatch.serve.codec import dumps_json
from ferrobatch.serve.http import error_response, read_json
from ferrobatch.serve.protocol import ProtocolError, sampling_params_from
from ferrobatch.serve.state import STATE

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# fields whose meaning this server cannot honour (no storage, no tools): refused, not ignored
REFUSED = {"previous_response_id": "nothing is stored on this server: send the whole "
           "conversation as 'input'",
           "conversation": "nothing is stored on this server: send the whole conversation as "
           "'input'",
           "background": "background responses need storage, which this server does not have",
           "prompt": "stored prompt templates are not supported",
           "tools": "tools are served on /v1/chat/completions, not on /v1/responses yet"}
# the Responses names of the sampling fields, and the vLLM extras taken as they are
EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "priority",
          "skip_special_tokens", "include_stop_str_in_output", "logit_bias")


class ResponsesRequest:
    """A parsed `/v1/responses` body: the conversation, the sampling, what is echoed back."""

    def __init__(self, messages: list[dict[str, str]], params: SamplingParams, stream: bool,
                 model: str, echo: dict[str, Any]) -> None:
        self.messages = messages
        self.params = params
        self.stream = stream
        self.model = model
        self.echo = echo                  # request fields the response object repeats
        self.id = f"resp_{secrets.token_hex(12)}"
        self.item_id = f"msg_{secrets.token_hex(12)}"
        self.created_at = int(time.time())


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


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    given = body.get("input")
    messages: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ProtocolError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
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
        if kind != "message":
            raise ProtocolError(f"{where} is of type {kind!r}: only messages are served (no "
                                "tool calls, tool outputs or reasoning items)", param="input")
        role = item.get("role")
        if role not in ROLES:
            raise ProtocolError(f"{where}.role must be one of {', '.join(ROLES)}",
                                param="input")
        messages.append({"role": role, "content": _text_of(item.get("content"), where)})
    return messages


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


def parse_responses(body: Any, model_name: str) -> ResponsesRequest:
    """A `/v1/responses` body as a ResponsesRequest; ProtocolError (a 400, 404 for another
    model) for anything it cannot serve as asked."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("'model' must be a string", param="model")
    if model not in (None, model_name):
        raise ProtocolError(f"The model '{model}' does not exist; this server serves "
                            f"'{model_name}'", code=404, param="model")
    for key, why in REFUSED.items():
        if body.get(key) not in (None, False, [], {}):
            raise ProtocolError(f"'{key}' is not supported: {why}", param=key)
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise ProtocolError("'tool_choice' needs tools, which /v1/responses does not serve yet",
                            param="tool_choice")
    if body.get("include"):
        raise ProtocolError("'include' is not supported (no logprobs or other extras on "
                            "/v1/responses yet)", param="include")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ProtocolError("'stream' must be a boolean", param="stream")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ProtocolError("'metadata' must be a map of at most 16 string keys to string "
                            "values", param="metadata")
    messages = _messages(body)
    guided, text = _text_format(body)
    fields = {k: body[k] for k in EXTRAS if k in body}
    fields.update(guided)
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p")):
        if body.get(theirs) is not None:
            fields[ours] = body[theirs]
    params = sampling_params_from(fields, defaults={"max_tokens": None},
                                  output_kind="delta" if stream else "final")
    echo = {"instructions": body.get("instructions"), "metadata": metadata or {},
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": params.temperature, "top_p": params.top_p, "text": text}
    return ResponsesRequest(messages, params, stream, model_name, echo)


# -- the response object and the stream's events -------------------------------------------------

def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(req: ResponsesRequest, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": req.item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [_part(text)]}


def response_object(req: ResponsesRequest, status: str, text: str | None = None,
                    finish_reason: str | None = None, usage: tuple[int, int, int] | None = None,
                    error: str | None = None) -> dict[str, Any]:
    """The `response` object: `status` "in_progress" (no output yet), "completed",
    "incomplete" (cut by max_output_tokens or the context) or "failed"."""
    out: dict[str, Any] = {
        "id": req.id, "object": "response", "created_at": req.created_at, "model": req.model,
        "status": status, "output": [], "parallel_tool_calls": False, "tool_choice": "none",
        "tools": [], "error": None, "incomplete_details": None, "usage": None, **req.echo}
    if text is not None:
        out["output"] = [_item(req, text, "incomplete" if status == "incomplete"
                               else "completed")]
    if status == "incomplete":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    if error is not None:
        out["error"] = {"code": "server_error", "message": error}
    if usage is not None:
        prompt, generated, cached = usage
        out["usage"] = {"input_tokens": prompt, "output_tokens": generated,
                        "total_tokens": prompt + generated,
                        "input_tokens_details": {"cached_tokens": cached,
                                                 "cache_write_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": 0}}
    return out


def _status(finish_reason: str | None, error: str | None) -> str:
    if error is not None or finish_reason in ("error", "abort"):
        return "failed"
    return "incomplete" if finish_reason == "length" else "completed"


class _Events:
    """The stream's SSE events (`event: <type>`, `data: <json>`), numbered in order."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})
        self._seq = 0

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, kind: str, **fields: Any) -> None:
        """Raises ConnectionResetError once the client has gone."""
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        await self.response.write(f"event: {kind}\ndata: ".encode() + dumps_json(data).encode()
                                  + b"\n\n")


async def responses(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`."""
    state = request.app[STATE]
    req = parse_responses(await read_json(request), state.model_name)
    engine = state.engine
    await engine.prepare(req.params, messages=req.messages)
    stream = engine.add_request(None, req.params, messages=req.messages)
    try:
        if req.stream:
            return await _stream(request, req, stream)
        last = None
        async for out in stream:
            last = out
        if last.error:                    # as the other routes: the engine's error, a 500
            return error_response(500, last.error, "server_error")
        c = last.outputs[0]
        return web.json_response(response_object(
            req, _status(c.finish_reason, None), c.text, c.finish_reason,
            (len(stream.prompt_token_ids), len(c.token_ids), last.num_cached_tokens or 0)))
    finally:
        stream.abort()


async def _stream(request: web.Request, req: ResponsesRequest, stream: Any) -> web.StreamResponse:
    events = _Events(request)
    ids = dict(item_id=req.item_id, output_index=0, content_index=0)
    try:
        await events.open()
        await events.send("response.created", response=response_object(req, "in_progress"))
        await events.send("response.in_progress", response=response_object(req, "in_progress"))
        await events.send("response.output_item.added", output_index=0,
                          item=_item(req, None, "in_progress"))
        await events.send("response.content_part.added", part=_part(""), **ids)
        text, generated, finish, error, cached = [], 0, None, None, 0
        async for out in stream:
            cached = out.num_cached_tokens or 0
            c = out.outputs[0]
            generated += len(c.token_ids)
            if c.text:
                text.append(c.text)
                await events.send("response.output_text.delta", delta=c.text, logprobs=[],
                                  **ids)
            finish, error = c.finish_reason, out.error
        whole = "".join(text)
        status = _status(finish, error)
        if status == "failed":
            await events.send("response.failed", response=response_object(
                req, status, whole, finish, (len(stream.prompt_token_ids), generated, cached),
                error or "the request was aborted"))
        else:
            await events.send("response.output_text.done", text=whole, logprobs=[], **ids)
            await events.send("response.content_part.done", part=_part(whole), **ids)
            final = response_object(req, status, whole, finish,
                                    (len(stream.prompt_token_ids), generated, cached))
            await events.send("response.output_item.done", output_index=0,
                              item=final["output"][0])
            await events.send(f"response.{status}", response=final)
        await events.response.write_eof()
    except ConnectionError:
        pass                      # the client left: the caller's finally aborts the request
    return events.response
