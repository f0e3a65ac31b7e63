"""Errors the engine raises to its callers (each door maps them to its own error format)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of engine-side failures."""


class EngineDeadError(EngineError):
    """The step loop died (or was shut down); no request can be served any more."""


class QueueFullError(EngineError):
    """Too many requests are waiting; retry later (HTTP 429 + Retry-After)."""

    retry_after_s = 1


class LoraSlotsBusyError(QueueFullError):
    """Every LoRA slot holds an adapter of a running request (the engine queues the request
    until one frees; raised only to the engine itself)."""


class DuplicateRequestError(ValueError):
    """A request id that is still in flight was reused."""
