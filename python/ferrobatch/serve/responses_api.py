"""`POST /v1/responses`: OpenAI's Responses API for text generation (what `client.responses
.create` sends), on the chat path: the input is rendered by the model's chat template.

Served: `input` as text or a list of messages (roles user, system, developer, assistant; content
as text or `input_text` / `output_text` parts), `instructions` (a system message first),
`max_output_tokens`, `temperature`, `top_p`, `text.format` (`text`, `json_object`,
`json_schema`: guided decoding), `metadata` (echoed), `include:
["message.output_text.logprobs"]` with `top_logprobs`, `stream` (the typed events:
`response.created` ... `response.output_text.delta` ... `response.completed`), and the vLLM
sampling extras the other routes take (`top_k`, `min_p`, `repetition_penalty`, `seed`, `stop`,
...). Function tools as on the chat route (`tools.py`): `tool_choice` "required" or a named
function guide the output to be the call(s); "auto" is served for models that write Hermes
`<tool_call>` blocks. The calls come back as `function_call` output items, and the next turn's
`function_call` / `function_call_output` input items become the chat template's assistant
tool calls and tool messages. With `serve --enable-response-store` finished responses are kept
in memory (`response_store.py`; `store: false` opts a response out): `previous_response_id`
continues one, `GET` / `DELETE /v1/responses/{id}` find and forget them, `GET
/v1/responses/{id}/input_items` lists what their input held; without it
`previous_response_id` is refused. `conversation` and `background` are refused, as are other
tool types, reasoning items and non-text input (images, files), each with a 400 naming the
field, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ferrobatch.serve.codec import dumps_json
from ferrobatch.serve.http import error_response, read_json, reply_parts, start_one
from ferrobatch.serve.logprobs import chat_logprobs
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.reasoning import (
    ReasoningSplitter,
    count_reasoning_tokens,
)
from ferrobatch.serve.request_ids import object_id
from ferrobatch.serve.response_store import assistant_turn
from ferrobatch.serve.responses_protocol import (
    ResponsesRequest,
    call_item,
    message_item,
    parse_responses,
    reasoning_item,
    response_object,
    status_of,
    text_part,
)
from ferrobatch.serve.sse import SSEWriter
from ferrobatch.serve.state import STATE
from ferrobatch.serve.tools import ToolOutputStream


def _logprob_items(request: web.Request, entries: Any) -> list[dict[str, Any]]:
    """The output_text logprobs of `entries` (chat's shape: token, logprob, bytes, top)."""
    return chat_logprobs(entries or (), request.app[STATE].token_strings())["content"]


class _Events(SSEWriter):
    """The stream's SSE events (`event: <type>`, `data: <json>`), numbered in order; no
    `[DONE]` at the end (the Responses API ends with its `response.*` event)."""

    def __init__(self, request: web.Request) -> None:
        super().__init__(request)
        self._seq = 0

    async def emit(self, kind: str, **fields: Any) -> None:
        """Raises ConnectionResetError once the client has gone."""
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        await self.response.write(f"event: {kind}\ndata: ".encode() + dumps_json(data).encode()
                                  + b"\n\n")


async def responses(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`."""
    state = request.app[STATE]
    req = parse_responses(await read_json(request), state.model_names,
                          tool_parser=state.tool_call_parser,
                          sampling_defaults=state.engine.default_sampling_fields,
                          store=state.responses)
    req.id = object_id(request, "resp_", req.id)
    # a guided reply's grammar applies after its reasoning (guided/after_reasoning.py)
    req.reasoning_parser = state.reasoning_parser
    stream = await start_one(request, req.params, req.model, messages=req.messages,
                             chat_options=req.chat_options,
                             reasoning_parser=req.reasoning_parser)
    try:
        if req.stream:
            return await _stream(request, req, stream)
        last = None
        async for out in stream:
            last = out
        if last.error:                    # as the other routes: the engine's error, a 500
            return error_response(500, last.error, "server_error")
        c = last.outputs[0]
        reasoning, text, calls = reply_parts(req.tools, req.reasoning_parser, c.text,
                                             c.finish_reason)
        logprobs = _logprob_items(request, c.logprobs) if req.params.logprobs is not None \
            else None
        final = response_object(
            req, status_of(c.finish_reason, None, calls), text, calls,
            (len(stream.prompt_token_ids), len(c.token_ids), last.num_cached_tokens or 0,
             _reasoning_tokens(request, req, c.token_ids)),
            logprobs=logprobs, reasoning=reasoning)
        _keep(request, req, final, text, calls)
        return web.json_response(final)
    finally:
        stream.abort()


def _keep(request: web.Request, req: ResponsesRequest, final: dict[str, Any], text: str | None,
          calls: list[dict[str, Any]] | None) -> None:
    """Stores a finished response (`store`, on a server with a store) with its conversation:
    what a later `previous_response_id` continues."""
    store = request.app[STATE].responses
    if req.store and store is not None and final["status"] in ("completed", "incomplete"):
        store.put(final, req.conversation + [assistant_turn(text, calls)], req.input_items)


async def stored_response(request: web.Request) -> web.Response:
    """`GET` / `DELETE /v1/responses/{id}`, `POST .../cancel`, `GET .../input_items`: the
    stored response, its deletion, (no response runs in the background) a 400, or the items of
    its `input` a page at a time; a 404 for one not stored (the SDK's `responses.retrieve`
    raises NotFoundError with it)."""
    rid = request.match_info["response_id"]
    shown = rid if len(rid) <= 64 and rid.replace("_", "").isalnum() else "this id"
    store = request.app[STATE].responses
    stored = None if store is None else store.get(rid)
    if stored is None:
        why = (f"the store keeps the last {store.max_responses} responses" if store is not None
               else "this server keeps no responses (start it with --enable-response-store)")
        return error_response(404, f"response {shown} is not stored: {why}", "not_found_error")
    if request.method == "DELETE":
        store.delete(rid)
        return web.json_response({"id": rid, "object": "response", "deleted": True})
    if request.path.endswith("/input_items"):
        return web.json_response(input_items_page(stored.input_items, request.query))
    if request.path.endswith("/cancel"):
        return error_response(400, f"response {shown} is finished: only background responses "
                              "can be cancelled, and none run here", "invalid_request_error")
    return web.json_response(stored.response)


def input_items_page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of a stored response's input items (OpenAI's cursor list): ``order`` "desc"
    (the default: the last item first) or "asc", ``limit`` 1..100 (20), ``after`` / ``before``
    an item id the page starts after / ends before."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ProtocolError("'order' must be 'asc' or 'desc'", param="order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise ProtocolError("'limit' must be an integer in 1..100", param="limit")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for name in ("after", "before"):
        cursor = query.get(name)
        if cursor is not None:
            if cursor not in ids:
                raise ProtocolError(f"'{name}' names no input item of this response",
                                    param=name)
            if name == "after":
                start = ids.index(cursor) + 1
            else:
                end = ids.index(cursor)
    page = ordered[start:end][:int(limit)]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + len(page) < end}


class _ReasoningEvents:
    """The reasoning item's events (a reasoning parser): opened at the reply's first reasoning
    text, closed when the answer starts or the reply ends; always output 0."""

    def __init__(self, events: _Events, req: ResponsesRequest) -> None:
        self.events, self.req = events, req
        self.ids = dict(item_id=req.reasoning_id, output_index=0, content_index=0)
        self.opened = self.closed = False
        self.text: list[str] = []

    async def delta(self, text: str) -> None:
        if not self.opened:
            self.opened = True
            await self.events.emit("response.output_item.added", output_index=0,
                                   item=reasoning_item(self.req, None, "in_progress"))
        if text:
            self.text.append(text)
            await self.events.emit("response.reasoning_text.delta", delta=text, **self.ids)

    async def close(self) -> None:
        if self.opened and not self.closed:
            self.closed = True
            whole = "".join(self.text)
            await self.events.emit("response.reasoning_text.done", text=whole, **self.ids)
            await self.events.emit("response.output_item.done", output_index=0,
                                   item=reasoning_item(self.req, whole, "completed"))


class _MessageEvents:
    """The message item's events, opened at its first text (or at once without tools or a
    reasoning parser); output 1 after a reasoning item, else 0."""

    def __init__(self, events: _Events, req: ResponsesRequest) -> None:
        self.events, self.req = events, req
        self.ids = dict(item_id=req.item_id, output_index=0, content_index=0)
        self.opened = False
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []

    async def open(self, output_index: int = 0) -> None:
        if not self.opened:
            self.opened = True
            self.ids["output_index"] = output_index
            await self.events.emit("response.output_item.added", output_index=output_index,
                                   item=message_item(self.req, None, "in_progress"))
            await self.events.emit("response.content_part.added", part=text_part(""), **self.ids)

    async def delta(self, text: str, logprobs: list | None = None,
                    output_index: int = 0) -> None:
        if text or logprobs:
            await self.open(output_index)
            self.text.append(text)
            self.logprobs += logprobs or ()
            await self.events.emit("response.output_text.delta", delta=text,
                                   logprobs=logprobs or [], **self.ids)

    async def close(self, item: dict[str, Any]) -> None:
        whole = "".join(self.text)
        await self.events.emit("response.output_text.done", text=whole,
                               logprobs=self.logprobs, **self.ids)
        await self.events.emit("response.content_part.done", part=text_part(whole, self.logprobs),
                               **self.ids)
        await self.events.emit("response.output_item.done",
                               output_index=self.ids["output_index"], item=item)


def _reasoning_tokens(request: web.Request, req: ResponsesRequest, token_ids: list[int]) -> int:
    """How many of the reply's tokens are its reasoning (0 without a reasoning parser)."""
    if req.reasoning_parser is None:
        return 0
    return count_reasoning_tokens(req.reasoning_parser, token_ids,
                                  request.app[STATE].token_strings().text)


async def _stream(request: web.Request, req: ResponsesRequest, stream: Any) -> web.StreamResponse:
    events = _Events(request)
    message = _MessageEvents(events, req)
    # tools: a forced call is held whole; "auto" passes text until a <tool_call> may start
    tool_stream = ToolOutputStream(req.tools) if req.tools is not None else None
    splitter = ReasoningSplitter(req.reasoning_parser) if req.reasoning_parser else None
    thinking = _ReasoningEvents(events, req)

    def message_index() -> int:
        return 1 if thinking.opened else 0

    try:
        await events.open()
        await events.emit("response.created", response=response_object(req, "in_progress"))
        await events.emit("response.in_progress", response=response_object(req, "in_progress"))
        if req.tools is None and splitter is None:
            await message.open()
        raw, generated, finish, error, cached = [], 0, None, None, 0
        token_ids: list[int] = []
        async for out in stream:
            cached = out.num_cached_tokens or cached
            c = out.outputs[0]
            generated += len(c.token_ids)
            token_ids += c.token_ids
            raw.append(c.text)
            text = c.text
            if splitter is not None:
                reasoning, text = splitter.feed(c.text)
                if c.finish_reason is not None:
                    more_reasoning, more_text = splitter.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
                if reasoning or (splitter.saw_reasoning and not thinking.opened):
                    await thinking.delta(reasoning)
                if text or c.finish_reason is not None:
                    await thinking.close()          # the answer has begun (or the reply ended)
            if tool_stream is not None:
                await message.delta(tool_stream.feed(text), output_index=message_index())
            else:                 # (logprobs are asked for only without tools)
                await message.delta(text, _logprob_items(request, c.logprobs)
                                    if req.params.logprobs is not None else None,
                                    output_index=message_index())
            finish, error = c.finish_reason, out.error
        await thinking.close()
        # what was held back: the calls, or text after all
        rest, calls = tool_stream.finish(finish) if tool_stream is not None else ("", None)
        status = status_of(finish, error, calls)
        usage = (len(stream.prompt_token_ids), generated, cached,
                 _reasoning_tokens(request, req, token_ids))
        reasoning_text = "".join(thinking.text) if thinking.opened else None
        if status == "failed":
            await events.emit("response.failed", response=response_object(
                req, status, "".join(raw), None, usage, error or "the request was aborted"))
        else:
            await message.delta(rest, output_index=message_index())
            final = response_object(req, status, "".join(message.text), calls, usage,
                                    logprobs=message.logprobs, reasoning=reasoning_text)
            if message.opened or not calls:
                await message.open(message_index())
                await message.close(final["output"][message_index()])
            first_call = message_index() + (1 if message.opened else 0)
            for k, call in enumerate(calls or ()):
                index = first_call + k
                item = call_item(call)
                await events.emit("response.output_item.added", output_index=index,
                                  item=call_item(call, ""))
                await events.emit("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=index, delta=item["arguments"])
                await events.emit("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"])
                await events.emit("response.output_item.done", output_index=index, item=item)
            _keep(request, req, final, "".join(message.text), calls)
            await events.emit(f"response.{status}", response=final)
        await events.response.write_eof()
    except ConnectionError:
        pass                      # the client left: the caller's finally aborts the request
    return events.response
