"""Server fixtures: a fast server on FakeCore (per test) and, per module, one on the real model."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "engine"))

from fake_core import FakeCore  # noqa: E402
from ferrobatch.config import EngineConfig  # noqa: E402
from ferrobatch.engine.async_engine import AsyncEngine  # noqa: E402
from ferrobatch.serve.server import Server  # noqa: E402


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


async def stop_server(r: Running) -> None:
    await r.server.stop()
    await r.engine.shutdown()


@pytest.fixture
async def fake_server(request):
    opts = getattr(request, "param", {}) or {}
    core = FakeCore(**opts.pop("core", {}))
    engine = AsyncEngine(EngineConfig(model="fake", **opts.pop("config", {})), core=core)
    r = await start_server(engine, **opts)
    yield r
    if engine.is_running:
        await engine.check_idle_clean()
    await stop_server(r)
    engine.check_accounting()
