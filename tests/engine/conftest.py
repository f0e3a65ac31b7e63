"""Engine test fixtures: a fast engine on FakeCore, and accounting checks after each test."""

from __future__ import annotations

import pytest

from fake_core import FakeCore
from ferrobatch.config import EngineConfig
from ferrobatch.engine.async_engine import AsyncEngine


@pytest.fixture
async def fake_engine():
    core = FakeCore()
    engine = AsyncEngine(EngineConfig(model="fake", max_queued_requests=64), core=core)
    await engine.start()
    yield engine
    if engine.is_running:
        await engine.check_idle_clean()
    await engine.shutdown()
    engine.check_accounting()
