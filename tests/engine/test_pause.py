"""Pausing generation (vLLM's `pause_generation` / `resume_generation`, what RL loops do around
a weight update) on the real SmolLM2: in-flight requests are aborted, or run to their end first;
while paused new requests wait (those entering through `prepare`, as every door does, before
the engine; one added directly in the scheduler) and no step runs, while calls such as a prefix
cache reset still do; after the resume the held requests give, in full, what they give alone;
nothing is left behind."""

from __future__ import annotations

import asyncio

import pytest
from engine_support import REAL_ENGINE_OPTIONS

from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.engine.errors import EngineDeadError
from ferrobatch.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def _final(engine, prompt, params=GREEDY, request_id=None):
    outs = [o async for o in engine.generate(prompt, params, request_id=request_id)]
    return outs[-1].outputs[0]


@pytest.fixture
async def engine(loaded_smollm2):
    async with AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as engine:
        yield engine
        await engine.check_idle_clean()


async def test_pause_aborts_in_flight_holds_new_requests_until_resume(engine):
    alone = [(await _final(engine, p)).token_ids for p in ("Hello, my name is", "1, 2, 3,")]
    long = asyncio.create_task(_final(engine, "Tell me a long story.", SamplingParams(
        max_tokens=400, ignore_eos=True), request_id="long"))
    while "long" not in engine._by_name or not engine._requests[engine._by_name["long"]].seqs[
            0].token_ids:
        await asyncio.sleep(0.01)
    assert await engine.pause_generation() == 1
    assert engine.is_paused
    assert (await long).finish_reason == "abort"
    held = asyncio.create_task(_final(engine, "Hello, my name is"))
    direct = engine.add_request("1, 2, 3,", GREEDY)          # past the doors: in the scheduler
    steps = engine._loop_thread.num_steps
    await asyncio.sleep(0.3)
    assert not held.done() and engine._loop_thread.num_steps == steps   # nothing ran
    assert not engine._requests[engine._by_name[direct.request_id]].seqs[0].token_ids
    assert await engine.reset_prefix_cache() == 0            # calls still run while paused
    assert await engine.pause_generation() == 0              # paused already: nothing
    await engine.resume_generation()
    assert not engine.is_paused
    assert (await held).token_ids == alone[0]
    assert [o async for o in direct][-1].outputs[0].token_ids == alone[1]


async def test_pause_waiting_for_in_flight_requests_lets_them_finish(engine):
    running = asyncio.create_task(_final(engine, "Once upon a time", request_id="r"))
    while "r" not in engine._by_name:
        await asyncio.sleep(0.005)
    assert await engine.pause_generation(wait_for_inflight_requests=True,
                                         clear_cache=False) == 0
    out = await running
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert engine.is_paused
    await engine.resume_generation()
    assert len((await _final(engine, "Once upon a time")).token_ids) == 12


async def test_shutdown_while_paused_ends_every_waiter(loaded_smollm2):
    engine = await AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS).start()
    await engine.pause_generation()
    direct = engine.add_request("Hello", GREEDY)
    held = asyncio.create_task(_final(engine, "Hello"))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(engine.shutdown(), 20)
    assert [o async for o in direct][-1].outputs[0].finish_reason == "abort"
    with pytest.raises(EngineDeadError, match="shutting down"):   # released, then refused
        await held
