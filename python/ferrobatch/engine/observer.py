"""EngineObserver: the hooks through which metrics (or anything else) watch requests go by.

All hooks run on the asyncio thread, inside the one per-step hand-off; keep them cheap.
"""

from __future__ import annotations


class EngineObserver:
    def on_scheduled(self, queue_time_s: float, num_prompt_tokens: int) -> None:
        """A request was scheduled for the first time."""

    def on_first_token(self, ttft_s: float) -> None:
        """A request produced its first token."""

    def on_step_tokens(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        """Tokens generated in one step, and the gap since each request's previous token."""

    def on_finished(self, finish_reason: str, e2e_s: float, num_prompt_tokens: int,
                    num_generated: int) -> None:
        """A request reached its terminal state."""
