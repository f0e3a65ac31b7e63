"""Offline batch jobs in OpenAI's batch file format: `ferrobatch batch -i in.jsonl -o out.jsonl`
(or `ferrobatch run-batch -i in.jsonl -o out.jsonl`, vLLM's command, which writes the answers
in the input's order as vLLM's does).

Each input line is one request,

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with `url` one of `/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
`/v1/embeddings`, `/v1/score`, `/v1/rerank`. Every request goes through the very HTTP routes
`ferrobatch serve` runs (a server on an ephemeral loopback port, inside this process), up to
`concurrency` of them in flight at once, so continuous batching packs them as it packs live
traffic. Each output line answers one input line, in the order they finish (match them by
`custom_id`, as with OpenAI's batch output) or, with `in_order`, in the input's order:

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}},
     "error": null}

A request the server refuses gets its 4xx and OpenAI's error object in `response`; a line
that is not a request at all (bad JSON, an unknown url, `stream: true`, a `custom_id` an
earlier line already used) gets `response: null` and `error: {"code", "message"}`. Nothing is
lost: every input line gets exactly one output line.

Lines are read as requests take them: at most `concurrency` are in flight, so a file of
millions of lines runs in the memory of `concurrency` requests (with `in_order`, plus the
answers waiting behind a slower earlier line, at most `HOLD_PER_SLOT * concurrency`). An
interrupted job is resumed from its output file (`kept_answers`, the CLI's `--resume`): the
lines answered with a 200 stay, the rest are answered again.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
        "/v1/score", "/v1/rerank")
DEFAULT_CONCURRENCY = 256
MAX_LINE_BYTES = 1 << 20          # as the server's largest body
HOLD_PER_SLOT = 4                 # in_order: answers held behind an unfinished line, per slot
READ_CHUNK = 64                   # input lines read per trip to the reading thread
PROGRESS_LINE_S = 30.0            # without a terminal: a progress line this often


@dataclass
class BatchSummary:
    """How a batch went: lines answered (`total`: with a 200, or with an error) and lines
    skipped because an earlier run's output already answered their `custom_id`."""

    total: int = 0
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0


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


async def _answer(session: aiohttp.ClientSession, base: str, item: dict[str, Any],
                  defaults: dict[str, Any] | None = None) -> dict:
    body = {**defaults, **item["body"]} if defaults else item["body"]
    async with session.post(base + item["url"], json=body) as resp:
        body = await resp.json(content_type=None)
    request_id = body.get("id") if isinstance(body, dict) and resp.status == 200 else None
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": item["custom_id"],
            "response": {"status_code": resp.status, "request_id": request_id, "body": body},
            "error": None}


def kept_answers(path: str) -> set[str]:
    """Resuming a job into `path`: keeps the lines of an earlier run's output answered with a 200
    (one per `custom_id`), drops the rest (errors, a line cut short when the run stopped), and
    returns the kept `custom_id`s, whose input lines the new run skips. A missing file keeps
    nothing. The file is rewritten line by line through a temporary file beside it, then
    renamed (memory: the ids, not the answers)."""
    if not os.path.exists(path):
        return set()
    kept: set[str] = set()
    tmp = f"{path}.resume-{secrets.token_hex(4)}"
    try:
        with open(path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
            for line in src:
                try:
                    out = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(out, dict):
                    continue
                response, custom_id = out.get("response"), out.get("custom_id")
                if isinstance(custom_id, str) and custom_id not in kept \
                        and isinstance(response, dict) and response.get("status_code") == 200:
                    kept.add(custom_id)
                    dst.write(line if line.endswith("\n") else line + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return kept


class _Writer:
    """Hands each answer to `write`, as it finishes or (`in_order`) in the input's order: an
    answer waits until every earlier line's is out."""

    def __init__(self, write: Callable[[dict[str, Any]], None], in_order: bool) -> None:
        self._write, self._in_order = write, in_order
        self._next = 0
        self._held: dict[int, dict[str, Any]] = {}
        self._changed = asyncio.Event()

    def put(self, index: int, out: dict[str, Any]) -> None:
        if not self._in_order:
            self._write(out)
            return
        self._held[index] = out
        while self._next in self._held:
            self._write(self._held.pop(self._next))
            self._next += 1
        self._changed.set()

    @property
    def held(self) -> int:
        """Answers waiting for an earlier line's."""
        return len(self._held)

    async def changed(self) -> None:
        """Returns after the next `put`."""
        self._changed.clear()
        await self._changed.wait()


class _Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, CI) a line on stderr every
    `PROGRESS_LINE_S` seconds; or nothing."""

    def __init__(self, total: int | None, mode: str | None) -> None:
        self.total, self.done, self.mode = total, 0, mode
        self._bar = None
        self._start = self._last = time.monotonic()
        if mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc="Batch requests", dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines" and time.monotonic() - self._last >= PROGRESS_LINE_S:
            self._last = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        rate = self.done / max(time.monotonic() - self._start, 1e-9)
        of = f"/{self.total} ({100 * self.done / max(self.total, 1):.0f} %)" \
            if self.total is not None else ""
        return f"ferrobatch batch: {self.done}{of} lines done, {rate:.1f} per s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _chunks(lines: Iterable[str]) -> Iterator[list[str]]:
    it = iter(lines)
    while chunk := list(itertools.islice(it, READ_CHUNK)):
        yield chunk


async def run_batch(engine: Any, lines: Iterable[str], write: Callable[[dict[str, Any]], None],
                    *, concurrency: int = DEFAULT_CONCURRENCY, progress: bool | str = True,
                    served_model_name: str | None = None, in_order: bool = False,
                    answered: Collection[str] = (), total: int | None = None) -> BatchSummary:
    """Answers every request line through a loopback server on `engine` (started, and serving
    nothing else: stopping the server at the end aborts whatever still runs on it; its routes
    take a random key, so no other local process can use them meanwhile), calling
    `write(output_line_dict)` once per input line, as each finishes or (`in_order`) in input
    order; blank lines, and lines whose `custom_id` is in `answered` (an earlier run's, see
    `kept_answers`), get none. `lines` is read as requests take them (in a worker thread: a
    slow pipe does not stall the engine). `progress`: True or "bar" a tqdm bar, "lines" a
    line on stderr now and then, False none; `total`: the lines it counts to."""
    from ferrobatch.serve.server import Server

    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    key = secrets.token_urlsafe(24)
    server = Server(engine, served_model_name=served_model_name, api_key=key)
    await server.start("127.0.0.1", 0)
    try:
        return await answer_lines(f"http://127.0.0.1:{server.port}", lines, write,
                                  headers={"Authorization": f"Bearer {key}"},
                                  concurrency=concurrency, progress=progress,
                                  in_order=in_order, answered=answered, total=total)
    finally:
        await server.stop()


async def answer_lines(base_url: str, lines: Iterable[str],
                       write: Callable[[dict[str, Any]], None], *,
                       headers: dict[str, str] | None = None,
                       concurrency: int = DEFAULT_CONCURRENCY, progress: bool | str = False,
                       in_order: bool = False, answered: Collection[str] = (),
                       total: int | None = None,
                       defaults: dict[str, Any] | None = None) -> BatchSummary:
    """`run_batch`'s requests, posted to a running server at `base_url` (with `headers`):
    at most `concurrency` in flight; cancelling it closes their connections, which aborts
    them on the server (and nothing else there). `defaults`: fields each body gets unless it
    sets them itself."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    summary = BatchSummary()
    meter = _Progress(total, "bar" if progress is True else progress or None)
    writer = _Writer(write, in_order)
    gate = asyncio.Semaphore(concurrency)
    in_flight: set[asyncio.Task] = set()
    seen: set[str] = set()

    def done(index: int, out: dict[str, Any]) -> None:
        ok = out["response"] is not None and out["response"]["status_code"] == 200
        summary.succeeded += ok
        summary.failed += not ok
        writer.put(index, out)
        meter.update()

    async def one(session: aiohttp.ClientSession, index: int, item: dict[str, Any]) -> None:
        try:
            out = await _answer(session, base_url, item, defaults)
        except (aiohttp.ClientError, ValueError, asyncio.TimeoutError) as exc:
            out = _line_error(item["custom_id"], "request_failed",
                              f"{type(exc).__name__}: {exc}")
        finally:
            gate.release()
        done(index, out)

    try:
        timeout = aiohttp.ClientTimeout(total=None)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         headers=headers) as session:
            chunks = _chunks(lines)
            while chunk := await asyncio.to_thread(next, chunks, None):
                for line in chunk:
                    if not line.strip():
                        continue
                    item, error = parse_line(line)
                    custom_id = None if item is None else item["custom_id"]
                    if custom_id in answered:
                        summary.skipped += 1
                        meter.update()
                        continue
                    if custom_id in seen:
                        item, error = None, _line_error(
                            custom_id, "duplicate_custom_id",
                            f"custom_id {custom_id!r} was used by an earlier line")
                    index = summary.total
                    summary.total += 1
                    if item is None:
                        done(index, error)
                        continue
                    seen.add(custom_id)
                    while writer.held >= HOLD_PER_SLOT * concurrency:
                        await writer.changed()
                    await gate.acquire()
                    task = asyncio.create_task(one(session, index, item))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.gather(*in_flight)
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
        meter.close()
    return summary
