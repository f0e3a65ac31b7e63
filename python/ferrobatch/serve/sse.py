"""Server-sent events over an aiohttp StreamResponse (`data: <json>\n\n`, then `data: [DONE]`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ferrobatch.serve.codec import dumps_json


class SSEWriter:
    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, obj: Any) -> None:
        """Raises ConnectionResetError once the client has gone."""
        await self.response.write(b"data: " + dumps_json(obj).encode() + b"\n\n")

    async def close(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
