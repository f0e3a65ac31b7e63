"""Qwen3 on the GPU path: per-head q / k RMSNorm (swapped for the fused CUDA norm kernel) before
the fused rotary + KV write, through the CUDA attention backend, against transformers' logits on
the same random weights (float32 both, on CUDA). Written in session 35 without a device: the
next GPU session runs it first."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "model"))

CONFIG = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "max_position_embeddings": 512, "tie_word_embeddings": True}


def test_qwen3_cuda_logits_equal_transformers(tmp_path):
    from hf_tiny import random_hf_model
    from step_builder import ToyScheduler, greedy_run

    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.model_runner import ModelRunner

    reference = random_hf_model(CONFIG, seed=0)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    reference = reference.to("cuda")
    loaded = load_model(str(tmp_path), device="cuda", dtype=torch.float32)
    assert loaded.config.qk_norm
    runner = ModelRunner(loaded, num_blocks=64, block_size=16, attn_backend="cuda")
    prompts = [list(range(3, 60)), list(range(100, 104)), list(range(200, 250))]
    sched = ToyScheduler(64, 16, token_budget=64)
    for i, p in enumerate(prompts):
        sched.add(i, p, 8)
    generated, last = greedy_run(runner, sched)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p + generated[i][:-1]], device="cuda")
            want = reference(ids).logits[0]
            # each step's greedy token is the reference's argmax at that position
            assert want[len(p) - 1:].argmax(-1).tolist() == generated[i], i
            torch.testing.assert_close(last[i], want[-1], rtol=1e-3, atol=1e-3)
