"""RoPE over part of each head (Phi-4-mini's ``partial_rotary_factor``): q / k kept in the
reordered head layout of ``model.partial_rotary``, checked end to end against transformers for
Hugging Face directories, GGUF files (their blocks reordered too), LoRA adapters and weight
updates."""

from __future__ import annotations

import torch
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model
from step_builder import ToyScheduler
from test_phi3 import TINY_PHI3

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.loader import load_model
from ferrobatch.model.model_layout import to_model_layout
from ferrobatch.model.partial_rotary import head_dim_order
from ferrobatch.runtime.model_runner import ModelRunner

# head_dim 16, RoPE over 12 of them (Phi-4-mini: 96 of 128), LongRoPE's factors for 6 frequencies
PHI4_MINI = {**TINY_PHI3, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
             "max_position_embeddings": 128, "original_max_position_embeddings": 64,
             "rope_scaling": {"type": "longrope",
                              "short_factor": [1.0 + 0.4 * i for i in range(6)],
                              "long_factor": [3.0 + 0.5 * i for i in range(6)]}}


def test_the_head_order_pairs_rotated_dims_half_a_head_apart():
    config = ModelConfig(arch="phi3", vocab_size=8, hidden_size=64, intermediate_size=8,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=12)
    order = head_dim_order(config).tolist()
    assert order == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    assert head_dim_order(ModelConfig(arch="phi3", vocab_size=8, hidden_size=64,
                                      intermediate_size=8, num_layers=1, num_heads=4,
                                      num_kv_heads=2, head_dim=16)) is None
    qkv = torch.arange(128.0)[:, None]      # q: 4 heads, k: 2, v: 2 of 16 rows
    moved = to_model_layout("model.layers.0.self_attn.qkv_proj.weight", qkv, config)[:, 0]
    assert moved[:16].tolist() == [float(i) for i in order]
    assert moved[64:80].tolist() == [64.0 + i for i in order]          # k's first head
    assert torch.equal(moved[96:], qkv[96:, 0])                         # v as it was


def test_a_phi4_mini_shaped_directory_matches_transformers(tmp_path, monkeypatch):
    reference = random_hf_model(PHI4_MINI, seed=21, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.rotary_dim == 12 and loaded.config.max_position_embeddings == 64
    assert_greedy_matches(loaded, reference, [list(range(3, 50)), [5, 9, 11]], 6)
    # the weights left in transformers' order give other logits: the reordering is what matched
    import ferrobatch.model.loader as loader
    monkeypatch.setattr(loader, "state_in_model_layout", lambda state, config: state)
    unordered = load_model(str(tmp_path))
    prompt = list(range(3, 50))
    runner = ModelRunner(unordered, num_blocks=64, block_size=4)
    sched = ToyScheduler(64, 4, token_budget=64)
    sched.add(0, prompt, 1)
    logits = runner.execute(sched.schedule())[0]
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0, -1]
    assert (logits - want).abs().max() > 0.05


def test_a_phi4_mini_shaped_gguf_with_q8_0_blocks_matches_transformers(tmp_path):
    """``phi3.rope.dimension_count`` 12 of 16: the loader's weights and the Q8_0 blocks the CPU
    kernels read (q / k rows reordered alike, or the bit-for-bit proof would drop them)."""
    import math

    import numpy as np

    from ferrobatch.model.block_weights import block_weights_for_modules, read_block_weights

    cfg = {**PHI4_MINI, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "partial_rotary_factor": 0.75,
           "rope_scaling": {"type": "longrope",
                            "short_factor": [1.0 + 0.2 * i for i in range(12)],
                            "long_factor": [3.0 + 0.5 * i for i in range(12)]}}
    reference = random_hf_model(cfg, seed=22, std=0.3)
    scaling = cfg["rope_scaling"]

    def keys(writer):
        writer.add_rope_dimension_count(24)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(2.0) / math.log(64)))
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))

    path = tmp_path / "phi4-mini-ish.gguf"
    write_tiny_gguf(path, reference, cfg, "phi3", metadata=keys, q8_0_linears=True)
    loaded = load_model(str(path))
    assert loaded.config.rotary_dim == 24 and loaded.config.head_dim == 32
    proven = block_weights_for_modules(loaded.model, read_block_weights(str(path), loaded.config))
    assert "layers.0.self_attn.qkv_proj" in proven and "layers.1.self_attn.qkv_proj" in proven
    assert_greedy_matches(loaded, reference, [list(range(3, 50)), [5, 9, 11]], 6)


def test_lora_and_weight_updates_follow_the_order(tmp_path):
    """A trainer's new weights and a PEFT adapter of Phi-3's fused modules, both in
    transformers' head order, give transformers' tokens."""
    from lora_files import PHI3, assert_update_and_lora_match_transformers

    assert_update_and_lora_match_transformers(tmp_path, PHI4_MINI, PHI3, (23, 24, 3))


def test_a_phi4_mini_shaped_gguf_in_k_quants_loads_as_blocks_in_the_head_order(tmp_path):
    """Q4_K / Q6_K modules loaded as blocks are made straight from the file's bytes, in Rust
    (``block_weights._fused_blocks``), their rows in the model's order: the fused q / k / v's
    reordered head dims too. The oracle: the blocks the float32 path proves, value for value,
    and transformers' tokens."""
    from ferrobatch.model.block_weights import block_weights_for_modules, read_block_weights

    cfg = {**PHI4_MINI, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 256, "rope_scaling": None}
    reference = random_hf_model(cfg, seed=23, std=0.3)
    path = tmp_path / "phi4-mini-kquants.gguf"
    write_tiny_gguf(path, reference, cfg, "phi3",
                    metadata=lambda writer: writer.add_rope_dimension_count(48),
                    linear_types=lambda name: "Q6_K" if "attn_qkv" in name else "Q4_K",
                    embedding_type="Q4_K")
    dense = load_model(str(path))
    assert dense.config.rotary_dim == 48 and dense.config.head_dim == 64
    proven = block_weights_for_modules(dense.model, read_block_weights(str(path), dense.config))
    loaded = load_model(str(path), gguf_blocks=True)
    blocks = loaded.model.gguf_block_weights
    assert sorted(blocks) == sorted(proven) and len(blocks) == 2 * 4 + 1
    for name, want in proven.items():
        got = blocks[name]
        assert got.type_id == want.type_id, name
        assert torch.equal(got.scale, want.scale) and torch.equal(got.qs, want.qs), name
        assert torch.equal(got.minimum, want.minimum), name
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert_greedy_matches(loaded, reference, [list(range(3, 50)), [5, 9, 11]], 6, runner=runner)
