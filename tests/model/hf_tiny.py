"""Tiny transformers models with random weights: the oracle of the loader and architecture tests
(ferrobatch loads what `save_pretrained` or a GGUF writer makes of them)."""

from __future__ import annotations

import copy

import pytest
import torch


def random_hf_model(config: dict, seed: int, std: float = 0.1):
    """transformers' model for a `config.json` dict, float32, every parameter ~ N(0, std)
    (norms included, so their weights matter), in eval mode. ``config`` is left as it was
    (transformers completes nested rope dicts in place)."""
    transformers = pytest.importorskip("transformers")
    config = copy.deepcopy(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return model
