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

Approximations (the output is a subset of the valid texts, never a superset, except where noted):
properties appear only in schema order; `additionalProperties` is treated as false whenever
`properties` is given; `enum`/`const` values are written compactly; strings use canonical escapes
where the schema fixes their text; a `pattern` is anchored at both ends (JSON Schema searches), reads
`\\d \\w \\s` as ASCII classes and `.` as ECMA-262 does (any character but `\\n`, `\\r`, U+2028,
U+2029), may not use lookaround, backreferences, `\\b`, `\\p{..}` or flags, and is rewritten into the
dialect above so that `"`, `\\` and control characters appear JSON-escaped (`string_pattern`);
formats are "date", "time", "date-time" (both with a UTC offset) and "uuid". Superset: `oneOf` is
treated as `anyOf`; a pattern's `\\S` (or `[^\\s]`) also admits the Unicode spaces, such as U+00A0,
that ECMA-262's `\\s` matches; `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`,
`multipleOf` and `uniqueItems` are ignored, like the annotations (`title`, `description`, `default`,
`examples`, ...). Any other keyword, and any construct that cannot be honoured, raises
`GuidedSchemaError`, naming the keyword and its path.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from typing import Any

from ferrobatch.guided.regex_text import (
    MAX_STRING_LENGTH,
    GuidedSchemaError,
    alternation,
    escape_literal,
    quantifier,
)
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
_INTEGER = r"-?(?:0|[1-9][0-9]{0,15})"
_NUMBER = _INTEGER + r"(?:\.[0-9]{1,16})?(?:[eE][+\-]?[0-9]{1,3})?"
_BOOLEAN = "(?:true|false)"
_NULL = "null"
_SCALARS = (_STRING, _NUMBER, "true", "false", _NULL)

_DATE = "[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_HEX = "[0-9a-fA-F]"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
}

# --- keyword tables -------------------------------------------------------------------------------

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$schema", "$id", "$comment",
    "$anchor", "deprecated", "readOnly", "writeOnly", "discriminator", "strict",
    "contentEncoding", "contentMediaType", "$defs", "definitions",
    # assertions deliberately ignored (documented above)
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
})
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KEYWORDS = frozenset({"items", "minItems", "maxItems"})
_STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
_COMBINATORS = frozenset({"$ref", "allOf", "anyOf", "oneOf", "enum", "const"})
_KNOWN = (_ANNOTATIONS | _OBJECT_KEYWORDS | _ARRAY_KEYWORDS | _STRING_KEYWORDS | _COMBINATORS
          | {"type"})
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


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality (true is not 1, 1 is 1.0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def _count(schema: dict, key: str, path: str, cap: int) -> int | None:
    """A non-negative integer keyword (None if absent); above `cap` it is unsupported."""
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise GuidedSchemaError(f"'{key}' must be a non-negative integer at {path}")
    if value > cap:
        raise GuidedSchemaError(f"'{key}' above {cap} is not supported at {path}")
    return value


def _bounds(schema: dict, lo_key: str, hi_key: str, path: str, cap: int) -> tuple[int, int | None]:
    lo = _count(schema, lo_key, path, cap) or 0
    hi = _count(schema, hi_key, path, cap)
    if hi is not None and lo > hi:
        raise GuidedSchemaError(f"'{lo_key}' exceeds '{hi_key}' at {path}: nothing can match")
    return lo, hi


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

    def _map(self, value: str) -> str:
        member = f"{_STRING}:{self.ws}{value}"
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
            raise GuidedSchemaError(f"the schema at {path} is false: no value can match it")
        if not isinstance(schema, dict):
            raise GuidedSchemaError(
                f"expected a schema (object or boolean) at {path}, got {type(schema).__name__}")
        for key in schema:
            if key not in _KNOWN and not key.startswith("x-"):
                raise GuidedSchemaError(f"unsupported JSON Schema keyword {key!r} at {path}")
        return self._check_size(self._dispatch(schema, path, level))

    def _dispatch(self, schema: dict, path: str, level: int) -> str:
        for key in ("$ref", "allOf", "anyOf", "oneOf"):
            if key in schema:
                for other in schema:
                    if other != key and other not in _ANNOTATIONS and not other.startswith("x-"):
                        raise GuidedSchemaError(
                            f"unsupported JSON Schema keyword {other!r} next to {key!r} at {path}")
        if "$ref" in schema:
            return self._ref(schema["$ref"], path)
        if "allOf" in schema:
            subs = schema["allOf"]
            if not isinstance(subs, list) or len(subs) != 1:
                raise GuidedSchemaError(
                    f"unsupported JSON Schema keyword 'allOf' at {path}: only one subschema is supported")
            return self.value(subs[0], _child(_child(path, "allOf"), 0), level + 1)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._any_of(schema[key], _child(path, key), level)
        if "const" in schema or "enum" in schema:
            return self._literals(schema, path)
        types = self._types(schema, path)
        if types is None:
            return self.generic(self.max_depth)
        return alternation([self._typed(t, schema, path, level) for t in types])

    def _literals(self, schema: dict, path: str) -> str:
        """`const` / `enum`: the listed values, narrowed by each other and by a sibling `type`
        (a value the schema's other keywords refuse is never produced)."""
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise GuidedSchemaError(f"'enum' must be a non-empty array at {path}")
        else:
            values = [schema["const"]]
        where = _child(path, "enum" if "enum" in schema else "const")
        if "const" in schema and "enum" in schema:
            values = [v for v in values if _same_json(v, schema["const"])]
        if "type" in schema:
            types = self._types(schema, path) or []
            values = [v for v in values if any(_is_json_type(v, t) for t in types)]
        if not values:
            raise GuidedSchemaError(f"no value satisfies 'enum'/'const' together with the other "
                                    f"keywords at {path}")
        return alternation([_json_literal(v, where) for v in values])

    def _types(self, schema: dict, path: str) -> list[str] | None:
        """The value types allowed (None: any value, no type-specific keyword either)."""
        declared = schema.get("type")
        if declared is None:
            families = [name for name, keys in (("object", _OBJECT_KEYWORDS), ("array", _ARRAY_KEYWORDS),
                                                ("string", _STRING_KEYWORDS)) if keys & schema.keys()]
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
        return {"integer": _INTEGER, "number": _NUMBER, "boolean": _BOOLEAN, "null": _NULL}[kind]

    def _any_of(self, subs: Any, path: str, level: int) -> str:
        if not isinstance(subs, list) or not subs:
            raise GuidedSchemaError(f"expected a non-empty array of schemas at {path}")
        parts: list[str] = []
        pruned: _Pruned | None = None
        for i, sub in enumerate(subs):
            if sub is False:
                continue
            try:
                parts.append(self.value(sub, _child(path, i), level + 1))
            except _Pruned as exc:
                pruned = exc
        if parts:
            return alternation(parts)
        if pruned is not None:
            raise pruned
        raise GuidedSchemaError(f"no subschema at {path} can match any value")

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
            return self._fixed_object(props, required, path, level)
        if required:
            raise GuidedSchemaError(
                f"required property {required[0]!r} is not listed in 'properties' at {path}")
        extra = schema.get("additionalProperties", True)
        if extra is False:
            return r"\{\}"
        if _is_any(extra):
            return self.generic_object(self.max_depth)
        try:
            return self._map(self.value(extra, _child(path, "additionalProperties"), level + 1))
        except _Pruned:
            return r"\{\}"

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
            except _Pruned:
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
        items = schema.get("items", True)
        if isinstance(items, list):
            raise GuidedSchemaError(f"unsupported JSON Schema keyword 'items' (array form) at {path}")
        if _is_any(items):
            item = self.generic(self.max_depth - 1) if self.max_depth > 0 else None
        elif items is False:
            item = None
        else:
            try:
                item = self.value(items, _child(path, "items"), level + 1)
            except _Pruned:
                if lo > 0:
                    raise
                item = None
        if item is None:
            if lo > 0:
                raise GuidedSchemaError(f"no array item can match at {path}, yet 'minItems' is {lo}")
            return r"\[\]"
        return self._list(item, lo, hi)

    def _string(self, schema: dict, path: str) -> str:
        has_length = "minLength" in schema or "maxLength" in schema
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if pattern is not None or fmt is not None:
            if has_length or (pattern is not None and fmt is not None):
                raise GuidedSchemaError(
                    f"combining 'pattern'/'format' with each other or with 'minLength'/'maxLength' "
                    f"is not supported at {path}")
            if pattern is not None:
                if not isinstance(pattern, str):
                    raise GuidedSchemaError(f"'pattern' must be a string at {path}")
                return pattern_to_json_string_regex(pattern, _child(path, "pattern"))
            if fmt not in _FORMATS:
                raise GuidedSchemaError(f"unsupported string format {fmt!r} at {_child(path, 'format')}")
            return f'"{_FORMATS[fmt]}"'
        lo, hi = _bounds(schema, "minLength", "maxLength", path, MAX_STRING_LENGTH)
        if hi == 0:
            return '""'
        return f'"{_STRING_CHAR}{quantifier(lo, hi)}"'


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
    invalid or unsupported schemas. `minimum`/`maximum`/`multipleOf`/`uniqueItems` are ignored.
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
