"""The OpenAI Files and Batches APIs' state (`serve --enable-batch-api`): uploaded files on disk,
batch jobs running them through the server's own HTTP routes.

Files live in a directory of their own (a fresh temporary one, removed when the server stops:
nothing survives a restart), each written as it arrives, at most `max_file_bytes`, and all of
them (outputs too) at most `STORAGE_FILES` times that before an upload is refused. A batch
job, in the states OpenAI names:
- `validating`: every line of its input file read once: each must be a request
  (`batch.parse_line`) for the batch's endpoint with a `custom_id` no earlier line used; any
  that is not fails the whole batch (`failed`, `errors` listing up to `MAX_ERRORS` of them by
  line number), as OpenAI validates a batch before it runs;
- `in_progress`: the lines posted to the server's routes (`batch.answer_lines`, through a
  loopback address of the same server: the same options, auth and limits as any client), at
  most `concurrency` at a time, each with `priority` unless its body sets one (under
  `--scheduling-policy priority` live requests, at 0, go first); each answer written at once
  to the output file (status 200)
  or the error file (any other), `request_counts` following them;
- `finalizing` -> `completed`: the two files become file objects (`batch_output`), their ids
  on the batch (an empty one is not made);
- `cancelling` -> `cancelled`: the requests still running are aborted (their connections
  closed), the answers so far kept in the files as above;
- `expired`: the same, when `completion_window` (24 h) runs out first.

Memory stays bounded by `concurrency` requests per job, whatever the file's size; the batch
records themselves are small and kept until the server stops. Only the asyncio thread touches
the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ferrobatch.batch import URLS, answer_lines, parse_line
from ferrobatch.serve.protocol import ProtocolError

logger = logging.getLogger(__name__)

DEFAULT_MAX_FILE_MB = 200           # OpenAI's limit for a batch input file
STORAGE_FILES = 10                  # the directory holds at most this many files' worth
DEFAULT_CONCURRENCY = 64            # requests of one batch in flight at once
DEFAULT_PRIORITY = 1                # a line's priority unless it sets one: under the priority
#                                     scheduling policy, after live requests (0)
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
MAX_ERRORS = 100                    # validation errors a failed batch lists
UPLOAD_PURPOSES = ("batch",)


def _refused(code: int, message: str, param: str | None = None) -> ProtocolError:
    """A request the store refuses (400, 404, 413), as the HTTP routes report it."""
    return ProtocolError(message, code=code, param=param)


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    path: str

    def object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": None}


@dataclass
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    created_at: int
    status: str = "validating"
    errors: dict[str, Any] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    times: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(
        ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")))
    task: asyncio.Task | None = None

    def object(self) -> dict[str, Any]:
        window = COMPLETION_WINDOW_S[self.completion_window]
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint,
                "errors": self.errors, "input_file_id": self.input_file_id,
                "completion_window": self.completion_window, "status": self.status,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.created_at + window,
                **self.times,
                "request_counts": {"total": self.total, "completed": self.completed,
                                   "failed": self.failed},
                "metadata": self.metadata}

    def mark(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())


class BatchStore:
    """Uploaded files and batch jobs; `base_url` / `headers`: where (and with what key) a job
    posts its requests: the owning server sets them once it listens."""

    def __init__(self, *, max_file_bytes: int = DEFAULT_MAX_FILE_MB << 20,
                 concurrency: int = DEFAULT_CONCURRENCY,
                 priority: int = DEFAULT_PRIORITY) -> None:
        if max_file_bytes < 1 or concurrency < 1:
            raise ValueError("the batch store needs max_file_bytes >= 1 and concurrency >= 1")
        self.max_file_bytes, self.concurrency = max_file_bytes, concurrency
        self.priority = priority
        self._dir: str | None = None        # made at the first file (a server never used, or
        #                                     never started, leaves nothing behind)
        self.files: OrderedDict[str, StoredFile] = OrderedDict()
        self.batches: OrderedDict[str, Batch] = OrderedDict()
        self.base_url: str | None = None
        self.headers: dict[str, str] = {}

    @property
    def dir(self) -> str:
        """The files' directory (a fresh temporary one, made on first use)."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="ferrobatch-files-")
        return self._dir

    # -- files -------------------------------------------------------------------------------

    async def add_file(self, filename: str, purpose: str,
                       read_chunk: Callable[[], Any]) -> StoredFile:
        """Writes an upload to disk as `read_chunk()` yields it (b"" at the end); 413 past
        `max_file_bytes` (nothing kept)."""
        if purpose not in UPLOAD_PURPOSES:
            raise _refused(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} "
                             f"(this server keeps files for batches only), got {purpose!r}",
                             "purpose")
        file_id = f"file-{secrets.token_hex(12)}"
        path = os.path.join(self.dir, file_id)
        room = STORAGE_FILES * self.max_file_bytes - sum(f.bytes for f in self.files.values())
        size = 0
        try:
            with open(path, "wb") as f:
                while chunk := await read_chunk():
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise _refused(413, f"the file is larger than the "
                                         f"{self.max_file_bytes >> 20} MiB this server takes "
                                         "(--batch-max-file-mb)", "file")
                    if size > room:
                        raise _refused(413, "the server's file storage is full "
                                       f"({STORAGE_FILES} x --batch-max-file-mb): delete "
                                       "files first", "file")
                    f.write(chunk)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        # the name is only shown (file objects, the download's Content-Disposition): printable,
        # without quotes or backslashes, at most 255 characters
        name = "".join(c for c in filename if c.isprintable() and c not in '"\\')[:255]
        stored = StoredFile(file_id, name or "upload.jsonl", purpose, size, int(time.time()),
                            path)
        self.files[file_id] = stored
        return stored

    def file(self, file_id: str) -> StoredFile:
        stored = self.files.get(file_id)
        if stored is None:
            raise _refused(404, f"No such File object: {file_id}", "file_id")
        return stored

    def delete_file(self, file_id: str) -> None:
        stored = self.file(file_id)
        del self.files[file_id]
        with contextlib.suppress(OSError):     # a running job keeps its open handle
            os.unlink(stored.path)

    def _new_output(self, purpose: str) -> StoredFile:
        file_id = f"file-{secrets.token_hex(12)}"
        return StoredFile(file_id, f"{file_id}.jsonl", purpose, 0, int(time.time()),
                          os.path.join(self.dir, file_id))

    # -- batches -----------------------------------------------------------------------------

    def create_batch(self, body: Any) -> Batch:
        """A batch from `POST /v1/batches`' body, its job started (validation first)."""
        if not isinstance(body, dict):
            raise _refused(400, "the request body must be a JSON object")
        input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window, metadata = body.get("completion_window"), body.get("metadata")
        if not isinstance(input_file_id, str):
            raise _refused(400, "'input_file_id' must be a file id", "input_file_id")
        stored = self.file(input_file_id)
        if stored.purpose != "batch":
            raise _refused(400, f"file {input_file_id} has purpose {stored.purpose!r}, not "
                             "'batch'", "input_file_id")
        if endpoint not in URLS:
            raise _refused(400, f"'endpoint' must be one of {', '.join(URLS)}", "endpoint")
        if window not in COMPLETION_WINDOW_S:
            raise _refused(400, "'completion_window' must be '24h'", "completion_window")
        if metadata is not None and not (
                isinstance(metadata, dict) and len(metadata) <= 16
                and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise _refused(400, "'metadata' must be an object of at most 16 string values",
                             "metadata")
        batch = Batch(f"batch_{secrets.token_hex(12)}", endpoint, input_file_id, window,
                      metadata, int(time.time()))
        self.batches[batch.id] = batch
        batch.task = asyncio.create_task(self._run(batch, stored.path))
        return batch

    def batch(self, batch_id: str) -> Batch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise _refused(404, f"No such Batch object: {batch_id}", "batch_id")
        return batch

    def cancel(self, batch_id: str) -> Batch:
        """`cancelling` now, `cancelled` once its running requests are aborted; a batch that
        has ended stays as it is."""
        batch = self.batch(batch_id)
        if batch.status in ("validating", "in_progress", "finalizing") and batch.task:
            batch.mark("cancelling")
            batch.task.cancel()
        return batch

    def listed(self, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """Newest first, `limit` of them after batch `after`; and whether more follow."""
        newest = list(reversed(self.batches.values()))
        if after is not None:
            ids = [b.id for b in newest]
            if after not in ids:
                raise _refused(404, f"No such Batch object: {after}", "after")
            newest = newest[ids.index(after) + 1:]
        return newest[:limit], len(newest) > limit

    async def _run(self, batch: Batch, path: str) -> None:
        window = COMPLETION_WINDOW_S[batch.completion_window]
        outputs = {"out": self._new_output("batch_output"),
                   "err": self._new_output("batch_output")}
        try:
            errors, total = await asyncio.to_thread(_validate, path, batch.endpoint)
            if errors or not total:
                batch.errors = {"object": "list", "data": errors or [
                    {"code": "empty_file", "message": "the input file holds no requests",
                     "param": None, "line": None}]}
                batch.mark("failed")
                return
            batch.total = total
            batch.mark("in_progress")
            await asyncio.wait_for(self._answer(batch, path, outputs), window)
            batch.mark("finalizing")
            self._keep(batch, outputs)
            batch.mark("completed")
        except asyncio.TimeoutError:
            self._keep(batch, outputs)
            batch.mark("expired")
        except asyncio.CancelledError:
            self._keep(batch, outputs)
            batch.mark("cancelled")
        except Exception as exc:  # noqa: BLE001 - the batch fails, the server goes on
            logger.exception("batch %s failed", batch.id)
            batch.errors = {"object": "list", "data": [
                {"code": "server_error", "message": f"{type(exc).__name__}: {exc}",
                 "param": None, "line": None}]}
            self._keep(batch, outputs)
            batch.mark("failed")

    async def _answer(self, batch: Batch, path: str, outputs: dict[str, StoredFile]) -> None:
        with open(path, encoding="utf-8", errors="replace") as lines, \
                open(outputs["out"].path, "w", encoding="utf-8") as out, \
                open(outputs["err"].path, "w", encoding="utf-8") as err:
            def write(answer: dict[str, Any]) -> None:
                ok = answer["response"] is not None and answer["response"]["status_code"] == 200
                (out if ok else err).write(json.dumps(answer, ensure_ascii=False) + "\n")
                batch.completed += ok
                batch.failed += not ok

            await answer_lines(self.base_url, lines, write, headers=self.headers,
                               concurrency=self.concurrency,
                               defaults={"priority": self.priority})

    def _keep(self, batch: Batch, outputs: dict[str, StoredFile]) -> None:
        """The output and error files as file objects on the batch (an empty one dropped)."""
        for key, attr in (("out", "output_file_id"), ("err", "error_file_id")):
            stored = outputs[key]
            try:
                stored.bytes = os.path.getsize(stored.path)
            except OSError:
                continue
            if stored.bytes:
                self.files[stored.id] = stored
                setattr(batch, attr, stored.id)
            else:
                os.unlink(stored.path)

    async def close(self) -> None:
        """Cancels the running jobs and removes every file."""
        tasks = [b.task for b in self.batches.values() if b.task and not b.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _validate(path: str, endpoint: str) -> tuple[list[dict[str, Any]], int]:
    """(up to MAX_ERRORS errors, by line number from 1; the number of requests) of a batch's
    input file."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    total = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            item, error = parse_line(line)
            message = error["error"]["message"] if error else None
            if item is not None and item["url"] != endpoint:
                message = f"'url' is {item['url']}, the batch's endpoint is {endpoint}"
            elif item is not None and item["custom_id"] in seen:
                message = f"custom_id {item['custom_id']!r} was used by an earlier line"
            if message is not None:
                if len(errors) < MAX_ERRORS:
                    errors.append({"code": "invalid_request", "message": message,
                                   "param": None, "line": number})
                continue
            seen.add(item["custom_id"])
            total += 1
    return errors, total
