"""Guided JSON Schema against an independent validator: for random schemas (bounds, lengths,
formats, enums, tuples, maps, anyOf, allOf merges, nested objects) and values drawn near them,
every value whose JSON text the schema's regex matches must be valid for `jsonschema`'s
Draft 2020-12 validator. The regex may leave valid texts out (key order, whitespace, formats),
never let an invalid one in."""

from __future__ import annotations

import json
import re

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrobatch.guided.json_schema import schema_to_regex
from ferrobatch.guided.regex_text import GuidedSchemaError

_NUMBERS = st.one_of(st.integers(-20, 20), st.sampled_from([0.5, -2.5, 1.25, 7.75, 100, -100]))
_NAMES = st.sampled_from(["a", "b", "c", "d"])


def _number_schema(kind: str):
    return st.fixed_dictionaries({"type": st.just(kind)}, optional={
        "minimum": _NUMBERS, "maximum": _NUMBERS, "exclusiveMinimum": _NUMBERS,
        "exclusiveMaximum": _NUMBERS})


_STRING = st.fixed_dictionaries({"type": st.just("string")}, optional={
    "minLength": st.integers(0, 4), "maxLength": st.integers(0, 6),
    "format": st.sampled_from(["date", "uuid", "email", "ipv4", "uri", "hostname"])})
_LEAF = st.one_of(
    _number_schema("integer"), _number_schema("number"), _STRING,
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda v: {"enum": v}, st.lists(st.one_of(_NUMBERS, st.sampled_from(["x", "yy"])),
                                              min_size=1, max_size=3)),
    st.builds(lambda v: {"const": v}, _NUMBERS),
    st.builds(lambda t: {"type": t}, st.lists(st.sampled_from(["integer", "string", "null"]),
                                              min_size=1, max_size=2, unique=True)),
    # allOf of one kind, whose merge (bounds, lengths, enums) is the thing under test
    st.builds(lambda subs: {"allOf": subs}, st.lists(_number_schema("integer"), min_size=2, max_size=3)),
    st.builds(lambda subs: {"allOf": subs}, st.lists(_number_schema("number"), min_size=2, max_size=3)),
    st.builds(lambda subs: {"allOf": subs}, st.lists(_STRING, min_size=2, max_size=3)),
    # enum beside keywords its values may break
    st.builds(lambda v, extra: {"enum": v, **extra},
              st.lists(st.sampled_from(["12", "ab", "x", 3, [1, 2, 3], [1]]), min_size=1, max_size=4),
              st.sampled_from([{"type": "string", "pattern": "^[0-9]+$"}, {"maxLength": 1},
                               {"type": "array", "maxItems": 2}, {"minimum": 5}])),
)


def _composite(inner):
    obj = st.builds(
        lambda props, req: {"type": "object", "properties": props,
                            "required": [n for n in props if n in req]},
        st.dictionaries(_NAMES, inner, min_size=1, max_size=3), st.sets(_NAMES))
    array = st.builds(lambda items, lo, hi: {"type": "array", "items": items,
                                             **({"minItems": lo} if lo is not None else {}),
                                             **({"maxItems": hi} if hi is not None else {})},
                      inner, st.one_of(st.none(), st.integers(0, 2)),
                      st.one_of(st.none(), st.integers(0, 3)))
    tup = st.builds(lambda pre, rest: {"type": "array", "prefixItems": pre, "items": rest},
                    st.lists(inner, min_size=1, max_size=2), st.one_of(st.just(False), inner))
    mapping = st.builds(lambda v, keys: {"type": "object", "additionalProperties": v,
                                         "propertyNames": {"enum": keys}},
                        inner, st.lists(_NAMES, min_size=1, max_size=2, unique=True))
    any_of = st.builds(lambda subs: {"anyOf": subs}, st.lists(inner, min_size=1, max_size=3))
    all_of = st.builds(lambda subs: {"allOf": subs}, st.lists(inner, min_size=2, max_size=3))
    closed = st.builds(lambda o, extra: {**o, "additionalProperties": extra}, obj,
                       st.one_of(st.just(False), inner))
    objects_all_of = st.builds(lambda subs: {"allOf": subs},
                               st.lists(st.one_of(obj, closed), min_size=2, max_size=3))
    arrays_all_of = st.builds(lambda a, b: {"allOf": [a, b]}, array, tup)
    beside = st.builds(lambda extra, subs: {**extra, "anyOf": subs},
                       st.sampled_from([{"type": "integer"}, {"minimum": 0}, {"maxLength": 2}]),
                       st.lists(inner, min_size=1, max_size=2))
    return st.one_of(obj, array, tup, mapping, any_of, all_of, objects_all_of, arrays_all_of,
                     beside)


SCHEMAS = st.recursive(_LEAF, _composite, max_leaves=6)

_TEXTS = st.sampled_from(["", "x", "yy", "abcd", "2024-02-29", "a@b.co", "10.0.0.1",
                          "https://e.com", "123e4567-e89b-12d3-a456-426614174000", "host-1"])


def _near(schema, depth: int = 0):
    """Values of roughly the schema's shape (right type mostly, near its bounds), plus strays."""
    stray = st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXTS, st.just([]), st.just({}))
    if depth > 4 or not isinstance(schema, dict):
        return stray
    options = [stray]
    for key in ("anyOf", "allOf"):
        for sub in schema.get(key, []):
            options.append(_near(sub, depth + 1))
    subs = schema.get("allOf", [])
    if subs and all(isinstance(sub, dict) and "properties" in sub for sub in subs):
        union = {k: v for sub in subs for k, v in sub["properties"].items()}   # keys of all
        options.append(_near({"type": "object", "properties": union}, depth + 1))
    if "enum" in schema:
        options.append(st.sampled_from(schema["enum"]))
    if "const" in schema:
        options.append(st.just(schema["const"]))
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if {"integer", "number"} & set(kinds) or "minimum" in schema:
        edges = [v for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
                 if isinstance(v := schema.get(k), (int, float))]
        near = [e + d for e in edges for d in (-1, -0.5, 0, 0.25, 1)]
        options.append(st.one_of(_NUMBERS, *(st.just(v) for v in near)) if near else _NUMBERS)
    if "string" in kinds or "maxLength" in schema:
        options.append(_TEXTS)
    if "object" in kinds:
        props = schema.get("properties", {})
        keys = list(props) or ["a", "b", "z"]
        value_of = {k: _near(props.get(k, schema.get("additionalProperties", {})), depth + 1)
                    for k in keys}
        options.append(st.lists(st.sampled_from(keys), max_size=len(keys), unique=True).flatmap(
            lambda ks: st.fixed_dictionaries({k: value_of[k] for k in sorted(ks, key=keys.index)})))
    if "array" in kinds:
        pre = [_near(s, depth + 1) for s in schema.get("prefixItems", [])]
        rest = _near(schema.get("items", {}), depth + 1)
        options.append(st.integers(0, 4).flatmap(
            lambda n: st.tuples(*(pre[i] if i < len(pre) else rest for i in range(n))).map(list)))
    return st.one_of(*options)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_every_matched_value_is_valid(data):
    schema = data.draw(SCHEMAS, label="schema")
    try:
        regex = re.compile(schema_to_regex(schema))
    except GuidedSchemaError:
        return                                   # refused (e.g. contradictory): nothing produced
    validator = jsonschema.Draft202012Validator(schema)
    for _ in range(12):
        value = data.draw(_near(schema), label="value")
        text = json.dumps(value, separators=(",", ":"))
        if regex.fullmatch(text):
            assert validator.is_valid(json.loads(text)), (schema, text)
