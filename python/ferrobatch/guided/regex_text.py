"""The regex text that guided decoding writes, shared by `json_schema` and `string_pattern`.

Every regex built for guided decoding must mean the same in Python's `re` and in Rust's
regex-syntax (the DFA compiler), so the builders here escape every metacharacter of either
dialect and only write literals, `(?:...)`, `|` and the quantifiers `?`, `*`, `+`, `{m}`,
`{m,}`, `{m,n}`. `GuidedSchemaError` is the error all of them raise.
"""

from __future__ import annotations

__all__ = [
    "MAX_STRING_LENGTH",
    "GuidedSchemaError",
    "Unsatisfiable",
    "alternation",
    "escape_class_char",
    "escape_literal",
    "quantifier",
]


class GuidedSchemaError(ValueError):
    """A schema (or choice list) that cannot be turned into a guided-decoding regex."""


class Unsatisfiable(GuidedSchemaError):
    """A (sub)schema that no value satisfies; an `anyOf` or a type list drops such a branch."""


MAX_STRING_LENGTH = 1024      # largest minLength / maxLength, and largest repetition in a pattern

_META = frozenset("\\.+*?()|[]{}^$#&-~")
_CLASS_META = frozenset("\\][^-&~")


def _escape_char(ch: str, meta: frozenset[str]) -> str:
    if ch in meta:
        return "\\" + ch
    code = ord(ch)
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02x}"
    if 0xD800 <= code <= 0xDFFF:
        raise GuidedSchemaError(f"a lone surrogate (U+{code:04X}) cannot be matched")
    return ch


def escape_literal(text: str) -> str:
    """Regex (outside a character class) matching exactly `text`, valid for Python and Rust."""
    return "".join(_escape_char(ch, _META) for ch in text)


def escape_class_char(ch: str) -> str:
    """`ch` written as a member (or range end) inside a character class."""
    return _escape_char(ch, _CLASS_META)


def alternation(parts: list[str]) -> str:
    """`(?:a|b|...)` over the distinct parts (a single part is returned as is)."""
    unique = list(dict.fromkeys(parts))
    if len(unique) == 1:
        return unique[0]
    return "(?:" + "|".join(unique) + ")"


def quantifier(lo: int, hi: int | None) -> str:
    """The shortest quantifier repeating `lo` to `hi` times (None: unbounded)."""
    if hi is None:
        return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    if lo == hi:
        return "" if lo == 1 else f"{{{lo}}}"
    if (lo, hi) == (0, 1):
        return "?"
    return f"{{{lo},{hi}}}"
