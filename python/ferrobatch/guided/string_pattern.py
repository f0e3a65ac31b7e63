"""A JSON Schema string `pattern`, rewritten as a regex over the string's JSON text.

The pattern describes the decoded string; guided decoding constrains the JSON text the model
writes. So `pattern_to_json_string_regex` anchors the pattern at both ends (JSON Schema searches;
a leading `^` and a trailing `$` are dropped), wraps it in quotes, and writes each character a
JSON string cannot hold raw (`"`, `\\`, U+0000-U+001F), as a literal or in a class, as its
canonical JSON escape (`\\"`, `\\\\`, `\\n`, `\\u0001`, ...).

Accepted: literals, the escapes `\\n \\r \\t \\f \\v \\xHH \\uHHHH` and escaped punctuation,
`(?:...)`, `|`, character classes with ranges, `? * + {m} {m,} {m,n}` (lazy forms too; counts up
to `MAX_STRING_LENGTH`). Refused with `GuidedSchemaError`: `.`, `\\d`-style and `\\p{..}`
classes, `\\b` and other anchors, other groups, flags, backreferences, class set operations,
nested quantifiers, a `{` that is not a repetition, surrogates.
"""

from __future__ import annotations

import json
import re

from ferrobatch.guided.regex_text import (
    MAX_STRING_LENGTH,
    GuidedSchemaError,
    alternation,
    escape_class_char,
    escape_literal,
    quantifier,
)

__all__ = ["pattern_to_json_string_regex"]


def pattern_to_json_string_regex(pattern: str, path: str = "$") -> str:
    """Regex matching the JSON string literals (quotes included) whose decoded text fully matches
    the JSON Schema `pattern`. `path` locates the pattern in the schema, for error messages.

    Raises GuidedSchemaError for a construct outside the supported syntax (see the module doc).
    """
    return f'"(?:{_PatternTranslator(pattern, path).translate()})"'


_SIMPLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B}
# characters JSON strings must escape: excluded from negated classes, written escaped otherwise
_JSON_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_JSON_ESCAPED_CODES = frozenset([*range(0x20), 0x22, 0x5C])
_REPETITION = re.compile(r"\{([0-9]+)(,([0-9]*))?\}")     # {m} {m,} {m,n}


def _json_escaped_char(code: int) -> str:
    """Regex for the canonical JSON escape of a character JSON strings cannot hold raw."""
    return escape_literal(json.dumps(chr(code))[1:-1])


class _PatternTranslator:
    """Rewrites a JSON Schema `pattern` (restricted syntax) to match JSON-encoded string content.

    The pattern describes the decoded string, the regex the JSON text, so `"`, `\\` and control
    characters (as literals or class members) become their JSON escapes. Anything outside the
    shared Python/Rust dialect raises GuidedSchemaError.
    """

    def __init__(self, pattern: str, path: str) -> None:
        self.src = pattern
        self.path = path
        self.pos = 0

    def fail(self, what: str) -> GuidedSchemaError:
        return GuidedSchemaError(
            f"unsupported construct in 'pattern' at {self.path}: {what} (pattern {self.src!r})")

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.src[i] if i < len(self.src) else ""

    def translate(self) -> str:
        src = self.src
        self.pos = 1 if src.startswith("^") else 0
        if len(src) > self.pos and src.endswith("$"):
            backslashes = len(src) - 1 - len(src[:-1].rstrip("\\"))
            if backslashes % 2 == 0:       # an unescaped trailing '$'
                src = src[:-1]
        self.src = src
        regex = self.alternation()
        if self.pos < len(self.src):
            raise self.fail(f"unbalanced {self.src[self.pos]!r}")
        try:
            re.compile(regex)
        except re.error as exc:  # pragma: no cover - the translation only emits valid syntax
            raise self.fail(str(exc)) from None
        return regex

    def alternation(self) -> str:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        return "|".join(branches)

    def sequence(self) -> str:
        parts = []
        while self.peek() not in ("", "|", ")"):
            text, atomic = self.atom()
            parts.append(self.quantified(text, atomic))
        return "".join(parts)

    def atom(self) -> tuple[str, bool]:
        ch = self.peek()
        self.pos += 1
        if ch == "(":
            if self.src.startswith("?:", self.pos):
                self.pos += 2
                inner = self.alternation()
                if self.peek() != ")":
                    raise self.fail("unclosed '('")
                self.pos += 1
                return f"(?:{inner})", True
            raise self.fail("a group other than '(?:...)'")
        if ch == "[":
            return self.char_class()
        if ch == "\\":
            return self.literal(self.escape())
        if ch == ".":
            raise self.fail("'.'")
        if ch in "^$":
            raise self.fail(f"the anchor {ch!r} (only a leading '^' and a trailing '$' are allowed)")
        if ch in "*+?{":
            raise self.fail(f"{ch!r} with nothing to repeat (escape a literal '{{')")
        return self.literal(ord(ch))

    def literal(self, code: int) -> tuple[str, bool]:
        if 0xD800 <= code <= 0xDFFF:
            raise self.fail("a surrogate code point")
        if code < 0x20 or code in (0x22, 0x5C):
            return _json_escaped_char(code), False
        return escape_literal(chr(code)), True

    def quantified(self, text: str, atomic: bool) -> str:
        ch = self.peek()
        if ch in ("*", "+", "?"):
            self.pos += 1
            quant = ch
        elif ch == "{":
            match = _REPETITION.match(self.src, self.pos)
            if match is None:
                raise self.fail("a '{' that is not a repetition '{m}', '{m,}' or '{m,n}' (escape it)")
            self.pos = match.end()
            lo = int(match.group(1))
            hi = lo if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
            if lo > MAX_STRING_LENGTH or (hi is not None and hi > MAX_STRING_LENGTH):
                raise self.fail(f"a repetition above {MAX_STRING_LENGTH}")
            if hi is not None and hi < lo:
                raise self.fail("a repetition '{m,n}' with m > n")
            quant = quantifier(lo, hi)
        else:
            return text
        if self.peek() == "?":
            self.pos += 1          # lazy: matches the same strings
        if self.peek() in ("*", "+", "?", "{"):
            raise self.fail("a repeated repetition (possessive or nested quantifier)")
        return (text if atomic else f"(?:{text})") + quant

    def escape(self) -> int:
        """Code point of the escape after a backslash (the backslash already consumed)."""
        ch = self.peek()
        if not ch:
            raise self.fail("a trailing backslash")
        self.pos += 1
        if ch in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[ch]
        if ch in "xu":
            width = 2 if ch == "x" else 4
            digits = self.src[self.pos:self.pos + width]
            if len(digits) != width or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise self.fail(f"'\\{ch}' without {width} hex digits")
            self.pos += width
            return int(digits, 16)
        if not ch.isascii() or ch.isalnum() or ch in "<>":
            raise self.fail(f"the escape '\\{ch}'")
        return ord(ch)

    def class_char(self) -> int:
        ch = self.peek()
        if ch == "\\":
            self.pos += 1
            return self.escape()
        if ch == "[":
            raise self.fail("an unescaped '[' inside a character class")
        if ch in "&~-" and self.peek(1) == ch:
            raise self.fail(f"{ch * 2!r} inside a character class")
        self.pos += 1
        return ord(ch)

    def char_class(self) -> tuple[str, bool]:
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while True:
            ch = self.peek()
            if not ch:
                raise self.fail("an unclosed '['")
            if ch == "]" and ranges:
                self.pos += 1
                break
            lo = self.class_char()
            hi = lo
            if self.peek() == "-" and self.peek(1) not in ("", "]"):
                if self.peek(1) == "-":
                    raise self.fail("'--' inside a character class")
                self.pos += 1
                hi = self.class_char()
                if hi < lo:
                    raise self.fail("a reversed range inside a character class")
            if any(0xD800 <= c <= 0xDFFF for c in (lo, hi)):
                raise self.fail("a surrogate code point")
            ranges.append((lo, hi))
        escaped = {c for c in _JSON_ESCAPED_CODES if any(lo <= c <= hi for lo, hi in ranges) != negated}
        if negated:
            alternatives = ["[^" + _class_body(ranges + _JSON_ESCAPED) + "]"]
        else:
            allowed = _subtract(ranges, _JSON_ESCAPED)
            alternatives = ["[" + _class_body(allowed) + "]"] if allowed else []
        return alternation(alternatives + _escapes_of(escaped)), True


def _escapes_of(codes: set[int]) -> list[str]:
    """Regexes for JSON escapes that decode to exactly the characters `codes` (canonical forms)."""
    if codes == _JSON_ESCAPED_CODES:
        return [r'\\["\\bfnrt]', r"\\u00[01][0-9a-fA-F]"]
    return [_json_escaped_char(code) for code in sorted(codes)]


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _subtract(ranges: list[tuple[int, int]], removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    result = _merge(ranges)
    for r_lo, r_hi in removed:
        kept: list[tuple[int, int]] = []
        for lo, hi in result:
            if hi < r_lo or lo > r_hi:
                kept.append((lo, hi))
                continue
            if lo < r_lo:
                kept.append((lo, r_lo - 1))
            if hi > r_hi:
                kept.append((r_hi + 1, hi))
        result = kept
    return result


def _class_body(ranges: list[tuple[int, int]]) -> str:
    parts = []
    for lo, hi in _merge(ranges):
        text = escape_class_char(chr(lo))
        if hi > lo:
            text += "-" + escape_class_char(chr(hi))
        parts.append(text)
    return "".join(parts)
