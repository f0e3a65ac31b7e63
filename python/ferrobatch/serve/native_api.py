"""SGLang's native routes, for clients written against SGLang (RL rollout workers, scripts):

- ``POST /generate``: text or token ids in, text, ids, finish reason and logprobs out, streamed
  or whole (shapes: serve/native_protocol.py);
- ``POST /abort_request {"rid"}``: abort that request (``{"abort_all": true}`` every request,
  only on a server started with ``--allow-weight-updates``, the controller's flag: it lets any
  client stop everyone's work);
- ``GET /get_model_info``, ``GET /get_server_info``: the model and the server's settings;
- ``GET|POST /flush_cache``: the prefix cache forgets every block no running request holds;
- ``GET /health_generate``: a real one-token step, as ``/ready``.

Every request is checked whole before anything is submitted; a client that leaves mid-stream,
or a request that fails, aborts what it started (the ``finally``, as the OpenAI routes).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from aiohttp import web

from ferrobatch.serve.native_protocol import GenerateRequest, answer_item, parse_generate
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.sse import SSEWriter
from ferrobatch.serve.state import STATE


async def generate(request: web.Request) -> web.StreamResponse:
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    engine = state.engine
    started = time.monotonic()

    def check_lora(name: str) -> None:
        if name not in state.model_names or name in state.base_model_names:
            raise ProtocolError(f"no LoRA adapter named {name!r} is served", code=404,
                                param="lora_path")

    req = parse_generate(await read_json(request), engine.default_sampling_fields, check_lora)
    from ferrobatch.serve.lora_api import lora_for
    loras = [lora_for(state, it.lora_name) for it in req.items]
    for it, lora in zip(req.items, loras):        # tokenized off the event loop
        await engine.prepare(it.params, it.prompt, lora_request=lora)
    streams: list[Any] = []
    try:
        for it, lora in zip(req.items, loras):
            streams.append(engine.add_request(it.prompt, it.params, it.rid, lora_request=lora))
        if req.stream:
            return await _stream(request, req, streams, started)
        return await _collect(request, req, streams, started)
    finally:
        for s in streams:
            s.abort()


def _namer(request: web.Request) -> Any:
    return request.app[STATE].token_strings().text


async def _collect(request: web.Request, req: GenerateRequest, streams: list[Any],
                   started: float) -> web.Response:
    from ferrobatch.serve.http import _merged, error_response
    last: dict[int, Any] = {}
    async for i, out in _merged(streams):
        if out.error:
            return error_response(500, out.error, "server_error")
        last[i] = out
    version = request.app[STATE].engine.weights_version
    elapsed = time.monotonic() - started
    answers = []
    for i, it in enumerate(req.items):
        for c in sorted(last[i].outputs, key=lambda c: c.index):
            answers.append(answer_item(it, last[i], c, weight_version=version,
                                       e2e_latency=elapsed, text=_namer(request)))
    return web.json_response(answers if req.answers_a_list else answers[0])


async def _stream(request: web.Request, req: GenerateRequest, streams: list[Any],
                  started: float) -> web.StreamResponse:
    from ferrobatch.serve.http import _merged
    engine = request.app[STATE].engine
    sse = SSEWriter(request)
    sent: dict[tuple[int, int], tuple[int, bool]] = {}   # (prompt, sample) -> (tokens, done)
    try:
        await sse.open()
        version = engine.weights_version
        async for i, out in _merged(streams):
            if out.error:
                await sse.send({"error": {"message": out.error, "type": "server_error",
                                          "code": 500}})
                break
            for c in sorted(out.outputs, key=lambda c: c.index):
                now = (len(c.token_ids), c.finish_reason is not None)
                if sent.get((i, c.index)) == now or (now == (0, False)):
                    continue
                sent[(i, c.index)] = now
                item = answer_item(req.items[i], out, c, weight_version=version,
                                   e2e_latency=time.monotonic() - started,
                                   text=_namer(request))
                if req.answers_a_list:
                    item["index"] = i * req.n + c.index
                await sse.send(item)
        await sse.close()
    except ConnectionError:
        pass                     # the client left: generate's finally aborts the requests
    return sse.response


async def abort_request(request: web.Request) -> web.Response:
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    if body.get("abort_all"):
        if not state.allow_weight_updates:
            raise ProtocolError("'abort_all' needs a server started with "
                                "--allow-weight-updates", code=403, param="abort_all")
        return web.json_response({"num_aborted": state.engine.abort_all()})
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise ProtocolError("'rid' must be a non-empty string", param="rid")
    return web.json_response({"aborted": state.engine.abort(rid)})


async def get_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    cfg = engine.config
    return web.json_response({
        "model_path": cfg.model, "tokenizer_path": cfg.tokenizer or cfg.model,
        "served_model_name": state.model_name, "is_generation": True,
        "max_model_len": engine.max_model_len,
        "weight_version": str(engine.weights_version),
        "preferred_sampling_params": engine.default_sampling_fields or None,
        "has_image_understanding": False, "has_audio_understanding": False})


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


async def get_server_info(request: web.Request) -> web.Response:
    """The engine's settings (``EngineConfig``), the version and the scheduler's latest state."""
    from ferrobatch import __version__
    engine = request.app[STATE].engine
    info = _json_safe(dataclasses.asdict(engine.config))
    info.update(version=__version__, attention_backend=engine.attention_backend,
                internal_states=[_json_safe(engine.stats())])
    return web.json_response(info)


async def flush_cache(request: web.Request) -> web.Response:
    dropped = await request.app[STATE].engine.reset_prefix_cache()
    return web.json_response({"success": True, "num_blocks_dropped": dropped})


async def health_generate(request: web.Request) -> web.Response:
    from ferrobatch.serve.http import ready
    return await ready(request)


def add_native_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_get("/health_generate", health_generate)
