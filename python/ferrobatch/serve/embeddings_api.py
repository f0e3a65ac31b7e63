"""`POST /v1/embeddings` (OpenAI's shape): one embedding per input, through `AsyncEngine.embed`.

`input`: a string, a list of strings, a list of token ids or a list of token-id lists (at most
`MAX_INPUTS`); `encoding_format` "float" (default) or "base64" (little-endian float32, what the
`openai` SDK asks for and decodes); `dimensions` keeps the first that many values (before
normalizing). vLLM's extras: `normalize` (default true), `truncate_prompt_tokens`, and
`pooling` ("last", the default, or "mean"). The inputs run side by side, at most
`MAX_IN_FLIGHT` at once; a client that leaves cancels them.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from typing import Any

import numpy as np
from aiohttp import web

from ferrobatch.serve.http import read_json
from ferrobatch.serve.lora_api import lora_for
from ferrobatch.serve.openai_protocol import check_model
from ferrobatch.serve.protocol import (
    ProtocolError,
    is_int,
    pooling_params_from,
    truncate_prompt_tokens_of,
)
from ferrobatch.serve.request_ids import object_id
from ferrobatch.serve.state import STATE

MAX_INPUTS = 2048
MAX_IN_FLIGHT = 256



def parse_inputs(value: Any) -> list[Any]:
    """The body's `input` as a list of prompts (text or token-id lists)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(is_int(v) for v in value):
            return [value]
        if all(isinstance(v, list) and v and all(is_int(t) for t in v) for v in value):
            return list(value)
    raise ProtocolError("'input' must be a non-empty string, list of strings, list of token "
                        "ids or list of token-id lists", param="input")


def _encoded(vector: list[float], encoding: str) -> Any:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def embeddings(request: web.Request) -> web.Response:
    """`POST /v1/embeddings`."""
    state = request.app[STATE]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = check_model(body, state.model_names)
    inputs = parse_inputs(body.get("input"))
    if len(inputs) > MAX_INPUTS:
        raise ProtocolError(f"at most {MAX_INPUTS} inputs per request", param="input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ProtocolError("'encoding_format' must be \"float\" or \"base64\"",
                            param="encoding_format")
    pooling = pooling_params_from(body)
    truncate = truncate_prompt_tokens_of(body)
    engine = state.engine
    lora = lora_for(state, model)
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(prompt: Any) -> Any:
        async with gate:
            return await engine.embed(prompt, pooling, truncate_prompt_tokens=truncate,
                                      lora_request=lora)

    tasks = [asyncio.ensure_future(one(p)) for p in inputs]
    try:
        outs = await asyncio.gather(*tasks)
    except ValueError as exc:           # a bad input: a 400 naming the field when there is one
        field = str(exc).split()[0] if str(exc) else ""
        raise ProtocolError(str(exc), param=field if field in (
            "dimensions", "truncate_prompt_tokens") else None) from None
    finally:
        for t in tasks:
            t.cancel()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return web.json_response({
        "id": object_id(request, "embd-", f"embd-{secrets.token_hex(12)}"),
        "object": "list", "created": int(time.time()), "model": model,
        "data": [{"object": "embedding", "index": i,
                  "embedding": _encoded(o.outputs.embedding, encoding)}
                 for i, o in enumerate(outs)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
