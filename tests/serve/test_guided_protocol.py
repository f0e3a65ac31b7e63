"""Guided decoding on the request doors, parsing only (no server, no engine): OpenAI's
`response_format` and the `guided_*` fields on HTTP, and `params.guided_*` in WS/TCP messages."""

from __future__ import annotations

import re

import pytest

from ferrobatch.serve.openai_protocol import parse_chat, parse_completion
from ferrobatch.serve.protocol import ProtocolError, error_status, parse_message, sampling_params_from

MODEL = "test-model"
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields):
    return parse_chat({"model": MODEL, "messages": MESSAGES, **fields}, MODEL)


def completion(**fields):
    return parse_completion({"model": MODEL, "prompt": "hi", **fields}, MODEL)


def guided_fields(params) -> dict:
    return {"json": params.guided_json, "regex": params.guided_regex, "choice": params.guided_choice}


PARSERS = pytest.mark.parametrize("parse", [chat, completion], ids=["chat", "completion"])


# --- response_format ------------------------------------------------------------------------------


@PARSERS
def test_json_object_is_any_json_object(parse):
    params = parse(response_format={"type": "json_object"}, temperature=0.5).params
    assert guided_fields(params) == {"json": {"type": "object"}, "regex": None, "choice": None}
    assert params.is_guided and params.temperature == 0.5


@PARSERS
def test_json_schema_is_the_given_schema(parse):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA}}
    params = parse(response_format=fmt).params
    assert params.guided_json == SCHEMA and params.is_guided
    assert parse(response_format={"type": "json_schema", "json_schema": {"name": "any"}}
                 ).params.guided_json == {}          # OpenAI's schema is optional: any value


@PARSERS
def test_text_and_no_response_format_are_unguided(parse):
    for fields in ({"response_format": {"type": "text"}}, {"response_format": None}, {}):
        params = parse(**fields).params
        assert not params.is_guided, fields
        assert guided_fields(params) == {"json": None, "regex": None, "choice": None}
    # "text" constrains nothing, so it may sit next to a guided field
    assert parse(response_format={"type": "text"}, guided_regex="[0-9]+").params.guided_regex == "[0-9]+"


@PARSERS
@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "xml"}}, "'response_format' must be"),
    ({"response_format": "json_object"}, "'response_format' must be"),
    ({"response_format": {"json_schema": {"schema": SCHEMA}}}, "'response_format' must be"),
    ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": "object"}},
     "'response_format.json_schema' must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "object"}}},
     "'response_format.json_schema.schema' must be a JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [SCHEMA]}}},
     "'response_format.json_schema.schema' must be a JSON Schema object"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "'response_format' cannot be combined with 'guided_regex'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
      "guided_choice": ["a"]}, "'response_format' cannot be combined with 'guided_choice'"),
])
def test_bad_response_format_is_a_protocol_error(parse, fields, message):
    with pytest.raises(ProtocolError) as info:
        parse(**fields)
    assert message in str(info.value)
    assert info.value.param == "response_format" and info.value.code == 400


# --- guided_* fields on HTTP ----------------------------------------------------------------------


@PARSERS
def test_guided_fields_pass_through(parse):
    assert parse(guided_choice=["yes", "no"]).params.guided_choice == ("yes", "no")
    assert parse(guided_regex="[a-z]{3}").params.guided_regex == "[a-z]{3}"
    assert parse(guided_json=SCHEMA).params.guided_json == SCHEMA
    assert parse(guided_json='{"type": "integer"}').params.guided_json == '{"type": "integer"}'


@PARSERS
@pytest.mark.parametrize("field, value, message", [
    ("guided_choice", ["yes", 1], "'guided_choice' must be a list of strings"),
    ("guided_choice", "yes", "'guided_choice' must be a list of strings"),
    ("guided_regex", 5, "'guided_regex' must be a string"),
    ("guided_regex", ["a+"], "'guided_regex' must be a string"),
    ("guided_json", 3, "'guided_json' must be a JSON Schema"),
    ("guided_json", 2.5, "'guided_json' must be a JSON Schema"),
    ("guided_json", [SCHEMA], "'guided_json' must be a JSON Schema"),
])
def test_badly_typed_guided_fields_name_the_field(parse, field, value, message):
    with pytest.raises(ProtocolError) as info:
        parse(**{field: value})
    assert message in str(info.value)
    assert info.value.param == field and info.value.code == 400


# --- SamplingParams rules surface as protocol errors ----------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"guided_regex": "a+", "guided_choice": ["a"]},
     "at most one of guided_json, guided_regex, guided_choice, guided_grammar may be set, got "
     "guided_regex, guided_choice"),
    ({"guided_json": SCHEMA, "guided_regex": "a+"}, "got guided_json, guided_regex"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "guided_choice cannot be combined with ignore_eos"),
    ({"guided_json": SCHEMA, "min_tokens": 2}, "guided_json cannot be combined with min_tokens"),
    ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list"),
])
def test_sampling_params_rules_become_protocol_errors(fields, message):
    with pytest.raises(ProtocolError) as info:
        sampling_params_from(fields)
    assert message in str(info.value)
    assert error_status(info.value) == (400, "invalid_request_error")
    with pytest.raises(ProtocolError, match=re.escape(message)):     # the same on the HTTP doors
        chat(**fields)
    with pytest.raises(ProtocolError, match=re.escape(message)):     # and on WS/TCP
        parse_message({"type": "generate", "id": "r", "prompt": "hi", "params": fields})


@pytest.mark.parametrize("fields, param", [
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logit_bias": {"7": 500}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": ["7"]}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "8"}, "truncate_prompt_tokens"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, None),     # no single field at fault
])
def test_sampling_params_errors_name_the_field(fields, param):
    """OpenAI's error object names the field at fault in `param`."""
    with pytest.raises(ProtocolError) as info:
        sampling_params_from(fields)
    assert info.value.param == param, str(info.value)


def test_response_format_counts_as_the_guided_field_for_sampling_params_rules():
    with pytest.raises(ProtocolError, match="guided_json cannot be combined with ignore_eos"):
        chat(response_format={"type": "json_object"}, ignore_eos=True)


# --- WS / TCP generate messages -------------------------------------------------------------------


def generate(params):
    kind, msg = parse_message({"type": "generate", "id": "r1", "prompt": "hi", "params": params})
    assert kind == "generate" and msg.id == "r1"
    return msg.params


def test_generate_message_accepts_each_guided_field():
    params = generate({"guided_choice": ["yes", "no"], "temperature": 0})
    assert params.guided_choice == ("yes", "no") and params.is_guided
    assert params.output_kind == "delta" and params.temperature == 0.0
    assert generate({"guided_regex": "[0-9]{2}"}).guided_regex == "[0-9]{2}"
    assert generate({"guided_json": SCHEMA}).guided_json == SCHEMA
    assert generate({"guided_json": '{"type": "object"}'}).guided_json == '{"type": "object"}'
    assert not generate({}).is_guided


def test_generate_message_checks_guided_fields_and_knows_no_response_format():
    with pytest.raises(ProtocolError) as info:
        generate({"guided_choice": "yes"})
    assert info.value.param == "guided_choice"
    with pytest.raises(ProtocolError) as info:
        generate({"guided_json": 7})
    assert info.value.param == "guided_json"
    with pytest.raises(ProtocolError, match="unknown sampling field"):
        generate({"response_format": {"type": "json_object"}})   # an HTTP-only (OpenAI) field


@pytest.mark.parametrize("msg, match", [
    ({"type": "hello", "version": True}, "version"),            # true == 1 in Python
    ({"type": "hello", "version": 1.0}, "version"),
    ({"type": "generate", "id": "r", "prompt": "hi", "params": []}, "params"),
    ({"type": "generate", "id": "r", "prompt": "hi", "params": 0}, "params"),
    ({"type": "generate", "id": "r", "prompt": "hi", "params": ""}, "params"),
    ({"type": "generate", "id": "r", "prompt": "hi", "params": False}, "params"),
])
def test_message_fields_of_the_wrong_type_are_refused(msg, match):
    with pytest.raises(ProtocolError, match=match):
        parse_message(msg)
    assert parse_message({"type": "generate", "id": "r", "prompt": "hi", "params": None})


def test_vllm_structured_outputs_become_guided_fields():
    p = sampling_params_from({"structured_outputs": {"choice": ["a", "b"]}})
    assert p.guided_choice == ("a", "b")
    assert sampling_params_from({"structured_outputs": {"regex": "x+"}}).guided_regex == "x+"
    assert sampling_params_from({"structured_outputs": {"json": {"type": "integer"}}}
                                ).guided_json == {"type": "integer"}
    assert sampling_params_from({"structured_outputs": {"json_object": True}}
                                ).guided_json == {"type": "object"}
    assert sampling_params_from({"structured_outputs": {}}).guided_json is None
    assert sampling_params_from({"structured_outputs": {"grammar": 'root ::= "x"'}}
                                ).guided_grammar == 'root ::= "x"'
    for fields, message in [
        ({"structured_outputs": {"structural_tag": "{}"}}, "'structured_outputs.structural_tag'"),
        ({"guided_grammar": ["root ::= x"]}, "'guided_grammar' must be a string"),
        ({"structured_outputs": "x"}, "must be an object"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "cannot be combined"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "cannot be combined"),
        ({"guided_whitespace_pattern": " "}, "'guided_whitespace_pattern' is not supported"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            sampling_params_from(fields)
