"""EngineObserver: the hooks through which metrics (or anything else) watch requests go by.

All hooks run on the asyncio thread, inside the one per-step hand-off; keep them cheap.
Readiness probes (`/ready`) are not traffic: no hook hears of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request at its terminal state (all of its `n` sequences ended): what it was, what it
    produced, and when (`time.monotonic()` seconds; None where it never got that far)."""

    finish_reason: str            # "error" / "abort" if any sequence ended so, else the first's
    num_prompt_tokens: int
    num_generated: int            # over all sequences
    max_tokens: int               # the output bound it ran under (per sequence)
    n: int
    arrival_time: float
    scheduled_time: float | None  # first scheduled
    first_token_time: float | None
    last_token_time: float | None
    finish_time: float

    @property
    def e2e_s(self) -> float:
        """Arrival to finish."""
        return self.finish_time - self.arrival_time

    @property
    def prefill_s(self) -> float | None:
        """First scheduled to first token (the prompt's computation, chunks included)."""
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.scheduled_time

    @property
    def decode_s(self) -> float | None:
        """First token to last token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_s(self) -> float | None:
        """First scheduled to last token (prefill + decode)."""
        if self.scheduled_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.scheduled_time


class EngineObserver:
    def on_scheduled(self, queue_time_s: float, num_prompt_tokens: int) -> None:
        """A request was scheduled for the first time."""

    def on_first_token(self, ttft_s: float) -> None:
        """A request produced its first token."""

    def on_step(self, num_batched_tokens: int) -> None:
        """An engine step computed this many tokens (prompt chunks + decodes + drafts)."""

    def on_step_tokens(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        """Tokens generated in one step, and the gap since each request's previous token."""

    def on_finished(self, request: FinishedRequest) -> None:
        """A request reached its terminal state (called once per request)."""
