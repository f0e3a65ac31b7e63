"""Tokenizer built from GGUF metadata vs llama.cpp's own tokenization; chat template; detokenizer."""

from __future__ import annotations

import json
import os

import pytest

from ferrobatch.model.chat_template import render_chat_template
from ferrobatch.model.detokenizer import IncrementalDetokenizer

ORACLE_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                           "smollm2_tokenization.json")
ROUND_TRIP_TEXTS = [
    "Hello, world!", "1234567890", "3.14159 and 2^10 = 1024", "  double  spaces\n\n\ttab",
    "naïve café — 東京 🚀👩‍💻", "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x**2\n",
    "", " ", "\n", "a\u00a0b", "Ελληνικά και русский",
]


def _oracle_cases() -> list[dict]:
    for path in (ORACLE_PATH, "/work/shared/data/smollm2_tokenization.json"):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)["cases"]
    pytest.skip("llama.cpp tokenization oracle not available")


def test_matches_llama_cpp_on_all_oracle_strings(tokenizer):
    cases = _oracle_cases()
    assert len(cases) >= 100
    mismatches = [c["text"] for c in cases if tokenizer.encode(c["text"]) != c["ids_parse_special"]]
    assert mismatches == []
    as_text = [c["text"] for c in cases if tokenizer.encode(c["text"], parse_special=False) != c["ids"]]
    assert as_text == []
    assert any(c["ids"] != c["ids_parse_special"] for c in cases)
    # the oracle covers what matters: digits, unicode, whitespace and special tokens
    texts = "".join(c["text"] for c in cases)
    assert any(ch.isdigit() for ch in texts) and "<|im_start|>" in texts and "\t" in texts
    assert any(ord(ch) > 0x3000 for ch in texts)


def test_digits_are_isolated(tokenizer):
    ids = tokenizer.encode("12345")
    assert len(ids) == 5
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


def test_vocabulary_and_specials(tokenizer, loaded_smollm2):
    assert tokenizer.vocab_size == loaded_smollm2.config.vocab_size == 49152
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids[0] == 2
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # add_bos false
    assert tokenizer.decode([1, 28120, 2]) == tokenizer.decode([28120])  # specials skipped


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_encode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", ["a\ud800b", "\udfff", "x" * 9000 + "\ud83d"])
def test_a_lone_surrogate_is_a_value_error(tokenizer, text):
    """JSON's "\\ud800" decodes to a lone surrogate, which no tokenizer can encode: a clear
    ValueError (a 400 on every door), not the tokenizers library's TypeError (a 500)."""
    with pytest.raises(ValueError, match="lone surrogate"):
        tokenizer.encode(text)


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]}],
        add_generation_prompt=False)
    assert with_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"


@pytest.mark.parametrize("messages", [
    [], "hello", [{"role": "wizard", "content": "x"}], [{"role": "user"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], [["user", "x"]],
])
def test_chat_template_rejects_bad_messages(tokenizer, messages):
    with pytest.raises(ValueError):
        tokenizer.apply_chat_template(messages)


def test_chat_template_is_sandboxed():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError):
        render_chat_template(evil, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        render_chat_template("{{ raise_exception('nope') }}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", [
    "Hello, world! 🚀🚀 東京タワー", "naïve café — 12345", "emoji 👩‍💻 zwj", "plain ascii text here",
])
def test_incremental_pieces_join_to_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt: ")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    pieces = [detok.add(i).text for i in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_never_emits_half_a_character(tokenizer):
    # byte-level tokens of one 4-byte emoji may arrive separately: nothing until it is complete
    ids = tokenizer.encode("🦀")
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i).text for i in ids]
    assert "".join(pieces) == "🦀" and all(p in ("", "🦀") for p in pieces)
    truncated = IncrementalDetokenizer(tokenizer)
    if len(ids) > 1:
        assert all(truncated.add(i).text == "" for i in ids[:-1])
        assert truncated.flush() == tokenizer.decode(ids[:-1])  # the partial char only at the end


def test_stop_string_is_held_back_and_excluded(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    detok = IncrementalDetokenizer(tokenizer, stop=["END", "never"])
    emitted = ""
    for token in ids:
        step = detok.add(token)
        emitted += step.text
        assert "E" not in emitted.split(". ")[-1] or step.stopped
        if step.stopped:
            break
    assert step.stopped and emitted == "The answer is 42. "
    assert detok.add(ids[0]).stopped and detok.flush() == ""


def test_stop_strings_end_the_output_only_after_min_tokens(tokenizer):
    """vLLM's rule: a stop string counts only when it ends in token min_tokens + 1 or later;
    an earlier match is plain text, and a match that ends later (even one that began before)
    stops the output."""
    ids = tokenizer.encode(" stop here and stop there and more")
    def run(min_tokens):
        detok = IncrementalDetokenizer(tokenizer, stop=["stop"], min_tokens=min_tokens)
        text, n = "", 0
        for t in ids:
            n += 1
            step = detok.add(t)
            text += step.text
            if step.stopped:
                return text, n
        return text + detok.flush(), None
    assert run(0) == (" ", 1)
    first_stop_end = len(tokenizer.encode(" stop here and stop"))
    assert run(1) == (" stop here and ", first_stop_end)
    text, n = run(first_stop_end)            # both matches end too early: no stop
    assert n is None and text == tokenizer.decode(ids)


def test_partial_stop_prefix_is_released_when_disambiguated(tokenizer):
    ids = tokenizer.encode("stop at ENDING? no: at END")
    detok = IncrementalDetokenizer(tokenizer, stop=["END!"])
    emitted = "".join(detok.add(i).text for i in ids)
    assert emitted == "stop at ENDING? no: at "  # "END" may still become "END!"
    assert detok.flush() == "END"


def test_tokenizer_json_path_agrees_with_gguf_path(tokenizer, tmp_path):
    from ferrobatch.model.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
    config = {"chat_template": tokenizer.chat_template, "eos_token": "<|im_end|>",
              "bos_token": {"content": "<|im_start|>"}, "add_bos_token": False}
    from_json = Tokenizer.from_hf_files(tmp_path / "tokenizer.json", config, generation_eos_ids=[0])
    assert from_json.eos_token_id == 2 and from_json.bos_token_id == 1
    assert from_json.eos_token_ids[0] == 2 and 0 in from_json.eos_token_ids
    for case in _oracle_cases()[::7]:
        assert from_json.encode(case["text"]) == case["ids_parse_special"]
    messages = [{"role": "user", "content": "2+2?"}]
    assert from_json.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_bos_follows_the_tokenizer_json_when_the_config_does_not_say(tokenizer, tmp_path):
    """transformers adds BOS when tokenizer.json's post-processor puts it (Llama 3 has no
    add_bos_token in its config); an explicit add_bos_token wins."""
    import json

    from ferrobatch.model.tokenizer import Tokenizer

    spec = json.loads(tokenizer.backend.to_str())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                            "tokens": ["<|im_start|>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    tok = Tokenizer.from_hf_files(tmp_path / "tokenizer.json", config)
    assert tok.add_bos_token and tok.encode("Hi", add_special_tokens=True)[0] == 1
    assert tok.encode("Hi") == tokenizer.encode("Hi")              # none unless asked
    off = Tokenizer.from_hf_files(tmp_path / "tokenizer.json", {**config, "add_bos_token": False})
    assert not off.add_bos_token
    (tmp_path / "plain.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
    assert not Tokenizer.from_hf_files(tmp_path / "plain.json", config).add_bos_token


# -- the token byte table (fast incremental detokenization) ----------------------------------

class _WithoutByteTable:
    """The same tokenizer, seen without its byte table: forces the general detokenizer."""

    def __init__(self, tokenizer):
        self._t = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self._t.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(detok, ids):
    steps = [detok.add(i) for i in ids]
    return [s.text for s in steps], [s.stopped for s in steps], detok.flush()


@pytest.mark.parametrize("skip", [True, False])
def test_byte_table_is_proven_for_the_shipped_tokenizer(tokenizer, skip):
    table = tokenizer.token_byte_table(skip)
    assert table is not None and len(table) == tokenizer.vocab_size
    assert table is tokenizer.token_byte_table(skip)          # built once
    end = tokenizer.backend.token_to_id("<|im_end|>")
    assert table[end] == (b"" if skip else b"<|im_end|>")
    assert table[tokenizer.encode(" hello")[0]] == b" hello"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip", [True, False])
def test_fast_detokenizer_matches_the_general_one_on_random_ids(tokenizer, seed, skip):
    # random ids hit partial UTF-8 byte tokens, special tokens and invalid byte runs
    import random
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    ids = [rng.randrange(vocab) for _ in range(200)]
    # and runs of single-byte tokens that split multi-byte characters in every way
    ids += tokenizer.encode("東京 🦀 naïve") + [rng.randrange(vocab) for _ in range(50)]
    stop = [tokenizer.decode(ids[100:103], skip_special_tokens=skip)[:3] or "zz"]
    fast = IncrementalDetokenizer(tokenizer, stop=stop, skip_special_tokens=skip)
    slow = IncrementalDetokenizer(_WithoutByteTable(tokenizer), stop=stop,
                                  skip_special_tokens=skip)
    assert fast._utf8 is not None and slow._utf8 is None
    # the same text and the same stop; only *when* an invalid byte's U+FFFD is released may differ
    # (the general path holds a trailing U+FFFD back one token, the byte table need not)
    (fp, fs, ft), (sp, ss, st) = _stream(fast, ids), _stream(slow, ids)
    assert "".join(fp) + ft == "".join(sp) + st
    assert any(fs) == any(ss)
    whole = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces, _, tail = _stream(whole, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", ["Hello, world! 🚀🚀 東京タワー", "emoji 👩‍💻 zwj 🦀", "a\n\tb  c"])
def test_fast_detokenizer_is_never_later_than_the_general_one(tokenizer, text):
    ids = tokenizer.encode(text)
    stop = ["タワ"]
    fp, fs, ft = _stream(IncrementalDetokenizer(tokenizer, stop=stop), ids)
    sp, ss, st = _stream(IncrementalDetokenizer(_WithoutByteTable(tokenizer), stop=stop), ids)
    assert "".join(fp) + ft == "".join(sp) + st and fs == ss
    assert all("\ufffd" not in p for p in fp)
    for k in range(len(ids)):              # after every token, at least as much text is out
        assert "".join(fp[:k + 1]).startswith("".join(sp[:k + 1]))


def test_byte_table_refused_for_a_non_byte_level_decoder():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from ferrobatch.model.token_bytes import build_token_byte_table

    backend = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    assert build_token_byte_table(backend, True) is None


def test_byte_table_refused_when_a_token_disagrees_with_decode():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from ferrobatch.model.token_bytes import build_token_byte_table

    vocab = {"a": 0, "Ġb": 1}
    backend = HFTokenizer(models.BPE(vocab, []))
    backend.decoder = decoders.ByteLevel()
    assert build_token_byte_table(backend, True) == [b"a", b" b"]
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert build_token_byte_table(backend, True) is None      # not plain byte-level


@pytest.mark.parametrize("general", [False, True])
def test_add_many_equals_the_joined_pieces(tokenizer, general):
    import random
    rng = random.Random(7)
    ids = tokenizer.encode("Prefix 東京 🦀 x") + [rng.randrange(tokenizer.vocab_size)
                                                   for _ in range(120)]
    tok = _WithoutByteTable(tokenizer) if general else tokenizer
    one = IncrementalDetokenizer(tok, prompt_token_ids=[42, 43])
    joined = "".join(one.add(i).text for i in ids) + one.flush()
    many = IncrementalDetokenizer(tok, prompt_token_ids=[42, 43])
    chunks = [ids[:5], ids[5:6], [], ids[6:70], ids[70:]]
    assert "".join(many.add_many(c) for c in chunks) + many.flush() == joined
    assert joined == tokenizer.decode(ids)
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, stop=["x"]).add_many(ids)


def test_long_texts_encode_exactly_like_short_ones(tokenizer):
    """Texts of LONG_TEXT_CHARS or more go through the GIL-releasing batch encode: the ids must
    be the very ids of the plain encode, special-token text and all."""
    from ferrobatch.model.tokenizer import LONG_TEXT_CHARS

    pieces = ["Hello, world! ", "<|im_start|>user\n", "naïve café 東京 🙂 ", "  \t\n", "x=1+2; ",
              "<|im_end|>\n", "1234567890 "]
    text = "".join(pieces[i % len(pieces)] for i in range(LONG_TEXT_CHARS // 8))
    assert len(text) >= LONG_TEXT_CHARS
    backend = tokenizer.backend
    assert tokenizer.encode(text) == backend.encode(text, add_special_tokens=False).ids
    plain = tokenizer.encode(text, parse_special=False)      # special text as plain text
    assert plain == tokenizer._plain_text_backend.encode(text, add_special_tokens=False).ids
    assert len(plain) > len(tokenizer.encode(text))
    assert tokenizer.encode(text[:LONG_TEXT_CHARS - 1]) == \
        backend.encode(text[:LONG_TEXT_CHARS - 1], add_special_tokens=False).ids


def test_tools_and_tool_messages_reach_a_template_that_renders_them():
    """Templates of tool-calling models render `tools`, assistant `tool_calls`, `tool_call_id`
    and `name`; the engine keeps them (they were dropped before the template saw them)."""
    from ferrobatch.engine.inputs import normalize_messages

    source = ("{% if tools %}TOOLS:{{ tools | map(attribute='function') | map(attribute='name')"
              " | join(',') }};{% endif %}{% for m in messages %}{{ m.role }}"
              "{% if m.name %}({{ m.name }}){% endif %}:{{ m.content }}"
              "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}"
              "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %};{% endfor %}")
    messages = normalize_messages([
        {"role": "user", "content": "weather?", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ])
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    assert render_chat_template(source, messages, tools=tools) == \
        "TOOLS:get;user(bob):weather?;assistant:[call get];tool:sunny[for c1];"
    with pytest.raises(ValueError, match="tool_calls must be a list"):
        normalize_messages([{"role": "assistant", "content": "", "tool_calls": "x"}])


def test_reasoning_content_of_earlier_turns_reaches_the_template():
    """A reasoning model's template may render an assistant turn's `reasoning_content` (what a
    reasoning parser served as such); it is kept, and must be text."""
    from ferrobatch.engine.inputs import normalize_messages

    source = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>"
              "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }};{% endfor %}")
    messages = normalize_messages([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"}])
    assert render_chat_template(source, messages) == "user:2+2?;assistant:<think>add them</think>4;"
    with pytest.raises(ValueError, match="reasoning_content must be a str"):
        normalize_messages([{"role": "assistant", "content": "", "reasoning_content": 1}])


def test_template_variables_may_have_any_name():
    assert render_chat_template("{{ source }}-{{ extra }}", [{"role": "user", "content": "x"}],
                                source=1, extra=2) == "1-2"


def test_continue_final_message_cuts_after_the_text_not_inside_the_closing_tag(tokenizer):
    """The final text "end" also occurs in ChatML's closing "<|im_end|>": the cut must come
    right after the message's own text."""
    from ferrobatch.engine.async_engine import AsyncEngine

    class Core:            # render_chat needs only the tokenizer
        pass

    engine = AsyncEngine.__new__(AsyncEngine)
    engine._core = Core()
    engine._core.tokenizer = tokenizer
    for final in ("end", "e", "im", "Sure, the colour is"):
        text = engine.render_chat([{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": final}],
                                  add_generation_prompt=False, continue_final_message=True)
        assert text.endswith("<|im_start|>assistant\n" + final), text


@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("llama3", True),
                                        ("qwen2", False), ("deepseek-r1-qwen", False),
                                        ("tekken", True), ("gpt-4o", False)])
def test_llama3_vocabularies_take_a_word_that_is_a_token_whole(pre, whole):
    """llama.cpp's "llama-bpe" (Llama 3's tokenizer.json: "ignore_merges": true) takes a word
    found in the vocabulary as one token even where the merges would not build it; other
    pre-tokenizers merge. "deepseek-r1-qwen" splits as "qwen2"."""
    from tokenizers.pre_tokenizers import ByteLevel

    from ferrobatch.model.gguf_loader import GGUFTokenizerMetadata
    from ferrobatch.model.tokenizer import Tokenizer

    alphabet = sorted(ByteLevel.alphabet())
    tokens = [*alphabet, "ab", "abc", "Ġab"]
    meta = GGUFTokenizerMetadata(model="gpt2", pre=pre, tokens=tokens, token_types=[],
                                 merges=["a b", "Ġ ab"], bos_token_id=None, eos_token_id=None,
                                 add_bos_token=False, chat_template=None)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode("abc ab")]
    assert pieces == (["abc", "Ġab"] if whole else ["ab", "c", "Ġab"])


# text -> the pieces each split gives it (Ġ is the byte-level space, Ċ the newline): Tekken
# splits cased words at their capitals, keeps contractions apart and digits single; GPT-4o's
# o200k attaches contractions and groups digits in threes; Llama 3 keeps a word whole
_SPLITS = {
    "HelloWorld": {"tekken": ["Hello", "World"], "gpt-4o": ["Hello", "World"],
                   "llama3": ["HelloWorld"]},
    "I'm here": {"tekken": ["I", "'m", "Ġhere"], "gpt-4o": ["I'm", "Ġhere"],
                 "llama3": ["I", "'m", "Ġhere"]},
    "12345": {"tekken": ["1", "2", "3", "4", "5"], "gpt-4o": ["123", "45"],
              "llama3": ["123", "45"]},
    "a/b/\n": {"tekken": ["a", "/b", "/Ċ"], "gpt-4o": ["a", "/b", "/Ċ"],
               "llama3": ["a", "/b", "/Ċ"]},
    "XMLHttp": {"tekken": ["XMLHttp"], "gpt-4o": ["XMLHttp"], "llama3": ["XMLHttp"]},
    "CAPS lock": {"tekken": ["CAPS", "Ġlock"], "gpt-4o": ["CAPS", "Ġlock"],
                  "llama3": ["CAPS", "Ġlock"]},
}


@pytest.mark.parametrize("text", sorted(_SPLITS))
def test_tekken_and_gpt_4o_vocabularies_split_words_as_their_models_do(text):
    """Mistral NeMo's "tekken" and Phi-4-mini's "gpt-4o" pre-tokenizers (refused before):
    the splits that tell them apart from each other and from Llama 3's."""
    from ferrobatch.model.tokenizer import _byte_level_pre_tokenizer

    for pre, want in _SPLITS[text].items():
        pieces = [piece for piece, _ in _byte_level_pre_tokenizer(pre).pre_tokenize_str(text)]
        assert pieces == want, pre


@pytest.mark.parametrize("pre, bos", [("tekken", True), ("llama-bpe", True), ("gpt-4o", False),
                                      ("qwen2", False), (None, False)])
def test_tekken_and_llama3_vocabularies_start_with_bos_where_the_file_does_not_say(
        tmp_path, pre, bos):
    """llama.cpp's default without ``tokenizer.ggml.add_bos_token``: BOS for Llama 3's and
    Tekken's byte-level vocabularies, none for the others."""
    import gguf

    from ferrobatch.model.gguf_file import GGUFFile
    from ferrobatch.model.gguf_loader import read_tokenizer_metadata

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<s>", "a"])
    writer.add_bos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_tokenizer_metadata(GGUFFile(str(path))).add_bos_token == bos
