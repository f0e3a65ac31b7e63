"""Several JSON Schemas that must all hold, merged into one, for guided decoding.

`allOf: [A, B]` (zod's `.and()`, mixins), keywords beside an `anyOf` / `oneOf` (`{"type":
"object", "properties": ..., "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}`) and keywords
beside a `$ref` all ask for a value valid for several schemas at once. A regex cannot intersect,
so the schemas are merged keyword by keyword into one schema with exactly that meaning:

- `type`: the types in both (`integer` is within `number`); `enum`: the values in both; `const`
  must agree;
- lower bounds (`minimum`, `minLength`, `minItems`, ...) take the larger, upper bounds the smaller;
- `properties`: the union; a property is held by each side's schema for it, or by that side's
  `additionalProperties` where the side does not list it (`false`: the property cannot appear);
  `required`: the union; `items` and `additionalProperties`: `allOf` of the two;
- `prefixItems`: position by position, each side's prefix schema there or its `items`;
- draft 4's boolean `exclusiveMinimum` / `exclusiveMaximum` are first written as 2020-12's
  numbers, so that bounds from either draft meet exactly;
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
_OWN_RULES = frozenset({"properties", "prefixItems", "items", "additionalProperties"})
_UPPER = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems"})
_BOTH = frozenset({"additionalItems", "propertyNames"})
_NUMERIC = ("integer", "number")

Resolve = Callable[[str, str], tuple[Any, str]]


def same_json(a: Any, b: Any) -> bool:
    """JSON equality (true is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _types(value: Any, path: str) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise GuidedSchemaError(f"'type' must be a string or an array of strings at {path}")
    return names


def _type_meet(a: Any, b: Any, path: str) -> list[str] | str:
    left, right = _types(a, path), _types(b, path)
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


def _draft4_bounds(schema: dict) -> dict:
    """`schema` with draft 4's boolean exclusive flags written as 2020-12's numeric bounds."""
    out = dict(schema)
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(flag), bool):
            if out.pop(flag) and bound in out:
                out[flag] = out.pop(bound)
    return out


def _both(x: Any, y: Any) -> Any:
    """A schema for what both `x` and `y` allow (`True` stands for no constraint)."""
    if x is True:
        return y
    if y is True:
        return x
    return {"allOf": [x, y]}


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
        return ([_draft4_bounds(rest)] if rest else []) + parts, refs

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
        out.update(self._objects_and_arrays(a, b, path))
        for key, value in b.items():
            if key in _OWN_RULES:
                continue
            if key not in out:
                out[key] = value
            elif same_json(out[key], value):
                continue
            elif key == "type":
                out[key] = _type_meet(out[key], value, path)
            elif key in _LOWER or key in _UPPER:
                out[key] = _bound(key, out[key], value, path)
            elif key == "required":
                for names in (out[key], value):
                    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                        raise GuidedSchemaError(f"'required' must be an array of strings at {path}")
                out[key] = list(dict.fromkeys([*out[key], *value]))
            elif key == "enum":
                if not isinstance(out[key], list) or not isinstance(value, list):
                    raise GuidedSchemaError(f"'enum' must be an array at {path}")
                out[key] = [v for v in out[key] if any(same_json(v, w) for w in value)]
                if not out[key]:
                    raise Unsatisfiable(f"no value is in both enums at {path}")
            elif key in _BOTH:
                out[key] = _both(out[key], value)
            elif key.startswith("x-") or key in ("title", "description", "default", "examples",
                                                 "$comment", "$defs", "definitions"):
                continue                                   # annotations: the first one stays
            else:
                raise GuidedSchemaError(f"cannot merge two different {key!r} at {path}")
        if ("nullable" in a) != ("nullable" in b):     # null only if both sides allow it
            out.pop("nullable")
        return out

    def _objects_and_arrays(self, a: dict, b: dict, path: str) -> dict:
        """The merged `properties`, `additionalProperties`, `prefixItems` and `items`."""
        out: dict[str, Any] = {}
        if "properties" in a or "properties" in b:
            sides = []
            for side in (a, b):
                props = side.get("properties", {})
                if not isinstance(props, dict):
                    raise GuidedSchemaError(f"'properties' must be an object at {path}")
                sides.append((props, side.get("additionalProperties", True)))
            names = list(dict.fromkeys([*sides[0][0], *sides[1][0]]))
            out["properties"] = {
                name: _both(*(props.get(name, extra) for props, extra in sides))
                for name in names}
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = _both(a.get("additionalProperties", True),
                                                b.get("additionalProperties", True))
        for side in (a, b):
            if isinstance(side.get("items"), list):
                raise GuidedSchemaError(f"the array form of 'items' cannot be merged at {path}")
        if "prefixItems" in a or "prefixItems" in b:
            prefixes = [side.get("prefixItems", []) for side in (a, b)]
            if not all(isinstance(p, list) for p in prefixes):
                raise GuidedSchemaError(f"'prefixItems' must be an array at {path}")
            out["prefixItems"] = [
                _both(*(p[i] if i < len(p) else side.get("items", True)
                        for p, side in zip(prefixes, (a, b), strict=True)))
                for i in range(max(map(len, prefixes)))]
        if "items" in a or "items" in b:
            out["items"] = _both(a.get("items", True), b.get("items", True))
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
