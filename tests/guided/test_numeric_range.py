"""Bounded numbers (`guided/numeric_range.py`) against an exact oracle: for bounds drawn at
random (integers, decimals, signs, exclusive or not), a spelling is matched iff it is a
well-formed number of the kind (integer / number, no exponent, no `-0`) whose value lies inside
the bounds. The spellings tried sit on and around the bounds, where off-by-one errors live."""

from __future__ import annotations

import random
import re
from decimal import Decimal

import pytest

from ferrobatch.guided.numeric_range import MAX_DIGITS, bounded_number_regex

_SPELLING = re.compile(r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,16})?")


def _valid(text: str, lo, lo_open, hi, hi_open, integer: bool) -> bool:
    if not _SPELLING.fullmatch(text) or (integer and "." in text):
        return False
    value = Decimal(text)
    if text.startswith("-") and value == 0:
        return False
    if lo is not None and (value < lo or (lo_open and value == lo)):
        return False
    return hi is None or not (value > hi or (hi_open and value == hi))


def _spellings(bounds, rng: random.Random) -> set[str]:
    """Texts on, next to and between the bounds, plus malformed ones."""
    out = {"0", "-0", "-0.0", "0.0", "00", "01", "1.", ".5", "-", "1e3", "+1", "9" * MAX_DIGITS,
           "-" + "9" * MAX_DIGITS, "1" + "0" * MAX_DIGITS, "0." + "0" * MAX_DIGITS + "1"}
    for b in bounds:
        if b is None:
            continue
        for delta in ("0", "1", "0.1", "0.01", "0.5", "0.0001", "1E-16", "2"):
            for v in (b + Decimal(delta), b - Decimal(delta)):
                out |= {format(v, "f"), format(v.normalize(), "f")}
        out.add(format(b, "f") + "0")                  # a trailing zero: the same value
        out.add(format(b, "f") + ("" if "." in format(b, "f") else ".") + "000")
    for _ in range(60):
        out.add(f"{rng.randint(-10**6, 10**6)}.{rng.randint(0, 999):03d}".rstrip("."))
        out.add(str(rng.randint(-10**6, 10**6)))
    return out


def _random_bound(rng: random.Random):
    kind = rng.randrange(5)
    if kind == 0:
        return None
    if kind == 1:
        return Decimal(rng.randint(-50, 50))
    if kind == 2:
        return Decimal(f"{rng.randint(-50, 50)}.{rng.randint(0, 99):02d}")
    if kind == 3:
        return Decimal(f"{rng.choice('-+')}0.{rng.randint(0, 9999):04d}".replace("+", ""))
    return Decimal(rng.randint(-10**17, 10**17))


@pytest.mark.parametrize("seed", range(12))
def test_random_bounds_match_exactly_the_values_inside(seed):
    rng = random.Random(seed)
    for _ in range(40):
        lo, hi = _random_bound(rng), _random_bound(rng)
        lo_open, hi_open = lo is not None and rng.random() < 0.5, hi is not None and rng.random() < 0.5
        integer = rng.random() < 0.5
        regex = bounded_number_regex(lo, lo_open, hi, hi_open, integer=integer)
        texts = _spellings((lo, hi), rng)
        wanted = {t for t in texts if _valid(t, lo, lo_open, hi, hi_open, integer)}
        if regex is None:
            assert not wanted, (lo, lo_open, hi, hi_open, integer, sorted(wanted)[:5])
            continue
        got = {t for t in texts if re.fullmatch(regex, t)}
        assert got == wanted, (lo, lo_open, hi, hi_open, integer, sorted(got ^ wanted)[:5])


def test_common_bounds_read_simply():
    assert bounded_number_regex(Decimal(1), False, Decimal(5), False, integer=True) == "[1-5]"
    assert bounded_number_regex(Decimal(0), False, None, False,
                                integer=True) == "(?:0|[1-9][0-9]{0,15})"
    assert bounded_number_regex(Decimal(0), False, Decimal(1), False,
                                integer=False) == r"(?:0(?:\.[0-9]{1,16})?|1(?:\.0{1,16})?)"


def test_empty_ranges_are_none():
    assert bounded_number_regex(Decimal(2), True, Decimal(3), True, integer=True) is None
    assert bounded_number_regex(Decimal("0.5"), False, Decimal("0.7"), False, integer=True) is None
    assert bounded_number_regex(Decimal(1), True, Decimal(1), False, integer=False) is None
    assert bounded_number_regex(Decimal(10) ** 20, False, None, False, integer=True) is None
