"""The server's log: the periodic engine line, the access log, and the CLI's log configuration."""

from __future__ import annotations

import asyncio
import io
import logging
import re

import aiohttp
import pytest

from ferrobatch.log_config import configure_logging

STATS_LOGGING = {"log_stats_interval_s": 0.05, "access_log": True}


async def complete(r, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + "/v1/completions", json=body) as resp:
            return resp.status, await resp.json()


@pytest.mark.parametrize("fake_server", [STATS_LOGGING], indirect=True)
async def test_stats_and_access_lines_while_serving(fake_server, caplog):
    caplog.set_level(logging.INFO, logger="ferrobatch")
    status, body = await complete(fake_server, {"prompt": "hello", "max_tokens": 7})
    assert status == 200 and body["usage"]["completion_tokens"] == 7
    status, _ = await complete(fake_server, {"prompt": "hello", "max_tokens": -1})
    assert status == 400
    stats = []
    for _ in range(200):                     # a tick after the request: its line is logged
        stats = [r.getMessage() for r in caplog.records if r.name == "ferrobatch.stats"]
        if any("finished" in m for m in stats):
            break
        await asyncio.sleep(0.02)
    done = [m for m in stats if "finished" in m]
    assert len(done) == 1 and "finished 1 (length 1)" in done[0], stats
    assert re.search(r"generation \d+\.\d tok/s \| running 0, waiting 0 \| KV cache", done[0])
    access = [r.getMessage() for r in caplog.records if r.name == "ferrobatch.access"]
    assert any(re.fullmatch(r'127\.0\.0\.1 "POST /v1/completions HTTP/1\.1" 200 \d+ [\d.]+ [0-9a-f]{24}', m)
               for m in access), access
    assert any('"POST /v1/completions HTTP/1.1" 400' in m for m in access), access
    # idle now: after the line showing the drop to zero the engine line goes quiet
    await asyncio.sleep(0.3)
    before = len([r for r in caplog.records if r.name == "ferrobatch.stats"])
    await asyncio.sleep(0.3)
    assert len([r for r in caplog.records if r.name == "ferrobatch.stats"]) == before


@pytest.mark.parametrize("fake_server", [{"log_stats_interval_s": 3600.0}], indirect=True)
async def test_stop_logs_the_last_interval(fake_server, caplog):
    caplog.set_level(logging.INFO, logger="ferrobatch")
    status, _ = await complete(fake_server, {"prompt": "hi", "max_tokens": 3})
    assert status == 200
    assert not [r for r in caplog.records if r.name == "ferrobatch.stats"]   # no tick yet
    await fake_server.server.stop()          # (the fixture's stop_server tolerates a 2nd stop)
    lines = [r.getMessage() for r in caplog.records if r.name == "ferrobatch.stats"]
    assert len(lines) == 1 and "finished 1 (length 1)" in lines[0]


async def test_no_stats_or_access_log_unless_asked(fake_server, caplog):
    caplog.set_level(logging.INFO, logger="ferrobatch")
    assert fake_server.server.stats_logger is None
    status, _ = await complete(fake_server, {"prompt": "hi", "max_tokens": 3})
    assert status == 200
    assert not [r for r in caplog.records
                if r.name in ("ferrobatch.stats", "ferrobatch.access")]


def test_configure_logging_shows_the_level_and_up_timestamped_once(ferrobatch_logger_left_as_found):
    first, out = io.StringIO(), io.StringIO()
    configure_logging("info", first)
    log = configure_logging("info", out)                # again: replaces, never doubles
    assert log is ferrobatch_logger_left_as_found
    logging.getLogger("ferrobatch.engine.core").info("speculative decoding: %s", "off")
    logging.getLogger("ferrobatch.engine.core").debug("not shown at info")
    logging.getLogger("someone.else").warning("not ours")
    assert first.getvalue() == ""
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO ferrobatch\.engine\.core: "
                        r"speculative decoding: off", lines[0]), lines
    configure_logging("warning", out)
    logging.getLogger("ferrobatch.stats").info("hidden at warning")
    assert len(out.getvalue().splitlines()) == 1
    with pytest.raises(ValueError, match="log level"):
        configure_logging("verbose")


async def test_debug_logs_a_line_per_request(fake_server, caplog):
    caplog.set_level(logging.DEBUG, logger="ferrobatch.engine.async_engine")
    async with aiohttp.ClientSession() as s:
        async with s.get(fake_server.base + "/ready") as resp:      # a probe: not logged
            assert resp.status == 200
    status, _ = await complete(fake_server, {"prompt": "hello", "max_tokens": 4})
    assert status == 200
    lines = [r.getMessage() for r in caplog.records
             if r.name == "ferrobatch.engine.async_engine"]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"request \S+: 5 prompt tokens, max_tokens 4, n 1, temperature 1", lines[0])
    assert re.fullmatch(r"request \S+ finished: length, 4 tokens generated, [\d.]+ s \(queued "
                        r"[\d.]+ s\)", lines[1])
