"""Hugging Face model directory -> (ModelConfig, state dict, Tokenizer | None).

Expects ``config.json`` + ``*.safetensors`` (sharded or not) and, optionally, ``tokenizer.json``,
``tokenizer_config.json`` (chat template, special tokens) and ``generation_config.json`` (EOS ids).
A base-model checkpoint (``Qwen3Model``, ``LlamaModel``: what embedding models such as
Qwen3-Embedding ship) names its weights without the ``model.`` prefix and has no LM head: its
names get the prefix, and its logits (only sampled to finish embedding requests) reuse the
token embeddings.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Any

import torch

from ferrobatch.model.attention_window import capped_to_window, sliding_window_of
from ferrobatch.model.config import SUPPORTED_ARCHS, ModelConfig
from ferrobatch.model.fused_tensors import split_fused_projections
from ferrobatch.model.gemma3 import gemma3_config_json, gemma3_fields, is_gemma3
from ferrobatch.model.progress import load_progress
from ferrobatch.model.rope import rope_context_length
from ferrobatch.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _with_original_context(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters completed as transformers completes them: the original context
    from the top level of config.json (where Phi-3 keeps it), the stretch ``factor`` as max
    positions / original (its attention factor depends on it)."""
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return scaling
    original = scaling.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings")
    if not original:
        raise ValueError("config.json: longrope scaling needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original)
    if not scaling.get("factor"):
        scaling["factor"] = int(cfg.get("max_position_embeddings", original)) / int(original)
    return scaling


def _nope_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: where ``no_rope_layers`` says 0, or by default every
    ``no_rope_layer_interval``-th layer (4: layers 3, 7, ...)."""
    if cfg.get("model_type") != "smollm3":
        return ()
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"config.json: no_rope_layers has {len(flags)} entries for {layers} "
                         "layers")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _granite_scalars(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars (transformers' defaults: 1.0, the attention scale included)."""
    if cfg.get("model_type") != "granite":
        return {}
    return {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
            "attention_multiplier": float(cfg.get("attention_multiplier", 1.0))}


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Maps a Hugging Face ``config.json`` dict to ModelConfig; ValueError for other architectures."""
    model_type = cfg.get("model_type")
    gemma3 = is_gemma3(cfg)
    if gemma3:
        cfg, model_type = gemma3_config_json(cfg), "gemma3"
    elif model_type == "gemma3":
        raise ValueError("config.json: a multimodal Gemma 3 checkpoint (model_type 'gemma3', "
                         "4B and up); ferrobatch serves the text ones (model_type "
                         "'gemma3_text': gemma-3-270m, gemma-3-1b)")
    if model_type not in SUPPORTED_ARCHS:
        served = ", ".join("gemma3_text" if a == "gemma3" else a for a in SUPPORTED_ARCHS)
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json; supported: {served}"
        )
    # transformers >= 5 writes rope settings as one "rope_parameters" dict
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
    if rope_scaling is not None:
        rope_scaling = _with_original_context(cfg, dict(rope_scaling))
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        fields = {"tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
                  "qk_norm": model_type == "qwen3",
                  **_granite_scalars(cfg), **(gemma3_fields(cfg, head_dim) if gemma3 else {})}
        return ModelConfig(
            arch=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            **fields,
            nope_layers=_nope_layers(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=capped_to_window(
                rope_context_length(int(cfg.get("max_position_embeddings", 4096)), rope_scaling),
                sliding_window_of(cfg), "config.json"),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_id=_first_id(cfg.get("eos_token_id")),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from exc


def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Loads config, safetensors weights (CPU) and the tokenizer of a Hugging Face directory."""
    from safetensors.torch import load_file

    path = os.fspath(path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {path}")
    hf_cfg = _read_json(config_path)
    if not isinstance(hf_cfg, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    config = config_from_hf(hf_cfg)
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path}")
    state: dict[str, torch.Tensor] = {}
    bar = load_progress(sum(os.path.getsize(s) for s in shards), "Reading safetensors shards")
    for shard in shards:
        try:
            state.update(load_file(shard, device="cpu"))
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types
            raise ValueError(f"cannot read the weights in {shard}: {exc}") from exc
        bar.update(os.path.getsize(shard))
    bar.close()
    state = split_fused_projections(state, config)
    base_model = "model.embed_tokens.weight" not in state and "embed_tokens.weight" in state
    if base_model:
        state = {f"model.{name}": w for name, w in state.items()}
    if base_model and "lm_head.weight" not in state and not config.tie_word_embeddings:
        logger.warning("%s has no LM head (a base or embedding model): its logits reuse the "
                       "token embeddings, so serve it for embeddings, not text", path)
        config = dataclasses.replace(config, tie_word_embeddings=True)
    return config, state, read_hf_tokenizer(path)


def read_hf_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer of a Hugging Face directory (``tokenizer.json``, with
    ``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``'s EOS ids
    where present); None without a ``tokenizer.json``."""
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        return None
    tok_cfg_path = os.path.join(path, "tokenizer_config.json")
    tok_cfg = _read_json(tok_cfg_path) if os.path.isfile(tok_cfg_path) else {}
    gen_path = os.path.join(path, "generation_config.json")
    gen_eos = _read_json(gen_path).get("eos_token_id") if os.path.isfile(gen_path) else None
    gen_eos_ids = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
    template_path = os.path.join(path, "chat_template.jinja")
    if "chat_template" not in tok_cfg and os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as f:
            tok_cfg = {**tok_cfg, "chat_template": f.read()}
    return Tokenizer.from_hf_files(tokenizer_json, tok_cfg, gen_eos_ids)
