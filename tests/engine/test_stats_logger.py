"""StatsLogger: the periodic engine line: rates over the interval, the snapshot's gauges, the
optional parts only when they happened, silence when idle, and it never stops on a failure."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ferrobatch.engine.observer import FinishedRequest
from ferrobatch.engine.stats_logger import StatsLogger


def finished(reason: str) -> FinishedRequest:
    return FinishedRequest(reason, 10, 5, 5, 1, 1.0, 1.1, 1.2, 1.5, 1.6)


class FakeEngine:
    """What StatsLogger uses of an AsyncEngine: add_observer and a stats() snapshot."""

    def __init__(self) -> None:
        self.observers = []
        self.snapshot = {"num_running": 0, "num_waiting": 0, "num_unscheduled_requests": 0,
                         "kv_cache_usage": 0.0, "prefix_cache_queries_total": 0,
                         "prefix_cache_hits_total": 0, "num_probe_prompt_tokens_total": 0,
                         "num_preemptions_total": 0, "num_draft_tokens_total": 0,
                         "num_accepted_tokens_total": 0}

    def add_observer(self, o) -> None:
        self.observers.append(o)

    def stats(self) -> dict:
        return dict(self.snapshot)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(interval: float = 10.0):
    engine, clock = FakeEngine(), Clock()
    return engine, clock, StatsLogger(engine, interval, clock=clock)


def test_registers_itself_and_refuses_a_non_positive_interval():
    engine, _, sl = make()
    assert engine.observers == [sl]
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="> 0"):
            StatsLogger(FakeEngine(), bad)


def test_rates_are_over_the_interval_and_the_gauges_from_the_snapshot():
    engine, clock, sl = make()
    sl.on_scheduled(0.01, 300)
    sl.on_scheduled(0.02, 100)
    for _ in range(5):
        sl.on_step_tokens(16, [0.05] * 16)
    engine.snapshot.update(num_running=16, num_waiting=2, num_unscheduled_requests=3,
                           kv_cache_usage=0.4213)
    clock.t += 8.0
    line = sl.line()
    assert line == ("engine: prompt 50.0 tok/s, generation 10.0 tok/s | running 16, waiting 3 "
                    "| KV cache 42.1 %")
    # the next interval starts from zero: nothing new but still running -> 0 tok/s, not stale
    clock.t += 2.0
    assert sl.line().startswith("engine: prompt 0.0 tok/s, generation 0.0 tok/s | running 16")


def test_optional_parts_show_the_interval_deltas_only():
    engine, clock, sl = make()
    engine.snapshot.update(prefix_cache_queries_total=1000, prefix_cache_hits_total=400,
                           num_preemptions_total=7, num_draft_tokens_total=50,
                           num_accepted_tokens_total=20)
    sl2 = StatsLogger(engine, 10.0, clock=clock)   # baseline taken at start: old totals ignored
    sl2.on_step_tokens(4, [])
    clock.t += 10.0
    line = sl2.line()
    assert "prefix cache" not in line and "preemptions" not in line and "drafts" not in line
    # this interval: 200 prompt tokens looked up (10 of them a readiness probe's), 95 hits,
    # 2 preemptions, 12 drafts of which 9 accepted, three requests finished
    engine.snapshot.update(prefix_cache_queries_total=1200, prefix_cache_hits_total=495,
                           num_probe_prompt_tokens_total=10, num_preemptions_total=9,
                           num_draft_tokens_total=62, num_accepted_tokens_total=29,
                           num_running=1)
    for reason in ("stop", "length", "stop"):
        sl2.on_finished(finished(reason))
    clock.t += 10.0
    parts = sl2.line().split(" | ")
    assert "prefix cache hits 50.0 %" in parts          # 95 / (200 - 10)
    assert "finished 3 (length 1, stop 2)" in parts
    assert "preemptions 2" in parts
    assert "drafts accepted 9/12 (75 %)" in parts


def test_silent_when_idle_after_one_line_that_shows_the_drop():
    engine, clock, sl = make()
    clock.t += 10.0
    assert sl.line() is None                            # idle from the start: nothing
    sl.on_step_tokens(8, [])
    engine.snapshot["num_running"] = 2
    clock.t += 10.0
    assert "generation 0.8 tok/s" in sl.line()
    engine.snapshot["num_running"] = 0
    clock.t += 10.0
    last = sl.line()                                    # the drop to zero is shown once
    assert last is not None and "generation 0.0 tok/s | running 0, waiting 0" in last
    clock.t += 10.0
    assert sl.line() is None
    engine.snapshot["num_waiting"] = 1                  # waiting alone is activity
    clock.t += 10.0
    assert "waiting 1" in sl.line()


async def test_run_logs_each_interval_and_survives_a_failing_snapshot(caplog):
    engine = FakeEngine()
    sl = StatsLogger(engine, 0.01)
    engine.snapshot["num_running"] = 1
    calls = {"n": 0}
    good = engine.stats

    def flaky():
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise RuntimeError("snapshot broke")
        return good()

    engine.stats = flaky
    with caplog.at_level(logging.INFO, logger="ferrobatch.stats"):
        task = asyncio.create_task(sl.run())
        for _ in range(500):
            await asyncio.sleep(0.01)
            if sum("engine: " in r.message for r in caplog.records) >= 2:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    lines = [r for r in caplog.records if r.message.startswith("engine: ")]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) >= 2 and all(r.levelno == logging.INFO for r in lines)
    assert len(warnings) == 1 and "snapshot broke" in warnings[0].message   # said once


def test_finished_request_phases():
    r = FinishedRequest("length", 10, 5, 5, 1, arrival_time=1.0, scheduled_time=1.5,
                        first_token_time=2.0, last_token_time=4.0, finish_time=4.25)
    assert (r.e2e_s, r.prefill_s, r.decode_s, r.inference_s) == (3.25, 0.5, 2.0, 2.5)
    never = FinishedRequest("abort", 10, 0, 5, 1, 1.0, None, None, None, 2.0)
    assert never.e2e_s == 1.0 and never.prefill_s is None and never.decode_s is None
    assert never.inference_s is None
