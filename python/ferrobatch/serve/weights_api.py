"""``POST /update_weights_from_disk`` (SGLang's route): the served model's weights replaced in
place from a checkpoint on the server's disk, between two steps (``AsyncEngine.
update_weights_from_disk``): what an RL trainer calls after saving new weights, without
restarting the server. Body ``{"model_path": "/ckpt/step-200"}`` (a model directory with
safetensors, or a .gguf file, of the served model's shape); answers ``{"success": true,
"message", "num_tensors", "weights_version", "prefix_blocks_dropped"}``. A missing path is a
404, a checkpoint it cannot use a 400 naming why; either way nothing changes.

vLLM's ``POST /pause?wait_for_inflight_requests=false&clear_cache=true``, ``POST /resume`` and
``GET /is_paused`` go with it: an RL loop pauses generation (in-flight requests aborted, or run
to their end; new ones held until the resume; ``AsyncEngine.pause_generation``), updates the
weights, and resumes, so that no token of any request mixes old and new weights. SGLang's ``POST /pause_generation``
(mode "abort") and ``POST /continue_generation`` do the same.

Only with ``serve --allow-weight-updates`` (off by default: it lets any API client make the
server read a path, change what every later request gets, or stop serving)."""

from __future__ import annotations

from aiohttp import web

from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.state import STATE


async def update_weights_from_disk(request: web.Request) -> web.Response:
    from ferrobatch.serve.http import read_json
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise ProtocolError("'model_path' must be a non-empty string", param="model_path")
    try:
        summary = await request.app[STATE].engine.update_weights_from_disk(path)
    except FileNotFoundError as exc:
        raise ProtocolError(str(exc), code=404, param="model_path") from None
    except ValueError as exc:
        raise ProtocolError(str(exc), param="model_path") from None
    return web.json_response({
        "success": True, "message": f"weights of {path} loaded",
        "num_tensors": summary["tensors"], "weights_version": summary["weights_version"],
        "prefix_blocks_dropped": summary["prefix_blocks_dropped"]})


def _flag(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise ProtocolError(f"'{name}' must be true or false, not {value!r}", param=name)


async def pause(request: web.Request) -> web.Response:
    wait = _flag(request, "wait_for_inflight_requests", False)
    clear = _flag(request, "clear_cache", True)
    aborted = await request.app[STATE].engine.pause_generation(
        wait_for_inflight_requests=wait, clear_cache=clear)
    return web.json_response({"is_paused": True, "num_aborted": aborted})


async def pause_generation(request: web.Request) -> web.Response:
    """SGLang's ``POST /pause_generation {"mode": "abort"}``: in-flight requests aborted, new
    ones held until ``/continue_generation`` (its other modes keep requests in the engine
    while paused: not supported)."""
    from ferrobatch.serve.http import read_json
    body = await read_json(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    mode = body.get("mode", "abort")
    if mode != "abort":
        raise ProtocolError(f"pause mode {mode!r} is not supported (only 'abort')",
                            param="mode")
    aborted = await request.app[STATE].engine.pause_generation(
        wait_for_inflight_requests=False, clear_cache=False)
    return web.json_response({"is_paused": True, "num_aborted": aborted})


async def resume(request: web.Request) -> web.Response:
    await request.app[STATE].engine.resume_generation()
    return web.json_response({"is_paused": False})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].engine.is_paused})


def add_weights_routes(app: web.Application, allow_weight_updates: bool) -> None:
    """The weight-update and pause routes, when allowed."""
    if allow_weight_updates:
        app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
        app.router.add_post("/pause", pause)
        app.router.add_post("/resume", resume)
        app.router.add_get("/is_paused", is_paused)
        app.router.add_post("/pause_generation", pause_generation)      # SGLang's names
        app.router.add_post("/continue_generation", resume)
