"""Server fixtures: a fast server on FakeCore, one per test (real-model servers: see test_e2e_real)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "engine"))

from fake_core import FakeCore  # noqa: E402
from serve_support import start_server, stop_server  # noqa: E402

from ferrobatch.config import EngineConfig  # noqa: E402
from ferrobatch.engine.async_engine import AsyncEngine  # noqa: E402


@pytest.fixture
async def fake_server(request):
    opts = dict(getattr(request, "param", None) or {})
    core = FakeCore(**opts.pop("core", {}))
    engine = AsyncEngine(EngineConfig(model="fake", **opts.pop("config", {})), core=core)
    r = await start_server(engine, **opts)
    yield r
    if engine.is_running:
        await engine.check_idle_clean()
    await stop_server(r)
    engine.check_accounting()
