"""Granite 3 (`granite`): Llama with four scalars (embedding, residual and attention
multipliers, a logits divisor), folded into the weights by ``model.model_layout``; Hugging Face
directories and GGUF files, LoRA adapters and weight updates against transformers."""

from __future__ import annotations

import copy

import pytest
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model

from ferrobatch.model.loader import load_model
from ferrobatch.runtime.model_runner import ModelRunner

# Granite 3's scalars for a tiny shape (3.x-8B: 12, 0.22, 16, 1/128)
TINY_GRANITE = {"model_type": "granite", "architectures": ["GraniteForCausalLM"],
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
                "embedding_multiplier": 6.0, "residual_multiplier": 0.3,
                "logits_scaling": 4.0, "attention_multiplier": 0.1, "tie_word_embeddings": True}


@pytest.mark.parametrize("tied", [True, False])
def test_a_granite_directory_matches_transformers(tmp_path, tied):
    cfg = {**TINY_GRANITE, "tie_word_embeddings": tied}
    reference = random_hf_model(cfg, seed=31, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.arch == "granite" and loaded.config.attention_scale == 0.1
    assert loaded.config.embedding_multiplier == 6.0 and loaded.config.logits_scaling == 4.0
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6)


def test_a_granite_gguf_matches_transformers(tmp_path):
    """llama.cpp's granite: Llama's Q / K row permutation and the scalars as metadata."""
    reference = random_hf_model(TINY_GRANITE, seed=32, std=0.3)

    def scalars(writer):
        writer.add_embedding_scale(6.0)
        writer.add_residual_scale(0.3)
        writer.add_logit_scale(4.0)
        writer.add_attention_scale(0.1)

    path = tmp_path / "tiny-granite.gguf"
    write_tiny_gguf(path, reference, TINY_GRANITE, "granite", metadata=scalars)
    loaded = load_model(str(path))
    assert loaded.config.arch == "granite"
    assert loaded.config.residual_multiplier == pytest.approx(0.3)     # float32 metadata
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6)


def test_lora_and_weight_updates_carry_the_scalars(tmp_path):
    """A LoRA adapter on every projection (its o / down deltas scaled as the modules are) and a
    trainer's new weights (transformers' names and values) give transformers' tokens."""
    from lora_files import ATTN, MLP, merge_into, write_peft_adapter

    from ferrobatch.model.lora_adapter import read_lora_adapter
    from ferrobatch.runtime.weight_update import apply_update, plan_update

    reference = random_hf_model(TINY_GRANITE, seed=33, std=0.3)
    reference.save_pretrained(tmp_path / "model", safe_serialization=True)
    loaded = load_model(str(tmp_path / "model"))
    updated = random_hf_model(TINY_GRANITE, seed=34, std=0.3)
    apply_update(loaded.model, plan_update(loaded.model, dict(updated.state_dict())))
    pairs = write_peft_adapter(str(tmp_path / "adapter"), loaded.config, targets=ATTN + MLP, r=4,
                               alpha=8, seed=5, b_std=0.2)
    merged = copy.deepcopy(updated)
    merge_into(merged, pairs, 2.0)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    runner.enable_lora(max_loras=1, max_rank=4).put(1, read_lora_adapter(
        str(tmp_path / "adapter"), loaded.config))
    assert_greedy_matches(loaded, merged, [list(range(3, 30)), [5, 9, 11, 40]], 4, runner=runner,
                    execute=lambda batch: runner.execute(batch, lora_slots=[1] * len(
                        batch.seq_req_ids)))
    assert_greedy_matches(loaded, updated, [list(range(3, 30))], 4, runner=runner)
