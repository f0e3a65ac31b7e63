"""Where the `ferrobatch.*` loggers' records go when ferrobatch runs as a program.

Importing ferrobatch configures no logging (a library leaves that to its application); the CLI
calls `configure_logging` so that `ferrobatch serve` shows its INFO lines (graph capture, kernel
builds, start-up checks, the periodic engine line) with a timestamp, on stderr:

    2026-12-05 03:10:00 INFO ferrobatch.stats: engine: prompt 1204.3 tok/s, ...
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _FerrobatchHandler(logging.StreamHandler):
    """Marks the handler configure_logging installed, so a second call replaces it."""


def configure_logging(level: str = "info", stream: TextIO | None = None) -> logging.Logger:
    """Records of the `ferrobatch` loggers at `level` (one of LOG_LEVELS) and above go to
    `stream` (stderr) one timestamped line each; returns the `ferrobatch` logger. Calling it
    again replaces the handler (no line is printed twice); other loggers are left alone."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    root = logging.getLogger("ferrobatch")
    for old in [h for h in root.handlers if isinstance(h, _FerrobatchHandler)]:
        root.removeHandler(old)
    handler = _FerrobatchHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    return root
