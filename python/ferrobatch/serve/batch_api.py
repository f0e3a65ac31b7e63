"""OpenAI's Files and Batches APIs over HTTP (`serve --enable-batch-api`), so that the `openai`
SDK's batch workflow runs against the server unchanged: upload a JSONL file of requests, create
a batch, poll it, download its output.

    POST   /v1/files                    multipart: `file`, `purpose` ("batch")
    GET    /v1/files                    the files, newest first
    GET    /v1/files/{file_id}          one file object
    GET    /v1/files/{file_id}/content  its bytes
    DELETE /v1/files/{file_id}
    POST   /v1/batches                  {"input_file_id", "endpoint", "completion_window": "24h",
                                         "metadata"?}
    GET    /v1/batches                  newest first (`limit` 1..100, default 20; `after`)
    GET    /v1/batches/{batch_id}
    POST   /v1/batches/{batch_id}/cancel

The jobs and files: `batch_store.py`. Without the flag these routes answer 404 saying so.
"""

from __future__ import annotations

from aiohttp import web

from ferrobatch.serve.http import read_json
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.state import STATE

OFF = "the Files and Batches APIs are off on this server (serve --enable-batch-api)"


def _store(request: web.Request):
    """The server's BatchStore (404 when the APIs are off); refusals are ProtocolErrors, which
    the error middleware answers in OpenAI's error shape."""
    store = request.app[STATE].batches
    if store is None:
        raise ProtocolError(OFF, code=404)
    return store


async def upload(request: web.Request) -> web.Response:
    store = _store(request)
    if not request.content_type.startswith("multipart/"):
        raise ProtocolError("upload a file as multipart/form-data (fields 'file' and "
                            "'purpose')", param="file")
    purpose, stored = None, None
    try:
        reader = await request.multipart()
        async for part in reader:
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                if stored is not None:
                    raise ProtocolError("one file per upload", param="file")
                # the openai SDK sends `purpose` first; a file before it is kept as a batch
                # file until the purpose, checked below, says otherwise
                stored = await store.add_file(part.filename or "upload.jsonl",
                                              purpose or "batch",
                                              lambda part=part: part.read_chunk(1 << 16))
        if stored is None:
            raise ProtocolError("the upload has no 'file' part", param="file")
        if purpose != stored.purpose:
            raise ProtocolError(f"'purpose' must be 'batch', got {purpose!r}", param="purpose")
    except BaseException as exc:
        if stored is not None and stored.id in store.files:
            store.delete_file(stored.id)
        if isinstance(exc, ValueError) and not isinstance(exc, ProtocolError):
            # a malformed multipart body
            raise ProtocolError(f"could not read the upload: {exc}", param="file") from None
        raise
    return web.json_response(stored.object())


async def list_files(request: web.Request) -> web.Response:
    store = _store(request)
    purpose = request.query.get("purpose")
    files = [f.object() for f in reversed(store.files.values())
             if purpose is None or f.purpose == purpose]
    return web.json_response({"object": "list", "data": files, "has_more": False})


async def file_object(request: web.Request) -> web.Response:
    store = _store(request)
    stored = store.file(request.match_info["file_id"])
    if request.method == "DELETE":
        store.delete_file(stored.id)
        return web.json_response({"id": stored.id, "object": "file", "deleted": True})
    return web.json_response(stored.object())


async def file_content(request: web.Request) -> web.StreamResponse:
    stored = _store(request).file(request.match_info["file_id"])
    return web.FileResponse(stored.path, headers={
        "Content-Type": "application/octet-stream",
        "Content-Disposition": f'attachment; filename="{stored.filename}"'})


async def create_batch(request: web.Request) -> web.Response:
    store = _store(request)
    return web.json_response(store.create_batch(await read_json(request)).object())


async def batch_object(request: web.Request) -> web.Response:
    store = _store(request)
    batch_id = request.match_info["batch_id"]
    batch = store.cancel(batch_id) if request.method == "POST" else store.batch(batch_id)
    return web.json_response(batch.object())


async def list_batches(request: web.Request) -> web.Response:
    store = _store(request)
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ProtocolError("'limit' must be an integer in [1, 100]", param="limit")
    batches, more = store.listed(limit, request.query.get("after"))
    data = [b.object() for b in batches]
    return web.json_response({"object": "list", "data": data,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": more})


def add_batch_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", file_object)
    app.router.add_delete("/v1/files/{file_id}", file_object)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", batch_object)
    app.router.add_post("/v1/batches/{batch_id}/cancel", batch_object)
