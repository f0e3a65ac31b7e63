"""Models whose config.json switches on a sliding attention window serve a context no longer
than the window, where full attention is exactly the windowed one (checked against
transformers, which applies the window)."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_tiny import random_hf_model
from step_builder import ToyScheduler, greedy_run

from ferrobatch.model.hf_loader import config_from_hf
from ferrobatch.model.loader import load_model
from ferrobatch.runtime.model_runner import ModelRunner

TINY_MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "max_position_embeddings": 64, "sliding_window": 16,
                "tie_word_embeddings": False}


@pytest.mark.parametrize("cfg, context", [
    (TINY_MISTRAL, 16),
    ({**TINY_MISTRAL, "sliding_window": None}, 64),                # Mistral 7B v0.2 on
    ({**TINY_MISTRAL, "sliding_window": 4096}, 64),                # wider than the context
    ({**TINY_MISTRAL, "model_type": "qwen2", "sliding_window": 16}, 64),   # Qwen: not switched on
    ({**TINY_MISTRAL, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True}, 16),
])
def test_the_served_context_is_capped_at_a_switched_on_window(cfg, context, caplog):
    with caplog.at_level(logging.WARNING, logger="ferrobatch.model.attention_window"):
        config = config_from_hf(cfg)
    assert config.max_position_embeddings == context
    assert ("sliding window of 16 tokens" in caplog.text) == (context == 16)


def test_within_the_window_the_model_matches_transformers(tmp_path):
    """Sequences up to the window's 16 tokens: greedy tokens and last logits equal transformers'
    (which masks by the window); a prompt beyond the window is refused, not silently drifted."""
    reference = random_hf_model(TINY_MISTRAL, seed=6, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.max_position_embeddings == 16
    prompts = [list(range(3, 15)), list(range(40, 45))]
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    sched = ToyScheduler(16, 4, token_budget=8)
    for i, prompt in enumerate(prompts):
        sched.add(i, prompt, 16 - len(prompt))
    generated, last = greedy_run(runner, sched)
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            sequence = prompt + generated[i][:-1]
            assert len(sequence) == 15
            want = reference(torch.tensor([sequence])).logits[0]
            assert want[len(prompt) - 1:].argmax(-1).tolist() == generated[i]
            torch.testing.assert_close(last[i], want[-1], rtol=1e-4, atol=1e-4)


def test_the_engine_refuses_a_prompt_beyond_the_window(tmp_path):
    from ferrobatch import LLM, SamplingParams

    # a tokenizer-less checkpoint served with SmolLM2's tokenizer (--tokenizer), whose ids fit
    random_hf_model({**TINY_MISTRAL, "vocab_size": 49152}, seed=6).save_pretrained(
        tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), tokenizer="smollm2", max_num_seqs=4)
    try:
        out = llm.generate([list(range(3, 10))], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match="16"):
            llm.generate([list(range(3, 20))], SamplingParams(max_tokens=4))
    finally:
        llm.close()
