"""Embeddings (`LLM.embed`): last-token and mean pooling of the final hidden states against
transformers' own hidden states of the same SmolLM2 weights, in batches with generation, with
prompts that span several prefill chunks and prefix-cache hits."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_support import REAL_ENGINE_OPTIONS  # noqa: E402

from ferrobatch.pooling_params import PoolingParams  # noqa: E402
from ferrobatch.sampling_params import SamplingParams  # noqa: E402

TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.",
         "Embeddings map text to vectors. " * 40]          # > 512 tokens: several chunks


@pytest.fixture(scope="module")
def llm(loaded_smollm2):
    from ferrobatch.engine.llm import LLM
    with LLM("smollm2", loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as llm:
        yield llm


def _hf_states(model, ids: list[int]) -> np.ndarray:
    """transformers' final-normed hidden states ``[T, hidden]`` of one prompt."""
    import torch
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].double().numpy()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_hidden_states(llm, hf_oracle_model, pooling):
    tok = llm.get_tokenizer()
    ids = [tok.encode(t, add_special_tokens=True) for t in TEXTS]
    # a prompt seen before (prefix-cache hit for "last"; "mean" computes every row anyway)
    llm.generate([{"prompt_token_ids": ids[2]}], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.embed([{"prompt_token_ids": i} for i in ids], PoolingParams(pooling=pooling))
    for i, out in zip(ids, outs):
        states = _hf_states(hf_oracle_model, i)
        want = states[-1] if pooling == "last" else states.mean(axis=0)
        want /= np.linalg.norm(want)
        got = np.asarray(out.outputs.embedding)
        assert out.prompt_token_ids == i and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-4)
        assert abs(np.linalg.norm(got) - 1.0) < 1e-5
    assert llm.engine.check_accounting()["tracked_extras"] == 0


def test_dimensions_normalize_and_side_by_side_generation(llm, hf_oracle_model):
    """`dimensions` cuts before normalizing; `normalize=False` gives the raw state; embedding
    requests batched with generation requests give what they give alone."""
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXTS[0], add_special_tokens=True)
    raw = np.asarray(llm.embed({"prompt_token_ids": ids},
                               PoolingParams(normalize=False))[0].outputs.embedding)
    np.testing.assert_allclose(raw, _hf_states(hf_oracle_model, ids)[-1], rtol=1e-4, atol=1e-3)
    cut = np.asarray(llm.embed({"prompt_token_ids": ids},
                               PoolingParams(dimensions=64))[0].outputs.embedding)
    np.testing.assert_allclose(cut, raw[:64] / np.linalg.norm(raw[:64]), atol=1e-5)

    async def both():
        import asyncio
        gen = [llm.engine.generate(t, SamplingParams(max_tokens=24, ignore_eos=True,
                                                     output_kind="final")) for t in TEXTS]

        async def drain(g):
            return [o async for o in g][-1]
        return await asyncio.gather(*(llm.engine.embed(TEXTS[0]) for _ in range(3)),
                                    *(drain(g) for g in gen))
    results = llm._run(both())
    alone = np.asarray(llm.embed(TEXTS[0])[0].outputs.embedding)
    for r in results[:3]:
        np.testing.assert_allclose(np.asarray(r.outputs.embedding), alone, atol=1e-5)
    assert all(len(r.outputs[0].token_ids) == 24 for r in results[3:])
    assert llm.engine.check_accounting()["tracked_extras"] == 0


def test_bad_pooling_params_are_refused():
    for kwargs, message in (({"pooling": "cls"}, "pooling"), ({"dimensions": 0}, "dimensions"),
                            ({"normalize": "yes"}, "normalize")):
        with pytest.raises(ValueError, match=message):
            PoolingParams(**kwargs)
