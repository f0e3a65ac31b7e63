"""LoRA adapters on the doors (vLLM's way): each served adapter is a model name of its own.

- ``--lora-modules NAME=PATH ...`` (``serve_lora_modules``) serves adapters under those names;
  a request whose ``model`` is one of them runs with that adapter (``lora_for``), on every door
  (HTTP routes, WebSocket / TCP messages' optional ``model``).
- ``GET /v1/models`` lists them after the base model, each with ``parent`` (the base name) and
  ``root`` (its directory).
- With ``--allow-runtime-lora`` (off by default: it lets any API client make the server read a
  directory), ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter {"lora_name"}`` add and remove served adapters while serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from ferrobatch.lora_request import LoRARequest
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.state import STATE


def parse_lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` or vLLM's JSON ``{"name": ..., "path": ...}`` -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON: {exc}") from None
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules: {text!r} is not NAME=PATH (or "
                         f"{{\"name\": ..., \"path\": ...}})")
    return name, path


def serve_lora_modules(engine: Any, modules: Sequence[tuple[str, str]],
                       reserved: Sequence[str] = ()) -> list[LoRARequest]:
    """Serves each (name, path) adapter under its name (loaded now: a bad one is a ValueError
    naming it); ``reserved``: names taken by the base model."""
    registry = engine.loras
    if registry is None:
        raise ValueError("LoRA adapters need an engine started with enable_lora")
    served = []
    for name, path in modules:
        if name in reserved:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name")
        request = LoRARequest(name, registry.next_free_id(), path)
        registry.add_served(request)
        served.append(request)
    return served


def lora_for(state: Any, model: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names, or None (the base model)."""
    registry = getattr(state.engine, "loras", None)
    if registry is None or model is None:
        return None
    return registry.served.get(model)


def resolve_model(state: Any, model: Any) -> LoRARequest | None:
    """A WebSocket / TCP message's optional ``model``: None or a served name (else a 404)."""
    if model is None:
        return None
    if not isinstance(model, str):
        raise ProtocolError("'model' must be a string", param="model")
    if model not in state.model_names:
        raise ProtocolError(f"The model '{model}' does not exist; this server serves "
                            f"'{state.model_name}'", code=404, param="model")
    return lora_for(state, model)


def adapter_cards(state: Any) -> list[dict[str, Any]]:
    """``/v1/models`` cards of the served adapters."""
    registry = getattr(state.engine, "loras", None)
    if registry is None:
        return []
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "ferrobatch",
             "root": request.lora_path, "parent": state.model_name,
             "max_model_len": state.engine.max_model_len}
            for name, request in registry.served.items()]


def _field(body: Any, name: str) -> str:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"'{name}' must be a non-empty string", param=name)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/load_lora_adapter``: serve the adapter at ``lora_path`` as ``lora_name``."""
    from ferrobatch.serve.http import read_json
    state = request.app[STATE]
    registry = state.engine.loras
    body = await read_json(request)
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    if name in state.model_names:
        raise ProtocolError(f"the model name {name!r} is already served", param="lora_name")
    lora = LoRARequest(name, registry.next_free_id(), path)
    try:     # the files are read off the event loop, then the adapter is served from memory
        adapter = await asyncio.to_thread(registry.read, lora)
    except ValueError as exc:
        raise ProtocolError(str(exc), param="lora_path") from None
    if name in state.model_names:                       # (served while we were reading)
        raise ProtocolError(f"the model name {name!r} is already served", param="lora_name")
    registry.add_served(LoRARequest(name, registry.next_free_id(), path), adapter)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/unload_lora_adapter``: stop serving ``lora_name`` (its running requests
    finish)."""
    from ferrobatch.serve.http import read_json
    registry = request.app[STATE].engine.loras
    name = _field(await read_json(request), "lora_name")
    if name not in registry.served:
        raise ProtocolError(f"no LoRA adapter named {name!r} is served", code=404,
                            param="lora_name")
    registry.remove_served(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application, allow_runtime_lora: bool) -> None:
    """The runtime (un)load routes, when allowed."""
    if allow_runtime_lora:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
