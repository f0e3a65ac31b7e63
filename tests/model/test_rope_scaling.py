"""RoPE scaling: YaRN's frequencies and attention factor against transformers', and whole tiny
models with YaRN (a Hugging Face directory and a GGUF file) against transformers' logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.loader import load_model
from ferrobatch.model.rope import RotaryEmbedding, rope_context_length, rope_parameters

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("head_dim, theta, max_pos, scaling", [
    (128, 1e6, 131072, QWEN3_YARN),                     # what Qwen3's model card asks for
    (64, 1e4, 4096, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                     "beta_fast": 16, "beta_slow": 2}),
    (64, 1e4, 4096, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                     "truncate": False}),
    (128, 1e4, 163840, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                        "mscale": 1.0, "mscale_all_dim": 0.707}),
    (64, 5e5, 8192, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                     "attention_factor": 0.9}),
])
def test_yarn_matches_transformers(head_dim, theta, max_pos, scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.AutoConfig.for_model(
        "llama", hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=max_pos, rope_parameters={**scaling, "rope_theta": theta})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = ModelConfig(arch="llama", vocab_size=8, hidden_size=4 * head_dim, intermediate_size=8,
                       num_layers=1, num_heads=4, num_kv_heads=4, head_dim=head_dim,
                       rope_theta=theta, max_position_embeddings=max_pos, rope_scaling=scaling)
    freq, factor = rope_parameters(ours)
    torch.testing.assert_close(freq, want_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    plain = rope_parameters(dataclasses.replace(ours, rope_scaling=None))[0]
    assert freq[0] == plain[0] and freq[-1] == pytest.approx(plain[-1] / scaling["factor"])


def test_the_attention_factor_scales_every_cos_and_sin():
    small = ModelConfig(arch="llama", vocab_size=8, hidden_size=64, intermediate_size=8,
                        num_layers=1, num_heads=4, num_kv_heads=4, head_dim=16,
                        max_position_embeddings=32,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 8})
    rotary = RotaryEmbedding(small)
    factor = rope_parameters(small)[1]
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    # cos^2 + sin^2 of every position and dimension is the factor squared, not 1
    torch.testing.assert_close(rotary.cos_cached ** 2 + rotary.sin_cached ** 2,
                               torch.full((32, 16), factor ** 2))


def test_yarn_serves_the_context_it_stretches_to():
    assert rope_context_length(40960, QWEN3_YARN) == 131072
    assert rope_context_length(262144, QWEN3_YARN) == 262144       # never shortened
    assert rope_context_length(40960, None) == 40960
    assert rope_context_length(8192, {"rope_type": "linear", "factor": 4.0}) == 8192
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_parameters(ModelConfig(arch="llama", vocab_size=8, hidden_size=64, intermediate_size=8,
                                    num_layers=1, num_heads=4, num_kv_heads=4, head_dim=16,
                                    rope_scaling={"rope_type": "yarn", "factor": 4.0}))


TINY_YARN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": True,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 16}}


def _assert_matches_transformers(loaded, reference) -> None:
    """Greedy continuations of prompts longer than the original context (16: the stretched,
    interpolated regime) against transformers."""
    assert_greedy_matches(loaded, reference,
                          [list(range(3, 56)), list(range(50, 53)), list(range(7, 30))], 5)


def test_a_yarn_hf_directory_matches_transformers(tmp_path):
    reference = random_hf_model(TINY_YARN, seed=3, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.rope_scaling["rope_type"] == "yarn"
    assert loaded.config.max_position_embeddings == 64
    _assert_matches_transformers(loaded, reference)
    # without YaRN the same weights give other logits (weights ~ N(0, 0.3), so that attention
    # is sharp enough for positions to matter): the scaling is what matched
    plain = random_hf_model({**TINY_YARN, "rope_scaling": None}, seed=3, std=0.3)
    with torch.no_grad():
        prompt = torch.tensor([list(range(3, 60))])
        assert (plain(prompt).logits - reference(prompt).logits).abs().max() > 0.1


def test_a_yarn_gguf_matches_transformers(tmp_path):
    import gguf

    reference = random_hf_model(TINY_YARN, seed=4, std=0.3)
    path = tmp_path / "tiny-yarn.gguf"

    def yarn_keys(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(16)

    write_tiny_gguf(path, reference, TINY_YARN, "qwen2", metadata=yarn_keys)
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 16}
    _assert_matches_transformers(loaded, reference)


def test_a_gguf_context_stretched_by_yarn(tmp_path):
    """A GGUF that keeps the original context length (as the converter writes a model whose
    config.json asks for YaRN) serves original x factor positions."""
    import gguf

    cfg = {**TINY_YARN, "max_position_embeddings": 16}
    reference = random_hf_model({**cfg, "rope_scaling": None}, seed=5)
    path = tmp_path / "tiny-yarn-ctx.gguf"

    def yarn_keys(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(16)
        writer.add_rope_scaling_yarn_beta_fast(16.0)

    write_tiny_gguf(path, reference, cfg, "qwen2", metadata=yarn_keys)
    config = load_model(str(path)).config
    assert config.max_position_embeddings == 64 and config.rope_scaling["beta_fast"] == 16.0
