"""Scoring pairs (`LLM.score`): a pair's score is the cosine similarity of its texts' embeddings,
checked against transformers' final hidden states of the same SmolLM2 weights; vLLM's pairing
rules; every distinct text embedded once."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_support import REAL_ENGINE_OPTIONS  # noqa: E402

from ferrobatch.engine.scoring import MAX_PAIRS, pairs_of  # noqa: E402


@pytest.fixture(scope="module")
def llm(loaded_smollm2):
    from ferrobatch.engine.llm import LLM
    with LLM("smollm2", loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as llm:
        yield llm


def test_scores_are_cosines_of_transformers_hidden_states(llm, hf_oracle_model):
    import torch
    tok = llm.get_tokenizer()
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Cats sleep most of the day.", query]
    outs = llm.score(query, docs)
    assert [o.request_id for o in outs] == ["score-0", "score-1", "score-2"]

    def state(text):
        ids = tok.encode(text, add_special_tokens=True)
        with torch.inference_mode():
            hidden = hf_oracle_model(torch.tensor([ids]), output_hidden_states=True)
        vec = hidden.hidden_states[-1][0, -1].double().numpy()
        return ids, vec / np.linalg.norm(vec)
    q_ids, q = state(query)
    for out, doc in zip(outs, docs):
        d_ids, d = state(doc)
        assert out.prompt_token_ids == q_ids + d_ids
        assert abs(out.outputs.score - float(q @ d)) < 2e-4
    assert abs(outs[2].outputs.score - 1.0) < 1e-6         # a text against itself
    # the same as the embeddings' own dot products; lists pair up one by one
    a, b = (np.asarray(e.outputs.embedding) for e in llm.embed([docs[0], docs[1]]))
    pairwise = llm.score([docs[0], docs[1]], [docs[1], docs[0]])
    assert [round(o.outputs.score, 6) for o in pairwise] == [round(float(a @ b), 6)] * 2
    assert llm.engine.check_accounting()["open"] == 0


def test_pairing_rules_and_bad_input(llm):
    assert pairs_of("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pairs_of(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    assert pairs_of([1, 2, 3], "a") == [([1, 2, 3], "a")]     # token ids are one text
    for text_1, text_2, message in ((["x", "y"], ["a", "b", "c"], "give one text_1"),
                                    ([], ["a"], "text_1 must be"), ("q", None, "text_2 must"),
                                    ("q", ["a"] * (MAX_PAIRS + 1), "at most")):
        with pytest.raises(ValueError, match=message):
            pairs_of(text_1, text_2)
    with pytest.raises(ValueError):
        llm.score("q", [""])                                  # an empty prompt
    llm._run(llm.engine.check_idle_clean())     # the other text's request was aborted
