"""Guided decoding after the reasoning (`guided/after_reasoning.py`) on SmolLM2's real
vocabulary and the real grammar: every token is allowed while the reply reasons, `</think>` is
found whole or in pieces, then the masks are exactly the grammar's from its start; with `qwen3`
the first token is `<think>` or one the grammar allows. Through the engine, the sampler and
the guide advancement use the wrapper as they use a plain guide."""

from __future__ import annotations

import numpy as np
import pytest

from ferrobatch.model.loader import _load_gguf_tokenizer
from ferrobatch.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path):
    return _load_gguf_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="module")
def compiler(tok):
    from ferrobatch.guided.compiler import GuidedCompiler
    table = tok.token_byte_table(True)
    return GuidedCompiler(table, len(table), list(tok.eos_token_ids))


def _mask(guide, size):
    out = np.zeros(size, dtype=bool)
    guide.write_mask(out)
    return out


def _choice(compiler):
    params = SamplingParams(guided_choice=["yes", "no"])
    return compiler.sequences(params)[0], params


@pytest.mark.parametrize("end_text", ["</think>", "hmm </think>", "</thi" + "nk>"])
def test_deepseek_r1_reasoning_is_free_then_the_grammar_applies(tok, compiler, end_text):
    plain, params = _choice(compiler)
    size = compiler.vocab_size
    guide = compiler.after_reasoning(compiler.sequences(params), "deepseek_r1")[0]
    assert guide.reasoning and _mask(guide, size).all() and not guide.is_finished
    ids = tok.encode("Let me think about it. ") + tok.encode(end_text)
    for t in ids[:-1]:
        assert guide.advance(t) and guide.reasoning and _mask(guide, size).all()
    forked = guide.copy()
    assert guide.advance(ids[-1]) and not guide.reasoning
    np.testing.assert_array_equal(_mask(guide, size), _mask(plain, size))
    assert forked.reasoning                     # a copy moves on its own
    for t in tok.encode("yes"):
        assert guide.advance(t)
    assert guide.is_accepting and not guide.is_finished
    assert guide.advance(tok.eos_token_ids[0]) and guide.is_finished
    refused = compiler.after_reasoning(compiler.sequences(params), "deepseek_r1")[0]
    for t in ids:
        refused.advance(t)
    assert not refused.advance(tok.encode(" maybe")[0])    # the grammar's own refusal


def test_qwen3_first_token_opens_the_reasoning_or_starts_the_grammar(tok, compiler):
    plain, params = _choice(compiler)
    size = compiler.vocab_size
    think = [i for i, b in enumerate(tok.token_byte_table(True)) if b == b"<think>"]
    guide = compiler.after_reasoning(compiler.sequences(params), "qwen3")[0]
    first = _mask(guide, size)
    want = _mask(plain, size)
    want[think] = True
    np.testing.assert_array_equal(first, want)
    # thinking off: the first token is the grammar's, and the grammar goes on from there
    direct = compiler.after_reasoning(compiler.sequences(params), "qwen3")[0]
    for t in tok.encode("no"):
        assert direct.advance(t) and not direct.reasoning
    assert direct.is_accepting
    if think:                   # SmolLM2 has no `<think>` token: the opening path needs one
        assert guide.advance(think[0]) and guide.reasoning


def test_opening_with_think_token_reasons_first():
    """The `<think>` path of `qwen3` on a toy vocabulary that has the token."""
    from ferrobatch.guided.after_reasoning import AfterReasoning

    class Guide:                                   # a grammar allowing only token 3, once
        def __init__(self):
            self.done = False

        def copy(self):
            g = Guide()
            g.done = self.done
            return g

        num_allowed = property(lambda self: 0 if self.done else 1)
        is_finished = is_accepting = property(lambda self: self.done)

        def write_mask(self, out):
            out[3] = not self.done

        def advance(self, t):
            ok = t == 3 and not self.done
            self.done = self.done or ok
            return ok

    table = [b"<think>", b"</think>", b"x", b"A", b"</", b"think>"]
    guide = AfterReasoning(Guide(), "qwen3", table, np.asarray([0]))
    mask = np.zeros(6, dtype=bool)
    guide.write_mask(mask)
    assert mask.tolist() == [True, False, False, True, False, False]
    assert guide.advance(0) and guide.reasoning and guide.num_allowed == 6
    for t in (2, 4, 2):                 # "x</x": no end yet
        assert guide.advance(t) and guide.reasoning
    assert guide.advance(4) and guide.advance(5) and not guide.reasoning    # "</" "think>"
    assert not guide.advance(2) and guide.advance(3) and guide.is_finished
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        AfterReasoning(Guide(), "nope", table)


def test_engine_keeps_a_guided_reply_free_until_its_reasoning_ends(loaded_smollm2):
    """Through the engine (sampler masks, guide advancement): with the reasoning parser a
    guided reply that never writes `</think>` is not held to the grammar (it runs to
    max_tokens with free text); without one the same request is a grammar match."""
    from ferrobatch.engine.llm import LLM
    with LLM("smollm2", loaded_model=loaded_smollm2, device="cpu", num_blocks=256,
             max_model_len=1024) as llm:
        engine = llm.engine
        params = SamplingParams(guided_choice=["yes", "no"], max_tokens=12, temperature=0.0,
                                output_kind="final")

        async def one(parser):
            stream = engine.add_request(None, params, reasoning_parser=parser, messages=[
                {"role": "user", "content": "Is the sky blue? Think first."}])
            return [o async for o in stream][-1].outputs[0]
        plain = llm._run(one(None))
        thinking = llm._run(one("deepseek_r1"))
        assert plain.text in ("yes", "no")
        assert "</think>" not in thinking.text and thinking.text not in ("yes", "no")
        assert len(thinking.token_ids) == 12 and thinking.finish_reason == "length"
        with pytest.raises(ValueError, match="unknown reasoning parser"):
            engine.add_request("x", params, reasoning_parser="nope")
        llm._run(engine.check_idle_clean())
