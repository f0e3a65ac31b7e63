"""``POST /v1/messages`` (Anthropic's Messages API, streamed or whole) and ``POST
/v1/messages/count_tokens``, on the chat path: the request becomes the chat route's
(serve/anthropic_protocol.py), the model's chat template renders it, and the reply comes back in
Anthropic's shapes. A stream is Anthropic's events: ``message_start``, ``ping``, per content
block ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``thinking_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason, output
tokens) and ``message_stop``; a failure mid-stream is an ``error`` event. Errors before the
reply are Anthropic's error objects with the matching status. The API key is accepted as
``x-api-key`` (the ``anthropic`` SDK's header) as well as ``Authorization: Bearer``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ferrobatch.serve.anthropic_protocol import (
    content_blocks,
    error_body,
    message_object,
    parse_messages,
    stop_reason,
    tool_use_block,
    usage,
)
from ferrobatch.serve.codec import dumps_json
from ferrobatch.serve.http import errors_shaped, failure_of, reply_parts, start_one
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.reasoning import ReasoningSplitter
from ferrobatch.serve.sse import SSEWriter
from ferrobatch.serve.state import STATE
from ferrobatch.serve.tools import ToolOutputStream

_anthropic_errors = errors_shaped(error_body)


@_anthropic_errors
async def messages(request: web.Request) -> web.StreamResponse:
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    req = parse_messages(await read_json(request), state.model_names,
                         tool_parser=state.tool_call_parser,
                         sampling_defaults=state.engine.default_sampling_fields)
    req.reasoning_parser = state.reasoning_parser
    stream = await start_one(request, req.params, req.model, messages=req.messages,
                             chat_options=req.chat_template,
                             reasoning_parser=req.reasoning_parser)
    try:
        if req.stream:
            return await _stream(request, req, stream)
        last = None
        async for out in stream:
            last = out
        why = failure_of(last)
        if why is not None:
            return web.json_response(error_body(500, why), status=500)
        c = last.outputs[0]
        reasoning, text, calls = reply_parts(req.tools, req.reasoning_parser, c.text,
                                             c.finish_reason)
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, calls)
        return web.json_response(message_object(
            req, content_blocks(text, calls, reasoning), reason, sequence,
            usage(len(stream.prompt_token_ids), len(c.token_ids), last.num_cached_tokens or 0)))
    finally:
        stream.abort()


class _Events(SSEWriter):
    """Anthropic's stream: ``event: <type>`` and its data, and the content blocks' indices."""

    def __init__(self, request: web.Request) -> None:
        super().__init__(request)
        self.blocks = 0              # content blocks opened so far
        self.open_kind: str | None = None   # the kind of the block open now

    async def emit(self, kind: str, **fields: Any) -> None:
        """Raises ConnectionResetError once the client has gone."""
        await self.response.write(f"event: {kind}\ndata: ".encode()
                                  + dumps_json({"type": kind, **fields}).encode() + b"\n\n")

    async def open_block(self, block: dict[str, Any]) -> None:
        await self.close_block()
        self.open_kind = block["type"]
        await self.emit("content_block_start", index=self.blocks, content_block=block)

    async def delta(self, delta: dict[str, Any]) -> None:
        await self.emit("content_block_delta", index=self.blocks, delta=delta)

    async def close_block(self) -> None:
        if self.open_kind is not None:
            await self.emit("content_block_stop", index=self.blocks)
            self.open_kind = None
            self.blocks += 1


async def _stream(request: web.Request, req: Any, stream: Any) -> web.StreamResponse:
    events = _Events(request)
    tool_stream = ToolOutputStream(req.tools) if req.tools is not None else None
    splitter = ReasoningSplitter(req.reasoning_parser) if req.reasoning_parser else None

    async def text(piece: str) -> None:
        if piece:
            if events.open_kind != "text":
                await events.open_block({"type": "text", "text": ""})
            await events.delta({"type": "text_delta", "text": piece})

    try:
        await events.open()
        await events.emit("message_start", message=message_object(
            req, [], None, None, usage(len(stream.prompt_token_ids), 0, 0)))
        await events.emit("ping")
        if tool_stream is None and splitter is None:
            await events.open_block({"type": "text", "text": ""})
        generated, cached, last = 0, 0, None
        async for out in stream:
            last = out
            cached = out.num_cached_tokens or cached
            c = out.outputs[0]
            generated += len(c.token_ids)
            piece = c.text
            if splitter is not None:
                reasoning, piece = splitter.feed(c.text)
                if c.finish_reason is not None:
                    more_reasoning, more_text = splitter.finish()
                    reasoning, piece = reasoning + more_reasoning, piece + more_text
                if reasoning:
                    if events.open_kind != "thinking":
                        await events.open_block({"type": "thinking", "thinking": "",
                                                 "signature": ""})
                    await events.delta({"type": "thinking_delta", "thinking": reasoning})
            await text(tool_stream.feed(piece) if tool_stream is not None else piece)
        why = failure_of(last) if last is not None else "the request was aborted"
        if why is not None:
            await events.emit("error", error=error_body(500, why)["error"])
            await events.response.write_eof()
            return events.response
        c = last.outputs[0]
        rest, calls = tool_stream.finish(c.finish_reason) if tool_stream is not None \
            else ("", None)
        await text(rest)
        if events.open_kind is None and events.blocks == 0 and not calls:
            await events.open_block({"type": "text", "text": ""})     # an empty reply
        for call in calls or ():
            block = tool_use_block(call)
            await events.open_block({**block, "input": {}})
            await events.delta({"type": "input_json_delta",
                                "partial_json": call["function"]["arguments"]})
        await events.close_block()
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, calls)
        await events.emit("message_delta", delta={"stop_reason": reason,
                                                  "stop_sequence": sequence},
                          usage=usage(len(stream.prompt_token_ids), generated, cached))
        await events.emit("message_stop")
        await events.response.write_eof()
    except ConnectionError:
        pass                      # the client left: the caller's finally aborts the request
    return events.response


@_anthropic_errors
async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt tokens ``/v1/messages`` would take for
    the same body (the served model's tokenizer and chat template, tools included)."""
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    req = parse_messages({**body, "max_tokens": 1, "stream": False}, state.model_names,
                         tool_parser=state.tool_call_parser)
    engine = state.engine
    try:
        prompt = engine.render_chat(req.messages, **(req.chat_template or {}))
    except ValueError as exc:
        raise ProtocolError(str(exc), param="messages") from None
    return web.json_response({"input_tokens": len(engine.tokenizer.encode(
        prompt, add_special_tokens=False))})


def add_anthropic_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
