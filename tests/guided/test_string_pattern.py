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
    (r"^\d{3}-\d{4}$", ["555-1234", "000-0000"],
     ["555-123", "5551234", "555-12345", "\u0663\u0663\u0663-1234", "abc-defg", "555-1234\n"]),
    ("^[A-Z][a-z]+$", ["Mari", "Ab"], ["mari", "A", "MAri", "R\u00e9", "Ab "]),
    (r"^(\+|00)[0-9 ]+$", ["+372 555", "00 1"], ["+", "0 1", "+1a", "+1\t", "++1"]),
    ("^.+@.+$", ["a@b", 'q"t@b\\c', "\t\x01@\u00e9", "a@b@c", "\x7f@\u2027"],
     ["@b", "a@", "a\n@b", "a\r@b", "a@\u2028", "\u2029@b"]),
    (r"[\w.-]+@(?P<host>[^\s@]+)", ["a.b-c_9@x.y", 'a@"q\\', "a@\u00a0\x01"],
     ["a b@x", "a@x y", "\u00e9@x", "a@x\n", "a@b@c", "a@x\x0b"]),
    (r"\S+\s\S+", ['"a"\t\\b', "\u00e9\x01 \u6f22", "a\x0bb"], ["a  b", "a b c", "ab", "a\u00a0b"]),
    (r"\D\W", ['x"', "\u00e9\n", "\\\\", "a\u00e9"], ["1!", "a_", "ab", "x"]),
    (r"(?P<a>x)(y|z)", ["xy", "xz"], ["x", "xyz", "y"]),
    (r"[\n]+", ["\n", "\n\n"], ["", "\nn", "n"]),                 # an escape, repeated whole
])
def test_python_and_rust_agree_on_the_json_texts(byte_vocab, pattern, good, bad):
    regex = translate(pattern)
    grammar = GuidedGrammar(regex, byte_vocab, [BYTE_EOS])
    for value in good:
        text = json_text(value)
        assert re.fullmatch(regex, text), text
        assert grammar.matches(text), text
        assert re.fullmatch(pattern, value, re.ASCII)    # the pattern itself, on the decoded text
    for value in bad:
        text = json_text(value)
        assert not re.fullmatch(regex, text), text
        assert not grammar.matches(text), text


# single characters the comparisons below combine: ASCII classes, JSON's escaped characters,
# other whitespace and digits (non-ASCII: outside \s and \d here), non-ASCII letters
PROBE_CHARS = [
    "a", "Z", "_", "0", "9", " ", "-", ".", "@", "+", "/", '"', "\\", "\t", "\n", "\r", "\f",
    "\v", "\x00", "\x01", "\x08", "\x1f", "\x7f", "\u00a0", "\u00e9", "\u00df", "\u0663",
    "\u2028", "\u2029", "\u6f22", "\uff21", "\U0001f600",
]
PROBES = ["", *PROBE_CHARS, *(a + b for a in PROBE_CHARS for b in PROBE_CHARS)]
# where `.` appears, the reference spells out ECMA-262's '.', which Python's does not match
ECMA_DOT = "[^\\n\\r\u2028\u2029]"


@pytest.mark.parametrize("pattern, reference, extra", [
    (r"\d", None, []),
    (r"\D", None, []),
    (r"\w", None, []),
    (r"\W", None, []),
    (r"\s", None, []),
    (r"\S", None, []),
    (r"\s*", None, ["\t\n\r\f\v ", " \x0b\x0c"]),
    (r"\S\S?", None, []),
    (r"\W+", None, ['"\\\n\x00', '\u00e9"\u6f22']),
    (r"\D{2}", None, []),
    (r"[\d.-]+", None, ["3.14", "-1.5e3", "1-2-3"]),
    (r"[^\s@]+", None, ["user.name", 'q"\\', "a@b"]),
    (r"[^\d\s]", None, []),
    (r"[\w\s]", None, []),
    (r"[^\W_]{1,2}", None, []),
    (r"[\D\d]", None, []),                        # every character
    (r"[\S\n]", None, []),                        # all but \t \r \f \v and space
    (r"[\Wa]", None, []),
    (r"[^\Sa-c]", None, []),                       # whitespace
    (r"^\d{3}-\d{4}$", None, ["555-1234", "555-123", "5551-234", "\u0663\u0663\u0663-1234"]),
    (r"^(\+|00)[0-9 ]+$", None, ["+372 555", "00 1", "+", "0 1", "+1a"]),
    (r"(?P<year>\d{4})-(?<m>\d\d)", r"(?P<year>\d{4})-(?P<m>\d\d)",
     ["2024-05", "2024-5", "20245-05", "2024-05x"]),
    (r"(a|\s)(\W)?", None, []),
    (".", ECMA_DOT, []),
    (".?.", f"{ECMA_DOT}?{ECMA_DOT}", []),
    ("^.+@.+$", f"{ECMA_DOT}+@{ECMA_DOT}+", ["a@b", 'q"t@b\\c', "a\n@b", "a@\u2028", "a\r\n@b"]),
    (r"[.]\.", None, []),                            # an escaped or class '.' is a literal
])
def test_matches_the_decoded_strings_the_pattern_matches_in_ascii_mode(pattern, reference, extra):
    """Over pairs of tricky characters, the translation accepts the JSON text of a string exactly
    when Python's `re` (ASCII mode) fully matches the string against the pattern."""
    regex = translate(pattern)
    expected_pattern = re.compile(reference or pattern, re.ASCII)
    outcomes = set()
    for value in PROBES + extra:
        expected = expected_pattern.fullmatch(value) is not None
        assert (re.fullmatch(regex, json_text(value)) is not None) == expected, (value, expected)
        outcomes.add(expected)
    assert outcomes == {True, False}            # the probes tell a right translation from a wrong one


def test_dot_is_ecma_262s_any_character_but_line_terminators():
    regex = translate(".")
    for value in ["a", " ", '"', "\\", "\t", "\x00", "\x0b", "\x1f", "\x7f", "\u00e9", "\u0085",
                  "\u2027", "\u202a", "\U0001f600"]:
        assert re.fullmatch(regex, json_text(value)), value
    for value in ["\n", "\r", "\u2028", "\u2029", "", "ab"]:
        assert not re.fullmatch(regex, json_text(value)), value


def test_class_escapes_are_ascii():
    digit, word, space = translate(r"\d"), translate(r"\w"), translate(r"\s")
    for value in ["\u0663", "\uff11", "\u00b2"]:           # non-ASCII digits
        assert not re.fullmatch(digit, json_text(value)), value
        assert not re.fullmatch(word, json_text(value)), value
        assert re.fullmatch(translate(r"\D"), json_text(value)), value
    for value in ["\u00e9", "\u00df", "\u6f22"]:
        assert not re.fullmatch(word, json_text(value)), value
        assert re.fullmatch(translate(r"\W"), json_text(value)), value
    for value in ["\u00a0", "\u2028", "\u3000", "\x1c"]:    # Unicode (not ASCII) whitespace
        assert not re.fullmatch(space, json_text(value)), value
        assert re.fullmatch(translate(r"\S"), json_text(value)), value
    assert translate(r"\d") == '"(?:[0-9])"'
    assert translate(r"\w") == '"(?:[0-9A-Z_a-z])"'


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
    for pattern in [r"\D", r"\W", r"\S", ".", r"[^\s@]", r"[\D\d]", r"[^\w]"]:
        regex = translate(pattern)
        for text in ['"""', '"\\"', '"\n"', '"\t"', '"\x00"', '"\x1f"']:
            assert not re.fullmatch(regex, text), (pattern, text)
        assert re.fullmatch(regex, r'"\""') and re.fullmatch(regex, r'"\\"'), pattern
    no_quote = translate('[^"]')
    assert not re.fullmatch(no_quote, r'"\""')
    assert re.fullmatch(no_quote, r'"\\"')


@pytest.mark.parametrize("pattern, what", [
    ("(?=a)a", "a lookahead '(?=...)'"),
    ("a(?!b)", "a negative lookahead '(?!...)'"),
    ("(?<=a)b", "a lookbehind '(?<=...)'"),
    ("(?<!a)b", "a negative lookbehind '(?<!...)'"),
    (r"(a)\1", r"the backreference '\1'"),
    (r"(?<n>a)\k<n>", r"the backreference '\k<name>'"),
    ("(?P<n>a)(?P=n)", "a backreference '(?P=name)'"),
    (r"a\b", r"the word boundary '\b'"),
    (r"a\B", r"the word boundary '\B'"),
    (r"[\b]", r"'\b' inside a character class"),
    (r"\Aa", r"the anchor '\A'"),
    (r"\p{L}", r"the Unicode property class '\p{...}'"),
    (r"[\P{L}]", r"the Unicode property class '\P{...}'"),
    ("(?i)a", "inline flags '(?i...)'"),
    ("(?i:a)", "inline flags '(?i...)'"),
    ("(?#note)a", "a group other than '(...)', '(?:...)'"),
    ("(?P>n)", "a group other than '(...)', '(?:...)'"),
    ("(?<1a>x)", "a group name that is not an identifier"),
    ("(?P<n", "a group name that is not an identifier"),
    (r"[\d-z]", r"a class escape like '\d' as a range end"),
    (r"[a-\w]", r"a class escape like '\d' as a range end"),
    (r"[^\s\S]", "a character class that matches no character"),
    (r"\cA", r"the escape '\c'"),
    ("(a", "unclosed '('"),
    ("a^", "the anchor '^'"),
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
    pydantic = r"^\d{3}-\d{4}$"                        # constr(pattern=...)
    assert schema_to_regex({"type": "string", "pattern": pydantic}) == '"(?:[0-9]{3}\\-[0-9]{4})"'
    schema = {"type": "object", "properties": {"k x": {"type": "string", "pattern": "a(?=c)"}}}
    with pytest.raises(GuidedSchemaError, match=re.escape("""at $.properties["k x"].pattern:""")):
        schema_to_regex(schema)
