"""Granite 3 (`granite`): Llama with four scalars (embedding, residual and attention
multipliers, a logits divisor), folded into the weights by ``model.model_layout``; Hugging Face
directories and GGUF files, LoRA adapters and weight updates against transformers."""

from __future__ import annotations

import pytest
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model

from ferrobatch.model.loader import load_model

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
    from lora_files import ATTN, MLP, assert_update_and_lora_match_transformers

    assert_update_and_lora_match_transformers(tmp_path, TINY_GRANITE, ATTN + MLP, (33, 34, 5))
