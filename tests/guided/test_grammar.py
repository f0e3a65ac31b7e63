"""The Rust grammar (`GuidedGrammar` / `GuidedSequence`) on SmolLM2's real vocabulary: the
allowed tokens in a state are exactly those whose bytes keep the text a prefix of some full
match, end-of-sequence exactly where the text is a full match, and bad input is a ValueError."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ferrobatch._scheduler import GuidedGrammar, TokenVocab
from ferrobatch.model.loader import _load_gguf_tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path):
    return _load_gguf_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="module")
def table(tok):
    return tok.token_byte_table(True)


@pytest.fixture(scope="module")
def vocab(table):
    return TokenVocab(table, len(table) + 7)      # 7 padding ids past the tokenizer


def test_allowed_tokens_are_exactly_the_prefix_preserving_ones(tok, table, vocab):
    pattern = "(?:yes|no|maybe)[!.]"
    language = [word + end for word in ("yes", "no", "maybe") for end in "!."]   # every match
    g = GuidedGrammar(pattern, vocab, list(tok.eos_token_ids))
    for text in ("", "y", "ye", "yes", "may", "maybe", "no!"):
        s = g.start()
        for t in tok.encode(text):
            assert s.advance(t)
        # brute force over the whole vocabulary: a token is allowed iff text + its bytes is a
        # prefix of a full match
        want = {i for i, b in enumerate(table)
                if b and any(m.encode().startswith(text.encode() + b) for m in language)}
        if text in language:
            want |= set(tok.eos_token_ids)
        assert set(s.allowed_token_ids()) == want, text
        assert s.is_accepting == (text in language)


def test_eos_only_where_the_output_is_complete(tok, vocab):
    g = GuidedGrammar("[0-9]{2,3}", vocab, list(tok.eos_token_ids))
    s = g.start()
    eos = set(tok.eos_token_ids)
    assert not eos & set(s.allowed_token_ids())
    for t in tok.encode("4"):
        assert s.advance(t)
    assert not eos & set(s.allowed_token_ids())
    for t in tok.encode("2"):
        assert s.advance(t)
    assert eos <= set(s.allowed_token_ids()) and s.is_accepting
    for t in tok.encode("7"):
        assert s.advance(t)
    # three digits: nothing but end-of-sequence can follow
    assert set(s.allowed_token_ids()) == eos
    assert s.advance(next(iter(eos))) and s.is_finished
    assert s.num_allowed == 0 and not s.advance(next(iter(eos)))


def test_a_walk_through_random_json_is_always_allowed(tok, vocab):
    pattern = r'\{"n":[ ]?-?(?:0|[1-9][0-9]{0,8}),[ ]?"s":[ ]?"[a-z ]{0,40}"\}'
    g = GuidedGrammar(pattern, vocab, list(tok.eos_token_ids))
    rng = random.Random(0)
    mask = np.zeros(vocab.vocab_size, dtype=bool)
    for _ in range(20):
        words = "".join(rng.choice("ab cde") for _ in range(rng.randint(0, 40)))
        text = f'{{"n": {rng.randint(-99999, 99999)}, "s": "{words}"}}'
        assert g.matches(text) and g.matches(text.encode())
        s = g.start()
        for t in tok.encode(text):
            count = s.write_mask(mask)
            assert mask[t] and count == int(mask.sum())
            assert s.advance(t)
        assert s.is_accepting
    assert not g.matches('{"n": 01, "s": ""}')
    assert not g.matches('{"n": 1, "s": "A"}')


def test_disallowed_tokens_are_refused_and_change_nothing(tok, vocab):
    g = GuidedGrammar("abc", vocab, list(tok.eos_token_ids))
    s = g.start()
    before = s.allowed_token_ids()
    for bad in (tok.encode("x")[0], -1, vocab.vocab_size, vocab.vocab_size - 1,
                tok.eos_token_ids[0]):
        assert not s.advance(bad)
    assert s.allowed_token_ids() == before
    c = s.copy()
    assert c.advance(tok.encode("a")[0])
    assert s.allowed_token_ids() == before, "a copy moves on its own"


def test_bad_input_is_a_value_error(tok, vocab, table):
    eos = list(tok.eos_token_ids)
    with pytest.raises(ValueError, match="unclosed group"):
        GuidedGrammar("(ab", vocab, eos)
    with pytest.raises(ValueError, match="word boundar"):
        GuidedGrammar(r"\bword", vocab, eos)
    with pytest.raises(ValueError, match="larger than"):
        GuidedGrammar("[a-z]{500}[0-9]{500}", vocab, eos, 1 << 16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        GuidedGrammar("a", vocab, [vocab.vocab_size])
    with pytest.raises(ValueError):
        TokenVocab(table, len(table) - 1)
    s = GuidedGrammar("a", vocab, eos).start()
    with pytest.raises(ValueError, match="entries"):
        s.write_mask(np.zeros(10, dtype=bool))
    with pytest.raises(ValueError, match="C-contiguous"):
        s.write_mask(np.zeros((vocab.vocab_size, 2), dtype=bool)[:, 0])
    with pytest.raises(TypeError):
        s.write_mask(np.zeros(vocab.vocab_size, dtype=np.float32))
    with pytest.raises(ValueError):
        GuidedGrammar("a", vocab, eos).matches(3)


def test_padding_and_special_ids_are_never_allowed(tok, vocab, table):
    g = GuidedGrammar("(?s:.){1,3}", vocab, list(tok.eos_token_ids))
    ids = set(g.start().allowed_token_ids())
    assert not ids & set(range(len(table), vocab.vocab_size))
    specials = {i for i, b in enumerate(table) if not b}
    assert specials and not ids & specials


def test_an_object_of_250_optional_members_compiles_and_walks(tok, vocab):
    """Many optional properties (a wide tool schema) compile within the default limits: the
    object's regex is linear in its members and nests ~2 sqrt(n) groups (the parser allows 200)."""
    from ferrobatch.guided.json_schema import schema_to_regex

    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(250)}}
    g = GuidedGrammar(schema_to_regex(schema), vocab, list(tok.eos_token_ids))

    def walk(text: str):
        s = g.start()
        return s if all(s.advance(t) for t in tok.encode(text)) else None

    for text in ('{}', '{"p0":1}', '{"p7":1,"p100":-2,"p249":30}', '{"p249":0}'):
        assert walk(text) is not None and walk(text).is_accepting, text
    for text in ('{"p100":1,"p7":1}', '{"p7":1,}', '{,"p7":1}', '{"p250":1}'):
        s = walk(text)
        assert s is None or not s.is_accepting, text


def test_the_grammar_cache_is_bounded_by_count_and_by_bytes(tok, table):
    from ferrobatch.guided.compiler import GuidedCompiler

    small = GuidedCompiler(table, len(table), list(tok.eos_token_ids), cache_size=3)
    for word in ("a", "b", "c", "d"):
        small.grammar(word)
    assert small.num_cached() == 3
    one = small.grammar("[a-z]{200}").dfa_memory_bytes
    tight = GuidedCompiler(table, len(table), list(tok.eos_token_ids), cache_bytes=2 * one + 1000)
    first = tight.grammar("[a-z]{200}")
    tight.grammar("[0-9]{200}")
    assert tight.num_cached() == 2 and tight.cached_bytes() <= tight.cache_bytes
    tight.grammar("[A-Z]{200}")                 # over the budget: the oldest goes
    assert tight.num_cached() == 2 and tight.cached_bytes() <= tight.cache_bytes
    assert tight.grammar("[a-z]{200}") is not first
    huge = GuidedCompiler(table, len(table), list(tok.eos_token_ids), cache_bytes=1)
    assert huge.grammar("abc") is huge.grammar("abc")      # the newest one always stays
