"""Amazon SageMaker's two routes (vLLM serves them too), so the server runs as a SageMaker
endpoint container unchanged:

- ``GET|POST /ping``: liveness, as ``/health`` (SageMaker's health check);
- ``POST /invocations``: the one route SageMaker forwards requests to, dispatched on what the
  body holds: ``messages`` -> chat completions, ``prompt`` -> completions, ``input`` ->
  embeddings, ``text_1`` -> score, ``query`` -> rerank (a body with none of them is a 400 naming
  them). The route it reaches answers, in its own shape, streams included.
"""

from __future__ import annotations

from aiohttp import web

from ferrobatch.serve.protocol import ProtocolError

# (the body field that names the route, the route's path), first match wins
INVOCATION_ROUTES = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"),
                     ("input", "/v1/embeddings"), ("text_1", "/v1/score"),
                     ("query", "/v1/rerank"))


def _handlers() -> dict[str, object]:
    from ferrobatch.serve.embeddings_api import embeddings
    from ferrobatch.serve.http import chat_completions, completions
    from ferrobatch.serve.score_api import rerank, score
    return {"/v1/chat/completions": chat_completions, "/v1/completions": completions,
            "/v1/embeddings": embeddings, "/v1/score": score, "/v1/rerank": rerank}


async def invocations(request: web.Request) -> web.StreamResponse:
    from ferrobatch.serve.http import read_json
    body = await read_json(request)            # (aiohttp keeps the bytes: the route reads them)
    if isinstance(body, dict):
        for field, path in INVOCATION_ROUTES:
            if field in body:
                return await _handlers()[path](request)
    raise ProtocolError("an invocation is a JSON object with 'messages' (chat), 'prompt' "
                        "(completions), 'input' (embeddings), 'text_1' (score) or 'query' "
                        "(rerank)")


async def ping(request: web.Request) -> web.Response:
    from ferrobatch.serve.http import health
    return await health(request)


def add_sagemaker_routes(app: web.Application) -> None:
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_post("/invocations", invocations)
