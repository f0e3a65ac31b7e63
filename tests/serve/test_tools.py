"""Forced tool calls (`serve/tools.py`): the OpenAI `tools` / `tool_choice` shapes become a
guided JSON Schema whose every match is a well-formed call, and the finished text becomes
`tool_calls`; bad shapes are 400s naming the field."""

from __future__ import annotations

import json
import re

import pytest

from ferrobatch.guided.json_schema import schema_to_regex
from ferrobatch.serve.openai_protocol import parse_chat
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.tools import parse_tools, tool_calls_from_text

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {"name": "now"}}        # no parameters
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw):
    return parse_chat({"messages": MSGS, **kw}, "m")


def test_named_tool_choice_guides_by_its_parameters():
    req = chat(tools=[WEATHER, CLOCK],
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert req.tools.mode == "named" and req.tools.names == ("get_weather",)
    assert req.params.guided_json == WEATHER["function"]["parameters"]
    calls = tool_calls_from_text(req.tools, '{"city": "Paris", "unit": "c"}')
    assert len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])
    # a function without parameters takes exactly an empty object
    req = chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "now"}})
    regex = re.compile(schema_to_regex(req.params.guided_json))
    assert regex.fullmatch("{}") and not regex.fullmatch('{"a":1}')


def test_tool_arguments_are_always_an_object():
    """`parameters: {}` (an empty schema) means no parameters, as an omitted one does, and a
    schema without a type is an object schema: clients json.loads the arguments into a dict."""
    for params in ({}, {"properties": {"q": {"type": "string"}}, "required": ["q"]}):
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        req = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
        assert req.params.guided_json["type"] == "object"
        regex = re.compile(schema_to_regex(req.params.guided_json))
        assert not regex.fullmatch('"SmolLM"') and not regex.fullmatch("[]")
        assert regex.fullmatch("{}" if not params else '{"q": "x"}')


def test_tools_with_defs_and_root_refs(tmp_path):
    """pydantic's nested models give `$defs` + `$ref`: both tool_choice modes accept them. In
    "required" mode each tool's `$defs` move to the new root's and its refs follow (two tools
    may even use the same def name for different things)."""
    addr = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ship = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "$defs": {"Addr": addr},
        "properties": {"to": {"$ref": "#/$defs/Addr"}}, "required": ["to"]}}}
    tag = {"type": "function", "function": {"name": "tag", "parameters": {
        "$ref": "#/definitions/Addr", "definitions": {"Addr": {
            "type": "object", "properties": {"label": {"enum": ["x", "y"]}},
            "required": ["label"]}}}}}
    req = chat(tools=[ship, tag], tool_choice="required")
    regex = re.compile(schema_to_regex(req.params.guided_json))
    assert regex.fullmatch('[{"name": "ship", "parameters": {"to": {"city": "Oslo"}}}, '
                           '{"name": "tag", "parameters": {"label": "x"}}]')
    assert not regex.fullmatch('[{"name": "ship", "parameters": {"to": {"label": "x"}}}]')
    assert not regex.fullmatch('[{"name": "tag", "parameters": {"city": "Oslo"}}]')
    req = chat(tools=[ship, tag], tool_choice={"type": "function", "function": {"name": "tag"}})
    regex = re.compile(schema_to_regex(req.params.guided_json))
    assert regex.fullmatch('{"label": "y"}') and not regex.fullmatch('"x"')


def test_required_tool_choice_is_an_array_of_listed_calls():
    req = chat(tools=[WEATHER, CLOCK], tool_choice="required")
    assert req.tools.mode == "required"
    regex = re.compile(schema_to_regex(req.params.guided_json))
    ok = '[{"name": "get_weather", "parameters": {"city": "Lima"}}, {"name": "now", "parameters": {}}]'
    assert regex.fullmatch(ok)
    for bad in ("[]", '[{"name": "other", "parameters": {}}]',
                '[{"name": "get_weather", "parameters": {}}]',        # city is required
                '{"name": "now", "parameters": {}}'):
        assert not regex.fullmatch(bad), bad
    calls = tool_calls_from_text(req.tools, ok)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Lima"}
    assert len({c["id"] for c in calls}) == 2
    assert tool_calls_from_text(req.tools, '[{"name": "get_weather", "param') is None
    assert tool_calls_from_text(req.tools, '[{"name": "rm_rf", "parameters": {}}]') is None


def test_none_ignores_the_tools():
    req = chat(tools=[WEATHER], tool_choice="none")
    assert req.tools is None and req.params.guided_json is None
    assert parse_tools({"messages": MSGS}) is None


@pytest.mark.parametrize("body, param, match", [
    (dict(tools=[WEATHER]), "tool_choice", "auto"),
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", "auto"),
    (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
     "tool_choice", "not in 'tools'"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "must be"),
    (dict(tools=[], tool_choice="required"), "tools", "non-empty"),
    (dict(tools=[{"type": "retrieval"}], tool_choice="required"), "tools", r"tools\[0\]"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}], tool_choice="required"),
     "tools", "letters"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools", "twice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}],
          tool_choice="required"), "tools", "JSON Schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
          tool_choice="required"), "tools", "type 'object'"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice", "response_format"),
    (dict(tools=[WEATHER], tool_choice="required", guided_regex="a"), "tool_choice",
     "guided_regex"),
    (dict(functions=[{"name": "f"}]), "functions", "deprecated"),
])
def test_bad_tool_requests_name_the_field(body, param, match):
    with pytest.raises(ProtocolError, match=match) as e:
        chat(**body)
    assert e.value.code == 400 and e.value.param == param


def test_parallel_tool_calls_false_allows_one_call():
    one = chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    regex = re.compile(schema_to_regex(one.params.guided_json))
    call = '{"name": "now", "parameters": {}}'
    assert regex.fullmatch(f"[{call}]") and not regex.fullmatch(f"[{call}, {call}]")
    many = chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=True)
    assert re.fullmatch(schema_to_regex(many.params.guided_json), f"[{call}, {call}]")
    with pytest.raises(ProtocolError, match="'parallel_tool_calls' must be a boolean"):
        chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls="no")
