"""Shared checks of the smaller KV cache dtypes (float16, FP8, int8) against the float32 cache:
SmolLM2's greedy steps replayed over both, and the engine end to end over one."""

from __future__ import annotations

import numpy as np
import torch
from step_builder import ToyScheduler

from ferrobatch import LLM, SamplingParams
from ferrobatch.runtime.model_runner import ModelRunner


def replay_against_float32(loaded, dtype: torch.dtype) -> tuple[float, int, int]:
    """The float32 cache's greedy run replayed over a ``dtype`` cache (the same steps, the same
    tokens): the largest logit change relative to the largest logit, and on how many of how many
    rows the top token stayed."""
    runners = {dt: ModelRunner(loaded, num_blocks=128, block_size=16, kv_cache_dtype=dt)
               for dt in (torch.float32, dtype)}
    assert runners[dtype].kv_cache.layers[0].dtype == dtype
    sched = ToyScheduler(128, 16, token_budget=64, seed=0)
    rng = np.random.default_rng(5)
    for i, n in enumerate((40, 7, 90, 15)):
        sched.add(i, rng.integers(100, 40000, size=n).tolist(), max_new_tokens=24)
    worst = 0.0
    agree = total = 0
    while (batch := sched.schedule()) is not None:
        want = runners[torch.float32].execute(batch).clone()
        got = runners[dtype].execute(batch)
        assert got.isfinite().all()
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += want.shape[0]
        sched.update(want.argmax(-1).numpy())
    print(f"{dtype} cache: logits within {worst:.2e} of their largest value, top-1 {agree}/{total}")
    return worst, agree, total


def serve_end_to_end(loaded, kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """``LLM(kv_cache_dtype=...)`` end to end: parallel sampling (block copies), a long prompt's
    chunks and decodes, every request finished, no block left held."""
    llm = LLM("smollm2", loaded_model=loaded, kv_cache_dtype=kv_cache_dtype, num_blocks=128,
              max_num_batched_tokens=64, device="cpu")
    try:
        assert llm.engine._core.runner.kv_cache.dtype == dtype
        long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
        outs = llm.generate(["The capital of France is", long_prompt],
                            SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=3,
                                           ignore_eos=True))
        assert [len(o.outputs) for o in outs] == [3, 3]
        assert all(len(c.token_ids) == 12 for o in outs for c in o.outputs)
        greedy = llm.generate(["The capital of France is"],
                              SamplingParams(max_tokens=6, temperature=0))
        assert greedy[0].outputs[0].text.startswith(" Paris")
        llm._run(llm.engine.check_idle_clean())
        assert llm.engine.stats()["num_used_blocks"] == 0
    finally:
        llm.close()
