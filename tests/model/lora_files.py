"""LoRA adapters written as Hugging Face PEFT saves them (``adapter_config.json`` +
``adapter_model.safetensors``, keys ``base_model.model.model.layers.{i}.{self_attn|mlp}.{m}
.lora_{A|B}.weight``), with random A and B, and the oracle that merges one into a transformers
model (``W += scale * B @ A``, what PEFT's ``merge_and_unload`` computes)."""

from __future__ import annotations

import json
import math
import os

import torch

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PHI3 = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")     # Phi-3's fused module names


def module_dims(cfg) -> dict[str, tuple[int, int]]:
    """HF module -> (in_features, out_features) for a ferrobatch ModelConfig."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, inter = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
            "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * inter)}


def write_peft_adapter(path: str, cfg, *, targets=("q_proj", "v_proj"), r: int = 8,
                       alpha: float = 16, seed: int = 0, b_std: float = 0.02,
                       layers=None, use_rslora: bool = False, extra_config=None) -> dict:
    """Writes a random adapter; returns ``{(layer, module): (A, B)}`` (float32)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    dims = module_dims(cfg)
    tensors, pairs = {}, {}
    for layer in (range(cfg.num_layers) if layers is None else layers):
        for module in targets:
            fan_in, fan_out = dims[module]
            a = torch.randn(r, fan_in, generator=gen) / math.sqrt(fan_in)
            b = torch.randn(fan_out, r, generator=gen) * b_std
            part = "self_attn" if module in ATTN + ("qkv_proj",) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
            pairs[(layer, module)] = (a, b)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
              "use_rslora": use_rslora, "task_type": "CAUSAL_LM", **(extra_config or {})}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return pairs


def merge_into(hf_model, pairs: dict, scale: float) -> None:
    """Adds ``scale * B @ A`` to each adapted weight of a transformers llama model."""
    with torch.no_grad():
        for (layer, module), (a, b) in pairs.items():
            block = hf_model.model.layers[layer]
            attention = module in ATTN + ("qkv_proj",)
            linear = getattr(block.self_attn if attention else block.mlp, module)
            linear.weight += scale * (b @ a)


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
              "qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}       # the last two: Phi-3's


def write_gguf_lora(path: str, cfg, pairs: dict, alpha: float, *, arch: str = "llama",
                    f16: bool = False, adapter_type: str = "lora") -> None:
    """The GGUF LoRA file llama.cpp's `convert_lora_to_gguf.py` writes for `pairs` (as
    `write_peft_adapter` returns them): `blk.{i}.{name}.weight.lora_a / .lora_b`, B's rows of
    attn_q / attn_k permuted as the converter permutes them for llama."""
    import gguf
    import numpy as np

    from ferrobatch.model.gguf_loader import llama_permute

    writer = gguf.GGUFWriter(path, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", adapter_type)
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for (layer, module), (a, b) in sorted(pairs.items()):
        if arch == "llama" and module in ("q_proj", "k_proj"):
            b = llama_permute(b, cfg.num_heads if module == "q_proj" else cfg.num_kv_heads)
        base = f"blk.{layer}.{GGUF_NAMES[module]}.weight"
        for suffix, t in (("lora_a", a), ("lora_b", b)):
            array = t.numpy().astype(np.float16 if f16 else np.float32)
            writer.add_tensor(f"{base}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_update_and_lora_match_transformers(tmp_path, cfg: dict, targets, seeds: tuple) -> None:
    """A tiny transformers model of config dict ``cfg`` saved and loaded, a trainer's new
    weights (another random model, under transformers' names and values) applied as a weight
    update, then a PEFT adapter on ``targets`` installed in slot 1: rows with the adapter give
    the updated model's tokens with the adapter merged, rows without it the updated model's.
    ``seeds``: (model, update, adapter)."""
    import copy

    from hf_tiny import assert_greedy_matches, random_hf_model

    from ferrobatch.model.loader import load_model
    from ferrobatch.model.lora_adapter import read_lora_adapter
    from ferrobatch.runtime.model_runner import ModelRunner
    from ferrobatch.runtime.weight_update import apply_update, plan_update

    model_seed, update_seed, adapter_seed = seeds
    random_hf_model(cfg, seed=model_seed, std=0.3).save_pretrained(
        tmp_path / "model", safe_serialization=True)
    loaded = load_model(str(tmp_path / "model"))
    updated = random_hf_model(cfg, seed=update_seed, std=0.3)
    apply_update(loaded.model, plan_update(loaded.model, dict(updated.state_dict())))
    pairs = write_peft_adapter(str(tmp_path / "adapter"), loaded.config, targets=targets, r=4,
                               alpha=8, seed=adapter_seed, b_std=0.2)
    merged = copy.deepcopy(updated)
    merge_into(merged, pairs, 2.0)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    runner.enable_lora(max_loras=1, max_rank=4).put(1, read_lora_adapter(
        str(tmp_path / "adapter"), loaded.config))
    assert_greedy_matches(
        loaded, merged, [list(range(3, 30)), [5, 9, 11, 40]], 4, runner=runner,
        execute=lambda batch: runner.execute(batch, lora_slots=[1] * len(batch.seq_req_ids)))
    assert_greedy_matches(loaded, updated, [list(range(3, 30))], 4, runner=runner)
