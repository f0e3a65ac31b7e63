"""Starting and stopping a real Server on ephemeral ports (shared by the serve tests)."""

from __future__ import annotations

import contextlib

from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.engine.observer import EngineObserver
from ferrobatch.serve.server import Server


class Running:
    """A started server plus handy addresses."""

    def __init__(self, server: Server, engine: AsyncEngine) -> None:
        self.server = server
        self.engine = engine
        self.base = f"http://127.0.0.1:{server.port}"
        self.ws_url = f"ws://127.0.0.1:{server.port}/v1/ws"
        self.tcp_port = server.tcp_port


async def start_server(engine: AsyncEngine, **kw) -> Running:
    await engine.start()
    server = Server(engine, **kw)
    await server.start("127.0.0.1", 0, tcp_port=0)
    return Running(server, engine)


@contextlib.asynccontextmanager
async def sdk_client(r: Running):
    """The `openai` SDK's async client on `r`'s HTTP door; on leaving, the engine must be idle
    with every block free and the request tables empty."""
    import openai
    client = openai.AsyncOpenAI(base_url=r.base + "/v1", api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
    await r.engine.check_idle_clean(10.0)


async def stop_server(r: Running) -> None:
    await r.server.stop()
    await r.engine.shutdown()


class Finishes(EngineObserver):
    """Every finished request's (finish reason, tokens generated), in order: a test sees that
    a request ended as it should (a client that left: an abort, not a natural end)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_finished(self, request) -> None:
        self.seen.append((request.finish_reason, request.num_generated))


async def start_watched(loaded_model, **server_options) -> Running:
    """A server on the real model (REAL_ENGINE_OPTIONS) whose engine's `finishes` records
    every finished request."""
    from engine_support import REAL_ENGINE_OPTIONS
    engine = AsyncEngine(loaded_model=loaded_model, **REAL_ENGINE_OPTIONS)
    engine.finishes = Finishes()
    engine.add_observer(engine.finishes)
    return await start_server(engine, **server_options)
