"""WebSocket door (`/v1/ws`): the message protocol over JSON text frames or msgpack binary frames.

Replies to a message use the frame kind it came in. A heartbeat detects dead peers; closing the
socket (or losing it) aborts every request the connection started.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import WSMsgType, web

from ferrobatch.serve.codec import MAX_FRAME_BYTES, dumps_json, loads_json, pack, unpack
from ferrobatch.serve.lora_api import resolve_model
from ferrobatch.serve.protocol import ProtocolError, error_msg
from ferrobatch.serve.session import Session
from ferrobatch.serve.state import STATE

HEARTBEAT_S = 20.0


async def ws_handler(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME_BYTES)
    await ws.prepare(request)
    lock = asyncio.Lock()

    async def send(msg: dict[str, Any], binary: bool) -> None:
        if ws.closed:
            raise ConnectionResetError("websocket closed")
        async with lock:
            if binary:
                await ws.send_bytes(pack(msg))
            else:
                await ws.send_str(dumps_json(msg))

    # The HTTP upgrade already passed the API-key middleware, so no hello is needed here.
    session = Session(state.engine, send, limits=state.limits,
                      draining=lambda: state.draining, model_name=state.model_name,
                      lora_of=lambda model: resolve_model(state, model))
    state.sessions.add(session)
    state.websockets.add(ws)
    try:
        async for msg in ws:
            if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                break                    # ERROR / CLOSE / CLOSING
            binary = msg.type == WSMsgType.BINARY    # answer in the frame kind the client used
            try:
                obj = unpack(msg.data) if binary else loads_json(msg.data)
            except ProtocolError as exc:
                await send(error_msg(None, exc.code, str(exc)), binary)
                continue
            await session.handle(obj, binary)
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        state.sessions.discard(session)
        state.websockets.discard(ws)
        await session.close()
        if not ws.closed:
            await ws.close()
    return ws
