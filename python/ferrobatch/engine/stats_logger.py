"""StatsLogger: one log line of engine activity every few seconds while there is any.

What a server operator reads in the log (vLLM prints the same kind of line):

    engine: prompt 1204.3 tok/s, generation 345.6 tok/s | running 16, waiting 3 |
    KV cache 42.1 % | prefix cache hits 12.0 % | finished 5 (stop 3, length 2)

Rates are over the interval since the previous line; running / waiting / KV cache are the
engine's latest step snapshot. Optional parts (prefix cache, finished, preemptions, drafts)
appear only when the interval had any. An idle engine logs nothing, after one last line that
shows the drop to zero. Counting happens in the observer hooks (the asyncio thread, one add
each); the line is built only once per interval. Readiness probes are not counted (the engine
keeps them from every observer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ferrobatch.engine.observer import EngineObserver, FinishedRequest

logger = logging.getLogger("ferrobatch.stats")

DEFAULT_INTERVAL_S = 10.0
# scheduler counters (cumulative since start) whose change over an interval the line shows
_DELTA_KEYS = ("prefix_cache_queries_total", "prefix_cache_hits_total",
               "num_probe_prompt_tokens_total", "num_preemptions_total",
               "num_draft_tokens_total", "num_accepted_tokens_total")


class StatsLogger(EngineObserver):
    """Watches `engine` (an AsyncEngine: `add_observer`, `stats()`) and builds a line per
    interval; `run()` logs them until cancelled."""

    def __init__(self, engine: Any, interval_s: float = DEFAULT_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic,
                 log: logging.Logger = logger) -> None:
        if not interval_s > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval_s}")
        self.interval_s = float(interval_s)
        self._engine = engine
        self._clock = clock
        self._log = log
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: Counter[str] = Counter()
        self._since = clock()
        self._totals = self._read_totals(engine.stats())
        self._was_active = False
        self._failed = False
        engine.add_observer(self)

    # -- observer hooks (asyncio thread, once per event: keep them to an add) -------------------

    def on_scheduled(self, queue_time_s: float, num_prompt_tokens: int) -> None:
        self._prompt_tokens += num_prompt_tokens

    def on_step_tokens(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        self._generation_tokens += num_tokens

    def on_finished(self, request: FinishedRequest) -> None:
        self._finished[request.finish_reason] += 1

    # -- the line -------------------------------------------------------------------------------

    @staticmethod
    def _read_totals(stats: dict[str, Any]) -> dict[str, int]:
        return {k: int(stats.get(k, 0)) for k in _DELTA_KEYS}

    def line(self) -> str | None:
        """The line for the interval since the previous call (which this call closes), or None
        when this interval and the one before it were both idle."""
        now = self._clock()
        elapsed = max(now - self._since, 1e-9)
        stats = self._engine.stats()
        totals = self._read_totals(stats)
        delta = {k: totals[k] - self._totals[k] for k in _DELTA_KEYS}
        prompt, generation, finished = (self._prompt_tokens, self._generation_tokens,
                                        self._finished)
        self._since, self._totals = now, totals
        self._prompt_tokens = self._generation_tokens = 0
        self._finished = Counter()

        running = int(stats.get("num_running", 0))
        waiting = max(int(stats.get("num_waiting", 0)),
                      int(stats.get("num_unscheduled_requests", 0)))
        active = bool(prompt or generation or finished or running or waiting)
        if not active and not self._was_active:
            return None
        self._was_active = active

        parts = [f"prompt {prompt / elapsed:.1f} tok/s, generation {generation / elapsed:.1f} "
                 f"tok/s",
                 f"running {running}, waiting {waiting}",
                 f"KV cache {100.0 * float(stats.get('kv_cache_usage', 0.0)):.1f} %"]
        # a readiness probe's one-token prompt is looked up too: not traffic
        queries = delta["prefix_cache_queries_total"] - delta["num_probe_prompt_tokens_total"]
        if queries > 0:
            hits = min(delta["prefix_cache_hits_total"], queries)
            parts.append(f"prefix cache hits {100.0 * hits / queries:.1f} %")
        if finished:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(finished.items()))
            parts.append(f"finished {sum(finished.values())} ({reasons})")
        if delta["num_preemptions_total"] > 0:
            parts.append(f"preemptions {delta['num_preemptions_total']}")
        drafts = delta["num_draft_tokens_total"]
        if drafts > 0:
            accepted = delta["num_accepted_tokens_total"]
            parts.append(f"drafts accepted {accepted}/{drafts} "
                         f"({100.0 * accepted / drafts:.0f} %)")
        return "engine: " + " | ".join(parts)

    def log_line(self) -> None:
        """Log the line for the interval now ending, if there is one. A failure to build it is
        logged (once: later ones are silent) and never raised."""
        try:
            text = self.line()
        except Exception as exc:  # noqa: BLE001 - a stats line must not take the server down
            if not self._failed:
                self._log.warning("engine stats line failed: %s: %s", type(exc).__name__, exc)
            self._failed = True
            return
        if text is not None:
            self._log.info("%s", text)

    async def run(self) -> None:
        """`log_line()` every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_line()
