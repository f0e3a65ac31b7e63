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
    word-level, byte-level-decoded tokenizer.json): both ferrobatch and transformers load these same weights."""
    key = (seed, num_layers)
    if key in _TINY_DIRS:
        return _TINY_DIRS[key]
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    arch = dict(ARCHS["tiny"], num_hidden_layers=num_layers)
    arch["rope_parameters"] = {"rope_type": "default", "rope_theta": arch.pop("rope_theta")}
    cfg = LlamaConfig(**arch, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = tempfile.mkdtemp(prefix="ferrobatch-bench-tiny-")
    atexit.register(shutil.rmtree, d, True)
    model.save_pretrained(d)
    tok = byte_level_word_backend(cfg.vocab_size, {"<pad>": 0, "<s>": 1, "</s>": 2})
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


def byte_level_word_backend(vocab_size: int, specials: dict[str, int] | None = None):
    """A `tokenizers` tokenizer covering every id < vocab_size: token i is the word " w{i}"
    written as byte-level BPE writes it ("Ġw{i}"), decoded by the byte-level decoder. So it
    detokenizes the way a real BPE vocabulary does (including the engine's token-byte-table fast
    path) without needing merges. `specials`: name -> id, registered as special tokens."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    specials = specials or {}
    taken = set(specials.values())
    vocab = dict(specials)
    vocab.update({f"\u0120w{i}": i for i in range(vocab_size) if i not in taken})
    backend = HFTokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    backend.pre_tokenizer = pre_tokenizers.Sequence([      # " w12 w7" -> " w12", " w7"
        pre_tokenizers.Split(Regex(" ?[^ ]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def word_level_tokenizer(vocab_size: int, bos_token_id: int | None, eos_token_id: int | None):
    """`byte_level_word_backend` wrapped in ferrobatch's Tokenizer: it exists only because the
    engine refuses to serve a model without a tokenizer and `random:<shape>` models (other than
    smollm2-135m) have none. Its per-token detokenization costs what a real BPE vocabulary's does
    (a table look-up); only encoding text differs, and the benches send token ids."""
    from ferrobatch.model.tokenizer import Tokenizer

    return Tokenizer(byte_level_word_backend(vocab_size), bos_token_id=bos_token_id,
                     eos_token_id=eos_token_id)


def ferrobatch_loaded_model(w: Workload):
    """None (let the engine load `w.model` itself), or, for a `random:<shape>` model without a
    tokenizer, the engine's own loaded model with a word-level tokenizer attached."""
    if not w.model.startswith("random:") or w.model == "random:tiny":
        return None
    import torch

    from ferrobatch.model.loader import load_model

    device = w.device if w.device != "cuda" or torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[w.dtype]
    loaded = load_model(w.model, device=device, dtype=dtype)
    if loaded.tokenizer is None:
        c = loaded.config
        loaded.tokenizer = word_level_tokenizer(c.vocab_size, c.bos_token_id, c.eos_token_id)
    return loaded
