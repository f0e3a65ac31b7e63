"""Reliability battery fixtures: the oracles run after every test.

`oracle` (autouse) records every AsyncEngine started during the test. At teardown, for each one:
- it waits (bounded) until the engine has no open request, then checks request accounting
  (accepted == released == sum of terminal reasons == observer count; no id left in the
  engine's tables, the core's extras or a connection session) and, while the engine runs, block
  accounting in Rust (no used block, free + cached == total - 1, empty intake, integrity check);
- it stops the engine (and its server) if the test left it running.
"""

from __future__ import annotations

import asyncio

import pytest
from harness import FinishCounter, assert_engine_clean, serve, truncated_model, wait_engine_idle

from ferrobatch.engine.async_engine import AsyncEngine


@pytest.fixture(scope="session")
def tiny_model(loaded_smollm2):
    return truncated_model(loaded_smollm2)


class Oracle:
    def __init__(self) -> None:
        self.engines: list[tuple[AsyncEngine, FinishCounter]] = []
        self.servers: list = []
        self.idle_timeout_s = 10.0

    def counter(self, engine: AsyncEngine) -> FinishCounter:
        return next(c for e, c in self.engines if e is engine)

    async def serve(self, loaded=None, **kw):
        s = await serve(loaded, **kw)
        self.servers.append(s)
        return s

    async def check(self) -> None:
        for s in self.servers:
            # connections close asynchronously: every session must go away, bounded
            for _ in range(500):
                if not s.server.state.sessions:
                    break
                await asyncio.sleep(0.01)
            assert not s.server.state.sessions, "connection sessions left open"
        for engine, counter in self.engines:
            if engine.is_running:
                await wait_engine_idle(engine, self.idle_timeout_s)
            elif engine._requests:
                raise AssertionError(f"dead engine kept {len(engine._requests)} open requests")
            assert_engine_clean(engine, counter)

    async def close(self) -> None:
        for s in self.servers:
            await s.stop()
        for engine, _ in self.engines:
            await engine.shutdown()
            engine.check_accounting()


@pytest.fixture(autouse=True)
async def oracle(monkeypatch):
    o = Oracle()
    real_start = AsyncEngine.start

    async def start(self):
        if not any(e is self for e, _ in o.engines):
            c = FinishCounter()
            self.add_observer(c)
            o.engines.append((self, c))
        return await real_start(self)

    monkeypatch.setattr(AsyncEngine, "start", start)
    try:
        yield o
        await o.check()
    finally:
        await o.close()
