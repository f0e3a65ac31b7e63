"""GGUF SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``): a BPE model trained by
the sentencepiece library on this README, written into a GGUF file as llama.cpp's converter
writes one (pieces, scores, token types), tokenizes every test string exactly as sentencepiece
itself does (the oracle llama.cpp's tokenizer follows), and decodes back."""

from __future__ import annotations

import io
import os

import pytest

from ferrobatch.model.loader import load_tokenizer

spm = pytest.importorskip("sentencepiece")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
TEXTS = [
    "Hello world", "Hello  world", "  leading spaces", "trailing spaces   ", "", " ", "\n",
    "tabs\tand\nnew\n\nlines", "naïve café, Größe, ÿ", "emoji 😀 and ✓ marks", "中文字符",
    "numbers 12345 and 3.14159", "x" * 300, "mixed: <b>html</b> & {json: [1, 2]}",
    "The engine re-forms the batch at every decoding step; finished sequences leave.",
    "def f(x):\n    return x ** 2  # comment",
]


def _train(vocab_size: int, dummy_prefix: bool = True):
    with open(README, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        add_dummy_prefix=dummy_prefix, remove_extra_whitespaces=False, split_digits=True,
        character_coverage=0.999, allow_whitespace_only_pieces=True, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _write_vocab_gguf(path, sp, *, add_space_prefix: bool | None = None) -> None:
    """A GGUF holding ``sp``'s vocabulary as llama.cpp's converter writes it (no weights)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    _add_vocabulary(writer, sp, add_space_prefix=add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_vocabulary(writer, sp, *, add_space_prefix: bool | None = None) -> None:
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        pieces.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else
                     6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)


@pytest.fixture(scope="module", params=[500, 4000], ids=["vocab500", "vocab4000"])
def pair(request, tmp_path_factory):
    sp = _train(request.param)
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    _write_vocab_gguf(path, sp)
    return sp, load_tokenizer(str(path))


def test_ids_equal_sentencepiece(pair):
    sp, tokenizer = pair
    for text in TEXTS:
        assert tokenizer.encode(text) == sp.encode(text), text


def test_ids_equal_sentencepiece_on_the_readme_line_by_line(pair):
    sp, tokenizer = pair
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()[:400]
    mismatched = [line for line in lines if tokenizer.encode(line) != sp.encode(line)]
    assert not mismatched, mismatched[:3]


def test_decode_gives_the_text_back_and_bos_comes_first(pair):
    sp, tokenizer = pair
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == sp.decode(ids) == text
    # llama.cpp's default for SentencePiece vocabularies: BOS first; <s> in text is the special
    assert tokenizer.add_bos_token and tokenizer.encode("Hi", add_special_tokens=True)[0] == sp.bos_id()
    assert tokenizer.encode("<s>Hi") == [sp.bos_id(), *sp.encode("Hi")]
    assert tokenizer.eos_token_id == sp.eos_id()


def test_without_the_space_prefix(tmp_path):
    """``tokenizer.ggml.add_space_prefix = false``: no ``▁`` in front (a model trained without
    SentencePiece's dummy prefix is the oracle)."""
    sp = _train(500, dummy_prefix=False)
    path = tmp_path / "vocab.gguf"
    _write_vocab_gguf(path, sp, add_space_prefix=False)
    tokenizer = load_tokenizer(str(path))
    for text in TEXTS:
        assert tokenizer.encode(text) == sp.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_an_engine_serves_a_gguf_model_with_a_sentencepiece_vocabulary(tmp_path):
    """The engine loads such a GGUF (a tiny random model over the trained vocabulary) and
    prompts get BOS and sentencepiece's ids."""
    from gguf_tiny import write_tiny_gguf
    from hf_tiny import random_hf_model

    from ferrobatch import LLM, SamplingParams

    sp = _train(500)
    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": sp.get_piece_size(), "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True}
    path = tmp_path / "tiny-spm.gguf"
    write_tiny_gguf(path, random_hf_model(cfg, seed=15), cfg, "qwen2",
                    vocabulary=lambda writer: _add_vocabulary(writer, sp))
    llm = LLM(model=str(path), max_num_seqs=4)
    try:
        out = llm.generate(["The engine re-forms the batch"],
                           SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))[0]
        assert out.prompt_token_ids == [sp.bos_id(), *sp.encode("The engine re-forms the batch")]
        assert len(out.outputs[0].token_ids) == 8
        # the text continues the prompt's (a first piece's "▁" is its leading space); a random
        # model emits byte tokens that need not form UTF-8, decoded as HF tokenizers' byte
        # fallback does (one U+FFFD per byte of an invalid run, where sentencepiece writes one
        # per invalid sequence)
        tokenizer = llm.get_tokenizer()
        head = tokenizer.decode(out.prompt_token_ids)
        whole = tokenizer.decode(out.prompt_token_ids + list(out.outputs[0].token_ids))
        assert whole.startswith(head) and out.outputs[0].text == whole[len(head):]
    finally:
        llm.close()
