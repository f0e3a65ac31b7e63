"""Abort / disconnect storm: 200 concurrent streams over HTTP/SSE, WebSocket (JSON + msgpack) and
TCP; half of them are cut at random moments by every means (HTTP close, WS close frame, WS/TCP
cancel message, TCP reset, client process SIGKILL).

Asserted per cycle:
- within 2 s after the last cut, no cut request is left in the engine or the Rust scheduler
  (open requests <= survivors still streaming);
- every survivor gets exactly one terminal message, exactly `max_tokens` tokens and the same
  greedy text (and token ids, on WS/TCP) as the same prompt run alone;
- within 2 s after the last survivor, the engine is idle with every KV block free;
- across cycles nothing grows: fds, threads, TCP connections, RSS (bounded), open requests.

CI size: 200 streams, 2 cycles, short survivors (the tiny 2-layer model). `slow`: the issue's
full size (10 cycles, long max_tokens); its figures go to RESULTS.md.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp
import pytest
from harness import (
    HERE,
    PROMPTS,
    Outcome,
    assert_engine_clean,
    http_stream,
    process_snapshot,
    tcp_stream,
    wait_engine_idle,
    ws_stream,
)

IDLE_AFTER_CUT_S = 2.0


@dataclass
class StormSize:
    streams: int = 200
    survivor_tokens: int = 12
    cut_tokens: int = 512          # "long max_tokens": a leaked cut request would run for ages
    cycles: int = 2
    procs: int = 2                 # client processes killed with SIGKILL
    per_proc: int = 4
    max_cut_after: int = 6


ENGINE = dict(num_blocks=1536, max_num_seqs=256, max_num_batched_tokens=2048,
              max_model_len=1024)


async def _reference(srv, size: StormSize) -> dict[str, tuple[str, list[int]]]:
    refs = {}
    for prompt in PROMPTS:
        o = Outcome("ref")
        await tcp_stream(srv.tcp_port, prompt, size.survivor_tokens, o)
        assert o.terminals == ["done"] and o.num_tokens == size.survivor_tokens, vars(o)
        refs[prompt] = (o.text, o.token_ids)
    return refs


async def _spawn_client(srv, size: StormSize, prompt: str) -> asyncio.subprocess.Process:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return await asyncio.create_subprocess_exec(
        sys.executable, os.path.join(HERE, "client_proc.py"), "--base", srv.base,
        "--tcp-port", str(srv.tcp_port), "--streams", str(size.per_proc),
        "--max-tokens", str(size.cut_tokens), "--prompt", prompt, "--life-s", "120",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


async def _one_cycle(srv, size: StormSize, refs, rng: random.Random) -> dict:
    engine = srv.engine
    n_local = size.streams - size.procs * size.per_proc
    n_cut_local = size.streams // 2 - size.procs * size.per_proc
    cut_idx = set(rng.sample(range(n_local), n_cut_local))
    cut_times: list[float] = []
    outs: list[Outcome] = []
    survivors: list[Outcome] = []

    async def run(i: int, s: aiohttp.ClientSession) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        door = ("http", "ws", "ws-msgpack", "tcp")[i % 4]
        cut = i in cut_idx
        o = Outcome(door)
        o.prompt = prompt
        outs.append(o)
        if not cut:
            survivors.append(o)
        max_tokens = size.cut_tokens if cut else size.survivor_tokens
        cut_after = rng.randint(0, size.max_cut_after) if cut else None
        how = rng.choice(["close", "cancel"] if door.startswith("ws") else ["reset", "cancel"])
        await asyncio.sleep(rng.uniform(0, 0.2))          # staggered arrivals
        if door == "http":
            await http_stream(s, srv.base, prompt, max_tokens, o, cut_after)
        elif door == "tcp":
            await tcp_stream(srv.tcp_port, prompt, max_tokens, o, cut_after, how)
        else:
            await ws_stream(s, srv.ws_url, prompt, max_tokens, o, cut_after,
                            binary=door == "ws-msgpack", how=how)
        if cut:
            cut_times.append(time.monotonic())

    async def killed_client(k: int) -> None:
        proc = await _spawn_client(srv, size, PROMPTS[k % len(PROMPTS)])
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line.strip() == b"STREAMING", (line, await proc.stderr.read())
            await asyncio.sleep(rng.uniform(0, 0.3))
            proc.send_signal(signal.SIGKILL)                # client process killed
            cut_times.append(time.monotonic())
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        # 255 is asyncio's stand-in when its child watcher finds the pid already reaped
        # ("Unknown child process pid ..., will report returncode 255", seen once in CI): the
        # status is lost, not wrong; the client script itself never exits with 255.
        assert proc.returncode in (-signal.SIGKILL, 255), proc.returncode

    aborts_before = engine.counters["abort"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        local = [asyncio.create_task(run(i, s)) for i in range(n_local)]
        procs = [asyncio.create_task(killed_client(k)) for k in range(size.procs)]
        cut_tasks = [t for i, t in enumerate(local) if i in cut_idx] + procs
        await asyncio.wait_for(asyncio.gather(*cut_tasks), 300)
        last_cut = max(cut_times)

        # within 2 s of the last cut no cut request is left anywhere
        while True:
            active = sum(1 for o in survivors if not o.terminals)
            st = engine.stats()
            if (st["num_open_requests"] <= active
                    and st["num_running"] + st["num_waiting"] <= active):
                break
            waited = time.monotonic() - last_cut
            assert waited < IDLE_AFTER_CUT_S, (
                f"{st['num_open_requests']} requests open, {active} survivors active, "
                f"{waited:.2f}s after the last cut: {st}")
            await asyncio.sleep(0.01)
        cut_cleared_s = time.monotonic() - last_cut

        await asyncio.wait_for(asyncio.gather(*local), 600)
    last_done = time.monotonic()
    idle_s = await wait_engine_idle(engine, IDLE_AFTER_CUT_S)
    assert_engine_clean(engine)

    assert len(survivors) == size.streams // 2
    bad = []
    for o in survivors:
        ref_text, ref_ids = refs[o.prompt]
        if o.door == "http":
            ok = o.terminals == ["length", "[DONE]"]
        else:
            ok = o.terminals == ["done"] and o.token_ids == ref_ids
        ok = ok and o.text == ref_text and o.num_tokens == size.survivor_tokens
        if not ok:
            bad.append((o.door, o.terminals, o.num_tokens, o.text[:60], ref_text[:60], o.error))
    assert not bad, f"{len(bad)} survivors wrong: {bad[:5]}"
    cut_accepted = sum(1 for o in outs if o.cut) + size.procs * size.per_proc
    aborted = engine.counters["abort"] - aborts_before
    # every cut that reached the engine was aborted (cut_after=0 on WS/TCP may beat admission)
    assert aborted >= sum(1 for o in outs if o.cut and (o.num_tokens or o.door == "http")), \
        (aborted, cut_accepted)
    return {"cut_cleared_s": cut_cleared_s, "idle_after_last_s": idle_s,
            "survivor_wait_s": last_done - last_cut, "aborted": aborted,
            **process_snapshot()}


async def run_storm(oracle, model, size: StormSize) -> list[dict]:
    srv = await oracle.serve(model, **ENGINE)
    refs = await _reference(srv, size)
    assert len({t for t, _ in refs.values()}) == len(PROMPTS), "prompts must give distinct text"
    rows = []
    for cycle in range(size.cycles):
        t0 = time.monotonic()
        row = await _one_cycle(srv, size, refs, random.Random(1000 + cycle))
        row["cycle_s"] = time.monotonic() - t0
        rows.append(row)
        print(f"storm cycle {cycle}: {row}")
    first, last = rows[0], rows[-1]
    assert last["fds"] <= first["fds"] + 4, rows
    assert last["threads"] <= first["threads"] + 2, rows
    assert last["conns"] <= first["conns"] + 2, rows
    assert last["rss_mb"] - first["rss_mb"] < 64 * max(1, size.cycles // 5), rows
    st = srv.engine.stats()
    assert st["num_used_blocks"] == 0 and st["num_open_requests"] == 0
    return rows


async def test_storm_ci(oracle, tiny_model):
    await run_storm(oracle, tiny_model, StormSize())


@pytest.mark.slow
async def test_storm_full(oracle, tiny_model):
    rows = await run_storm(oracle, tiny_model, StormSize(survivor_tokens=48, cycles=10,
                                                         procs=4, per_proc=4))
    from harness import record_result
    record_result("storm_full", rows)
