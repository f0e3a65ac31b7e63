"""Fault injectors that wrap the objects EngineCore holds (runner, sampler, detokenizer factory):
real seams, no test-only branches in product code."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class PanicLike(BaseException):
    """Stands in for pyo3's PanicException, which derives from BaseException."""


class RunnerProxy:
    """Wraps ModelRunner: `fail_at` = raise on that execute() call (1-based, counted from arming);
    `poison` = request ids whose logits rows become NaN."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0
        self.fail_at: int | None = None
        self.exc: BaseException = RuntimeError("injected forward failure")
        self.poison: set[int] = set()
        self.poisoned_rows = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def arm(self, after_calls: int, exc: BaseException) -> None:
        with self._lock:
            self.exc = exc
            self.fail_at = self.calls + after_calls

    def execute(self, batch: Any) -> torch.Tensor:
        with self._lock:
            self.calls += 1
            fail = self.fail_at is not None and self.calls >= self.fail_at
        if fail:
            raise self.exc
        logits = self._inner.execute(batch)
        if self.poison and len(batch.sample_req_ids):
            rows = np.flatnonzero(np.isin(batch.sample_req_ids,
                                          np.fromiter(self.poison, dtype=np.uint64)))
            if len(rows):
                logits = logits.clone()
                logits[torch.from_numpy(rows)] = float("nan")
                self.poisoned_rows += len(rows)
        return logits


class SamplerProxy:
    """Wraps Sampler: once armed, returns one token too many, so the Rust scheduler's update()
    rejects the step (a Rust-side ValueError on the step thread). Armed, no step is plain greedy
    (those take their tokens from the runner's read-back, not from ``sample``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def is_plain_greedy(self, batch: Any, extras: Any = None) -> bool:
        return not self.armed and self._inner.is_plain_greedy(batch, extras)

    def sample(self, logits: Any, batch: Any, extras: Any = None) -> Any:
        out = self._inner.sample(logits, batch, extras)
        if self.armed:
            out.token_ids = np.append(out.token_ids, np.int32(0))
        return out


class RaisingDetok:
    """Wraps an IncrementalDetokenizer: raises on the `after`-th token."""

    def __init__(self, inner: Any, after: int) -> None:
        self._inner = inner
        self._left = after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def add(self, token_id: int) -> Any:
        self._left -= 1
        if self._left <= 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
        return self._inner.add(token_id)


def detok_fault(core: Any, victim_prompt_ids: list[int], after: int) -> Callable[[], int]:
    """Make the detokenizer raise for requests whose prompt is `victim_prompt_ids`."""
    inner = core.new_detokenizer
    hits = [0]

    def new_detokenizer(prompt_ids: list[int], params: Any) -> Any:
        d = inner(prompt_ids, params)
        if list(prompt_ids) == list(victim_prompt_ids):
            hits[0] += 1
            return RaisingDetok(d, after)
        return d

    core.new_detokenizer = new_detokenizer
    return lambda: hits[0]
