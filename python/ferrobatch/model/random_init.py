"""Named real-model shapes with random weights, for benchmarks (throughput ignores weight values)."""

from __future__ import annotations

import torch

from ferrobatch.model.config import ModelConfig

RANDOM_SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001),
    "llama3-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        qk_norm=True, eos_token_id=151645),
    # gemma-3-270m: five sliding-window layers of six (model.gemma3)
    "gemma3-270m": ModelConfig(
        arch="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
        num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        qk_norm=True, bos_token_id=2, eos_token_id=1, sliding_window=512,
        sliding_layers=tuple(i for i in range(18) if (i + 1) % 6), local_rope_theta=10000.0,
        sandwich_norms=True, hidden_act="gelu_tanh", attention_multiplier=256 ** -0.5,
        embedding_scale=float(torch.tensor(640 ** 0.5, dtype=torch.float32))),
}


def random_config(shape_name: str) -> ModelConfig:
    """The ModelConfig of a named shape; ValueError lists the known names."""
    if shape_name not in RANDOM_SHAPES:
        raise ValueError(
            f"unknown random shape {shape_name!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    return RANDOM_SHAPES[shape_name]


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fills every parameter in place on its own device: norms = 1, the rest ~ N(0, std)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
