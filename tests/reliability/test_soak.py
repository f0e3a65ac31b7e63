"""Soak: mixed traffic with aborts on every door for a fixed time; reports the RSS slope and
block accounting. CI: ~40 s on the tiny model. `slow`: the full SmolLM2 for FB_SOAK_S seconds
(default 600), figures appended to results.jsonl and summarised in RESULTS.md."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import pytest
from harness import (
    PROMPTS,
    Outcome,
    assert_engine_clean,
    http_stream,
    process_snapshot,
    record_result,
    slope_mb_per_min,
    tcp_stream,
    wait_engine_idle,
    ws_stream,
)

ENGINE = dict(num_blocks=512, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024,
              max_queued_requests=64)


async def soak(oracle, model, duration_s: float, workers: int = 12) -> dict:
    srv = await oracle.serve(model, **ENGINE)
    engine = srv.engine
    rng = random.Random(7)
    stats = {"completed": 0, "cut": 0, "refused": 0, "bad": 0}
    samples: list[tuple[float, float]] = []
    t_end = time.monotonic() + duration_s

    async def worker(k: int, s: aiohttp.ClientSession) -> None:
        while time.monotonic() < t_end:
            door = rng.choice(["http", "ws", "ws-msgpack", "tcp"])
            cut = rng.random() < 0.3
            mt = rng.randint(4, 24)
            o = Outcome(door)
            cut_after = rng.randint(0, 3) if cut else None
            p = rng.choice(PROMPTS)
            if door == "http":
                await http_stream(s, srv.base, p, mt, o, cut_after)
            elif door == "tcp":
                await tcp_stream(srv.tcp_port, p, mt, o, cut_after, rng.choice(["reset", "cancel"]))
            else:
                await ws_stream(s, srv.ws_url, p, mt, o, cut_after, door == "ws-msgpack",
                                rng.choice(["close", "cancel"]))
            if o.cut:
                stats["cut"] += 1
            elif o.terminals in (["length", "[DONE]"], ["done"]) and o.num_tokens == mt:
                stats["completed"] += 1
            elif o.terminals and o.terminals[0] in ("http-429",) or (o.error and "429" in str(o.error)):
                stats["refused"] += 1
            else:
                stats["bad"] += 1

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < t_end:
            samples.append((time.monotonic() - t0, process_snapshot()["rss_mb"]))
            await asyncio.sleep(1.0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.wait_for(asyncio.gather(sampler(), *(worker(k, s) for k in range(workers))),
                               duration_s + 300)
    idle_s = await wait_engine_idle(engine, 5.0)
    acc = assert_engine_clean(engine)
    warm = samples[len(samples) // 4:]            # skip allocator warm-up
    out = {"duration_s": duration_s, **stats, "idle_after_s": round(idle_s, 3),
           "rss_start_mb": round(warm[0][1], 1), "rss_end_mb": round(warm[-1][1], 1),
           "rss_slope_mb_per_min": round(slope_mb_per_min(warm), 2),
           "accepted": acc["accepted"], "released": acc["released"],
           "preemptions": engine.stats()["num_preemptions_total"],
           "used_blocks_at_idle": engine.stats()["num_used_blocks"]}
    print("soak", out)
    assert stats["bad"] == 0, stats
    assert stats["completed"] > 0 and stats["cut"] > 0
    assert out["rss_end_mb"] - out["rss_start_mb"] < 64, out
    return out


async def test_soak_short(oracle, tiny_model):
    await soak(oracle, tiny_model, 40.0)


SOAK_LONG_S = float(os.environ.get("FB_SOAK_S", "600"))


@pytest.mark.slow
@pytest.mark.timeout(SOAK_LONG_S + 300)     # the soak itself, plus loading and draining
async def test_soak_long(oracle, loaded_smollm2):
    out = await soak(oracle, loaded_smollm2, SOAK_LONG_S)
    assert abs(out["rss_slope_mb_per_min"]) < 5, out
    record_result("soak_long", out)
