"""TCP door: the message protocol as length-prefixed msgpack frames.

Each frame is a 4-byte big-endian length followed by one msgpack map. The first message must be
`hello` {version: 1[, api_key]}. A frame over the size limit (or a zero-length one) makes the
stream unreadable: the server sends an `error` and closes the connection. EOF or a lost
connection aborts every request the connection started.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from ferrobatch.serve.codec import MAX_FRAME_BYTES, pack, unpack
from ferrobatch.serve.lora_api import resolve_model
from ferrobatch.serve.protocol import ProtocolError, error_msg
from ferrobatch.serve.session import Session

_LEN = struct.Struct(">I")


def frame(msg: dict[str, Any]) -> bytes:
    body = pack(msg)
    return _LEN.pack(len(body)) + body


class TCPServer:
    def __init__(self, state: Any) -> None:
        self._state = state
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._on_conn, host, port)
        return self._server.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        lock = asyncio.Lock()

        async def send(msg: dict[str, Any], binary: bool = True) -> None:
            if writer.is_closing():
                raise ConnectionResetError("connection closed")
            async with lock:
                writer.write(frame(msg))
                await writer.drain()

        state = self._state
        session = Session(state.engine, send, api_key=state.api_key, require_hello=True,
                          limits=state.limits, draining=lambda: state.draining,
                          model_name=state.model_name,
                          lora_of=lambda model: resolve_model(state, model))
        state.sessions.add(session)
        try:
            while True:
                try:
                    header = await reader.readexactly(4)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break                                   # EOF: abort this connection's work
                (length,) = _LEN.unpack(header)
                if length == 0 or length > MAX_FRAME_BYTES:
                    await send(error_msg(None, 413, f"frame length {length} is outside "
                                                    f"1..{MAX_FRAME_BYTES} bytes; closing"))
                    break
                try:
                    body = await reader.readexactly(length)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                try:
                    obj = unpack(body)
                except ProtocolError as exc:
                    await send(error_msg(None, exc.code, str(exc)))
                    continue
                await session.handle(obj, True)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            state.sessions.discard(session)
            await session.close()
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass
            if task is not None:
                self._conns.discard(task)
