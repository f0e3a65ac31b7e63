"""Ollama's API, so the ``ollama`` CLI and library (``OLLAMA_HOST=http://localhost:8000``) and
the tools written for Ollama run on ferrobatch: ``POST /api/chat`` and ``POST /api/generate``
(whole, or streamed as newline-delimited JSON, Ollama's default), ``GET /api/tags`` and
``GET /api/ps`` (the served model), ``POST /api/show``, ``GET /api/version``, ``POST
/api/embed`` (and the older ``/api/embeddings``), and ``GET|HEAD /`` (the CLI's liveness
check). Requests are read by serve/ollama_protocol.py into the chat and
completions routes' requests, so templates, guided ``format``, tools and reasoning behave as
there; a client that leaves mid-stream aborts its request. Errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from ferrobatch.serve.codec import dumps_json
from ferrobatch.serve.http import errors_shaped, failure_of, reply_parts, start_one
from ferrobatch.serve.lora_api import lora_for
from ferrobatch.serve.ollama_protocol import (
    created_at,
    done_reason,
    model_name,
    parse_ollama_chat,
    parse_ollama_generate,
    timings,
    tool_calls,
)
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.reasoning import ReasoningSplitter
from ferrobatch.serve.state import STATE
from ferrobatch.serve.tools import ToolOutputStream

OLLAMA_VERSION = "0.6.0"        # the Ollama API this follows (clients check it is recent enough)


_ollama_errors = errors_shaped(lambda status, message: {"error": message})


def _piece(route: str, model: str, text: str, thinking: str | None = None,
           calls: list | None = None) -> dict[str, Any]:
    """One answer object of `route` ("chat" or "generate"), not yet done."""
    if route == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = tool_calls(calls)
        return {"model": model, "created_at": created_at(), "message": message, "done": False}
    out = {"model": model, "created_at": created_at(), "response": text, "done": False}
    if thinking:
        out["thinking"] = thinking
    return out


async def _run(request: web.Request, route: str, req: Any, shown_model: str) -> web.StreamResponse:
    req.reasoning_parser = request.app[STATE].reasoning_parser if req.kind == "chat" else None
    started = time.monotonic()
    if req.kind == "chat":
        stream = await start_one(request, req.params, req.model, messages=req.messages,
                                 chat_options=req.chat_template,
                                 reasoning_parser=req.reasoning_parser)
    else:
        stream = await start_one(request, req.params, req.model, prompt=req.prompts[0])
    try:
        if req.stream:
            return await _stream(request, route, req, stream, shown_model, started)
        last = None
        async for out in stream:
            last = out
        m = last.metrics
        first = m["arrival_time"] + m["ttft_s"] if "ttft_s" in m else None
        why = failure_of(last)
        if why is not None:
            return web.json_response({"error": why}, status=500)
        c = last.outputs[0]
        reasoning, text, calls = reply_parts(req.tools, req.reasoning_parser, c.text,
                                             c.finish_reason)
        answer = _piece(route, shown_model, text, reasoning, calls)
        answer.update(done=True, done_reason=done_reason(c.finish_reason),
                      **timings(len(stream.prompt_token_ids), len(c.token_ids), started, first,
                                time.monotonic()))
        return web.json_response(answer)
    finally:
        stream.abort()


async def _stream(request: web.Request, route: str, req: Any, stream: Any, model: str,
                  started: float) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson",
                                                   "Cache-Control": "no-cache"})

    async def send(obj: dict[str, Any]) -> None:
        await resp.write(dumps_json(obj).encode() + b"\n")

    tool_stream = ToolOutputStream(req.tools) if req.tools is not None else None
    splitter = ReasoningSplitter(req.reasoning_parser) if req.reasoning_parser else None
    try:
        await resp.prepare(request)
        generated, first, last = 0, None, None
        async for out in stream:
            last = out
            c = out.outputs[0]
            generated += len(c.token_ids)
            if first is None and c.token_ids:
                first = time.monotonic()
            text, reasoning = c.text, ""
            if splitter is not None:
                reasoning, text = splitter.feed(c.text)
                if c.finish_reason is not None:
                    more_reasoning, more_text = splitter.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
            if tool_stream is not None:
                text = tool_stream.feed(text)
            if text or reasoning:
                await send(_piece(route, model, text, reasoning))
        why = failure_of(last) if last is not None else "the request was aborted"
        if why is not None:
            await send({"error": why})
            await resp.write_eof()
            return resp
        c = last.outputs[0]
        if tool_stream is not None:
            rest, calls = tool_stream.finish(c.finish_reason)
            if rest or calls:
                await send(_piece(route, model, rest, None, calls))
        final = _piece(route, model, "")
        final.update(done=True, done_reason=done_reason(c.finish_reason),
                     **timings(len(stream.prompt_token_ids), generated, started, first,
                               time.monotonic()))
        await send(final)
        await resp.write_eof()
    except ConnectionError:
        pass                      # the client left: _run's finally aborts the request
    return resp


@_ollama_errors
async def chat(request: web.Request) -> web.StreamResponse:
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_ollama_chat(body, state.model_names, tool_parser=state.tool_call_parser,
                            sampling_defaults=state.engine.default_sampling_fields)
    return await _run(request, "chat", req, body["model"])


@_ollama_errors
async def generate(request: web.Request) -> web.StreamResponse:
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_ollama_generate(body, state.model_names,
                                sampling_defaults=state.engine.default_sampling_fields)
    if req is None:                    # an empty prompt: "load the model" (it is loaded)
        return web.json_response({"model": body["model"], "created_at": created_at(),
                                  "response": "", "done": True, "done_reason": "load"})
    limit = (body.get("options") or {}).get("num_predict")
    if req.kind == "completion" and (limit is None or limit < 0):
        req.params = req.params.replace(max_tokens=None)      # Ollama's default: no limit
    return await _run(request, "generate", req, body["model"])


def _details(state: Any) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf" if state.engine.config.model.endswith(".gguf")
            or state.engine.config.model == "smollm2" else "safetensors",
            "family": "llama", "families": ["llama"], "parameter_size": "",
            "quantization_level": ""}


@_ollama_errors
async def tags(request: web.Request) -> web.Response:
    """``GET /api/tags``: the served model (and adapters) as Ollama lists local models."""
    state = request.app[STATE]
    return web.json_response({"models": [
        {"name": name, "model": name, "modified_at": created_at(), "size": 0,
         "digest": "", "details": _details(state)} for name in state.model_names]})


@_ollama_errors
async def running(request: web.Request) -> web.Response:
    """``GET /api/ps``: what is loaded (everything served, always)."""
    state = request.app[STATE]
    return web.json_response({"models": [
        {"name": name, "model": name, "size": 0, "digest": "", "details": _details(state),
         "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0}
        for name in state.model_names]})


@_ollama_errors
async def show(request: web.Request) -> web.Response:
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    if "model" not in body and isinstance(body.get("name"), str):
        body = {**body, "model": body["name"]}              # (older clients send "name")
    model_name(body, state.model_names)
    engine = state.engine
    capabilities = ["completion"] + (["tools"] if state.tool_call_parser else []) + (
        ["thinking"] if state.reasoning_parser else [])
    return web.json_response({
        "modelfile": "", "parameters": "", "license": "",
        "template": getattr(engine.tokenizer, "chat_template", None) or "",
        "details": _details(state), "capabilities": capabilities,
        "model_info": {"general.architecture": "llama",
                       "llama.context_length": engine.max_model_len},
        "modified_at": created_at()})


async def _embeddings(request: web.Request, model: str, inputs: list[Any], truncate: bool,
                      pooling: Any) -> tuple[list[list[float]], int]:
    """Each input's embedding (at most MAX_IN_FLIGHT at once) and the prompt tokens in all.
    `truncate` (Ollama's): an input longer than the context keeps its beginning."""
    import asyncio

    from ferrobatch.serve.embeddings_api import MAX_IN_FLIGHT
    state = request.app[STATE]
    engine = state.engine
    lora = lora_for(state, model)
    room = engine.max_model_len - 1             # (an embedding computes one step past it)
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(text: str) -> Any:
        prompt: Any = text
        if truncate:
            ids = await asyncio.to_thread(engine.tokenizer.encode, text, True)
            prompt = ids[:room]          # (the text's own tokens, BOS included where wanted)
        async with gate:
            return await engine.embed(prompt, pooling, lora_request=lora)

    tasks = [asyncio.ensure_future(one(t)) for t in inputs]
    try:
        outs = await asyncio.gather(*tasks)
    except ValueError as exc:
        raise ProtocolError(str(exc), param="input") from None
    finally:
        for t in tasks:
            t.cancel()
    return [o.outputs.embedding for o in outs], sum(len(o.prompt_token_ids) for o in outs)


def _embed_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    if not isinstance(body.get("options") or {}, dict):
        raise ProtocolError("'options' must be an object", param="options")
    return body


@_ollama_errors
async def embed(request: web.Request) -> web.Response:
    """``POST /api/embed``: ``input`` (a text or a list), ``truncate`` (true), ``dimensions``;
    unit-length vectors, as Ollama's."""
    from ferrobatch.serve.embeddings_api import MAX_INPUTS
    from ferrobatch.serve.http import read_json
    from ferrobatch.serve.protocol import pooling_params_from
    state = request.app[STATE]
    body = _embed_body(await read_json(request))
    model = model_name(body, state.model_names)
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(
            isinstance(t, str) and t for t in inputs):
        raise ProtocolError("'input' must be a non-empty text or a list of them", param="input")
    if len(inputs) > MAX_INPUTS:
        raise ProtocolError(f"at most {MAX_INPUTS} inputs per request", param="input")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ProtocolError("'truncate' must be a boolean", param="truncate")
    started = time.monotonic()
    vectors, tokens = await _embeddings(request, model, inputs, truncate, pooling_params_from(
        {"dimensions": body.get("dimensions")}))
    return web.json_response({"model": body["model"], "embeddings": vectors,
                              "total_duration": int((time.monotonic() - started) * 1e9),
                              "load_duration": 0, "prompt_eval_count": tokens})


@_ollama_errors
async def embeddings(request: web.Request) -> web.Response:
    """``POST /api/embeddings`` (Ollama's older route): ``prompt`` -> ``{"embedding"}``, not
    normalized (as there)."""
    from ferrobatch.pooling_params import PoolingParams
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    body = _embed_body(await read_json(request))
    model = model_name(body, state.model_names)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ProtocolError("'prompt' must be a non-empty text", param="prompt")
    vectors, _ = await _embeddings(request, model, [prompt], True,
                                   PoolingParams(normalize=False))
    return web.json_response({"embedding": vectors[0]})


@_ollama_errors
async def manage(request: web.Request) -> web.StreamResponse:
    """``/api/pull``, ``/api/push``, ``/api/create``, ``/api/copy``, ``/api/delete``: this server
    serves the models it was started with. Pulling one of them succeeds at once (it is here:
    tools pull before they chat); anything else is a 400 saying so."""
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    body = await read_json(request)
    if request.path == "/api/pull" and isinstance(body, dict):
        name = body.get("model", body.get("name"))
        if isinstance(name, str):
            model_name({"model": name}, state.model_names)      # (404 for another)
            if body.get("stream", True) is False:
                return web.json_response({"status": "success"})
            return web.Response(body=b'{"status":"success"}\n',
                                content_type="application/x-ndjson")
    raise ProtocolError(f"ferrobatch serves the models it was started with "
                        f"({', '.join(state.model_names)}); {request.path} does not change "
                        "them")


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


def add_ollama_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", running)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/version", version)
    app.router.add_post("/api/embed", embed)
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy"):
        app.router.add_post(path, manage)
    app.router.add_delete("/api/delete", manage)
    app.router.add_post("/api/embeddings", embeddings)
    app.router.add_get("/", root)                        # (HEAD too: the CLI's check)
