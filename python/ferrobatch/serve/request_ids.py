"""`X-Request-Id`: every HTTP response carries one, the client's own when it sent one.

A client's id (1..128 characters of letters, digits and `. _ : @ / + = -`) is echoed in the
response header and becomes the base of the OpenAI object's id (`cmpl-<id>`,
`chatcmpl-<id>`, `resp_<id>`, as vLLM does); without one the server makes one up. The id also
appears in the access log (`--access-log`). A malformed id is a 400, never reflected.
"""

from __future__ import annotations

import re
import secrets

from aiohttp import web

HEADER = "X-Request-Id"
_RequestKey = getattr(web, "RequestKey", None)     # aiohttp >= 3.12; plain keys before
_KEY = _RequestKey("ferrobatch.request_id", str) if _RequestKey else "ferrobatch.request_id"
_GIVEN = (_RequestKey("ferrobatch.request_id_given", bool) if _RequestKey
          else "ferrobatch.request_id_given")
_VALID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def request_id_middleware() -> web.middleware:
    """Reads (and checks) the client's `X-Request-Id`, or makes one; the outermost middleware,
    so that errors of the others carry the id too."""
    from ferrobatch.serve.http import error_response

    @web.middleware
    async def assign(request: web.Request, handler):
        given = request.headers.get(HEADER)
        if given is not None and not _VALID.fullmatch(given):
            return error_response(400, f"{HEADER} must be 1 to 128 characters of letters, "
                                  "digits and . _ : @ / + = -", "invalid_request_error")
        request[_KEY] = given if given is not None else secrets.token_hex(12)
        request[_GIVEN] = given is not None
        return await handler(request)

    return assign


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: the id goes out with every response, streamed ones too."""
    rid = request.get(_KEY)
    if rid is not None:
        response.headers[HEADER] = rid


def object_id(request: web.Request, prefix: str, default: str) -> str:
    """The id of the OpenAI object a route returns: `prefix` + the client's request id when it
    sent one, else `default` (the route's own)."""
    return f"{prefix}{request[_KEY]}" if request.get(_GIVEN) else default
