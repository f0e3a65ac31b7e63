"""GBNF grammars (guided/gbnf.py): what is read, what the regex accepts and refuses (in Python's
`re` and in the Rust DFA the engine compiles), recursion bounded, and clear errors with the
line and column."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrobatch._scheduler import GuidedGrammar, TokenVocab
from ferrobatch.guided.gbnf import GrammarError, gbnf_to_regex
from ferrobatch.model.loader import _load_gguf_tokenizer
from ferrobatch.sampling_params import SamplingParams

ANSWER = r'''
# a comment line
root   ::= answer "."          # trailing comment
answer ::= "yes" | "no" | number
number ::= "-"? [0-9]+ ("." [0-9]{1,3})?
'''

JSONISH = r'''
root   ::= value
value  ::= object | array | string | number | "true" | "false" | "null"
object ::=
  "{" ws (
      pair
      ( "," ws pair )*
  )? "}"
pair   ::= string ":" ws value ws
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\/nt] )* "\""
number ::= "-"? [0-9]+
ws     ::= [ \t\n]?
'''


def full(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


@pytest.mark.parametrize("grammar, good, bad", [
    (ANSWER, ["yes.", "no.", "12.", "-3.25.", "0.5."], ["maybe.", "yes", "1.2345.", "--1.", ""]),
    (JSONISH, ['{"a": [1, -2, {"b": null}]}', "[]", '"x\\n"', "[[[1]]]", '{"k":"v"}'],
     ['{"a":1,}', "[1 2]", '"\x01"', "[[[[1]]]]", "tru"]),
    # a class with escapes, ranges, a literal '-' at the end, negation, any character
    (r'root ::= [\x41-\x43\]\-] [^a-z] . "\u00e9"', ["A]xé", "C-\né", "]Zxé"],
     ["D]xé", "Aaxé", "Axé"]),
    # repetitions: exact, at least, between, and alternatives over lines after '|'
    (r'''root ::= "a"{3} "b"{2,} "c"{0,2} |
    "z"''', ["aaabb", "aaabbbcc", "z"], ["aabb", "aaab", "aaabbccc", "az"]),
    # an empty alternative, and a rule used before it is defined
    (r'''root ::= "<" opt ">"
opt ::= "x" | ''', ["<x>", "<>"], ["<xx>"]),
])
def test_the_regex_accepts_exactly_the_grammar(grammar, good, bad):
    regex = gbnf_to_regex(grammar)
    for text in good:
        assert full(regex, text), (text, regex)
    for text in bad:
        assert not full(regex, text), (text, regex)


def test_recursion_is_expanded_max_depth_deep():
    nest = 'root ::= "(" root ")" | "x"'
    for depth, deepest in ((1, "(x)"), (3, "(((x)))")):       # root inside itself d times
        regex = gbnf_to_regex(nest, max_depth=depth)
        assert full(regex, deepest) and not full(regex, "(" + deepest + ")")
    # a rule that cannot end without recursing has no text at any depth
    with pytest.raises(GrammarError, match="cannot end"):
        gbnf_to_regex('root ::= "(" root ")"')


@pytest.mark.parametrize("grammar, message", [
    ("", "non-empty"),
    ('answer ::= "x"', "no 'root' rule"),
    ('root ::= thing', "undefined rule 'thing' at line 1, column 10"),
    ('root ::= "a"\nroot ::= "b"', "defined twice at line 2, column 1"),
    ('root ::= "a', "missing closing"),
    (r'root ::= "\q"', "unknown escape \\q"),
    (r'root ::= "\xZZ"', "bad \\x escape"),
    ("root ::= [z-a]", "reversed"),
    ("root ::= []", "matches nothing"),
    ('root ::= "a"{3,1}', "fewer times"),
    ('root ::= "a"{2000}', "at most 1024"),
    ('root ::= * "a"', "repeats nothing"),
    ('root "a"', "expected '::='"),
    ('root ::= ("a" | "b"', "expected ')'"),
    ('root ::= "a" )', "end of the line"),
])
def test_bad_grammars_say_what_and_where(grammar, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        gbnf_to_regex(grammar)
    with pytest.raises(ValueError):                 # a GrammarError is a ValueError (a 400)
        gbnf_to_regex(grammar)


def test_sampling_params_take_one_grammar():
    p = SamplingParams(guided_grammar=ANSWER)
    assert p.is_guided
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams(guided_grammar=ANSWER, guided_regex="x")
    with pytest.raises(ValueError, match="non-empty GBNF"):
        SamplingParams(guided_grammar="  ")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(guided_grammar=ANSWER, ignore_eos=True)


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path):
    return _load_gguf_tokenizer(smollm2_gguf_path)


def test_the_rust_dfa_reads_the_regex_the_same(tok):
    """The regex dialect: the Rust DFA compiles it and accepts / refuses what Python's re does
    (classes with control characters, `(?s:.)`, non-ASCII)."""
    table = tok.token_byte_table(True)
    vocab = TokenVocab(table, len(table))
    for grammar, texts in ((JSONISH, ['{"a": [1, {"b": "x\\n"}]}', '{"a":1,}', "[[[1]]]",
                                      "[[[[1]]]]"]),
                           (r'root ::= [^a-z] . "é" [\t ]', ["A\né\t", "Zxé ", "axé "])):
        regex = gbnf_to_regex(grammar)
        g = GuidedGrammar(regex, vocab, list(tok.eos_token_ids))
        for text in texts:
            s = g.start()
            ok = all(s.advance(t) for t in tok.encode(text)) and s.is_accepting
            assert ok == full(regex, text), (grammar, text)


def test_deep_or_huge_input_is_refused_not_crashing():
    with pytest.raises(GrammarError, match="nest deeper"):
        gbnf_to_regex("root ::= " + "(" * 5000 + '"a"' + ")" * 5000)
    chain = "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(3000)) + '\nr3000 ::= "y"'
    with pytest.raises(GrammarError, match="inside each other"):
        gbnf_to_regex("root ::= r0\n" + chain)
    doubling = "\n".join(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(40)) + '\nr40 ::= "ab"'
    with pytest.raises(GrammarError, match="regex passes"):
        gbnf_to_regex("root ::= r0\n" + doubling)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('root::=|()[]^-"\\*+?{},.ab019 \n#xu')),
               max_size=80))
def test_any_text_gives_a_regex_or_a_grammar_error(text):
    try:
        regex = gbnf_to_regex(text)
    except GrammarError:
        return
    re.compile(regex)                        # and what it gives is a valid pattern
