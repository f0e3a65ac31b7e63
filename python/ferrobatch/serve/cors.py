"""CORS for the HTTP door (`serve --allowed-origins`), so a web page can call the API from a browser.

Off by default: with `*`, any page the user's browser visits could read the answers of a server
on the user's loopback. With origins configured:
- a middleware, the app's first, answers a preflight (`OPTIONS` with `Origin` and
  `Access-Control-Request-Method`) itself: 204 before the API-key check (browsers never send
  credentials on a preflight), or 403 for an origin that is not allowed;
- every response to an allowed origin gets `Access-Control-Allow-Origin` (the origin, or `*`
  when every origin is allowed), `Access-Control-Expose-Headers: X-Request-Id` and `Vary:
  Origin` as it is prepared, so streams and error bodies carry them too.
WebSocket upgrades are not checked (CORS does not apply to them).
"""

from __future__ import annotations

from aiohttp import web

ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE_S = 600


def parse_origins(text: str | None) -> frozenset[str]:
    """`"*"` or a comma-separated list of origins (`scheme://host[:port]`, no path) -> a set.

    Raises ValueError on an entry that is not an origin."""
    if text is None or not text.strip():
        return frozenset()
    origins = set()
    for raw in text.split(","):
        origin = raw.strip().rstrip("/")
        if origin == "*":
            origins.add(origin)
            continue
        scheme, sep, rest = origin.partition("://")
        if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
            raise ValueError(f"allowed origin {raw.strip()!r} is not '*' or "
                             "scheme://host[:port] (http or https, no path)")
        origins.add(origin)
    return frozenset(origins)


def install_cors(app: web.Application, origins: frozenset[str]) -> None:
    """Answers preflights (a middleware: it must be the app's first) and adds the allow headers
    to every response as it is prepared (streams included); nothing when `origins` is empty."""
    if not origins:
        return
    any_origin = "*" in origins

    def allow_origin(request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        return "*" if any_origin else origin if origin in origins else None

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method != "OPTIONS" or "Origin" not in request.headers \
                or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        allowed = allow_origin(request)
        if allowed is None:
            from ferrobatch.serve.http import error_response
            return error_response(403, "this origin is not allowed (serve --allowed-origins)",
                                  "permission_error")
        requested = request.headers.get("Access-Control-Request-Headers")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": requested or DEFAULT_ALLOWED_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})

    async def allow_headers(request: web.Request, response: web.StreamResponse) -> None:
        allowed = allow_origin(request)
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
            response.headers.add("Vary", "Origin")

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(allow_headers)
