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


def module_dims(cfg) -> dict[str, tuple[int, int]]:
    """HF module -> (in_features, out_features) for a ferrobatch ModelConfig."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, inter = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


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
            part = "self_attn" if module in ATTN else "mlp"
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
            linear = getattr(block.self_attn if module in ATTN else block.mlp, module)
            linear.weight += scale * (b @ a)
