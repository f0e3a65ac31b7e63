"""Phi-3 / Phi-4 (`phi3`): checkpoints with fused q/k/v and gate/up, LongRoPE within the original
context, a sliding window; Hugging Face directories and GGUF files against transformers."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model
from step_builder import ToyScheduler, greedy_run

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.fused_tensors import split_fused_projections
from ferrobatch.model.hf_loader import config_from_hf
from ferrobatch.model.loader import load_model
from ferrobatch.runtime.model_runner import ModelRunner

TINY_PHI3 = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "max_position_embeddings": 64,
             "original_max_position_embeddings": 64, "sliding_window": None,
             "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 2}
# Phi-3.5-mini's shape of config: LongRoPE factors for 8 frequencies, a 4x stretch
TINY_PHI3_LONGROPE = {**TINY_PHI3, "max_position_embeddings": 128,
                      "original_max_position_embeddings": 32,
                      "rope_scaling": {"type": "longrope",
                                       "short_factor": [1.0 + 0.3 * i for i in range(8)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(8)]}}


def test_a_phi3_directory_matches_transformers(tmp_path):
    reference = random_hf_model(TINY_PHI3, seed=7, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.arch == "phi3" and loaded.config.max_position_embeddings == 64
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6)


def test_longrope_within_the_original_context_matches_transformers(tmp_path, caplog):
    reference = random_hf_model(TINY_PHI3_LONGROPE, seed=8, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    with caplog.at_level(logging.WARNING):
        loaded = load_model(str(tmp_path))
    assert "original context of 32 tokens (not 128)" in caplog.text
    assert loaded.config.max_position_embeddings == 32
    assert loaded.config.rope_scaling["factor"] == 4.0
    # up to 32 tokens, where transformers applies the short factors (and the 4x stretch's
    # attention factor, sqrt(1 + ln 4 / ln 32))
    assert_greedy_matches(loaded, reference, [list(range(3, 26)), [5, 9, 11]], 6)


def test_phi3_configs_read_refused_or_capped(caplog):
    assert config_from_hf({**TINY_PHI3, "partial_rotary_factor": 0.75}).rotary_dim == 12
    with pytest.raises(ValueError, match="rotary_dim 9 must be even"):
        config_from_hf({**TINY_PHI3, "partial_rotary_factor": 0.5625})
    with caplog.at_level(logging.WARNING):       # Phi-3-mini-4k's window of 2047
        assert config_from_hf({**TINY_PHI3, "sliding_window": 47}).max_position_embeddings == 47
    assert "sliding window of 47 tokens" in caplog.text
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        config_from_hf({**TINY_PHI3_LONGROPE, "original_max_position_embeddings": None})


def test_fused_projections_split_into_their_parts():
    config = ModelConfig(arch="phi3", vocab_size=8, hidden_size=8, intermediate_size=6,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2)
    qkv = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    gate_up = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8)
    state = split_fused_projections({"model.layers.0.self_attn.qkv_proj.weight": qkv,
                                     "model.layers.0.mlp.gate_up_proj.weight": gate_up,
                                     "model.norm.weight": torch.ones(8)}, config)
    p = "model.layers.0."
    assert torch.equal(torch.cat([state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]), qkv)
    assert state[f"{p}self_attn.k_proj.weight"].shape == (4, 8)
    assert torch.equal(state[f"{p}mlp.up_proj.weight"], gate_up[6:])
    assert sorted(state) == sorted([f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
                                   + [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight",
                                      "model.norm.weight"])
    with pytest.raises(ValueError, match="qkv_proj.weight: 15 rows, expected 8 \\+ 4 \\+ 4"):
        split_fused_projections({"model.layers.0.self_attn.qkv_proj.weight": qkv[:15]}, config)


def test_a_phi3_gguf_matches_transformers(tmp_path):
    """llama.cpp's phi3 layout: ``attn_qkv`` fused, ``ffn_up`` holding gate then up rows,
    rotate-half RoPE (no Q / K permutation); LongRoPE's factors as ``rope_factors_short`` /
    ``rope_factors_long`` tensors, its attention factor as metadata."""
    import math

    reference = random_hf_model(TINY_PHI3_LONGROPE, seed=9, std=0.3)
    path = tmp_path / "tiny-phi3.gguf"
    scaling = TINY_PHI3_LONGROPE["rope_scaling"]

    def phi3_keys(writer):
        import numpy as np
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(4.0) / math.log(32)))
        writer.add_rope_scaling_orig_ctx_len(32)
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))

    write_tiny_gguf(path, reference, TINY_PHI3_LONGROPE, "phi3", metadata=phi3_keys)
    loaded = load_model(str(path))
    assert loaded.config.arch == "phi3" and loaded.config.max_position_embeddings == 32
    long = load_model(str(path), max_model_len=64).config      # the long factors' tensor
    assert long.max_position_embeddings == 128 and long.rope_scaling["use_long_factor"]
    assert_greedy_matches(loaded, reference, [list(range(3, 26)), [5, 9, 11]], 6)


def test_a_q8_0_phi3_gguf_keeps_its_fused_blocks_and_matches_transformers(tmp_path):
    """The CPU kernels that read GGUF blocks directly take Phi-3's fused ``attn_qkv`` and
    ``ffn_up`` blocks as the fused modules' weights (no re-concatenation)."""
    from ferrobatch.model.block_weights import block_weights_for_modules, read_block_weights

    reference = random_hf_model(TINY_PHI3, seed=10, std=0.3)
    path = tmp_path / "tiny-phi3-q8.gguf"
    write_tiny_gguf(path, reference, TINY_PHI3, "phi3", q8_0_linears=True)
    loaded = load_model(str(path))
    blocks = read_block_weights(str(path), loaded.config)
    assert "model.layers.0.self_attn.qkv_proj.weight" in blocks
    matched = block_weights_for_modules(loaded.model, blocks)
    assert sorted(matched) == sorted(
        [f"layers.{i}.{m}" for i in range(2)
         for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
        + ["lm_head"])
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6)


def test_weights_updated_under_phi3_names_give_the_new_models_tokens(tmp_path):
    """A trainer's Phi-3 tensors (fused ``qkv_proj`` / ``gate_up_proj`` names) replace the
    served weights in place."""
    from ferrobatch.runtime.weight_update import apply_update, plan_update

    first = random_hf_model(TINY_PHI3, seed=11, std=0.3)
    first.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    second = random_hf_model(TINY_PHI3, seed=12, std=0.3)
    update = plan_update(loaded.model, dict(second.state_dict()))
    assert "model.layers.1.self_attn.qkv_proj.weight" in [w.name for w in update.writes]
    apply_update(loaded.model, update)
    assert_greedy_matches(loaded, second, [list(range(3, 30))], 4)


def test_a_phi3_lora_adapter_on_its_fused_modules_matches_the_merged_model(tmp_path):
    """A PEFT adapter of a Phi-3 model targets ``qkv_proj`` / ``gate_up_proj`` (its module
    names); rows with it give transformers' tokens with the adapter merged, rows without it
    the base model's, in the same steps."""
    import copy

    from lora_files import PHI3, merge_into, write_peft_adapter

    from ferrobatch.model.lora_adapter import read_lora_adapter

    reference = random_hf_model(TINY_PHI3, seed=13, std=0.3)
    reference.save_pretrained(tmp_path / "model", safe_serialization=True)
    loaded = load_model(str(tmp_path / "model"))
    pairs = write_peft_adapter(str(tmp_path / "adapter"), loaded.config, targets=PHI3, r=4,
                               alpha=8, seed=1, b_std=0.2)
    adapter = read_lora_adapter(str(tmp_path / "adapter"), loaded.config)
    assert adapter.modules == list(PHI3)
    merged = copy.deepcopy(reference)
    merge_into(merged, pairs, 2.0)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    runner.enable_lora(max_loras=1, max_rank=4).put(1, adapter)
    prompts = {0: list(range(3, 30)), 1: list(range(3, 30)), 2: [5, 9, 11, 40]}
    slot_of = {0: 0, 1: 1, 2: 1}
    sched = ToyScheduler(64, 4, token_budget=16)
    for i, prompt in prompts.items():
        sched.add(i, prompt, 4)
    generated, last = greedy_run(runner, sched, execute=lambda batch: runner.execute(
        batch, lora_slots=[slot_of[int(r)] for r in batch.seq_req_ids]))
    assert generated[0] != generated[1]              # the adapter changes the tokens
    with torch.no_grad():
        for i, prompt in prompts.items():
            oracle = merged if slot_of[i] else reference
            sequence = prompt + generated[i][:-1]
            want = oracle(torch.tensor([sequence])).logits[0]
            assert want[len(prompt) - 1:].argmax(-1).tolist() == generated[i]
            torch.testing.assert_close(last[i], want[-1], rtol=1e-4, atol=1e-4)


def test_a_phi3_gguf_lora_file_reads_as_its_peft_twin(tmp_path):
    """llama.cpp's LoRA converter keeps Phi-3's fused names (``attn_qkv``, ``ffn_up`` for
    gate/up): the adapter read from the GGUF file equals the PEFT one it came from."""
    from lora_files import PHI3, write_gguf_lora, write_peft_adapter

    from ferrobatch.model.lora_adapter import read_lora_adapter

    config = config_from_hf(TINY_PHI3)
    pairs = write_peft_adapter(str(tmp_path / "peft"), config, targets=PHI3, r=4, alpha=8,
                               seed=2)
    write_gguf_lora(str(tmp_path / "a.gguf"), config, pairs, 8, arch="phi3")
    peft = read_lora_adapter(str(tmp_path / "peft"), config)
    gguf = read_lora_adapter(str(tmp_path / "a.gguf"), config)
    assert gguf.modules == peft.modules == list(PHI3)
    for mine, theirs in zip(gguf.layers, peft.layers):
        for name in PHI3:
            torch.testing.assert_close(mine[name].a_t, theirs[name].a_t)
            torch.testing.assert_close(mine[name].b_t, theirs[name].b_t)


def test_a_context_past_the_original_takes_the_long_factors(tmp_path):
    """``max_model_len`` past the original context: the long factors at every position and
    the whole stretched context served (llama.cpp's choice for such a context); transformers
    takes the long factors for any sequence past the original, so sequences of 33..128 tokens
    match it."""
    reference = random_hf_model(TINY_PHI3_LONGROPE, seed=17, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    assert load_model(str(tmp_path)).config.max_position_embeddings == 32     # short factors
    loaded = load_model(str(tmp_path), max_model_len=100)
    assert loaded.config.max_position_embeddings == 128
    assert loaded.config.rope_scaling["use_long_factor"]
    assert_greedy_matches(loaded, reference, [list(range(3, 60)), list(range(20, 90))], 6)
    # past the stretched context too (the engine then refuses it, naming the 128)
    assert load_model(str(tmp_path), max_model_len=500).config.max_position_embeddings == 128


def test_the_engine_serves_a_long_context_when_asked(tmp_path):
    from ferrobatch import LLM, SamplingParams

    cfg = {**TINY_PHI3_LONGROPE, "vocab_size": 49152}
    random_hf_model(cfg, seed=18).save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), tokenizer="smollm2", max_num_seqs=2, max_model_len=100)
    try:
        out = llm.generate([list(range(3, 80))], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()
    with pytest.raises(ValueError, match="128"):
        LLM(model=str(tmp_path), tokenizer="smollm2", max_model_len=500)
