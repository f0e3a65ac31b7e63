"""A vLLM offline script ports by its import: vLLM's spellings of prompts, parameters, options,
request ids and the tokenizer are taken as vLLM means them, and what this engine cannot honour
is an error, never a silently different run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_support import REAL_ENGINE_OPTIONS

from ferrobatch import LLM, SamplingParams
from ferrobatch.config import EngineConfig
from ferrobatch.engine.llm import _engine_options

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_prompt_dicts_and_keywords_of_vllm(real_llm):
    ids = real_llm.get_tokenizer().encode("The capital of France is")
    want = real_llm.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids
    for prompts in ({"prompt": "The capital of France is"}, [{"prompt": "The capital of France is"}],
                    {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]):
        out = real_llm.generate(prompts, sampling_params=GREEDY)
        assert len(out) == 1 and out[0].prompt_token_ids == ids, prompts
        assert out[0].outputs[0].token_ids == want, prompts
    old = real_llm.generate(prompt_token_ids=[ids, ids], sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in old] == [want, want]
    for bad in ({"prompt": "x", "multi_modal_data": {}}, {"text": "x"},
                {"prompt": "x", "prompt_token_ids": [1]}):
        with pytest.raises(ValueError, match="exactly one of 'prompt' or 'prompt_token_ids'"):
            real_llm.generate(bad, GREEDY)
    with pytest.raises(TypeError, match="not both"):
        real_llm.generate("x", GREEDY, params=GREEDY)
    chat = real_llm.chat([{"role": "user", "content": "Hi"}], sampling_params=GREEDY)
    assert chat[0].outputs[0].finish_reason == "length"


def test_request_ids_count_from_zero_as_numbers(real_llm):
    outs = real_llm.generate(["a", "b", "c"], GREEDY)
    ids = [int(o.request_id) for o in outs]            # vLLM scripts sort by int(request_id)
    assert ids == sorted(ids) and ids[1:] == [ids[0] + 1, ids[0] + 2]
    later = int(real_llm.generate("d", GREEDY)[0].request_id)
    assert later == ids[-1] + 1


def test_get_tokenizer(real_llm):
    tok = real_llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(text)
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_sampling_params_take_vllms_spellings():
    p = SamplingParams(stop=None, stop_token_ids=None, top_k=None, top_p=None, temperature=None,
                       n=None, seed=np.int64(3), max_tokens=np.int32(8), min_p=np.float32(0.5))
    assert (p.stop, p.stop_token_ids, p.top_k, p.top_p, p.temperature, p.n) == \
        ((), (), 0, 1.0, 1.0, 1)
    assert type(p.seed) is int and p.seed == 3 and type(p.max_tokens) is int
    assert type(p.min_p) is float and p.min_p == 0.5
    assert SamplingParams(seed=-1).seed is None                  # vLLM: -1 is no seed
    assert p.clone() == p and p.clone() is not p
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=np.bool_(True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 5                                        # noqa: B018 - replace() instead


def test_llm_options_of_vllm():
    opts = _engine_options("m", {"dtype": torch.float16, "enforce_eager": True,
                                 "tensor_parallel_size": 1, "trust_remote_code": True,
                                 "disable_log_stats": True, "tokenizer": "m", "quantization": None,
                                 "max_num_seqs": 4, "seed": 0})
    assert opts == {"dtype": "float16", "cuda_graphs": False, "max_num_seqs": 4, "seed": 0}
    assert _engine_options("m", {"tokenizer": "other/tok"}) == {"tokenizer": "other/tok"}
    assert EngineConfig.from_options(model="m", **_engine_options("m", {"dtype": "auto"})).dtype \
        is None
    assert EngineConfig(dtype="float").dtype == "float"
    for bad, match in [({"tensor_parallel_size": 2}, "one device"),
                       ({"quantization": "awq"}, "quantization"),
                       ({"enforce_eager": "yes"}, "enforce_eager"),
                       ({"enforce_eager": True, "cuda_graphs": True}, "disagree")]:
        with pytest.raises(ValueError, match=match):
            _engine_options("m", bad)
    with pytest.raises(ValueError, match="seed must be"):
        EngineConfig(seed=-3)


def test_an_engine_seed_repeats_unseeded_sampling(loaded_smollm2):
    """LLM(seed=...) seeds the draws of requests without their own seed (vLLM's `seed`). Its
    promise holds for the same requests in the same steps: one request here (two submitted
    together may share their first step or not, by the step thread's timing, and then draw in
    another order: a CI run under load met that)."""
    sampled = SamplingParams(max_tokens=12, temperature=1.0)
    runs = []
    for seed in (0, 0, 1):
        llm = LLM("smollm2", loaded_model=loaded_smollm2, seed=seed, **REAL_ENGINE_OPTIONS)
        try:
            runs.append([o.outputs[0].token_ids for o in
                         llm.generate(["Once upon a time"], sampled)])
        finally:
            llm.close()
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_text_prompts_get_bos_when_the_model_wants_it(real_llm):
    """As transformers' tokenizer(text) and vLLM: BOS before a text prompt if the model's
    tokenizer adds one (SmolLM2's does not: the flag is flipped for this test); a rendered chat
    gets none added, its template writes what it needs."""
    tok = real_llm.get_tokenizer()
    assert not tok.add_bos_token
    tok.add_bos_token = True
    try:
        out = real_llm.generate("Hello world", GREEDY)[0]
        assert out.prompt_token_ids == [tok.bos_token_id, *tok.encode("Hello world")]
        assert real_llm.generate([[5, 6]], GREEDY)[0].prompt_token_ids == [5, 6]   # ids as given
        chat = real_llm.chat([{"role": "user", "content": "Hi"}], GREEDY)[0]
        assert chat.prompt_token_ids == tok.encode(chat.prompt)
    finally:
        tok.add_bos_token = False


def test_logprobs_read_as_vllms_dicts(real_llm):
    out = real_llm.generate("The capital of France is",
                            SamplingParams(max_tokens=3, temperature=1.0, seed=5, logprobs=2,
                                           prompt_logprobs=1))[0]
    c = out.outputs[0]
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry[tok].logprob == entry.logprob and tok in entry      # vLLM's idiom
        assert 2 <= len(entry) <= 3 and set(entry) == set(entry.keys())
        ranks = {t: lp.rank for t, lp in entry.items()}
        assert [ranks[t] for t, _ in entry.top] == [1, 2]
        assert ranks[tok] == (next(i for i, (t, _) in enumerate(entry.top, 1) if t == tok)
                              if tok in dict(entry.top) else None)
        assert entry.get(-1) is None
    assert out.prompt_logprobs[0] is None
    first = out.prompt_logprobs[1]
    assert first[out.prompt_token_ids[1]].logprob == first.logprob
