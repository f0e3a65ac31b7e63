"""Which token rows of a step belong to which request (for the work some requests want done on
their rows: prompt logprobs, embeddings)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np


def rows_of_requests(batch: Any, req_ids: Iterable[int]) -> Iterator[tuple[int, Any, Any]]:
    """For each scheduled sequence of one of `req_ids`: (request id, its rows of the flat batch,
    their positions in the sequence), as int64 arrays."""
    wanted = np.asarray(list(req_ids), dtype=np.uint64)
    if not wanted.size:
        return
    seq_req_ids = np.asarray(batch.seq_req_ids)
    seqs = np.flatnonzero(np.isin(seq_req_ids, wanted))
    if not seqs.size:
        return
    qsl = np.asarray(batch.query_start_loc)
    positions = np.asarray(batch.positions)
    for b in seqs.tolist():
        span = np.arange(int(qsl[b]), int(qsl[b + 1]))
        yield int(seq_req_ids[b]), span, positions[span].astype(np.int64)
