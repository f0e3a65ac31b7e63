"""SmolLM3 (`smollm3`): Llama whose every fourth layer attends without RoPE ("NoPE"); Hugging
Face directories and GGUF files against transformers."""

from __future__ import annotations

import pytest
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model

from ferrobatch.model.hf_loader import config_from_hf
from ferrobatch.model.loader import load_model
from ferrobatch.runtime.model_runner import ModelRunner

TINY_SMOLLM3 = {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"],
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
                "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
                "eos_token_id": 2}


def _greedy_matches(loaded, reference, prompts, new_tokens, fused=True):
    """With ``fused`` the decode steps run every layer in one Rust call (NoPE layers told
    apart there), else layer by layer."""
    runner = ModelRunner(loaded, num_blocks=64, block_size=4, fused_decode=fused)
    assert (runner.model.fused_layers is not None) == fused
    assert_greedy_matches(loaded, reference, prompts, new_tokens, runner=runner)


def test_which_layers_go_without_rope():
    assert config_from_hf(TINY_SMOLLM3).nope_layers == (3,)
    assert config_from_hf({**TINY_SMOLLM3, "no_rope_layer_interval": 2}).nope_layers == (1, 3)
    assert config_from_hf({**TINY_SMOLLM3, "no_rope_layers": [1, 0, 0, 1]}).nope_layers == (1, 2)
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries for 4 layers"):
        config_from_hf({**TINY_SMOLLM3, "no_rope_layers": [1, 0, 1]})


@pytest.mark.parametrize("interval, fused", [(4, True), (2, True), (4, False)])
def test_a_smollm3_directory_matches_transformers(tmp_path, interval, fused):
    cfg = {**TINY_SMOLLM3, "no_rope_layer_interval": interval}
    reference = random_hf_model(cfg, seed=41, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.nope_layers == ((3,) if interval == 4 else (1, 3))
    _greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6, fused=fused)


def test_a_smollm3_gguf_matches_transformers(tmp_path):
    """llama.cpp's smollm3: Llama's Q / K permutation, NoPE in every fourth layer by rule."""
    reference = random_hf_model(TINY_SMOLLM3, seed=42, std=0.3)
    path = tmp_path / "tiny-smollm3.gguf"
    write_tiny_gguf(path, reference, {**TINY_SMOLLM3, "head_dim": 16}, "smollm3")
    loaded = load_model(str(path))
    assert loaded.config.arch == "smollm3" and loaded.config.nope_layers == (3,)
    _greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6)
