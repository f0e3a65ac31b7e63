"""argparse types of the benches' options: a bad value is a one-line error (exit code 2) from
`parse_args`, before any model loads, instead of a traceback or a silently odd run.

Imports nothing heavy and changes nothing (common.py puts the checkout's package first on
sys.path; the benches that keep it last import this module instead).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

SMOLLM2_ALIAS = "smollm2"      # ferrobatch.model.loader's names that are not paths
RANDOM_PREFIX = "random:"


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def positive_float(text: str) -> float:
    """A number > 0 (`inf` included)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if math.isnan(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return x


def _list_of(item: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    """An argparse type: comma-separated `item`s, at least one."""
    def parse(text: str) -> list[Any]:
        try:
            return [item(s.strip()) for s in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}") from None
    return parse


int_list = _list_of(positive_int, "integers >= 1")
float_list = _list_of(positive_float, "numbers > 0 (or inf)")


def name_list(known: Iterable[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of `known`, none twice, at least one."""
    known = tuple(known)

    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            what = f"unknown {', '.join(map(repr, unknown))}" if unknown else f"none in {text!r}"
            raise argparse.ArgumentTypeError(f"{what}; known: {', '.join(known)}")
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, twice))} given twice")
        return names
    return parse


def model_ref(text: str) -> str:
    """A model as ferrobatch's loader names one: 'smollm2', 'random:<shape>', or an existing
    .gguf file or model directory."""
    if text == SMOLLM2_ALIAS or text.startswith(RANDOM_PREFIX) \
            or os.path.exists(os.path.expanduser(text)):
        return text
    raise argparse.ArgumentTypeError(
        f"no such model file or directory: {text!r} (expected '{SMOLLM2_ALIAS}', "
        f"'{RANDOM_PREFIX}<shape>', a .gguf file or a model directory)")
