"""Several JSON Schemas that must all hold, merged into one, for guided decoding.

`allOf: [A, B]` (zod's `.and()`, mixins), keywords beside an `anyOf` / `oneOf` (`{"type":
"object", "properties": ..., "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}`) and keywords
beside a `$ref` all ask for a value valid for several schemas at once. A regex cannot intersect,
so the schemas are merged keyword by keyword into one schema with exactly that meaning:

- `type`: the types in both (`integer` is within `number`); `enum`: the values in both; `const`
  must agree;
- lower bounds (`minimum`, `minLength`, `minItems`, ...) take the larger, upper bounds the smaller;
- `properties`: the union, a property in both becoming `allOf` of its two schemas; `required`:
  the union; `items` and `additionalProperties`: `allOf` of the two;
- an `anyOf` / `oneOf` on one side stays (its branches are merged with the rest when the walk
  reaches it); on both sides the branches are paired, at most `MAX_BRANCH_PAIRS` pairs;
- a keyword that differs on the two sides and has no such rule (two `pattern`s, two `format`s)
  is refused: the merged schema would have to mean both.

`$ref`s at the top of a merged schema are resolved first (a recursive one is refused here; refs
nested in properties are expanded by the walk as usual).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ferrobatch.guided.regex_text import GuidedSchemaError, Unsatisfiable

MAX_BRANCH_PAIRS = 64

_LOWER = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems"})
_UPPER = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems"})
_BOTH = frozenset({"items", "additionalProperties", "additionalItems", "propertyNames"})
_NUMERIC = ("integer", "number")

Resolve = Callable[[str, str], tuple[Any, str]]


def _same(a: Any, b: Any) -> bool:
    """JSON equality (true is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _types(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _type_meet(a: Any, b: Any, path: str) -> list[str] | str:
    left, right = _types(a), _types(b)
    out = [t for t in left if t in right or (t == "integer" and "number" in right)]
    out += [t for t in right if t == "integer" and "number" in left and t not in out]
    if not out:
        raise Unsatisfiable(f"no value has a type in both {left} and {right} at {path}")
    return out[0] if len(out) == 1 else out


def _bound(key: str, a: Any, b: Any, path: str) -> Any:
    if isinstance(a, bool) or isinstance(b, bool):        # draft 4's exclusive flags
        if a != b:
            raise GuidedSchemaError(f"cannot merge two different {key!r} at {path}")
        return a
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        raise GuidedSchemaError(f"{key!r} must be a number at {path}")
    return max(a, b) if key in _LOWER else min(a, b)


def _branches(schema: dict) -> tuple[str, list] | None:
    for key in ("anyOf", "oneOf"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise GuidedSchemaError(f"expected a non-empty array of schemas in {key!r}")
            return key, schema[key]
    return None


class Merger:
    """Merges schemas that must all hold; `resolve(ref, path)` looks a `$ref` up."""

    def __init__(self, resolve: Resolve) -> None:
        self._resolve = resolve

    def flatten(self, schema: Any, path: str, seen: tuple[str, ...] = ()) -> tuple[list, list[str]]:
        """`schema` as the list of schemas it requires, top-level `$ref`s resolved and nested
        `allOf`s spread out (`True` drops out, `False` stays), and the refs it resolved."""
        if schema is True or schema == {}:
            return [], []
        if not isinstance(schema, dict):
            return [schema], []
        rest = dict(schema)
        parts: list[Any] = []
        refs: list[str] = []
        if "$ref" in rest:
            ref = rest.pop("$ref")
            if not isinstance(ref, str) or ref in seen:
                raise GuidedSchemaError(f"a recursive or invalid $ref {ref!r} cannot be merged at {path}")
            target, target_path = self._resolve(ref, path)
            more, more_refs = self.flatten(target, target_path, (*seen, ref))
            parts, refs = parts + more, [ref, *more_refs]
        if "allOf" in rest:
            subs = rest.pop("allOf")
            if not isinstance(subs, list) or not subs:
                raise GuidedSchemaError(f"'allOf' must be a non-empty array of schemas at {path}")
            for i, sub in enumerate(subs):
                more, more_refs = self.flatten(sub, f"{path}.allOf[{i}]", seen)
                parts, refs = parts + more, refs + more_refs
        return ([rest] if rest else []) + parts, refs

    def merge_all(self, schemas: list[Any], path: str) -> Any:
        """One schema valid exactly where all of `schemas` are."""
        merged: Any = True
        for schema in schemas:
            merged = self.merge(merged, schema, path)
        return merged

    def merge(self, a: Any, b: Any, path: str) -> Any:
        if a is True:
            return b
        if b is True:
            return a
        if a is False or b is False:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise GuidedSchemaError(f"expected a schema (object or boolean) at {path}")
        branches_a, branches_b = _branches(a), _branches(b)
        if branches_a and branches_b:
            return self._pair_branches(a, b, branches_a, branches_b, path)
        out = dict(a)
        for key, value in b.items():
            if key not in out:
                out[key] = value
            elif _same(out[key], value):
                continue
            elif key == "type":
                out[key] = _type_meet(out[key], value, path)
            elif key in _LOWER or key in _UPPER:
                out[key] = _bound(key, out[key], value, path)
            elif key == "properties":
                out[key] = self._properties(out[key], value, path)
            elif key == "required":
                out[key] = list(dict.fromkeys([*out[key], *value]))
            elif key == "enum":
                out[key] = [v for v in out[key] if any(_same(v, w) for w in value)]
                if not out[key]:
                    raise Unsatisfiable(f"no value is in both enums at {path}")
            elif key in _BOTH:
                out[key] = {"allOf": [out[key], value]}
            elif key.startswith("x-") or key in ("title", "description", "default", "examples",
                                                 "$comment", "$defs", "definitions"):
                continue                                   # annotations: the first one stays
            else:
                raise GuidedSchemaError(f"cannot merge two different {key!r} at {path}")
        if ("nullable" in a) != ("nullable" in b):     # null only if both sides allow it
            out.pop("nullable")
        return out

    def _properties(self, a: Any, b: Any, path: str) -> dict:
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise GuidedSchemaError(f"'properties' must be an object at {path}")
        out = dict(a)
        for name, sub in b.items():
            out[name] = {"allOf": [out[name], sub]} if name in out else sub
        return out

    def _pair_branches(self, a: dict, b: dict, branches_a: tuple[str, list],
                       branches_b: tuple[str, list], path: str) -> dict:
        """`anyOf` on both sides: every pair of branches (with the rest of both schemas)."""
        if len(branches_a[1]) * len(branches_b[1]) > MAX_BRANCH_PAIRS:
            raise GuidedSchemaError(
                f"merging two anyOf/oneOf lists gives more than {MAX_BRANCH_PAIRS} branches at {path}")
        rest_a = {k: v for k, v in a.items() if k != branches_a[0]}
        rest_b = {k: v for k, v in b.items() if k != branches_b[0]}
        rest = self.merge(rest_a, rest_b, path)
        pairs = [{"allOf": [x, y]} for x in branches_a[1] for y in branches_b[1]]
        if rest is False:
            return {"anyOf": [False]}
        return {**(rest if isinstance(rest, dict) else {}), "anyOf": pairs}
