"""Offline batch jobs in OpenAI's batch file format: `ferrobatch batch -i in.jsonl -o out.jsonl`.

Each input line is one request,

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with `url` one of `/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
`/v1/embeddings`, `/v1/score`, `/v1/rerank`. Every request goes through the very HTTP routes `ferrobatch serve` runs (a
server on an ephemeral loopback port,
inside this process), all of them in flight at once up to `concurrency`, so continuous batching
packs them as it packs live traffic. Each output line answers one input line, in the order
they finish (match them by `custom_id`, as with OpenAI's batch output):

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}},
     "error": null}

A request the server refuses gets its 4xx and OpenAI's error object in `response`; a line
that is not a request at all (bad JSON, an unknown url, `stream: true`) gets `response: null`
and `error: {"code", "message"}`. Nothing is lost: every input line gets exactly one output
line. A progress bar counts finished lines.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
        "/v1/score", "/v1/rerank")
DEFAULT_CONCURRENCY = 256
MAX_LINE_BYTES = 1 << 20          # as the server's largest body


@dataclass
class BatchSummary:
    """How a batch went: lines read, answered with a 200, and answered with an error."""

    total: int = 0
    succeeded: int = 0
    failed: int = 0


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": custom_id if isinstance(custom_id, str) else None,
            "response": None, "error": {"code": code, "message": message}}


def parse_line(line: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the request, None) for a valid input line, or (None, its error output line)."""
    if len(line.encode()) > MAX_LINE_BYTES:
        return None, _line_error(None, "invalid_request", f"line longer than {MAX_LINE_BYTES} "
                                 "bytes")
    try:
        item = json.loads(line)
    except ValueError as exc:
        return None, _line_error(None, "invalid_json", f"not JSON: {exc}")
    if not isinstance(item, dict):
        return None, _line_error(None, "invalid_request", "a line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _line_error(custom_id, "invalid_request",
                                 "'custom_id' must be a non-empty string")
    if item.get("method", "POST") != "POST":
        return None, _line_error(custom_id, "invalid_request", "'method' must be POST")
    if item.get("url") not in URLS:
        return None, _line_error(custom_id, "invalid_request",
                                 f"'url' must be one of {', '.join(URLS)}")
    body = item.get("body")
    if not isinstance(body, dict):
        return None, _line_error(custom_id, "invalid_request", "'body' must be an object")
    if body.get("stream"):
        return None, _line_error(custom_id, "invalid_request",
                                 "'stream' is not served in a batch (each line gets one answer)")
    return item, None


async def _answer(session: aiohttp.ClientSession, base: str, item: dict[str, Any]) -> dict:
    async with session.post(base + item["url"], json=item["body"]) as resp:
        body = await resp.json(content_type=None)
    request_id = body.get("id") if isinstance(body, dict) and resp.status == 200 else None
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": item["custom_id"],
            "response": {"status_code": resp.status, "request_id": request_id, "body": body},
            "error": None}


async def run_batch(engine: Any, lines: Iterable[str], write: Any, *,
                    concurrency: int = DEFAULT_CONCURRENCY, progress: bool = True,
                    served_model_name: str | None = None) -> BatchSummary:
    """Answers every request line through a loopback server on `engine` (started, and serving
    nothing else: stopping the server at the end aborts whatever still runs on it), calling
    `write(output_line_dict)` once per input line as each finishes; blank lines are skipped."""
    from ferrobatch.serve.server import Server

    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    todo = [line for line in lines if line.strip()]
    summary = BatchSummary(total=len(todo))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc="Batch requests", dynamic_ncols=True)
    server = Server(engine, served_model_name=served_model_name)
    await server.start("127.0.0.1", 0)
    gate = asyncio.Semaphore(concurrency)

    def done(out: dict[str, Any]) -> None:
        ok = out["response"] is not None and out["response"]["status_code"] == 200
        summary.succeeded += ok
        summary.failed += not ok
        write(out)
        if bar is not None:
            bar.update(1)

    async def one(session: aiohttp.ClientSession, line: str) -> None:
        item, error = parse_line(line)
        if error is not None:
            done(error)
            return
        async with gate:
            try:
                out = await _answer(session, f"http://127.0.0.1:{server.port}", item)
            except (aiohttp.ClientError, ValueError, asyncio.TimeoutError) as exc:
                out = _line_error(item["custom_id"], "request_failed",
                                  f"{type(exc).__name__}: {exc}")
        done(out)

    try:
        timeout = aiohttp.ClientTimeout(total=None)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await asyncio.gather(*(one(session, line) for line in todo))
    finally:
        if bar is not None:
            bar.close()
        await server.stop()
    return summary
