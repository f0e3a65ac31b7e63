"""`POST /score` (`/v1/score`) and `POST /rerank` (`/v1/rerank`, `/v2/rerank`): vLLM's scoring
routes for embedding models, in its shapes (`/rerank` is Jina's and Cohere's). A score is the
cosine similarity of two texts' embeddings (`engine/scoring.py`).

- score: `{"model", "text_1": text | [texts], "text_2": text | [texts],
  "truncate_prompt_tokens"?}` -> `{"id", "object": "list", "created", "model", "data":
  [{"index", "object": "score", "score"}], "usage"}`, one entry per pair in order.
- rerank: `{"model", "query", "documents": [texts], "top_n"? (0 or absent: all),
  "return_documents"? (true)}` -> `{"id", "model", "usage": {"total_tokens"}, "results":
  [{"index", "document": {"text"}, "relevance_score"}]}`, best first.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from aiohttp import web

from ferrobatch.engine.scoring import MAX_PAIRS
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


def _body(value: Any) -> dict:
    if not isinstance(value, dict):
        raise ProtocolError("the request body must be a JSON object")
    return value


async def _scores(request: web.Request, body: dict, text_1: Any, text_2: Any) -> tuple:
    """(model, ScoringRequestOutputs) of a checked body; a bad text is a 400."""
    state = request.app[STATE]
    model = check_model(body, state.model_names)
    pooling, truncate = pooling_params_from(body), truncate_prompt_tokens_of(body)
    try:
        outs = await state.engine.score(text_1, text_2, pooling, truncate_prompt_tokens=truncate,
                                        lora_request=lora_for(state, model))
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    return model, outs


async def score(request: web.Request) -> web.Response:
    """`POST /score`, `POST /v1/score`."""
    body = _body(await read_json(request))
    for name in ("text_1", "text_2"):
        if name not in body:
            raise ProtocolError(f"'{name}' is required", param=name)
    model, outs = await _scores(request, body, body["text_1"], body["text_2"])
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return web.json_response({
        "id": object_id(request, "score-", f"score-{secrets.token_hex(12)}"),
        "object": "list", "created": int(time.time()), "model": model,
        "data": [{"index": i, "object": "score", "score": o.outputs.score}
                 for i, o in enumerate(outs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(request: web.Request) -> web.Response:
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`."""
    body = _body(await read_json(request))
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query:
        raise ProtocolError("'query' must be a non-empty string", param="query")
    if not isinstance(documents, list) or not documents or \
            not all(isinstance(d, str) for d in documents):
        raise ProtocolError("'documents' must be a non-empty list of strings", param="documents")
    if len(documents) > MAX_PAIRS:
        raise ProtocolError(f"at most {MAX_PAIRS} documents per request", param="documents")
    top_n = body.get("top_n")
    if top_n is not None and (not is_int(top_n) or top_n < 0):
        raise ProtocolError("'top_n' must be an integer >= 0", param="top_n")
    keep_docs = body.get("return_documents", True)
    if not isinstance(keep_docs, bool):
        raise ProtocolError("'return_documents' must be a boolean", param="return_documents")
    model, outs = await _scores(request, body, query, documents)
    order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)[:top_n or None]
    results = []
    for i in order:
        entry: dict[str, Any] = {"index": i, "relevance_score": outs[i].outputs.score}
        if keep_docs:
            entry["document"] = {"text": documents[i]}
        results.append(entry)
    return web.json_response({
        "id": object_id(request, "rerank-", f"rerank-{secrets.token_hex(12)}"),
        "model": model, "usage": {"total_tokens": sum(len(o.prompt_token_ids) for o in outs)},
        "results": results})


def add_score_routes(app: web.Application) -> None:
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
