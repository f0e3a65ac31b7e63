"""aiohttp middlewares: API-key auth (constant-time) and OpenAI-shaped errors, never tracebacks;
and the log filter that keeps a client's malformed HTTP from logging one."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ferrobatch.serve.http import error_response, exception_response

log = logging.getLogger("ferrobatch.serve")
OPEN_PATHS = frozenset({"/health", "/ping"})          # liveness (/ping: SageMaker's)
DRAIN_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


def drain_middleware(state) -> web.middleware:
    """While the server drains, every new request but liveness/metrics gets 503 (Connection:
    close); requests already streaming are not affected."""

    @web.middleware
    async def check(request: web.Request, handler):
        if state.draining and request.path not in DRAIN_OPEN_PATHS:
            resp = error_response(503, "the server is shutting down; retry elsewhere",
                                  "server_error")
            resp.headers["Connection"] = "close"
            return resp
        return await handler(request)

    return check


def auth_middleware(api_key: str) -> web.middleware:
    """Every path but liveness needs the key: ``Authorization: Bearer <key>`` (OpenAI's SDK),
    or ``x-api-key: <key>`` (Anthropic's)."""
    expected = f"Bearer {api_key}".encode()
    key = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            bearer = hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                         expected)
            given = request.headers.get("x-api-key", "").encode()
            header = hmac.compare_digest(given, key) and bool(given)
            if not (bearer or header):
                return error_response(401, "invalid or missing API key (Authorization: Bearer "
                                           "<key>, or x-api-key: <key>)", "authentication_error")
        return await handler(request)

    return check


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return error_response(exc.status, exc.reason or "error", kind)
    except ConnectionError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to 4xx/5xx, never a traceback
        status = exception_response(exc)
        if status.status >= 500 and status.status != 503:
            log.exception("unhandled error on %s", request.path)
        return status


class MalformedRequestLogFilter(logging.Filter):
    """aiohttp logs a request it cannot parse (a bad header, a line too long, a body in a
    Content-Encoding it cannot decode, ...) with the parser's whole traceback, at ERROR: any
    client could fill the log. Such a record becomes one WARNING line naming the client and
    the parser's reason; the client still gets aiohttp's 400."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            reason = " ".join(str(exc.message).split())
            record.msg, record.args = "rejected a malformed HTTP request from %s: %s", \
                (remote, reason)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_malformed_request_logs() -> None:
    """Install `MalformedRequestLogFilter` on aiohttp's server logger (once)."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestLogFilter) for f in server_log.filters):
        server_log.addFilter(MalformedRequestLogFilter())
