"""Engine test fixtures: a fast engine on FakeCore, and accounting checks after each test."""

from __future__ import annotations

import pytest
from engine_support import REAL_ENGINE_OPTIONS
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


@pytest.fixture(scope="module")
def real_llm(loaded_smollm2):
    """One LLM on the real SmolLM2 (shared weights, a small KV cache) per test module."""
    from ferrobatch.engine.llm import LLM
    llm = LLM("smollm2", loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS)
    yield llm
    llm.close()
