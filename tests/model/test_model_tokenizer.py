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
