"""Reading a LoRA adapter (Hugging Face PEFT's format, or llama.cpp's GGUF: `gguf_lora.py`) for
a loaded llama-family model.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...)
and ``adapter_model.safetensors`` with, per adapted linear layer ``W [out, in]``, the matrices
``lora_A [r, in]`` and ``lora_B [out, r]``; the adapted layer computes
``W x + scale * B (A x)`` with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``). ferrobatch fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``,
so an adapter's q, k and v (gate and up) pairs become one :class:`LoraWeights`: their A matrices
stacked, their B matrices placed block-diagonally (each part's rows of the fused output, its
columns of the stacked A, zeros elsewhere), so one fused module's update is two matmuls,
``(x @ A.T) @ B.T``, whatever it adapts. Both are kept transposed and contiguous (the layout
torch's CPU matmul takes fastest: half the time of the transposed views at decode sizes), and
the scale is folded into B once, here.

Only what this file can apply exactly is accepted: anything else (DoRA, bias training, embedding
or LM-head adapters, pickle checkpoints) is a ValueError naming it, never a silent difference.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.loader import HUB_ID, hub_snapshot
from ferrobatch.model.model_layout import to_model_layout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The HF module names of one decoder layer -> (ferrobatch's fused module, which slice)
HF_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
              "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
              # Phi-3 / Phi-4 adapters adapt the fused modules themselves
              "qkv_proj": ("qkv_proj", 0), "gate_up_proj": ("gate_up_proj", 0)}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|"
                  r"gate_up_proj)\."
                  r"lora_([AB])(?:\.[A-Za-z0-9_\-]+)?\.weight$")


@dataclass(eq=False)
class LoraWeights:
    """One fused module's adapter: ``a_t [in, R]`` (the parts' A matrices stacked, transposed)
    and ``b_t [R, out]`` (each part's B times its scale in its block, zeros elsewhere,
    transposed): the module's output gains ``(x @ a_t) @ b_t``."""

    a_t: torch.Tensor
    b_t: torch.Tensor


@dataclass(eq=False)
class LoraAdapter:
    """An adapter's weights per decoder layer: ``layers[i]`` maps a fused module name
    (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) to its :class:`LoraWeights`
    (modules the adapter leaves alone are absent)."""

    path: str
    rank: int                    # the largest r of its modules
    layers: list[dict[str, LoraWeights]] = field(default_factory=list)
    base_model: str | None = None   # the model it says it was trained on, if it says

    @property
    def num_bytes(self) -> int:
        """Bytes its weights take."""
        return sum(w.a_t.numel() * w.a_t.element_size() + w.b_t.numel() * w.b_t.element_size()
                   for layer in self.layers for w in layer.values())

    @property
    def modules(self) -> list[str]:
        """The fused modules it adapts in some layer, in model order."""
        seen = {name for layer in self.layers for name in layer}
        return [m for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if m in seen]


def _module_shapes(config: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """HF module -> (in_features, out_features, offset of its rows in the fused output)."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (h, q, 0), "k_proj": (h, kv, q), "v_proj": (h, kv, q + kv),
            "o_proj": (q, h, 0), "gate_proj": (h, inter, 0), "up_proj": (h, inter, inter),
            "down_proj": (inter, h, 0), "qkv_proj": (h, q + 2 * kv, 0),
            "gate_up_proj": (h, 2 * inter, 0)}


def _fused_out_features(config: ModelConfig) -> dict[str, int]:
    """Output features of each fused module."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv_proj": q + 2 * kv, "o_proj": config.hidden_size,
            "gate_up_proj": 2 * config.intermediate_size, "down_proj": config.hidden_size}


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` look-up: a key names the module itself or a
    suffix of its dotted name (or is a regex that matches such a suffix)."""
    for key, value in (patterns or {}).items():
        if module_name == key or module_name.endswith("." + key) or \
                re.fullmatch(rf"(?:.*\.)?{key}", module_name):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    """The adapter's ``adapter_config.json``, checked for what ferrobatch can apply."""
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ValueError(f"LoRA adapter {path!r} {what} (a PEFT adapter directory holds "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE}; a llama.cpp adapter is a .gguf "
                         f"file)")
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is unreadable: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"LoRA adapter {path!r} is a {kind} adapter; only LORA is supported")
    refusals = (("use_dora", "DoRA adapters are not supported"),
                ("fan_in_fan_out", "fan_in_fan_out adapters (GPT-2 style Conv1D) do not fit "
                                   "llama's linear layers"),
                ("modules_to_save", "adapters that retrain whole modules (modules_to_save) "
                                    "are not supported"),
                ("layer_replication", "layer_replication is not supported"))
    for key, why in refusals:
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {why} ({key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: trained biases (bias={cfg['bias']!r}) are "
                         f"not supported")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"LoRA adapter {path!r}: {key} must be a positive number, got "
                             f"{value!r}")
    return cfg


def read_lora_adapter(path: str, config: ModelConfig, *, max_rank: int = 16,
                      dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> LoraAdapter:
    """The adapter at ``path`` for a model of ``config``, as ``dtype`` on ``device``: a PEFT
    directory, a Hugging Face Hub id of one (``org/name``: its cached snapshot, else
    downloaded, as models are), or a llama.cpp GGUF LoRA file (``.gguf``, what
    ``convert_lora_to_gguf.py`` writes; ``gguf_lora.py``).

    Raises ValueError for anything it cannot apply exactly: a missing or pickle-only checkpoint,
    an unknown tensor, a shape that does not fit the model, a rank above ``max_rank``."""
    local = os.path.expanduser(path)
    if not os.path.exists(local) and HUB_ID.fullmatch(path):       # "org/name" on the Hub
        try:
            local = hub_snapshot(path)
        except FileNotFoundError as exc:
            raise ValueError(f"LoRA adapter {path!r}: {exc}") from None
    path = os.path.abspath(local)
    if path.endswith(".gguf") and os.path.isfile(path):
        from ferrobatch.model.gguf_lora import read_gguf_lora
        pairs, scale_of = read_gguf_lora(path, config)
    else:
        pairs, scale_of = _read_peft(path, config)
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA matrices")
    adapter = _assemble(path, config, pairs, scale_of, max_rank, dtype, device)
    if os.path.isdir(path):
        base = read_adapter_config(path).get("base_model_name_or_path")
        adapter.base_model = base if isinstance(base, str) and base else None
    return adapter


def _read_peft(path: str, config: ModelConfig) -> tuple[dict, Callable[[str, int], float]]:
    """A PEFT directory's ``{(layer, HF module): {"A": a, "B": b}}`` and its scale rule."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_adapter_config(path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise ValueError(f"LoRA adapter {path!r} has only adapter_model.bin (a pickle "
                             f"file, which ferrobatch never loads); save it with "
                             f"safe_serialization=True")
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    try:
        state = load_file(weights_path, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is unreadable: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA A/B matrix "
                             f"of a llama decoder layer's q/k/v/o/gate/up/down projection")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= config.num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} names layer {layer}; the "
                             f"model has {config.num_layers}")
        pairs.setdefault((layer, module), {})[which] = tensor
    use_rslora = bool(cfg.get("use_rslora", False))

    def scale_of(name: str, rank: int) -> float:
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), name, cfg["lora_alpha"]))
        return alpha / (math.sqrt(rank) if use_rslora else rank)
    return pairs, scale_of


def _assemble(path: str, config: ModelConfig, pairs: dict,
              scale_of: Callable[[str, int], float], max_rank: int, dtype: torch.dtype,
              device: torch.device | str) -> LoraAdapter:
    """The A/B pairs of HF modules, checked against the model's shapes, as fused modules'
    :class:`LoraWeights`, ``scale_of(module name, rank)`` folded into B."""
    shapes = _module_shapes(config)
    adapter = LoraAdapter(path, 0, [{} for _ in range(config.num_layers)])
    grouped: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pairs.items(), key=lambda kv: (
            kv[0][0], list(HF_MODULES).index(kv[0][1]))):
        name = f"model.layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {name} has lora_{''.join(ab)} without "
                             f"its pair")
        a, b = ab["A"], ab["B"]
        in_features, out_features, offset = shapes[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_features) or \
                tuple(b.shape) != (out_features, rank):
            raise ValueError(f"LoRA adapter {path!r}: {name}'s lora_A {tuple(a.shape)} / "
                             f"lora_B {tuple(b.shape)} do not fit the model's "
                             f"[{out_features} x {in_features}] layer")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: {name} has rank {rank}, above "
                             f"max_lora_rank {max_rank}")
        scale = scale_of(name, rank)
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") \
            else "mlp"
        b = to_model_layout(f"{part}.{module}.weight", b, config)   # as the module's weight
        adapter.rank = max(adapter.rank, rank)
        fused, _ = HF_MODULES[module]
        grouped.setdefault((layer, fused), []).append(
            (offset, offset + out_features, a.float(), b.float() * scale))
    out_features = _fused_out_features(config)
    for (layer, fused), parts in grouped.items():
        a = torch.cat([p[2] for p in parts])
        b = torch.zeros(out_features[fused], a.shape[0])
        start = 0
        for out_start, out_stop, a_part, b_part in parts:
            b[out_start:out_stop, start:start + a_part.shape[0]] = b_part
            start += a_part.shape[0]
        adapter.layers[layer][fused] = LoraWeights(
            a.T.to(device=device, dtype=dtype).contiguous(),
            b.T.to(device=device, dtype=dtype).contiguous())
    return adapter
