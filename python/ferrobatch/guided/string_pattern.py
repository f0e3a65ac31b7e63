"""A JSON Schema string `pattern`, rewritten as a regex over the string's JSON text.

The pattern describes the decoded string; guided decoding constrains the JSON text the model
writes. So `pattern_to_json_string_regex` anchors the pattern at both ends (JSON Schema searches;
a leading `^` and a trailing `$` are dropped), wraps it in quotes, and writes each character a
JSON string cannot hold raw (`"`, `\\`, U+0000-U+001F), as a literal or in a class, as its
canonical JSON escape (`\\"`, `\\\\`, `\\n`, `\\u0001`, ...). The output never holds `.`, `\\d`
and the like: every set of characters is written as an explicit class (plus the escapes of its
members JSON must escape), so it means the same in Python's `re` and Rust's regex-syntax.

Accepted: literals, the escapes `\\n \\r \\t \\f \\v \\xHH \\uHHHH` and escaped punctuation;
`.`; the class escapes `\\d \\w \\s \\D \\W \\S`, outside and inside character classes;
character classes with ranges (negated too); groups `(...)`, `(?:...)`, `(?P<name>...)` and
`(?<name>...)`, all matching as `(?:...)`; `|`; `? * + {m} {m,} {m,n}` (lazy forms too; counts up
to `MAX_STRING_LENGTH`).

The class escapes are ASCII: `\\d` is `[0-9]` and `\\w` is `[A-Za-z0-9_]`, as in ECMA-262 (the
regex dialect JSON Schema names) and Python's `re.ASCII`; `\\s` is `[ \\t\\n\\r\\f\\v]`, as in
`re.ASCII` (ECMA-262's `\\s` also matches Unicode spaces such as U+00A0 and U+2028, so here `\\s` is
narrower and `\\S` wider); `\\D`, `\\W`, `\\S` are every other character, non-ASCII ones included.
`.` is ECMA-262's: any character except `\\n`, `\\r`, U+2028 and U+2029 (Python's `.` only
excludes `\\n`).

Refused with `GuidedSchemaError`, naming the construct: lookaround, backreferences (`\\1`,
`\\k<name>`, `(?P=name)`), `\\b` and other anchors, `\\p{..}` classes, inline flags and other
`(?...)` groups, class set operations, a class escape as a range end, a class that matches
nothing, nested quantifiers, a `{` that is not a repetition, surrogates.
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

Ranges = list[tuple[int, int]]          # inclusive code point ranges


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
# their canonical two-character escapes (the others are written `\u00xx`, lowercase hex)
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_REPETITION = re.compile(r"\{([0-9]+)(,([0-9]*))?\}")     # {m} {m,} {m,n}
_SURROGATES = (0xD800, 0xDFFF)
_UNIVERSE: Ranges = [(0x0000, 0xD7FF), (0xE000, 0x10FFFF)]   # the Unicode scalar values
# the class escapes, ASCII semantics; the upper-case forms are their complements
_CLASS_ESCAPES: dict[str, Ranges] = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x09, 0x0D), (0x20, 0x20)],                # \t \n \v \f \r and space
}
_GROUP_NAME = re.compile(r"[^\W\d]\w*")                  # an identifier


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
            self.group_opening()
            inner = self.alternation()
            if self.peek() != ")":
                raise self.fail("unclosed '('")
            self.pos += 1
            return f"(?:{inner})", True
        if ch == "[":
            return self.char_class()
        if ch == "\\":
            value = self.escape(in_class=False)
            return self.literal(value) if isinstance(value, int) else self.char_set(value)
        if ch == ".":
            return self.char_set(_complement([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))
        if ch in "^$":
            raise self.fail(f"the anchor {ch!r} (only a leading '^' and a trailing '$' are allowed)")
        if ch in "*+?{":
            raise self.fail(f"{ch!r} with nothing to repeat (escape a literal '{{')")
        return self.literal(ord(ch))

    def group_opening(self) -> None:
        """Consumes what follows a '(' up to the group's content: nothing, '?:' or a name."""
        if self.peek() != "?":
            return                                      # a capturing group
        rest = self.src[self.pos:]
        if rest.startswith("?:"):
            self.pos += 2
            return
        for opening, what in (("?=", "a lookahead"), ("?!", "a negative lookahead"),
                              ("?<=", "a lookbehind"), ("?<!", "a negative lookbehind")):
            if rest.startswith(opening):
                raise self.fail(f"{what} '({opening}...)'")
        if rest.startswith("?P="):
            raise self.fail("a backreference '(?P=name)'")
        if rest.startswith(("?P<", "?<")):
            self.pos += 3 if rest.startswith("?P<") else 2
            name = _GROUP_NAME.match(self.src, self.pos)
            if name is None or self.peek(name.end() - self.pos) != ">":
                raise self.fail("a group name that is not an identifier closed by '>'")
            self.pos = name.end() + 1
            return
        if rest[1:2] and rest[1:2] in "aiLmsux-":
            raise self.fail(f"inline flags '({rest[:2]}...)'")
        raise self.fail(
            "a group other than '(...)', '(?:...)', '(?P<name>...)' or '(?<name>...)'")

    def literal(self, code: int) -> tuple[str, bool]:
        if _SURROGATES[0] <= code <= _SURROGATES[1]:
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

    def escape(self, in_class: bool) -> int | Ranges:
        """What the escape after a backslash (already consumed) stands for: a code point, or the
        characters of a class escape (`\\d`, `\\W`, ...)."""
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
        if ch.lower() in _CLASS_ESCAPES:
            ranges = _CLASS_ESCAPES[ch.lower()]
            return _complement(ranges) if ch.isupper() else list(ranges)
        if ch in "bB":
            raise self.fail("'\\b' inside a character class" if in_class
                            else f"the word boundary '\\{ch}'")
        if ch in "AZz":
            raise self.fail(f"the anchor '\\{ch}'")
        if ch in "pP":
            raise self.fail(f"the Unicode property class '\\{ch}{{...}}'")
        if ch in "123456789":
            raise self.fail(f"the backreference '\\{ch}'")
        if ch == "k":
            raise self.fail("the backreference '\\k<name>'")
        if not ch.isascii() or ch.isalnum() or ch in "<>":
            raise self.fail(f"the escape '\\{ch}'")
        return ord(ch)

    def class_member(self) -> int | Ranges:
        ch = self.peek()
        if ch == "\\":
            self.pos += 1
            return self.escape(in_class=True)
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
        ranges: Ranges = []
        first = True
        while True:
            ch = self.peek()
            if not ch:
                raise self.fail("an unclosed '['")
            if ch == "]" and not first:
                self.pos += 1
                break
            first = False
            lo = self.class_member()
            is_range = self.peek() == "-" and self.peek(1) not in ("", "]")
            if isinstance(lo, list):
                if is_range:
                    raise self.fail("a class escape like '\\d' as a range end")
                ranges.extend(lo)
                continue
            hi = lo
            if is_range:
                if self.peek(1) == "-":
                    raise self.fail("'--' inside a character class")
                self.pos += 1
                end = self.class_member()
                if isinstance(end, list):
                    raise self.fail("a class escape like '\\d' as a range end")
                hi = end
                if hi < lo:
                    raise self.fail("a reversed range inside a character class")
            if any(_SURROGATES[0] <= c <= _SURROGATES[1] for c in (lo, hi)):
                raise self.fail("a surrogate code point")
            ranges.append((lo, hi))
        return self.char_set(_complement(ranges) if negated else ranges)

    def char_set(self, ranges: Ranges) -> tuple[str, bool]:
        """Regex for one decoded character from `ranges`, written as JSON text: the members JSON
        holds raw in a class, the others as their canonical escapes. Returns (regex, atomic)."""
        members = _subtract(ranges, [_SURROGATES])
        if not members:
            raise self.fail("a character class that matches no character")
        escaped = {c for c in _JSON_ESCAPED_CODES if any(lo <= c <= hi for lo, hi in members)}
        if members[-1][1] == _UNIVERSE[-1][1]:
            # open-ended: the negation of the characters left out, and of all that JSON escapes
            alternatives = ["[^" + _class_body(_complement(members) + _JSON_ESCAPED) + "]"]
        else:
            allowed = _subtract(members, _JSON_ESCAPED)
            alternatives = ["[" + _class_body(allowed) + "]"] if allowed else []
        parts = alternatives + _escapes_of(escaped)
        return alternation(parts), len(parts) > 1 or parts[0].startswith("[")


def _escapes_of(codes: set[int]) -> list[str]:
    """Regexes for JSON escapes that decode to exactly the characters `codes` (canonical forms)."""
    if codes == _JSON_ESCAPED_CODES:
        return [r'\\["\\bfnrt]', r"\\u00[01][0-9a-fA-F]"]
    parts = []
    short = [ord(_SHORT_ESCAPES[c]) for c in codes if c in _SHORT_ESCAPES]
    if short:
        parts.append(r"\\" + _one_of(short))
    for high in (0, 1):
        lows = [ord(f"{c & 0xF:x}") for c in codes if c not in _SHORT_ESCAPES and c >> 4 == high]
        if lows:
            parts.append(rf"\\u00{high}" + _one_of(lows))
    return parts


def _one_of(codes: list[int]) -> str:
    """A literal for one ASCII character, a class for several."""
    if len(codes) == 1:
        return escape_literal(chr(codes[0]))
    return "[" + _class_body([(c, c) for c in codes]) + "]"


def _merge(ranges: Ranges) -> Ranges:
    merged: Ranges = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    result = _merge(ranges)
    for r_lo, r_hi in removed:
        kept: Ranges = []
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


def _complement(ranges: Ranges) -> Ranges:
    """The Unicode scalar values outside `ranges`."""
    return _subtract(_UNIVERSE, ranges)


def _class_body(ranges: Ranges) -> str:
    merged: Ranges = []
    for lo, hi in _merge(ranges):
        if merged and merged[-1][1] == _SURROGATES[0] - 1 and lo == _SURROGATES[1] + 1:
            merged[-1] = (merged[-1][0], hi)       # one range across the surrogate gap
        else:
            merged.append((lo, hi))
    parts = []
    for lo, hi in merged:
        text = escape_class_char(chr(lo))
        if hi > lo:
            text += "-" + escape_class_char(chr(hi))
        parts.append(text)
    return "".join(parts)
