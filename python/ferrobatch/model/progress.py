"""A progress bar for loading weights, shown only where loading takes a while.

Small models (the embedded SmolLM2's 100 MB GGUF) load in about a second and print nothing;
from `PROGRESS_MIN_BYTES` of weights on, a tqdm bar on stderr counts the bytes read, so a
multi-gigabyte model does not look hung. `FERROBATCH_NO_PROGRESS=1` turns the bars off.
"""

from __future__ import annotations

import os
from typing import Any

PROGRESS_MIN_BYTES = 512 << 20


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def load_progress(total_bytes: int, desc: str) -> Any:
    """A bar over `total_bytes` (`update(n)`, `close()`), or one that shows nothing."""
    if total_bytes < PROGRESS_MIN_BYTES or os.environ.get("FERROBATCH_NO_PROGRESS"):
        return _Silent()
    from tqdm import tqdm
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                dynamic_ncols=True)
