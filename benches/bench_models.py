"""Model references shared by the ferrobatch and transformers systems of the benchmarks."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

from workloads import ARCHS, Workload

_TINY_DIRS: dict[tuple[int, int], str] = {}


def materialize_tiny_hf_dir(seed: int = 0, num_layers: int = 2) -> str:
    """A tiny random Llama saved as a Hugging Face directory (config.json, safetensors, a
    word-level tokenizer.json): both ferrobatch and transformers load these same weights."""
    key = (seed, num_layers)
    if key in _TINY_DIRS:
        return _TINY_DIRS[key]
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig

    arch = dict(ARCHS["tiny"], num_hidden_layers=num_layers)
    arch["rope_parameters"] = {"rope_type": "default", "rope_theta": arch.pop("rope_theta")}
    cfg = LlamaConfig(**arch, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = tempfile.mkdtemp(prefix="ferrobatch-bench-tiny-")
    atexit.register(shutil.rmtree, d, True)
    model.save_pretrained(d)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, cfg.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, f)
    _TINY_DIRS[key] = d
    return d


def model_ref(w: Workload) -> str:
    """What to pass as ferrobatch's `model` (and what transformers loads for `random:tiny`)."""
    if w.model == "random:tiny":
        return materialize_tiny_hf_dir()
    return w.model
