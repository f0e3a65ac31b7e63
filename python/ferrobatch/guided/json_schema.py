"""JSON Schema -> regular expression, for guided (structured-output) decoding.

The regex returned by `schema_to_regex` fully matches (a practical subset of) the JSON texts that
are valid for the schema; the engine compiles it to a byte-level DFA and masks the next-token
logits with it. The regex is built by a recursive walk over the schema: every value kind has a
fixed regex (strings, bounded-digit numbers, true/false/null), objects list their properties in
the order the schema gives them, arrays use bounded repeats, `anyOf`/`oneOf`/`enum`/type lists
become alternations and `$ref` is expanded in place.

Dialect: the output must mean the same in Python's `re` and in Rust's regex-syntax, so it only
uses literals, `(?:...)`, `|`, `?`, `*`, `+`, `{m}`, `{m,n}` and character classes, with every
metacharacter escaped (`escape_literal`, from `regex_text`). No `.`, `\\d`-style classes, anchors,
lookaround, captures or flags.

Whitespace: the output is compact JSON except that one optional space (`WHITESPACE`, overridable)
may follow each `,` and `:`. Nothing else: unbounded whitespace lets a model loop on spaces
forever. Digit counts are bounded for the same reason (integers up to 16 digits, fractions up to
16, exponents up to 3).

Nesting: "any value" (`{}`, `true`, an object without `properties`, an array without `items`) is
a generic JSON value nested at most `max_depth` containers deep; a recursive `$ref` is expanded
at most `max_depth` times inside itself, after which the recursive branch is dropped (an optional
property is left out, an array becomes empty, an `anyOf` branch goes).

Bounds: `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` (numbers, or draft 4's
boolean flags) are enforced exactly (`numeric_range`); a bounded number has no exponent. A
`maxLength` / `maxItems` above the caps is lowered to them; `enum` / `const` values are narrowed
by the bounds and lengths beside them. Tuples: `prefixItems` (with `items` for the rest) and
draft 4-7's array form of `items` (with `additionalItems`). Map keys: `propertyNames` (a string
schema, an enum, or a `$ref` to one) for objects without `properties`. OpenAPI's `nullable`.
`allOf`, and keywords beside an `anyOf` / `oneOf` or a `$ref`, are merged into one schema
(`schema_merge`); a branch of an `anyOf` (or a type of a type list), an optional property or an
array's items that no value satisfies drop out. `enum` / `const` values are kept only where the
regex of the schema's other keywords matches them.

Approximations (the output is a subset of the valid texts, never a superset, except where noted):
properties appear only in schema order; `additionalProperties` is treated as false whenever
`properties` is given; `enum`/`const` values are written compactly; strings use canonical escapes
where the schema fixes their text; a string with `minLength` / `maxLength` has no `\\uXXXX` escapes
(its characters are raw or short escapes); a `pattern` is anchored at both ends (JSON Schema searches), reads
`\\d \\w \\s` as ASCII classes and `.` as ECMA-262 does (any character but `\\n`, `\\r`, U+2028,
U+2029), may not use lookaround, backreferences, `\\b`, `\\p{..}` or flags, and is rewritten into the
dialect above so that `"`, `\\` and control characters appear JSON-escaped (`string_pattern`);
beside a `pattern`, a `format` is ignored. Formats "date", "time", "date-time" (both with a UTC
offset), "uuid", "ipv4", "email" (dot-atoms @ a host) and "uri" (http / https, a host of
labels, an optional port, path and fragment with %XX escapes) are enforced; a known format whose
texts do not all fit the lengths beside it, and any other format, is an annotation, as JSON
Schema has it (the string follows its lengths).
Superset: `oneOf` is treated as `anyOf`; a pattern's `\\S` (or `[^\\s]`) also admits the Unicode
spaces, such as U+00A0, that ECMA-262's `\\s` matches; `multipleOf` and `uniqueItems` are
ignored, like the annotations (`title`, `description`, `default`, `examples`, ...). Any other
keyword, and any construct that cannot be honoured, raises `GuidedSchemaError`, naming the
keyword and its path.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from decimal import Decimal
from typing import Any

from ferrobatch.guided.numeric_range import bounded_number_regex, check_bound
from ferrobatch.guided.regex_text import (
    MAX_STRING_LENGTH,
    GuidedSchemaError,
    Unsatisfiable,
    alternation,
    escape_class_char,
    escape_literal,
    quantifier,
)
from ferrobatch.guided.schema_merge import Merger, same_json
from ferrobatch.guided.string_pattern import pattern_to_json_string_regex

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "WHITESPACE",
    "GuidedSchemaError",
    "choice_to_regex",
    "escape_literal",
    "json_object_regex",
    "schema_to_regex",
]


WHITESPACE = r"[ ]?"          # allowed after each ',' and ':'
DEFAULT_MAX_DEPTH = 3         # container nesting of generic values / recursive $ref expansions

MAX_SCHEMA_NESTING = 32       # subschemas nested inside each other in the schema document
MAX_REGEX_LENGTH = 200_000
MAX_ARRAY_ITEMS = 64          # largest minItems / maxItems
_MAX_SUBSCHEMA_VISITS = 50_000
_MAX_REF_EXPANSIONS = 64      # $refs expanded inside each other
_TOO_LARGE = "the schema is too large for guided decoding"

# --- fixed pieces ----------------------------------------------------------------------------------

# One character of a JSON string: a raw one, a short escape, a `\\uXXXX` escape of a BMP
# character, or a surrogate pair's two escapes (one character, as JSON Schema's lengths count;
# a lone surrogate decodes to no Unicode text and is never produced).
_HEX4_BMP = "(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})"
_HEX4_PAIR = r"[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_STRING_CHAR = rf'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:{_HEX4_BMP}|{_HEX4_PAIR}))'
_STRING = f'"{_STRING_CHAR}*"'
# A character of a string with minLength / maxLength: raw, or a short escape. A `\uXXXX`
# escape is left out: every counted position would carry its hex states (and a surrogate pair's),
# ~5x the automaton, and a raw character says the same (only the control characters without a
# short escape, U+0000-001F but \b \f \n \r \t, cannot then appear).
_BOUNDED_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])'
_INTEGER = r"-?(?:0|[1-9][0-9]{0,15})"
_NUMBER = _INTEGER + r"(?:\.[0-9]{1,16})?(?:[eE][+\-]?[0-9]{1,3})?"
_BOOLEAN = "(?:true|false)"
_NULL = "null"
_SCALARS = (_STRING, _NUMBER, "true", "false", _NULL)

_DATE = "[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_HEX = "[0-9a-fA-F]"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9\\-]{0,30}[A-Za-z0-9])?"   # a domain label (up to 32 here)
# a URI's path / query / fragment character: unreserved, sub-delims, ':', '@', '/', '?', or %XX
_URI_CHAR = ("(?:[" + "".join(escape_class_char(c) for c in "-._~!$&'()*+,;=:@/?") +
             "A-Za-z0-9]|%[0-9A-Fa-f]{2})")
_HOST = rf"{_LABEL}(?:\.{_LABEL}){{0,3}}"                       # up to 4 labels, 131 characters
_URI = rf"https?://{_HOST}(?::[0-9]{{1,5}})?(?:/{_URI_CHAR}{{0,512}})?(?:#{_URI_CHAR}{{0,64}})?"
_DOT_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]{1,32}"             # an email local part's atom
# Each known `format`: its regex inside the quotes, and the shortest / longest text it matches
# (None: unbounded), so that a sibling minLength / maxLength can be checked against it.
_FORMATS: dict[str, tuple[str, int, int | None]] = {
    "date": (_DATE, 10, 10),
    "time": (_TIME, 9, 24),
    "date-time": (f"{_DATE}T{_TIME}", 20, 35),
    "uuid": (f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}", 36, 36),
    "ipv4": (rf"{_OCTET}(?:\.{_OCTET}){{3}}", 7, 15),
    "email": (rf"{_DOT_ATOM}(?:\.{_DOT_ATOM}){{0,1}}@{_HOST}\.[A-Za-z]{{2,12}}", 6, 211),
    "uri": (_URI, 8, 8 + 131 + 6 + 1 + 3 * 512 + 1 + 3 * 64),     # 1,875: fits HttpUrl's 2,083
}

# --- keyword tables -------------------------------------------------------------------------------

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$schema", "$id", "$comment",
    "$anchor", "deprecated", "readOnly", "writeOnly", "discriminator", "strict",
    "contentEncoding", "contentMediaType", "$defs", "definitions",
    # assertions deliberately ignored (documented above)
    "multipleOf", "uniqueItems",
})
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "propertyNames"})
_ARRAY_KEYWORDS = frozenset({"items", "minItems", "maxItems", "prefixItems", "additionalItems"})
_STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
_NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_COMBINATORS = frozenset({"$ref", "allOf", "anyOf", "oneOf", "enum", "const"})
_KNOWN = (_ANNOTATIONS | _OBJECT_KEYWORDS | _ARRAY_KEYWORDS | _STRING_KEYWORDS | _NUMBER_KEYWORDS
          | _COMBINATORS | {"type", "nullable"})
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")

# --- small helpers ----------------------------------------------------------------------------------

_IDENTIFIER = re.compile(r"[A-Za-z_$][A-Za-z0-9_$\-]*")


def _child(path: str, key: str | int) -> str:
    """JSONPath-like location of `key` under `path` (for error messages)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _IDENTIFIER.fullmatch(key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _json_literal(value: Any, path: str) -> str:
    """Regex matching the compact JSON serialization of `value`."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GuidedSchemaError(f"value at {path} is not JSON-serializable: {exc}") from None
    return escape_literal(text)


def _is_json_type(value: Any, name: str) -> bool:
    """Whether a JSON value (as json.loads gives it) is of a JSON Schema type."""
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "array": list, "object": dict}
    if name == "null":
        return value is None
    return name in kinds and isinstance(value, kinds[name])


def _count(schema: dict, key: str, path: str, cap: int) -> int | None:
    """A non-negative integer keyword (None if absent); a minimum above `cap` is unsupported, a
    maximum above it is lowered to it (the output stays valid)."""
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise GuidedSchemaError(f"'{key}' must be a non-negative integer at {path}")
    if value > cap:
        if key.startswith("max"):
            return cap
        raise GuidedSchemaError(f"'{key}' above {cap} is not supported at {path}")
    return value


def _bounds(schema: dict, lo_key: str, hi_key: str, path: str, cap: int) -> tuple[int, int | None]:
    lo = _count(schema, lo_key, path, cap) or 0
    hi = _count(schema, hi_key, path, cap)
    if hi is not None and lo > hi:
        raise Unsatisfiable(f"'{lo_key}' exceeds '{hi_key}' at {path}: nothing can match")
    return lo, hi


def _number_bounds(schema: dict, path: str) -> tuple[tuple[Decimal | None, bool],
                                                     tuple[Decimal | None, bool]]:
    """((lower, exclusive), (upper, exclusive)) of a number schema, the tighter of `minimum`
    and `exclusiveMinimum` (a number, or draft 4's boolean flag on `minimum`) and likewise up."""
    def one(key: str, open_key: str, tighter) -> tuple[Decimal | None, bool]:
        bound = None if schema.get(key) is None else check_bound(schema[key], f"'{key}' at {path}")
        flag = schema.get(open_key)
        if isinstance(flag, bool):              # draft 4
            return bound, flag and bound is not None
        if flag is None:
            return bound, False
        open_bound = check_bound(flag, f"'{open_key}' at {path}")
        if bound is None or tighter(open_bound, bound):
            return open_bound, True
        return bound, False
    return (one("minimum", "exclusiveMinimum", lambda a, b: a >= b),
            one("maximum", "exclusiveMaximum", lambda a, b: a <= b))


def _single(subs: Any) -> bool:
    """An `allOf` of exactly one subschema (walked as that subschema)."""
    return isinstance(subs, list) and len(subs) == 1


def _json_types(values: list) -> list[str]:
    """The JSON Schema types of `values` (for the regex their other keywords are checked by)."""
    kinds = {"number" if isinstance(v, (int, float)) and not isinstance(v, bool) else
             "boolean" if isinstance(v, bool) else "null" if v is None else
             "string" if isinstance(v, str) else "array" if isinstance(v, list) else "object"
             for v in values}
    return sorted(kinds)


def _is_any(schema: Any) -> bool:
    """True for schemas that accept every value (`true`, `{}`, annotations only)."""
    return schema is True or (isinstance(schema, dict) and _ANNOTATIONS.issuperset(schema))


class _Pruned(Exception):
    """A recursive $ref reached the depth limit; the enclosing optional construct drops it."""

    def __init__(self, ref: str, path: str) -> None:
        super().__init__(ref, path)
        self.ref = ref
        self.path = path


# --- the schema walk ------------------------------------------------------------------------------


class _Builder:
    """One conversion: the root document (for $ref), the settings and the walk's state."""

    def __init__(self, root: Any, whitespace: str, max_depth: int) -> None:
        self.root = root
        self.ws = f"(?:{whitespace})" if "|" in whitespace else whitespace
        self.max_depth = max_depth
        self.ref_stack: list[str] = ["#"]     # $refs being expanded; the root counts as "#"
        self.visits = 0
        self._generic: dict[int, str] = {}

    def _check_size(self, regex: str) -> str:
        if len(regex) > MAX_REGEX_LENGTH:
            raise GuidedSchemaError(
                f"{_TOO_LARGE}: its regular expression would exceed {MAX_REGEX_LENGTH} characters")
        return regex

    # generic values

    def generic(self, depth: int) -> str:
        """Any JSON value with at most `depth` nested containers."""
        if depth not in self._generic:
            if depth == 0:
                regex = alternation(list(_SCALARS))
            else:
                inner = self.generic(depth - 1)
                regex = alternation([*_SCALARS, self._map(inner), self._list(inner)])
            self._generic[depth] = self._check_size(regex)
        return self._generic[depth]

    def generic_object(self, depth: int) -> str:
        return r"\{\}" if depth == 0 else self._map(self.generic(depth - 1))

    def _map(self, value: str, key: str = _STRING) -> str:
        member = f"{key}:{self.ws}{value}"
        return rf"\{{(?:{member}(?:,{self.ws}{member})*)?\}}"

    def _list(self, item: str, lo: int = 0, hi: int | None = None) -> str:
        """An array of `lo` to `hi` (None: unbounded) items matching `item`."""
        if hi == 0:
            return r"\[\]"
        body = item
        if hi != 1:    # the items after the first, each preceded by a comma
            more = quantifier(max(lo - 1, 0), None if hi is None else hi - 1)
            body += f"(?:,{self.ws}{item}){more}"
        return rf"\[{body}\]" if lo > 0 else rf"\[(?:{body})?\]"

    # schemas

    def value(self, schema: Any, path: str, level: int) -> str:
        """Regex for the JSON values valid for `schema` (found at `path`, `level` deep)."""
        self.visits += 1
        if self.visits > _MAX_SUBSCHEMA_VISITS:
            raise GuidedSchemaError(
                f"{_TOO_LARGE}: it expands to more than {_MAX_SUBSCHEMA_VISITS} subschemas")
        if level > MAX_SCHEMA_NESTING:
            raise GuidedSchemaError(
                f"{_TOO_LARGE}: it nests deeper than {MAX_SCHEMA_NESTING} levels at {path}")
        if _is_any(schema):
            return self.generic(self.max_depth)
        if schema is False:
            raise Unsatisfiable(f"the schema at {path} is false: no value can match it")
        if not isinstance(schema, dict):
            raise GuidedSchemaError(
                f"expected a schema (object or boolean) at {path}, got {type(schema).__name__}")
        for key in schema:
            if key not in _KNOWN and not key.startswith("x-"):
                raise GuidedSchemaError(f"unsupported JSON Schema keyword {key!r} at {path}")
        if "nullable" in schema:                # OpenAPI 3.0's way of adding null
            nullable = schema["nullable"]
            if not isinstance(nullable, bool):
                raise GuidedSchemaError(f"'nullable' must be a boolean at {path}")
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            regex = self.value(rest, path, level)
            return self._check_size(alternation([regex, _NULL]) if nullable else regex)
        return self._check_size(self._dispatch(schema, path, level))

    def _dispatch(self, schema: dict, path: str, level: int) -> str:
        for key in ("$ref", "allOf", "anyOf", "oneOf"):
            if key not in schema:
                continue
            rest = {k: v for k, v in schema.items()
                    if k != key and k not in _ANNOTATIONS and not k.startswith("x-")}
            if key in ("anyOf", "oneOf"):        # keywords beside the branches hold in each
                subs = schema[key]
                if rest and isinstance(subs, list):
                    subs = [{"allOf": [rest, sub]} for sub in subs]
                return self._any_of(subs, _child(path, key), level)
            if rest or (key == "allOf" and not _single(schema["allOf"])):
                subs = [{"$ref": schema["$ref"]}] if key == "$ref" else schema["allOf"]
                if not isinstance(subs, list) or not subs:
                    raise GuidedSchemaError(f"'allOf' must be a non-empty array of schemas at {path}")
                return self._all_of([*subs, rest] if rest else subs, path, level)
            if key == "$ref":
                return self._ref(schema["$ref"], path)
            return self.value(schema["allOf"][0], _child(_child(path, "allOf"), 0), level + 1)
        if "const" in schema or "enum" in schema:
            return self._literals(schema, path, level)
        types = self._types(schema, path)
        if types is None:
            return self.generic(self.max_depth)
        return self._branches([lambda t=t: self._typed(t, schema, path, level) for t in types])

    @staticmethod
    def _branches(builders: list) -> str:
        """The alternation of the branches that some value satisfies (each built by calling
        it); the last branch's Unsatisfiable if none is."""
        parts: list[str] = []
        unsatisfiable: Unsatisfiable | None = None
        for build in builders:
            try:
                parts.append(build())
            except Unsatisfiable as exc:
                unsatisfiable = exc
        if not parts:
            assert unsatisfiable is not None
            raise unsatisfiable
        return alternation(parts)

    def _all_of(self, subs: list, path: str, level: int) -> str:
        """Schemas that must all hold, merged into one (`schema_merge`); the $refs resolved at
        their top count as expanded, so a recursive one is cut like any other."""
        merger = Merger(self._resolve)
        parts, refs = merger.flatten({"allOf": subs}, path)
        for ref in refs:
            if self.ref_stack.count(ref) > self.max_depth:
                raise _Pruned(ref, path)
        merged = merger.merge_all(parts, path)
        if merged is False:
            raise Unsatisfiable(f"no value satisfies all of the schemas at {path}")
        self.ref_stack.extend(refs)
        try:
            return self.value(merged, path, level + 1)
        finally:
            del self.ref_stack[len(self.ref_stack) - len(refs):]

    def _literals(self, schema: dict, path: str, level: int) -> str:
        """`const` / `enum`: the listed values, narrowed by each other and by the schema's other
        keywords (a value whose compact JSON their regex does not match is left out, so a value
        they refuse is never produced)."""
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise GuidedSchemaError(f"'enum' must be a non-empty array at {path}")
        else:
            values = [schema["const"]]
        where = _child(path, "enum" if "enum" in schema else "const")
        if "const" in schema and "enum" in schema:
            values = [v for v in values if same_json(v, schema["const"])]
        if "type" in schema:
            types = self._types(schema, path) or []
            values = [v for v in values if any(_is_json_type(v, t) for t in types)]
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const", "type")
                and k not in _ANNOTATIONS and not k.startswith("x-")}
        if rest and values:
            try:
                others = re.compile(self.value({**rest, "type": _json_types(values)}, path, level))
            except Unsatisfiable:
                values = []
            else:
                values = [v for v in values if others.fullmatch(
                    json.dumps(v, separators=(",", ":"), ensure_ascii=False))]
        if not values:
            raise Unsatisfiable(f"no value satisfies 'enum'/'const' together with the other "
                                    f"keywords at {path}")
        return alternation([_json_literal(v, where) for v in values])

    def _types(self, schema: dict, path: str) -> list[str] | None:
        """The value types allowed (None: any value, no type-specific keyword either)."""
        declared = schema.get("type")
        if declared is None:
            families = [name for name, keys in (("object", _OBJECT_KEYWORDS), ("array", _ARRAY_KEYWORDS),
                                                ("string", _STRING_KEYWORDS),
                                                ("number", _NUMBER_KEYWORDS)) if keys & schema.keys()]
            return families or None
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names:
            raise GuidedSchemaError(f"'type' must be a string or a non-empty array at {path}")
        for name in names:
            if name not in _TYPES:
                raise GuidedSchemaError(f"unsupported JSON Schema type {name!r} at {_child(path, 'type')}")
        if "number" in names:
            names = [n for n in names if n != "integer"]   # number already matches integers
        return list(dict.fromkeys(names))

    def _typed(self, kind: str, schema: dict, path: str, level: int) -> str:
        if kind == "object":
            return self._object(schema, path, level)
        if kind == "array":
            return self._array(schema, path, level)
        if kind == "string":
            return self._string(schema, path)
        if kind in ("integer", "number"):
            return self._number(kind, schema, path)
        return {"boolean": _BOOLEAN, "null": _NULL}[kind]

    def _number(self, kind: str, schema: dict, path: str) -> str:
        """An integer / number, inside `minimum` / `maximum` and their exclusive forms if given
        (bounded ones are written without an exponent, `numeric_range`)."""
        (lo, lo_open), (hi, hi_open) = _number_bounds(schema, path)
        if lo is None and hi is None:
            return _INTEGER if kind == "integer" else _NUMBER
        regex = bounded_number_regex(lo, lo_open, hi, hi_open, integer=kind == "integer")
        if regex is None:
            raise Unsatisfiable(f"no {kind} lies within the schema's bounds at {path}")
        return regex

    def _any_of(self, subs: Any, path: str, level: int) -> str:
        """The branches' alternation; a branch no value satisfies (`false`, a contradiction)
        drops out, and a recursive one cut at the depth limit too, unless all do."""
        if not isinstance(subs, list) or not subs:
            raise GuidedSchemaError(f"expected a non-empty array of schemas at {path}")
        pruned: _Pruned | None = None

        def branch(i: int, sub: Any) -> str:
            nonlocal pruned
            try:
                return self.value(sub, _child(path, i), level + 1)
            except _Pruned as exc:
                pruned = exc
                raise Unsatisfiable(f"no subschema at {path} can match any value") from None
        try:
            return self._branches([lambda i=i, sub=sub: branch(i, sub) for i, sub in enumerate(subs)])
        except Unsatisfiable:
            if pruned is not None:
                raise pruned from None
            raise

    def _ref(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GuidedSchemaError(
                f"unsupported $ref {ref!r} at {path}: only references inside the schema ('#/...') are supported")
        target, target_path = self._resolve(ref, path)
        if self.ref_stack.count(ref) > self.max_depth:
            raise _Pruned(ref, path)
        if len(self.ref_stack) >= _MAX_REF_EXPANSIONS:
            raise GuidedSchemaError(f"{_TOO_LARGE}: $refs nest more than {_MAX_REF_EXPANSIONS} deep at {path}")
        self.ref_stack.append(ref)
        try:
            return self.value(target, target_path, 1)
        finally:
            self.ref_stack.pop()

    def _resolve(self, ref: str, path: str) -> tuple[Any, str]:
        node, node_path = self.root, "$"
        pointer = urllib.parse.unquote(ref[1:])
        if pointer and not pointer.startswith("/"):
            raise GuidedSchemaError(f"cannot resolve $ref {ref!r} at {path}")
        for token in pointer.split("/")[1:] if pointer else []:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node, node_path = node[token], _child(node_path, token)
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node, node_path = node[int(token)], _child(node_path, int(token))
            else:
                raise GuidedSchemaError(f"cannot resolve $ref {ref!r} at {path}")
        return node, node_path

    def _object(self, schema: dict, path: str, level: int) -> str:
        props = schema.get("properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GuidedSchemaError(f"'required' must be an array of strings at {path}")
        if props is not None and not isinstance(props, dict):
            raise GuidedSchemaError(f"'properties' must be an object at {path}")
        if props:
            if "propertyNames" in schema:
                raise GuidedSchemaError(
                    f"'propertyNames' next to 'properties' is not supported at {path}")
            return self._fixed_object(props, required, path, level)
        if required:
            raise GuidedSchemaError(
                f"required property {required[0]!r} is not listed in 'properties' at {path}")
        extra = schema.get("additionalProperties", True)
        key = self._property_names(schema, path, level)
        if extra is False or key is None:
            return r"\{\}"
        if _is_any(extra) and key == _STRING:
            return self.generic_object(self.max_depth)
        try:
            value = (self.generic(self.max_depth - 1) if _is_any(extra) and self.max_depth > 0
                     else self.value(extra, _child(path, "additionalProperties"), level + 1))
            return self._map(value, key)
        except _Pruned:
            return r"\{\}"

    def _property_names(self, schema: dict, path: str, level: int) -> str | None:
        """The regex of a map's keys: any string, or those `propertyNames` allows (a string
        schema, an enum, a $ref, ...); None if no key can match."""
        names = schema.get("propertyNames", True)
        if _is_any(names):
            return _STRING
        if names is False:
            return None
        try:      # keys are strings: the schema met with {"type": "string"} ($ref siblings kept)
            return self.value({"allOf": [names, {"type": "string"}]},
                              _child(path, "propertyNames"), level + 1)
        except Unsatisfiable:
            return None                             # no key can match: the object is empty

    def _fixed_object(self, props: dict, required: list[str], path: str, level: int) -> str:
        for name in required:
            if name not in props:
                raise GuidedSchemaError(f"required property {name!r} is not listed in 'properties' at {path}")
        members: list[tuple[str, bool]] = []
        props_path = _child(path, "properties")
        for name, sub in props.items():
            needed = name in required
            if sub is False and not needed:
                continue
            try:
                value = self.value(sub, _child(props_path, name), level + 1)
            except (_Pruned, Unsatisfiable):        # an optional one is left out
                if needed:
                    raise
                continue
            key = escape_literal(json.dumps(name, ensure_ascii=False))
            members.append((f"{key}:{self.ws}{value}", needed))
        return r"\{" + self._members(members) + r"\}"

    def _members(self, members: list[tuple[str, bool]]) -> str:
        """The members of a fixed-property object, in order, optional ones possibly absent.

        Linear in the member count: the optional members before the first required one form an
        optional run (`_optional_run`); the first required member follows it after a comma if
        it is not empty; every later member is appended with its comma (optional ones in
        `(?:...)?`), since something was written before it.
        """
        lead = next((i for i, (_, needed) in enumerate(members) if needed), len(members))
        run = self._optional_run([text for text, _ in members[:lead]])
        if lead == len(members):
            return f"(?:{run})?" if run else ""
        run = f"(?:{run},{self.ws})?{members[lead][0]}" if run else members[lead][0]
        for text, needed in members[lead + 1:]:
            tail = f",{self.ws}{text}"
            run += tail if needed else f"(?:{tail})?"
        return self._check_size(run)

    def _optional_run(self, texts: list[str]) -> str:
        """A non-empty run of `texts` in order, any of them absent, commas between ("" if none).

        Grown from the front: a run of the first k texts is either a run of the first k - 1
        followed by an optional `,text`, or the k-th text alone, so each text appears twice and
        the text grows linearly. Done one text at a time, that nests one group per text; done a
        block of ~sqrt(n) texts at a time (a run so far, then each of the block's texts as an
        optional `,text`; or a run that starts inside the block), it nests ~2 sqrt(n) groups,
        well inside the parser's nesting limit (200, guided.rs) for any schema under the size
        limit, with each text appearing three times.
        """
        step = max(1, math.isqrt(len(texts)))
        run = ""
        for start in range(0, len(texts), step):
            block = texts[start:start + step]
            own = block[0]
            for text in block[1:]:
                own = f"(?:{own}(?:,{self.ws}{text})?|{text})"
            if run:
                tails = "".join(f"(?:,{self.ws}{text})?" for text in block)
                own = f"(?:{run}{tails}|{own})"
            run = self._check_size(own)
        return run

    def _array(self, schema: dict, path: str, level: int) -> str:
        lo, hi = _bounds(schema, "minItems", "maxItems", path, MAX_ARRAY_ITEMS)
        if "prefixItems" in schema:                  # 2020-12 tuples: `items` is the rest
            prefix_key, rest_key = "prefixItems", "items"
        elif isinstance(schema.get("items"), list):  # draft 4-7 tuples: `additionalItems` is
            prefix_key, rest_key = "items", "additionalItems"
        else:
            prefix_key, rest_key = None, "items"
        item = self._item(schema.get(rest_key, True), _child(path, rest_key), level,
                          needed=lo > 0 and prefix_key is None)
        if prefix_key is not None:
            return self._tuple(schema[prefix_key], item, lo, hi, _child(path, prefix_key), level)
        if item is None:
            if lo > 0:
                raise Unsatisfiable(f"no array item can match at {path}, yet 'minItems' is {lo}")
            return r"\[\]"
        return self._list(item, lo, hi)

    def _item(self, schema: Any, path: str, level: int, *, needed: bool) -> str | None:
        """An array item's regex; None if no item can match (`false`, or a pruned recursion)."""
        if _is_any(schema):
            return self.generic(self.max_depth - 1) if self.max_depth > 0 else None
        if schema is False:
            return None
        try:
            return self.value(schema, path, level + 1)
        except (_Pruned, Unsatisfiable):
            if needed:
                raise
            return None

    def _tuple(self, prefix: Any, rest: str | None, lo: int, hi: int | None, path: str,
               level: int) -> str:
        """An array whose first items follow `prefix`'s schemas in turn and any later ones
        `rest` (None: there are none). As in JSON Schema, a shorter array is fine too."""
        if not isinstance(prefix, list) or not prefix:
            raise GuidedSchemaError(f"expected a non-empty array of schemas at {path}")
        if len(prefix) > MAX_ARRAY_ITEMS:
            raise GuidedSchemaError(f"more than {MAX_ARRAY_ITEMS} tuple items are not supported at {path}")
        items: list[str] = []
        for i, sub in enumerate(prefix):           # an item that cannot match ends the tuple
            item = self._item(sub, _child(path, i), level, needed=lo > i)
            if item is None:
                rest = None
                break
            items.append(item)
        longest = len(items) if rest is None else hi
        if longest is not None and hi is not None:
            longest = min(longest, hi)
        if longest is not None and lo > longest:
            raise Unsatisfiable(f"no array of at least {lo} items can match at {path}")
        items = items[:longest]
        if not items:
            return r"\[\]"
        count = len(items)
        body = items[-1]
        if rest is not None and (longest is None or longest > count):
            more = quantifier(max(lo - count, 0), None if longest is None else longest - count)
            body += f"(?:,{self.ws}{rest}){more}"
        for i in range(count - 2, -1, -1):          # item i + 1 is there iff the array is longer
            after = f",{self.ws}{body}"
            body = items[i] + (after if lo > i + 1 else f"(?:{after})?")
        return rf"\[{body}\]" if lo > 0 else rf"\[(?:{body})?\]"

    def _string(self, schema: dict, path: str) -> str:
        has_length = "minLength" in schema or "maxLength" in schema
        lo, hi = _bounds(schema, "minLength", "maxLength", path, MAX_STRING_LENGTH)
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if pattern is not None:                 # a pattern asserts; a format beside it is ignored
            if has_length:
                raise GuidedSchemaError(
                    f"combining 'pattern' with 'minLength'/'maxLength' is not supported at {path}")
            if not isinstance(pattern, str):
                raise GuidedSchemaError(f"'pattern' must be a string at {path}")
            return pattern_to_json_string_regex(pattern, _child(path, "pattern"))
        if fmt is not None:
            if not isinstance(fmt, str):
                raise GuidedSchemaError(f"'format' must be a string at {path}")
            # the lengths as written, not lowered to the cap: a format's texts are short anyway
            unclamped = _bounds(schema, "minLength", "maxLength", path, 1 << 62)[1]
            regex = _format_regex(fmt, lo, unclamped)
            if regex is not None:
                return f'"{regex}"'
        if hi == 0:
            return '""'
        if lo == 0 and hi is None:
            return _STRING
        return f'"{_BOUNDED_STRING_CHAR}{quantifier(lo, hi)}"'


def _format_regex(fmt: str, lo: int, hi: int | None) -> str | None:
    """A known format's regex, if every text it matches has a length in lo..hi; None otherwise
    (the string is then written by its lengths alone: `format` is an annotation in JSON Schema)."""
    if fmt not in _FORMATS:
        return None
    regex, shortest, longest = _FORMATS[fmt]
    if shortest < lo or (hi is not None and (longest is None or longest > hi)):
        return None
    return regex


# --- public entry points ------------------------------------------------------------------------


def _check_settings(whitespace: Any, max_depth: Any) -> None:
    if not isinstance(whitespace, str):
        raise GuidedSchemaError("whitespace must be a regex string")
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 0:
        raise GuidedSchemaError("max_depth must be a non-negative integer")


def schema_to_regex(schema: dict | bool | str, *, whitespace: str = WHITESPACE,
                    max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """Regex whose full matches are the (supported subset of) JSON texts valid for `schema`.

    `schema` is a JSON Schema as a dict, a boolean, or JSON text. Raises GuidedSchemaError for
    invalid or unsupported schemas. `multipleOf` and `uniqueItems` are ignored.
    """
    _check_settings(whitespace, max_depth)
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise GuidedSchemaError(f"{_TOO_LARGE}: it nests too deeply") from None
        except ValueError as exc:
            raise GuidedSchemaError(f"the schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GuidedSchemaError(f"a JSON Schema must be an object or a boolean, got {type(schema).__name__}")
    builder = _Builder(schema, whitespace, max_depth)
    try:
        return builder.value(schema, "$", 0)
    except _Pruned as exc:
        raise GuidedSchemaError(
            f"the recursive $ref {exc.ref!r} at {exc.path} cannot end within max_depth={max_depth}: "
            f"no optional branch stops the recursion") from None
    except RecursionError:
        raise GuidedSchemaError(f"{_TOO_LARGE}: it nests too deeply") from None
    except (TypeError, AttributeError) as exc:   # a keyword of the wrong shape that no check
        raise GuidedSchemaError(f"the schema is malformed: {exc}") from None   # named first


def json_object_regex(*, whitespace: str = WHITESPACE, max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """Regex for any JSON object nesting at most `max_depth` containers (itself included)."""
    _check_settings(whitespace, max_depth)
    return _Builder({}, whitespace, max_depth).generic_object(max_depth)


def choice_to_regex(choices: list[str]) -> str:
    """Regex matching exactly one of `choices` (raw text, not JSON-quoted)."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise GuidedSchemaError("guided choice needs a non-empty list of strings")
    if not all(isinstance(c, str) for c in choices):
        raise GuidedSchemaError("guided choice needs a non-empty list of strings")
    return alternation([escape_literal(c) for c in choices])
