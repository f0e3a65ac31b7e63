"""Beam search: the engine's (`LLM.beam_search`) against transformers' `generate(num_beams=k)`
on the shipped SmolLM2, token for token, and the search's bookkeeping on hand-made steps."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_support import REAL_ENGINE_OPTIONS  # noqa: E402

from ferrobatch.engine.beam_search import BeamSearchParams, BeamState  # noqa: E402

# (beam width, max tokens, length_penalty, early_stopping, chat?) - the chat prompts end in EOS
# within the budget, so hypotheses finish at different lengths and the stopping rules matter
CASES = [
    (2, 12, 1.0, False, False),
    (4, 24, 1.0, False, True),
    (3, 24, 0.5, True, True),
    (4, 24, 2.0, "never", True),
    (5, 10, 0.0, False, False),
]
PROMPTS = ["The best way to learn a new language is", "What colour is the sky? Answer in "
           "three words."]


@pytest.fixture(scope="module")
def llm(loaded_smollm2):
    from ferrobatch.engine.llm import LLM
    with LLM("smollm2", loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as llm:
        yield llm


def _hf_beams(model, prompt_ids, eos, k, max_tokens, length_penalty, early_stopping):
    """transformers' k returned beams: (generated ids up to and with EOS, score)."""
    import torch
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             num_beams=k, num_return_sequences=k, max_new_tokens=max_tokens,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                             return_dict_in_generate=True)
    beams = []
    for row, score in zip(out.sequences[:, len(prompt_ids):].tolist(),
                          out.sequences_scores.tolist()):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        beams.append((row[:end], score))
    return beams


@pytest.mark.parametrize("k, max_tokens, length_penalty, early_stopping, chat", CASES)
def test_beams_equal_transformers_beam_search(llm, hf_oracle_model, k, max_tokens,
                                              length_penalty, early_stopping, chat):
    tok = llm.get_tokenizer()
    eos = list(tok.eos_token_ids)
    prompt = PROMPTS[chat]
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}])
                     if chat else prompt, add_special_tokens=not chat)
    expected = _hf_beams(hf_oracle_model, ids, eos, k, max_tokens, length_penalty,
                         early_stopping)
    out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(
        beam_width=k, max_tokens=max_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping))[0]
    got = [s.output_token_ids for s in out.sequences]
    assert got == [b for b, _ in expected]
    assert [s.score for s in out.sequences] == pytest.approx([s for _, s in expected],
                                                              abs=2e-3)
    for s in out.sequences:
        assert s.tokens == ids + s.output_token_ids
        assert s.finish_reason == ("stop" if s.output_token_ids[-1] in eos else "length")
        assert s.text == tok.decode(s.output_token_ids, skip_special_tokens=True)
    if chat:
        assert any(s.finish_reason == "stop" for s in out.sequences)
    assert llm.engine.check_accounting()["tracked_extras"] == 0


def test_searches_run_side_by_side_with_plain_requests(llm):
    """Two searches at once give what each gives alone (scores to float32 noise: batched with
    other rows a step may take another linear kernel, which could reorder a near-tie), and
    leave nothing held."""
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    alone = [llm.beam_search(p, params)[0] for p in PROMPTS]
    both = llm.beam_search(PROMPTS, params)
    for a, b in zip(alone, both):
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences],
                                                               abs=1e-4)
        assert a.prompt == b.prompt and a.prompt_token_ids == b.prompt_token_ids
    stats = llm.engine.check_accounting()
    assert stats["tracked_extras"] == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "length_penalty": "x"}, "length_penalty"),
    ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"beam_width": 2, "ignore_eos": 1}, "ignore_eos"),
])
def test_bad_params_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_too_wide_or_too_long_searches_are_refused_before_any_work(llm):
    with pytest.raises(ValueError, match="beam_width must be at most"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="context window"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=4000))
    with pytest.raises(TypeError):
        llm.beam_search("Hello", {"beam_width": 2})
    assert llm.engine.check_accounting()["tracked_extras"] == 0


# --- the bookkeeping on hand-made steps ------------------------------------------------------


def _top(pairs):
    return [(t, float(np.log(p))) for t, p in pairs]


def test_an_eos_candidate_finishes_only_within_the_best_k():
    """Step 1: beam A (p .6) and B (.4). Step 2: A's EOS is among the best 2 candidates, so it
    finishes with its EOS counted (score = logp / 2); B's EOS ranks 3rd, so it is dropped."""
    eos = 9
    state = BeamState(BeamSearchParams(beam_width=2, max_tokens=5), [eos])
    assert not state.step([_top([(1, .6), (2, .4), (eos, 1e-9), (3, 1e-9)])])
    assert [b.tokens for b in state.running] == [[1], [2]]
    assert not state.step([_top([(eos, .5), (4, .5), (5, 1e-6), (6, 1e-6)]),
                           _top([(7, .5), (eos, .5), (5, 1e-6), (6, 1e-6)])])
    (score, beam), = state.finished
    assert beam.tokens == [1, eos]
    assert score == pytest.approx(np.log(.6 * .5) / 2, rel=1e-5)
    assert [b.tokens for b in state.running] == [[1, 4], [2, 7]]


def test_early_stopping_true_stops_once_k_hypotheses_are_finished():
    eos = 9
    params = BeamSearchParams(beam_width=1, max_tokens=50, early_stopping=True)
    state = BeamState(params, [eos])
    assert state.step([_top([(eos, .5), (1, .5), (2, 1e-6)])])      # done at the first EOS
    assert [b.tokens for _, b in state.finished] == [[eos]]
    assert state.results([5])[0].finish_reason == "stop"


def test_max_tokens_finishes_the_best_k_candidates_as_length():
    state = BeamState(BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), [9])
    assert state.step([_top([(9, .5), (1, .3), (2, .2), (3, 1e-6)])])
    res = state.results([])
    assert [r.output_token_ids for r in res] == [[9], [1]]
    assert [r.finish_reason for r in res] == ["length", "length"]     # ignore_eos: no EOS
