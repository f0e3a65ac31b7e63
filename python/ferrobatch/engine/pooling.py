"""Embeddings on the step thread: which rows of a step a pooling request needs, and the pooled
vector once its prompt is computed (`PoolingParams`).

A pooling request is an ordinary one-token request whose `RequestExtras.pooling` holds a
`PoolingState`. "last" needs the row of the last prompt token (always computed: it is the row
the request samples from); "mean" needs every prompt row, so such a request skips the prefix
cache (`EngineCore.submit` salts it) and sums the rows as they come, each position once (a
recompute after preemption sees positions it already has, and skips them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferrobatch.engine.step_rows import rows_of_requests
from ferrobatch.pooling_params import PoolingParams


class PoolingState:
    """One pooling request's progress through its prompt."""

    def __init__(self, params: PoolingParams, prompt_len: int) -> None:
        self.params = params
        self.prompt_len = prompt_len
        self.sum: np.ndarray | None = None
        self.next_position = 0          # "mean": positions below it are in `sum`

    def wants(self, positions: np.ndarray) -> np.ndarray:
        """Which of a sequence's step rows (their positions) this request needs."""
        if self.params.pooling == "last":
            return positions == self.prompt_len - 1
        return (positions >= self.next_position) & (positions < self.prompt_len)

    def take(self, positions: np.ndarray, hidden: np.ndarray) -> np.ndarray | None:
        """Adds the needed rows (float32 ``[N, hidden]`` at ``positions``); returns the
        embedding once the last prompt position has been seen, else None."""
        if self.params.pooling == "last":
            pooled = hidden[-1].astype(np.float64)
        else:
            order = np.argsort(positions, kind="stable")
            fresh = positions[order] >= self.next_position
            rows = hidden[order][fresh].astype(np.float64)
            self.sum = rows.sum(axis=0) if self.sum is None else self.sum + rows.sum(axis=0)
            self.next_position = max(self.next_position, int(positions.max()) + 1)
            if self.next_position < self.prompt_len:
                return None
            pooled = self.sum / self.prompt_len
        return finish_embedding(pooled, self.params)


def finish_embedding(pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
    """`dimensions` then `normalize` applied to a pooled vector; float32."""
    if params.dimensions is not None:
        pooled = pooled[:params.dimensions]
    if params.normalize:
        norm = float(np.linalg.norm(pooled))
        if norm > 0.0:
            pooled = pooled / norm
    return pooled.astype(np.float32)


def pooling_rows(batch: Any, extras: dict[int, Any]) -> tuple | None:
    """The step's rows pooling requests need: (rows, req ids, positions) arrays, or None."""
    asking = [rid for rid, e in extras.items() if e.pooling is not None]
    rows, rids, pos = [], [], []
    for rid, span, p in rows_of_requests(batch, asking):
        keep = extras[rid].pooling.wants(p)
        if keep.any():
            rows.append(span[keep])
            pos.append(p[keep])
            rids.append(np.full(int(keep.sum()), rid, dtype=np.uint64))
    if not rows:
        return None
    return np.concatenate(rows), np.concatenate(rids), np.concatenate(pos)


def pooled_embeddings(hidden: np.ndarray, wanted: tuple, extras: dict[int, Any]) -> dict:
    """req id -> embedding for the requests whose pooling this step completed."""
    _, req_ids, positions = wanted
    out: dict[int, np.ndarray] = {}
    for rid in dict.fromkeys(req_ids.tolist()):
        mine = req_ids == rid
        vec = extras[rid].pooling.take(positions[mine], hidden[mine])
        if vec is not None:
            out[int(rid)] = vec
    return out
