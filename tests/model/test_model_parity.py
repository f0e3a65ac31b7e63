"""Greedy parity with transformers on the shipped SmolLM2 GGUF, token for token.

Both models get the same token ids (transformers' GGUF tokenizer does not isolate digits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_data import NUM_NEW_TOKENS
from step_builder import ToyScheduler

from ferrobatch.runtime.model_runner import ModelRunner
from ferrobatch.runtime.sampler import Sampler

BLOCK_SIZE = 16
NUM_BLOCKS = 512


@pytest.fixture(scope="module", params=["torch", "cpu"])
def runner(request, loaded_smollm2):
    """Both CPU attention backends: the torch reference and the Rust decode kernel (the model's
    linear layers and norms are swapped for the Rust kernels by the first runner either way)."""
    return ModelRunner(loaded_smollm2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                       attn_backend=request.param)


@pytest.fixture(scope="module")
def sampler(loaded_smollm2):
    return Sampler(loaded_smollm2.config.vocab_size, loaded_smollm2.tokenizer.eos_token_ids, "cpu")


def _step_until_done(runner, sampler, scheduler, on_step=None) -> None:
    for step in range(10_000):
        batch = scheduler.schedule()
        if batch is None:
            return
        if on_step is not None:
            on_step(step, scheduler)
            batch = scheduler.schedule()
            if batch is None:
                return
        logits = runner.execute(batch)
        assert logits.dtype == torch.float32 and logits.shape == (batch.num_samples, runner.config.vocab_size)
        scheduler.update(sampler.sample(logits, batch).token_ids)


def test_prompt_set_is_varied(parity_prompts, hf_greedy_outputs):
    assert len(parity_prompts) >= 16
    assert max(map(len, parity_prompts)) > 3 * BLOCK_SIZE  # spans several blocks
    assert min(map(len, parity_prompts)) < 8
    assert all(len(o) == NUM_NEW_TOKENS for o in hf_greedy_outputs)


def test_each_prompt_alone_matches_transformers(runner, sampler, parity_prompts, hf_greedy_outputs):
    mismatches = []
    for i, (prompt, expected) in enumerate(zip(parity_prompts, hf_greedy_outputs)):
        scheduler = ToyScheduler(NUM_BLOCKS, BLOCK_SIZE, token_budget=4096, seed=i)
        seq = scheduler.add(i, prompt, NUM_NEW_TOKENS)
        _step_until_done(runner, sampler, scheduler)
        if seq.output_ids != expected:
            mismatches.append((i, seq.output_ids, expected))
    assert not mismatches


def test_a_long_context_matches_transformers(loaded_smollm2, sampler, hf_oracle_model, tokenizer):
    """~1,400 tokens of context: the Rust decode kernel cuts this one sequence between its
    threads (split-KV: each part's softmax state merged after the job) where it has two or
    more. Greedy tokens must be transformers' own, and every decode step's logits must agree
    with transformers' at that position (a wrongly merged softmax moves logits long before it
    flips an argmax on this repetitive text)."""
    from parity_data import RAW_PROMPTS

    text = " ".join(RAW_PROMPTS)
    prompt = tokenizer.encode(" ".join([text] * (1 + 1400 // len(tokenizer.encode(text)))))
    assert 1400 <= len(prompt) < NUM_BLOCKS * BLOCK_SIZE // 2
    num_new = 16
    runner = ModelRunner(loaded_smollm2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         attn_backend="cpu")
    scheduler = ToyScheduler(NUM_BLOCKS, BLOCK_SIZE, token_budget=512, seed=7)
    seq = scheduler.add(0, prompt, num_new)
    step_logits = []
    while (batch := scheduler.schedule()) is not None:
        logits = runner.execute(batch)
        step_logits += list(logits)
        scheduler.update(sampler.sample(logits, batch).token_ids)
    assert len(seq.output_ids) == len(step_logits) == num_new
    with torch.inference_mode():
        ids = torch.tensor([prompt + seq.output_ids[:-1]])
        hf_logits = hf_oracle_model(ids).logits[0, len(prompt) - 1:]
    assert seq.output_ids == hf_logits.argmax(-1).tolist()
    worst = max(float((ours - theirs).abs().max()) for ours, theirs in zip(step_logits, hf_logits))
    assert worst < 1e-3, f"decode logits differ from transformers' by up to {worst}"


def test_all_prompts_in_one_batch_with_chunked_prefill_and_prefix_hit(
        runner, sampler, parity_prompts, hf_greedy_outputs):
    """Half the prompts start at once; the rest join mid-flight (they reuse the chat system
    prompt's cached blocks); prefills are chunked by a 40-token budget next to decodes."""
    scheduler = ToyScheduler(NUM_BLOCKS, BLOCK_SIZE, token_budget=40, seed=123)
    order = np.random.default_rng(0).permutation(len(parity_prompts))
    first, later = order[: len(order) // 2], order[len(order) // 2:]
    seqs = {int(i): scheduler.add(int(i), parity_prompts[i], NUM_NEW_TOKENS) for i in first}

    def add_later(step, sched):
        if step == 12:
            for i in later:
                seqs[int(i)] = sched.add(int(i), parity_prompts[i], NUM_NEW_TOKENS)

    _step_until_done(runner, sampler, scheduler, on_step=add_later)
    assert any(s.num_cached_tokens > 0 for s in seqs.values()), "no prefix-cache hit happened"
    mismatches = [i for i, s in seqs.items() if s.output_ids != hf_greedy_outputs[i]]
    assert not mismatches


@pytest.mark.parametrize("drafts", [0, 4], ids=["plain", "speculative"])
def test_real_scheduler_drives_the_model(loaded_smollm2, sampler, parity_prompts, hf_greedy_outputs,
                                         drafts):
    """The real scheduler, runner and sampler match transformers token for token; with prompt
    lookup on (drafts checked in one step, at any load), still token for token."""
    scheduler_mod = pytest.importorskip("ferrobatch._scheduler")
    sched = scheduler_mod.Scheduler(
        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=64,
        max_model_len=1024, vocab_size=loaded_smollm2.config.vocab_size,
        eos_token_ids=loaded_smollm2.tokenizer.eos_token_ids, num_speculative_tokens=drafts,
        speculative_ngram_min=1, speculative_ngram_max=3)
    runner = ModelRunner(loaded_smollm2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    intake = sched.intake()
    chosen = range(0, len(parity_prompts), 2) if not drafts else range(len(parity_prompts))
    for i in chosen:
        intake.submit(i, parity_prompts[i], max_tokens=NUM_NEW_TOKENS, temperature=0.0,
                      ignore_eos=True, speculate=True)
    outputs: dict[int, list[int]] = {i: [] for i in chosen}
    finished: set[int] = set()
    for _ in range(2_000):
        batch = sched.schedule()
        logits = runner.execute(batch)
        result = sched.update(sampler.sample(logits, batch).token_ids)
        for req_id, token, reason in zip(result.req_ids, result.token_ids, result.finish_reasons):
            if token >= 0:
                outputs[int(req_id)].append(int(token))
            if reason != 0:
                finished.add(int(req_id))
        if finished == set(chosen):
            break
    assert finished == set(chosen)
    assert {i: outputs[i] for i in chosen} == {i: hf_greedy_outputs[i] for i in chosen}
    stats = sched.stats()
    sched.check_integrity()
    assert stats["num_generation_tokens_total"] == len(chosen) * NUM_NEW_TOKENS
    if drafts:      # the check above is only meaningful if drafts were both kept and refused
        assert 0 < stats["num_accepted_tokens_total"] < stats["num_draft_tokens_total"]
    else:
        assert stats["num_draft_tokens_total"] == 0


def test_engine_logprobs_match_transformers(loaded_smollm2, hf_oracle_model, parity_prompts,
                                            hf_greedy_outputs):
    """The engine's logprobs (four prompts batched, greedy, top 5) against transformers'
    log_softmax over the same prompt + output, teacher-forced in one forward."""
    from ferrobatch.engine.llm import LLM
    from ferrobatch.sampling_params import SamplingParams

    chosen = [0, 3, len(parity_prompts) // 2, len(parity_prompts) - 1]
    llm = LLM("smollm2", loaded_model=loaded_smollm2, num_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=256, device="cpu", enable_prefix_caching=False)
    try:
        outs = llm.generate([parity_prompts[i] for i in chosen], SamplingParams(
            max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5),
            use_tqdm=False)
    finally:
        llm.close()
    worst = 0.0
    for i, out in zip(chosen, outs):
        c = out.outputs[0]
        assert c.token_ids == hf_greedy_outputs[i]
        assert len(c.logprobs) == NUM_NEW_TOKENS
        ids = torch.tensor([parity_prompts[i] + c.token_ids[:-1]])
        with torch.inference_mode():
            logits = hf_oracle_model(ids).logits[0, len(parity_prompts[i]) - 1:].float()
        reference = logits.log_softmax(-1)
        assert reference.shape[0] == NUM_NEW_TOKENS
        for pos, e in enumerate(c.logprobs):
            ref = reference[pos]
            assert e.token_id == c.token_ids[pos]
            assert e.top[0][0] == e.token_id and e.top[0][1] == e.logprob   # greedy: the best
            values = [lp for _, lp in e.top]
            assert values == sorted(values, reverse=True)
            ref_values, ref_ids = ref.topk(5)
            np.testing.assert_allclose(values, ref_values.numpy(), atol=2e-3)
            worst = max(worst, abs(e.logprob - float(ref[e.token_id])))
            for k, (tok, lp) in enumerate(e.top):       # ids agree except inside a near-tie
                if int(ref_ids[k]) != tok:
                    assert abs(float(ref[tok]) - lp) < 2e-3
                    assert abs(float(ref_values[k]) - lp) < 4e-3
    assert worst < 2e-3, worst


def test_engine_prompt_logprobs_match_transformers(loaded_smollm2, hf_oracle_model,
                                                   parity_prompts):
    """Prompt logprobs (top 3) against transformers' log_softmax over the prompt: computed in
    16-token prefill chunks, and complete although the same prompts were just cached by plain
    requests (a cached token has no logits, so such a request must skip the cache)."""
    from ferrobatch.engine.llm import LLM
    from ferrobatch.sampling_params import SamplingParams

    prompts = sorted(parity_prompts, key=len)[-2:]          # the two longest
    llm = LLM("smollm2", loaded_model=loaded_smollm2, num_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=16, device="cpu", block_size=16)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)   # fills the cache
        hits_before = llm.engine.stats().get("prefix_cache_hits_total", 0)
        outs = llm.generate(prompts + [prompts[0]], [
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3),
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3),
            SamplingParams(max_tokens=1, temperature=0.0)], use_tqdm=False)
        hits_after = llm.engine.stats().get("prefix_cache_hits_total", 0)
    finally:
        llm.close()
    assert hits_after > hits_before            # the plain request still used the cache
    assert outs[2].prompt_logprobs is None
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        assert len(prompt) > 2 * 16             # three chunks or more
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        with torch.inference_mode():
            reference = hf_oracle_model(torch.tensor([prompt])).logits[0, :-1].float()
        reference = reference.log_softmax(-1)
        for pos, e in enumerate(entries[1:]):
            ref = reference[pos]
            assert e.token_id == prompt[pos + 1]
            worst = max(worst, abs(e.logprob - float(ref[e.token_id])))
            ref_values, _ = ref.topk(3)
            np.testing.assert_allclose([lp for _, lp in e.top], ref_values.numpy(), atol=2e-3)
            for tok, lp in e.top:
                assert abs(float(ref[tok]) - lp) < 2e-3
    assert worst < 2e-3, worst
