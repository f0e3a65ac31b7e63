"""A JSON Schema string `pattern` -> the regex over the string's JSON text
(ferrobatch.guided.string_pattern), checked with Python's `re` and with the Rust grammar.

The `pattern` cases reached through `schema_to_regex` are in test_json_schema.py; these call the
entry function directly.
"""

from __future__ import annotations

import json
import re

import pytest
from test_json_schema import assert_dialect

from ferrobatch._scheduler import GuidedGrammar, TokenVocab
from ferrobatch.guided.json_schema import GuidedSchemaError, schema_to_regex
from ferrobatch.guided.string_pattern import pattern_to_json_string_regex

BYTE_EOS = 256


@pytest.fixture(scope="module")
def byte_vocab():
    """One token per byte, plus an end-of-sequence token: the grammar sees the text byte by byte."""
    return TokenVocab([bytes([b]) for b in range(256)] + [b""], 257)


def translate(pattern: str) -> str:
    regex = pattern_to_json_string_regex(pattern)
    assert_dialect(regex)
    return regex


def json_text(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def test_result_is_the_quoted_pattern():
    assert translate("ab") == '"(?:ab)"'
    assert translate("^a|b$") == '"(?:a|b)"'            # the anchors are dropped
    assert translate("x{2,}?y??") == '"(?:x{2,}y?)"'     # lazy repeats match the same strings


@pytest.mark.parametrize("pattern, good, bad", [
    ("^[A-Z]{2}(?:-[0-9]{3})+$", ["AB-123", "XY-000-999"], ["AB", "ab-123", "AB-123x", "xAB-123"]),
    (r"\x41\u00e9\n\t\"", ['Aé\n\t"'], ['Ae\n\t"', "Aé\n\t", 'Aé\n\t"x']),
    (r"[^\n]*", ["", 'a"b\\c\t\x01', "漢"], ["a\nb", "\n"]),
    (r"[\x00-\x1f]+", ["\x01\n\x1f", "\x00"], ["", "a", " ", "\x01 "]),
    ("[^@]+@[^@]+", ["a@b", 'q"t@b\\c', "x\ny\x01@\t"], ["@b", "a@", "a@b@c"]),
    (r"x\$", ["x$"], ["x", "x\\"]),
    (r"x\\$", ["x\\"], ["x\\$", "x"]),                 # an escaped backslash, then the anchor
    ("(?:a|b|)c?", ["", "c", "ac", "b"], ["abc", "cc"]),
    ("é漢😀+", ["é漢😀", "é漢😀😀"], ["é漢", "e漢😀"]),
    (r"[ -~\&\-]{1,3}", ["a", '"', "\\", "~&-"], ["", "abcd", "é"]),
    ("a{1024}", ["a" * 1024], ["a" * 1023, "a" * 1025]),
])
def test_python_and_rust_agree_on_the_json_texts(byte_vocab, pattern, good, bad):
    regex = translate(pattern)
    grammar = GuidedGrammar(regex, byte_vocab, [BYTE_EOS])
    for value in good:
        text = json_text(value)
        assert re.fullmatch(regex, text), text
        assert grammar.matches(text), text
        assert re.fullmatch(pattern, value)              # the pattern itself, on the decoded text
    for value in bad:
        text = json_text(value)
        assert not re.fullmatch(regex, text), text
        assert not grammar.matches(text), text


def test_characters_json_must_escape_appear_only_as_canonical_escapes():
    quote = translate('"')
    assert re.fullmatch(quote, r'"\""')
    for text in ['"""', r'"\u0022"']:
        assert not re.fullmatch(quote, text), text
    newline = translate(r"\n")
    assert re.fullmatch(newline, r'"\n"')
    for text in ['"\n"', r'"\u000a"', r'"\\n"']:
        assert not re.fullmatch(newline, text), text
    slash = translate("/")
    assert re.fullmatch(slash, '"/"') and not re.fullmatch(slash, r'"\/"')


def test_a_negated_class_never_admits_raw_quotes_backslashes_or_controls():
    regex = translate("[^a]")
    for text in ['"""', '"\\"', '"\n"', '"\x00"', '"a"']:
        assert not re.fullmatch(regex, text), repr(text)
    for text in [r'"\""', r'"\\"', r'"\n"', r'"\u0000"', '"b"', '"é"']:
        assert re.fullmatch(regex, text), text
    no_quote = translate('[^"]')
    assert not re.fullmatch(no_quote, r'"\""')
    assert re.fullmatch(no_quote, r'"\\"')


@pytest.mark.parametrize("pattern, what", [
    ("a.c", "'.'"),
    ("a{1025}", "a repetition above 1024"),
    ("a{3,2}", "m > n"),
    ("a{2}{3}", "a repeated repetition"),
    ("[z-a]", "a reversed range"),
    (r"\ud800", "a surrogate code point"),
    ("a\\", "a trailing backslash"),
    (r"\x4", "without 2 hex digits"),
    ("(?:a", "unclosed '('"),
    ("[]", "an unclosed '['"),
])
def test_errors_name_the_path_the_construct_and_the_pattern(pattern, what):
    with pytest.raises(GuidedSchemaError) as info:
        pattern_to_json_string_regex(pattern, "$.properties.code.pattern")
    message = str(info.value)
    assert message.startswith("unsupported construct in 'pattern' at $.properties.code.pattern: ")
    assert what in message
    assert message.endswith(f"(pattern {pattern!r})")


def test_schema_to_regex_delegates_with_the_pattern_path():
    pattern = "^[a-f]{2}(?:-[0-9]+)?$"
    assert schema_to_regex({"type": "string", "pattern": pattern}) == translate(pattern)
    schema = {"type": "object", "properties": {"k x": {"type": "string", "pattern": "a.c"}}}
    with pytest.raises(GuidedSchemaError, match=re.escape("""at $.properties["k x"].pattern:""")):
        schema_to_regex(schema)
