"""Regular expressions for the JSON numbers inside bounds (`minimum`, `maximum` and their
exclusive forms), for guided decoding.

Numbers are written as the unbounded ones in `json_schema` are: an optional `-`, an integer part
of at most `MAX_DIGITS` digits without leading zeros, and for `number` an optional fraction of 1
to `MAX_DIGITS` digits; bounded numbers have no exponent and never read `-0`. Within those
spellings the regex matches exactly the values inside the bounds (a bound past the largest
spelled value is the largest spelled value).

How: a value is a sign and a magnitude; each sign's magnitudes form one interval, split into
its integer part's range (`_natural_range`, the usual digit-by-digit construction) and, at the
interval's two ends, the fractions allowed with that integer part (`_fraction`, digit by digit
against the bound's own fraction digits).
"""

from __future__ import annotations

import math
from decimal import Decimal

from ferrobatch.guided.regex_text import GuidedSchemaError, alternation, quantifier

MAX_DIGITS = 16                       # integer digits, and fraction digits, of a number
_LARGEST = 10 ** MAX_DIGITS - 1       # the largest integer part that can be spelled


def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _any_digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" + quantifier(count, count)


def _same_length(lo: str, hi: str) -> list[str]:
    """The digit strings of len(lo) == len(hi) from lo to hi (as strings), as alternatives."""
    if not lo:
        return [""]
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    n, parts = len(lo) - 1, []
    first, last = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:        # lo's leading digit only with the tails from lo[1:] up
        parts += [lo[0] + rest for rest in _same_length(lo[1:], "9" * n)]
        first += 1
    if hi[1:] != "9" * n:        # hi's leading digit only with the tails up to hi[1:]
        tail = [hi[0] + rest for rest in _same_length("0" * n, hi[1:])]
        last -= 1
    else:
        tail = []
    if first <= last:
        parts.append(_digit_class(first, last) + _any_digits(n))
    return parts + tail


def _natural_range(lo: int, hi: int) -> list[str]:
    """The canonical decimal spellings (no leading zeros) of lo..hi (0 <= lo <= hi)."""
    parts = ["0"] if lo == 0 else []
    lo = max(lo, 1)
    full: list[int] = []                 # digit counts whose every number is in the range
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        start, end = max(lo, 10 ** (digits - 1)), min(hi, 10 ** digits - 1)
        if (start, end) == (10 ** (digits - 1), 10 ** digits - 1):
            full.append(digits)
        elif start <= end:
            parts += _same_length(str(start), str(end))
    if full:                             # consecutive: only the first and last count can be partial
        parts.append("[1-9]" + ("[0-9]" + quantifier(full[0] - 1, full[-1] - 1)
                                if full[-1] > 1 else ""))
    return parts


def _fraction(lo: str | None, lo_open: bool, hi: str | None, hi_open: bool,
              room: int) -> tuple[bool, str | None]:
    """The fraction digit strings D (up to `room` digits) with lo <= 0.D <= hi.

    `lo` / `hi` are a bound's fraction digits without trailing zeros ("" is 0; None: no bound),
    `*_open` makes that bound exclusive. Returns whether the empty string (0.D == 0) is in, and
    a regex for the non-empty ones (None if there are none).
    """
    empty = (lo is None or (lo == "" and not lo_open)) and (hi is None or hi != "" or not hi_open)
    if room == 0:
        return empty, None
    # flat shortcuts for the common tails (the digit-by-digit walk would nest `room` groups)
    if hi is None and (lo is None or (lo == "" and not lo_open)):
        return empty, "[0-9]" + quantifier(1, room)                 # any digits
    if lo is None and hi == "":
        return empty, None if hi_open else "0" + quantifier(1, room)   # zeros only
    if lo == "" and hi is None:                                        # not all zeros
        return empty, alternation([
            "0" * zeros + "[1-9]" + ("[0-9]" + quantifier(0, room - zeros - 1)
                                     if zeros < room - 1 else "")
            for zeros in range(room)])
    low = int(lo[0]) if lo else 0
    high = int(hi[0]) if hi else (0 if hi == "" else 9)
    parts: list[str] = []
    free: list[int] = []                 # leading digits after which any digits may follow
    for digit in range(low, high + 1):
        on_lo = lo is not None and digit == low
        on_hi = hi is not None and digit == high
        if not on_lo and not on_hi:
            free.append(digit)
            continue
        rest_empty, rest = _fraction(lo[1:] if on_lo else None, lo_open,
                                     hi[1:] if on_hi else None, hi_open, room - 1)
        if rest_empty and rest is not None:
            parts.append(f"{digit}(?:{rest})?")
        elif rest_empty:
            parts.append(str(digit))
        elif rest is not None:
            parts.append(f"{digit}{rest}")
    if free:
        parts.insert(0, _digit_class(free[0], free[-1]) + ("" if room == 1 else
                                                           "[0-9]" + quantifier(0, room - 1)))
    return empty, (alternation(parts) if parts else None)


def _split(bound: Decimal) -> tuple[int, str]:
    """A non-negative bound's integer part and fraction digits (no trailing zeros)."""
    whole = int(bound)                   # truncates; bound >= 0
    text = format(bound - whole, "f")
    fraction = text.split(".", 1)[1].rstrip("0") if "." in text else ""
    return whole, fraction


def _magnitudes(lo: Decimal, lo_open: bool, hi: Decimal | None, hi_open: bool,
                integer: bool) -> list[str]:
    """Spellings of the magnitudes m (no sign) with lo <(=) m <(=) hi; hi None: no upper bound."""
    if hi is not None and (lo > hi or (lo == hi and (lo_open or hi_open))):
        return []
    lo_whole, lo_frac = _split(lo)
    if hi is None or hi > _LARGEST:
        hi_whole, hi_frac, hi_open = _LARGEST, None, False
    else:
        hi_whole, hi_frac = _split(hi)
    if integer:
        first = lo_whole + (1 if lo_frac or lo_open else 0)
        last = hi_whole - (1 if hi_frac == "" and hi_open else 0)
        return _natural_range(first, last) if first <= last else []

    def with_fraction(whole: int, f_lo, f_lo_open, f_hi, f_hi_open) -> list[str]:
        empty, rest = _fraction(f_lo, f_lo_open, f_hi, f_hi_open, MAX_DIGITS)
        if rest is None:
            return [str(whole)] if empty else []
        return [f"{whole}(?:\\.{rest})" + ("?" if empty else "")]

    if lo_whole > _LARGEST:
        return []
    # whole parts whose every fraction is inside the bounds, and the (at most two) others
    bottom_free = lo_frac == "" and not lo_open
    top_free = hi_frac is None
    if lo_whole == hi_whole and not (bottom_free and top_free):
        return with_fraction(lo_whole, lo_frac, lo_open, hi_frac, hi_open)
    parts = [] if bottom_free else with_fraction(lo_whole, lo_frac, lo_open, None, False)
    first = lo_whole if bottom_free else lo_whole + 1
    last = hi_whole if top_free else hi_whole - 1
    if first <= last:
        middle = alternation(_natural_range(first, last))
        parts.append(f"{middle}(?:\\.[0-9]{quantifier(1, MAX_DIGITS)})?")
    return parts + ([] if top_free else with_fraction(hi_whole, None, False, hi_frac, hi_open))


def bounded_number_regex(minimum: Decimal | None, min_open: bool, maximum: Decimal | None,
                         max_open: bool, *, integer: bool) -> str | None:
    """Regex for the integers (or numbers) between the bounds, None if none can be written.

    A None bound is absent; `*_open` makes it exclusive.
    """
    parts: list[str] = []
    # v >= 0: magnitudes from max(minimum, 0)
    if maximum is None or maximum > 0 or (maximum == 0 and not max_open):
        if minimum is None or minimum < 0:
            parts += _magnitudes(Decimal(0), False, maximum, max_open, integer)
        else:
            parts += _magnitudes(minimum, min_open, maximum, max_open, integer)
    # v < 0: magnitudes -v in (max(-maximum, 0), -minimum], never -0
    if minimum is None or minimum < 0:
        if maximum is None or maximum >= 0:
            low, low_open = Decimal(0), True
        else:
            low, low_open = -maximum, max_open
        high = None if minimum is None else -minimum
        negative = _magnitudes(low, low_open, high, min_open, integer)
        if negative:
            parts.append("-" + alternation(negative))
    return alternation(parts) if parts else None


def to_decimal(value: object) -> Decimal | None:
    """A JSON number as an exact Decimal (a float by its shortest repr); None if not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def check_bound(value: object, where: str) -> Decimal:
    """A bound keyword's value as a Decimal, or the GuidedSchemaError naming it."""
    number = to_decimal(value)
    if number is None:
        raise GuidedSchemaError(f"{where} must be a finite number")
    return number
