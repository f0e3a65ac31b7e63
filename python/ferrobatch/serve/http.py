"""HTTP door: OpenAI-compatible routes plus /health, /ready, /metrics, /version and /v1/models.

Every request is validated and submitted before the response starts, so bad input is a 4xx with
the OpenAI error object. Once streaming, a client that goes away (a failed write, or the handler
being cancelled) aborts the request; a `finally` aborts whatever is still running, always.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ferrobatch.serve.beam_http import beam_params_of, serve_beams
from ferrobatch.serve.codec import loads_json
from ferrobatch.serve.logprobs import (
    TokenIdStrings,
    chat_logprobs,
    completion_logprobs,
    echo_completion_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from ferrobatch.serve.lora_api import adapter_cards, add_lora_routes, lora_for
from ferrobatch.serve.openai_protocol import (
    OpenAIRequest,
    cached_total,
    choice,
    envelope,
    parse_chat,
    parse_completion,
    usage,
)
from ferrobatch.serve.protocol import ProtocolError, error_status
from ferrobatch.serve.reasoning import (
    ReasoningSplitter,
    count_reasoning_tokens,
    split_reasoning,
)
from ferrobatch.serve.request_ids import object_id
from ferrobatch.serve.sse import SSEWriter
from ferrobatch.serve.state import MAX_BODY_BYTES, STATE
from ferrobatch.serve.tools import ToolOutputStream, tool_calls_of

READY_TIMEOUT_S = 30.0


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": status}}, status=status, headers=headers)


def exception_parts(exc: BaseException) -> tuple[int, str, str, int | None]:
    """(status, OpenAI error type, the message a client may see, Retry-After or None) of an
    exception raised while serving a request: every door's errors say the same."""
    status, kind = error_status(exc)
    message = str(exc) if status < 500 or status == 503 else "internal server error"
    retry = getattr(exc, "retry_after_s", None) if status == 429 else None
    return status, kind, message, retry


def exception_response(exc: BaseException) -> web.Response:
    status, kind, message, retry = exception_parts(exc)
    resp = error_response(status, message, kind, getattr(exc, "param", None), retry_after=retry)
    if getattr(exc, "close_connection", False):
        resp.force_close()              # Connection: close
    return resp


def errors_shaped(shape: Callable[[int, str], dict[str, Any]]) -> Callable:
    """A route decorator for the doors of other APIs (Anthropic's, Ollama's): their errors
    leave as ``shape(status, message)`` with the OpenAI routes' statuses and messages (and
    their Retry-After / Connection: close), never a traceback."""
    def decorate(handler: Callable) -> Callable:
        @functools.wraps(handler)
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except ConnectionError:
                raise
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return web.json_response(shape(exc.status, exc.reason or "error"),
                                         status=exc.status)
            except Exception as exc:  # noqa: BLE001 - mapped to 4xx/5xx, never a traceback
                status, _, message, retry = exception_parts(exc)
                if status >= 500 and status != 503:
                    logging.getLogger("ferrobatch.serve").exception(
                        "unhandled error on %s", request.path)
                resp = web.json_response(shape(status, message), status=status)
                if retry is not None:
                    resp.headers["Retry-After"] = str(retry)
                if getattr(exc, "close_connection", False):
                    resp.force_close()
                return resp
        return wrapped
    return decorate


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ProtocolError(f"request body exceeds {MAX_BODY_BYTES} bytes",
                            code=413) from None
    except web.RequestPayloadError:       # e.g. a body that is not the gzip it claims
        # Marked ended (else aiohttp reads the rest after the answer, meets the same error and
        # logs it as unhandled); the connection cannot carry another request: closed.
        request.content.feed_eof()
        raise ProtocolError("the request body could not be decoded (is it in the "
                            "Content-Encoding it claims?)", close_connection=True) from None
    return loads_json(raw)


# -- OpenAI routes ---------------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_completion(body, state.model_names, state.engine.default_sampling_fields)
    req.id = object_id(request, "cmpl-", req.id)
    req.lora = lora_for(state, req.model)
    req.beam = beam_params_of(body, req.params, state.engine.default_sampling_fields)
    return await _serve(request, req)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_chat(body, state.model_names, tool_parser=state.tool_call_parser,
                     sampling_defaults=state.engine.default_sampling_fields)
    req.id = object_id(request, "chatcmpl-", req.id)
    req.lora = lora_for(state, req.model)
    # a guided reply's grammar applies after its reasoning (guided/after_reasoning.py)
    req.reasoning_parser = state.reasoning_parser
    req.beam = beam_params_of(body, req.params, state.engine.default_sampling_fields)
    return await _serve(request, req)


async def _serve(request: web.Request, req: OpenAIRequest) -> web.StreamResponse:
    if req.beam is not None:
        return await serve_beams(request, req)
    engine = request.app[STATE].engine
    streams: list[Any] = []
    # long prompts are tokenized, and a guided grammar compiled, off the event loop
    if req.kind == "chat":
        await engine.prepare(req.params, messages=req.messages, chat_options=req.chat_template,
                             lora_request=req.lora)
    else:
        for p in req.prompts:
            await engine.prepare(req.params, p, lora_request=req.lora)
    try:
        if req.kind == "chat":
            streams.append(engine.add_request(None, req.params, messages=req.messages,
                                              chat_options=req.chat_template,
                                              lora_request=req.lora,
                                              reasoning_parser=req.reasoning_parser))
        else:
            for p in req.prompts:
                streams.append(engine.add_request(p, req.params, lora_request=req.lora))
        if req.stream:
            return await _stream(request, req, streams)
        return await _collect(request, req, streams)
    finally:
        for s in streams:
            s.abort()


async def start_one(request: web.Request, params: Any, model: str, *, prompt: Any = None,
                    messages: Any = None, chat_options: dict[str, Any] | None = None,
                    reasoning_parser: str | None = None) -> Any:
    """One request of a door that translates to a single chat (`messages`) or prompt: its
    `model`'s adapter, the tokenizing (and a grammar's compile) off the event loop, then the
    engine's RequestStream (the caller aborts it in a `finally`)."""
    state = request.app[STATE]
    lora = lora_for(state, model)
    await state.engine.prepare(params, prompt, messages=messages, chat_options=chat_options,
                               lora_request=lora)
    if messages is not None:
        return state.engine.add_request(None, params, messages=messages,
                                        chat_options=chat_options, lora_request=lora,
                                        reasoning_parser=reasoning_parser)
    return state.engine.add_request(prompt, params, lora_request=lora)


def reply_parts(tools: Any, reasoning_parser: str | None, text: str,
                finish_reason: str | None) -> tuple[str | None, str, list[dict] | None]:
    """A finished reply as (its reasoning or None, the text shown, its tool calls or None):
    the reasoning parser's split, then the tool plan's calls (what every chat-like door
    answers with)."""
    reasoning = None
    if reasoning_parser is not None:
        reasoning, text = split_reasoning(reasoning_parser, text)
    calls = None
    if tools is not None:
        text, calls = tool_calls_of(tools, text, finish_reason)
    return reasoning, text, calls


def failure_of(out: Any) -> str | None:
    """Why a finished output is no reply (the engine's error, an abort), or None."""
    if out.error:
        return out.error
    if out.outputs[0].finish_reason in ("abort", "error"):
        return "the request was aborted"
    return None


async def _merged(streams: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several request streams, as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: Any) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _token_strings(request: web.Request, req: OpenAIRequest) -> Any:
    """How logprobs show tokens: their text, or `token_id:<id>` with
    `return_tokens_as_token_ids` (the request's, or the server's default)."""
    state = request.app[STATE]
    as_ids = req.return_tokens_as_token_ids
    if as_ids is None:
        as_ids = state.return_tokens_as_token_ids
    return TokenIdStrings() if as_ids else state.token_strings()


def _logprobs_shape(request: web.Request, req: OpenAIRequest, entries: Any,
                    offset: int = 0) -> tuple[dict[str, Any] | None, int]:
    """The route's logprobs object for `entries` (None when not asked for), and the completions
    text offset after them."""
    if entries is None:
        return None, offset
    strings = _token_strings(request, req)
    if req.kind == "chat":
        return chat_logprobs(entries, strings), offset
    return completion_logprobs(entries, strings, offset)


def _echo(request: web.Request, req: OpenAIRequest,
          out: Any) -> tuple[str, dict[str, Any] | None, int]:
    """What `echo` puts before a choice: the prompt's text, and with logprobs its completions
    logprobs object and the text offset after it."""
    text = out.prompt
    if text is None:
        text = request.app[STATE].engine.tokenizer.decode(out.prompt_token_ids,
                                                          skip_special_tokens=False)
    if req.params.logprobs is None:
        return text, None, 0
    obj, offset = echo_completion_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                           _token_strings(request, req))
    return text, obj, offset


def _with_echo(request: web.Request, req: OpenAIRequest, prompt_out: Any, text: str,
               entries: Any) -> tuple[str, dict[str, Any] | None, int]:
    """A choice's text and logprobs object led by its echoed prompt; and the offset after."""
    echo_text, echo_lp, offset = _echo(request, req, prompt_out)
    lp, offset = _logprobs_shape(request, req, entries, offset)
    if echo_lp is not None and lp is not None:
        lp = joined(echo_lp, lp)
    return echo_text + text, lp, offset


async def _collect(request: web.Request, req: OpenAIRequest, streams: list[Any]) -> web.Response:
    n = req.params.n
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    logprobs: dict[int, Any] = {}
    token_ids: dict[int, list[int]] = {}
    last: dict[int, Any] = {}                 # prompt index -> its latest output (echo)
    completion = 0
    async for i, out in _merged(streams):
        if out.error:
            return error_response(500, out.error, "server_error")
        last[i] = out
        for c in out.outputs:
            texts[i * n + c.index] = c.text
            reasons[i * n + c.index] = c.finish_reason
            logprobs[i * n + c.index] = c.logprobs
            token_ids[i * n + c.index] = c.token_ids
            completion += len(c.token_ids)
    prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
    choices = []
    for k in sorted(texts):
        if req.echo:
            text, lp, _ = _with_echo(request, req, last[k // n], texts[k], logprobs[k])
        else:
            text, lp = texts[k], _logprobs_shape(request, req, logprobs[k])[0]
        reasoning, text, calls = reply_parts(req.tools, req.reasoning_parser, text, reasons[k])
        choices.append(choice(req, k, text, reasons[k], stream=False, logprobs=lp,
                              tool_calls=calls, reasoning=reasoning))
        if req.return_token_ids:
            choices[-1]["token_ids"] = token_ids[k]
            if req.kind == "completion":
                choices[-1]["prompt_token_ids"] = streams[k // n].prompt_token_ids
        if req.prompt_logprobs is not None and req.kind == "completion":
            choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(
                streams[k // n].prompt_token_ids, last[k // n].prompt_logprobs,
                request.app[STATE].token_strings())
    body = envelope(req, choices, chunk=False,
                    usage_=usage(prompt_tokens, completion, cached_total(last.values()),
                                 _reasoning_tokens(request, req, token_ids)))
    if req.return_token_ids and req.kind == "chat":
        body["prompt_token_ids"] = streams[0].prompt_token_ids
    if req.prompt_logprobs is not None and req.kind == "chat":
        body["prompt_logprobs"] = vllm_prompt_logprobs(
            streams[0].prompt_token_ids, last[0].prompt_logprobs,
            request.app[STATE].token_strings())
    return web.json_response(body)


def _reasoning_tokens(request: web.Request, req: OpenAIRequest,
                      token_ids: dict[int, list[int]]) -> int | None:
    """The choices' reasoning tokens together, with a reasoning parser (else None)."""
    if req.reasoning_parser is None:
        return None
    strings = request.app[STATE].token_strings()
    return sum(count_reasoning_tokens(req.reasoning_parser, ids, strings.text)
               for ids in token_ids.values())


async def _stream(request: web.Request, req: OpenAIRequest,
                  streams: list[Any]) -> web.StreamResponse:
    n = req.params.n
    sse = SSEWriter(request)
    completion = 0
    offsets: dict[int, int] = {}      # per choice: completions' text_offset so far
    prompt_outs: dict[int, Any] = {}  # prompt index -> the output with its prompt logprobs
    latest: dict[int, Any] = {}       # prompt index -> its latest output (cached tokens)
    tool_streams: dict[int, ToolOutputStream] = {}   # per choice, with a tool plan
    splitters: dict[int, ReasoningSplitter] = {}     # per choice, with a reasoning parser
    token_ids: dict[int, list[int]] = {}              # per choice, with a reasoning parser
    unsent_ids: dict[int, list[int]] = {}   # per choice, `return_token_ids`: not in a chunk yet
    prompt_ids_sent: set[int] = set()       # completions' choices whose prompt ids went out
    prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)

    def with_token_ids(chunk_choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`return_token_ids`: each choice's first chunk of this output takes its token ids
        not sent yet (completions' first chunk of a choice also its prompt's ids)."""
        for ch in chunk_choices if req.return_token_ids else ():
            k = ch["index"]
            if k in unsent_ids:
                ch["token_ids"] = unsent_ids.pop(k)
                if req.kind == "completion" and k not in prompt_ids_sent:
                    prompt_ids_sent.add(k)
                    ch["prompt_token_ids"] = streams[k // n].prompt_token_ids
        return chunk_choices

    def so_far() -> dict[str, int] | None:
        """A chunk's usage: the running counts with `continuous_usage_stats`, else null."""
        return (usage(prompt_tokens, completion, cached_total(latest.values()))
                if req.continuous_usage else None)

    # Chat's role chunk goes out with the first output, not at once: clients (`vllm bench
    # serve`) take the first chunk with choices as the first token, so an early role chunk
    # would hide the queueing and prefill time from their TTFT.
    role_sent = req.kind != "chat"
    try:
        await sse.open()
        async for i, out in _merged(streams):
            if out.error:
                await sse.send({"error": {"message": out.error, "type": "server_error",
                                          "param": None, "code": 500}})
                break
            if not role_sent:
                role_sent = True
                forced = req.tools is not None and req.tools.forced
                content = None if forced else ""                    # as OpenAI's first chunks
                first = envelope(req, [
                    {"index": k, "delta": {"role": "assistant", "content": content},
                     "logprobs": None, "finish_reason": None} for k in range(n)],
                    chunk=True, usage_=so_far())
                if req.return_token_ids:
                    first["prompt_token_ids"] = streams[0].prompt_token_ids
                await sse.send(first)
            latest[i] = out
            if out.prompt_logprobs is not None:
                prompt_outs[i] = out          # a delta stream carries them once
            choices, finishes = [], []
            for c in out.outputs:
                completion += len(c.token_ids)
                k = i * n + c.index
                if req.return_token_ids:
                    unsent_ids.setdefault(k, []).extend(c.token_ids)
                if req.reasoning_parser is not None:
                    token_ids.setdefault(k, []).extend(c.token_ids)
                asked = req.params.logprobs is not None
                text, reasoning = c.text, ""
                if req.reasoning_parser is not None:
                    rs = splitters.setdefault(k, ReasoningSplitter(req.reasoning_parser))
                    reasoning, text = rs.feed(c.text)
                    if c.finish_reason is not None:
                        more_reasoning, more_text = rs.finish()
                        reasoning, text = reasoning + more_reasoning, text + more_text
                if req.tools is not None:    # a forced call goes out whole, once complete;
                    # "auto" text streams until a <tool_call> block may start
                    ts = tool_streams.setdefault(k, ToolOutputStream(req.tools))
                    ts.entries.extend(c.logprobs or ())
                    out_text, calls = ts.feed(text), None
                    if c.finish_reason is not None:
                        rest, calls = ts.finish(c.finish_reason)
                        out_text += rest
                    if out_text or reasoning or c.finish_reason is not None:
                        lp = _logprobs_shape(request, req, ts.entries if asked else None)[0]
                        ts.entries = []         # a token's entry goes with its text's chunk
                        if calls:      # the calls, then the finish in a chunk of its own (as
                            # OpenAI: the SDK's stream helper closes a call on that chunk)
                            choices.append(choice(req, k, out_text, None, stream=True,
                                                  logprobs=lp, tool_calls=calls,
                                                  reasoning=reasoning))
                            finishes.append(choice(req, k, "", c.finish_reason, stream=True,
                                                   tool_calls=[]))
                        else:
                            choices.append(choice(req, k, out_text, c.finish_reason,
                                                  stream=True, logprobs=lp,
                                                  reasoning=reasoning))
                elif req.echo and k not in offsets:          # the choice's first chunk
                    text, lp, offsets[k] = _with_echo(request, req, prompt_outs.get(i, out),
                                                      c.text, c.logprobs)
                    choices.append(choice(req, k, text, c.finish_reason, stream=True,
                                          logprobs=lp))
                elif text or reasoning or c.finish_reason is not None or c.logprobs:
                    lp, offsets[k] = _logprobs_shape(request, req, c.logprobs, offsets.get(k, 0))
                    choices.append(choice(req, k, text, c.finish_reason, stream=True,
                                          logprobs=lp, reasoning=reasoning))
            if choices:
                await sse.send(envelope(req, with_token_ids(choices), chunk=True,
                                        usage_=so_far()))
            if finishes:
                await sse.send(envelope(req, finishes, chunk=True, usage_=so_far()))
        if req.include_usage:
            await sse.send(envelope(req, [], chunk=True,
                                    usage_=usage(prompt_tokens, completion,
                                                 cached_total(latest.values()),
                                                 _reasoning_tokens(request, req, token_ids))))
        await sse.close()
    except ConnectionError:
        pass                        # the client left: the finally in _serve aborts the request
    return sse.response


# -- service routes ----------------------------------------------------------------------------

def _model_card(state, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created,
            "owned_by": "ferrobatch", "root": state.engine.model_name,
            "max_model_len": state.engine.max_model_len}


def _anthropic_card(state, card: dict[str, Any]) -> dict[str, Any]:
    """A model card in Anthropic's shape (what the `anthropic` SDK's `models` read)."""
    import datetime
    created = datetime.datetime.fromtimestamp(state.created, datetime.timezone.utc)
    return {"type": "model", "id": card["id"], "display_name": card["id"],
            "created_at": created.strftime("%Y-%m-%dT%H:%M:%SZ")}


def _wants_anthropic(request: web.Request) -> bool:
    """Anthropic's SDK sends its API version with every request."""
    return "anthropic-version" in request.headers


async def models(request: web.Request) -> web.Response:
    """One card per served name (`--served-model-name a b`: both), then one per served LoRA
    adapter (with its `parent`); in Anthropic's list shape for Anthropic's SDK."""
    state = request.app[STATE]
    cards = [_model_card(state, n) for n in state.base_model_names] + adapter_cards(state)
    if _wants_anthropic(request):
        data = [_anthropic_card(state, c) for c in cards]
        return web.json_response({"data": data, "has_more": False,
                                  "first_id": data[0]["id"], "last_id": data[-1]["id"]})
    return web.json_response({"object": "list", "data": cards})


async def model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}` (the OpenAI SDK's `models.retrieve`)."""
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.model_names:
        return error_response(404, f"The model '{name}' does not exist; this server serves "
                                   f"'{state.model_name}'", "not_found_error", "model")
    card = next((c for c in adapter_cards(state) if c["id"] == name), None) or \
        _model_card(state, name)
    return web.json_response(_anthropic_card(state, card) if _wants_anthropic(request)
                             else card)


async def version(request: web.Request) -> web.Response:
    from ferrobatch import __version__
    return web.json_response({"version": __version__})


async def health(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    if engine.is_running:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "dead", "reason": engine.dead_reason}, status=503)


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    async with state.ready_lock:
        ok = await state.engine.check_ready(READY_TIMEOUT_S)
    if ok:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready", "reason": state.engine.dead_reason},
                             status=503)


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[STATE].metrics.registry
    return web.Response(body=generate_latest(registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """`POST /reset_prefix_cache` (vLLM's): the prefix cache forgets every block no running
    request holds; answers how many it dropped."""
    dropped = await request.app[STATE].engine.reset_prefix_cache()
    return web.json_response({"num_blocks_dropped": dropped})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    from ferrobatch.serve.responses_api import responses, stored_response
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", stored_response)
    app.router.add_delete("/v1/responses/{response_id}", stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", stored_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", stored_response)
    from ferrobatch.serve.embeddings_api import embeddings
    app.router.add_post("/v1/embeddings", embeddings)
    from ferrobatch.serve.tokenizer_routes import add_tokenizer_routes
    add_tokenizer_routes(app)
    add_lora_routes(app, app[STATE].allow_runtime_lora)
    from ferrobatch.serve.weights_api import add_weights_routes
    add_weights_routes(app, app[STATE].allow_weight_updates)
    from ferrobatch.serve.score_api import add_score_routes
    add_score_routes(app)
    from ferrobatch.serve.native_api import add_native_routes
    add_native_routes(app)
    from ferrobatch.serve.anthropic_api import add_anthropic_routes
    add_anthropic_routes(app)
    from ferrobatch.serve.sagemaker import add_sagemaker_routes
    add_sagemaker_routes(app)
    from ferrobatch.serve.ollama_api import add_ollama_routes
    add_ollama_routes(app)
