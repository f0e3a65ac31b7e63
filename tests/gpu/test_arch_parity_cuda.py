"""The architectures of session 40 on the GPU path (float32, the CUDA attention backend, the
fused elementwise kernels): YaRN, Phi-3's LongRoPE with partial rotary (Phi-4-mini's shape),
Granite's scalars, SmolLM3's NoPE layers, each against transformers on the same random weights
(the CPU tests check the same on the CPU). Written without a device: the next GPU session runs
it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "model"))

# head_dim 64: a shape the CUDA kernels take
_BASE = {"hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
         "tie_word_embeddings": True}
CONFIGS = {
    "qwen2-yarn": {**_BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64}},
    "phi4-mini-like": {**_BASE, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                       "partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
                       "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                       "rope_scaling": {"type": "longrope",
                                        "short_factor": [1.0 + 0.1 * i for i in range(24)],
                                        "long_factor": [2.0 + 0.1 * i for i in range(24)]}},
    "granite": {**_BASE, "model_type": "granite", "architectures": ["GraniteForCausalLM"],
                "embedding_multiplier": 6.0, "residual_multiplier": 0.3, "logits_scaling": 4.0,
                "attention_multiplier": 0.05},
    "smollm3": {**_BASE, "model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"],
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cuda_greedy_tokens_and_logits_equal_transformers(tmp_path, name):
    from hf_tiny import random_hf_model
    from step_builder import ToyScheduler, greedy_run

    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.model_runner import ModelRunner

    reference = random_hf_model(CONFIGS[name], seed=0, std=0.2)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    reference = reference.to("cuda")
    loaded = load_model(str(tmp_path), device="cuda", dtype=torch.float32)
    runner = ModelRunner(loaded, num_blocks=64, block_size=16, attn_backend="cuda")
    prompts = [list(range(3, 90)), list(range(100, 104)), list(range(200, 250))]
    sched = ToyScheduler(64, 16, token_budget=64)
    for i, p in enumerate(prompts):
        sched.add(i, p, 8)
    generated, last = greedy_run(runner, sched)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p + generated[i][:-1]], device="cuda")
            want = reference(ids).logits[0]
            assert want[len(p) - 1:].argmax(-1).tolist() == generated[i], (name, i)
            torch.testing.assert_close(last[i], want[-1], rtol=1e-3, atol=1e-3)
