"""llama.cpp's GGUF LoRA adapters (what its ``convert_lora_to_gguf.py`` writes from a PEFT
directory), read into the same A / B pairs as a PEFT adapter (``lora_adapter.py`` assembles both).

The file says ``general.type = "adapter"``, ``adapter.type = "lora"``, the base model's
``general.architecture`` and ``adapter.lora.alpha``; each adapted projection has
``blk.{i}.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down}.weight.lora_a``
(``[r, in]``) and ``.lora_b`` (``[out, r]``), in any type the dequantizer reads. As in llama.cpp
the scale is ``alpha / r``, or 1 when ``alpha`` is 0 or absent. For the ``llama`` architecture
the converter permutes B's rows of ``attn_q`` / ``attn_k`` as it permutes the base weights for
llama.cpp's rotary layout; they are permuted back here, as the loader does for the base model.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from ferrobatch.model.config import GGUF_PERMUTED_QK, ModelConfig
from ferrobatch.model.dequant import dequantize_tensor
from ferrobatch.model.gguf_file import GGUFFile
from ferrobatch.model.gguf_loader import reverse_llama_permute

GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
                "ffn_down": "down_proj"}
# Phi-3's converter keeps its fused modules: q/k/v as attn_qkv, gate/up as ffn_up
_PHI3_MODULES = {**GGUF_MODULES, "attn_qkv": "qkv_proj", "ffn_up": "gate_up_proj"}
_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight\.lora_([ab])$")


def read_gguf_lora(path: str, config: ModelConfig
                   ) -> tuple[dict, Callable[[str, int], float]]:
    """``{(layer, HF module): {"A": a, "B": b}}`` (float32) of a GGUF LoRA file and its scale
    rule; ValueError for a file that is not a LoRA adapter of this model's architecture, or a
    tensor it cannot apply."""
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path!r} is not a readable GGUF file: {exc}") from None
    meta = reader.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ValueError(f"{path!r} is not a GGUF LoRA adapter (general.type "
                         f"{meta.get('general.type')!r}, adapter.type "
                         f"{meta.get('adapter.type')!r}; a model file goes to --model)")
    arch = meta.get("general.architecture")
    if arch != config.arch:
        raise ValueError(f"LoRA adapter {path!r} is for architecture {arch!r}; the model is "
                         f"{config.arch!r}")
    alpha = float(meta.get("adapter.lora.alpha", 0.0) or 0.0)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules = _PHI3_MODULES if config.arch == "phi3" else GGUF_MODULES
    for tensor in reader.tensors.values():
        m = _NAME.match(tensor.name)
        module = modules.get(m.group(2)) if m else None
        if module is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {tensor.name!r} is not a LoRA A/B "
                             f"matrix of a decoder layer's q/k/v/o/gate/up/down projection")
        layer = int(m.group(1))
        if layer >= config.num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {tensor.name!r} names layer "
                             f"{layer}; the model has {config.num_layers}")
        weight = dequantize_tensor(tensor.data, tensor.type_id, tensor.type_name)
        if m.group(3) == "b" and config.arch in GGUF_PERMUTED_QK and module in ("q_proj", "k_proj"):
            heads = config.num_heads if module == "q_proj" else config.num_kv_heads
            if weight.dim() == 2 and weight.shape[0] % (2 * heads) == 0:
                weight = reverse_llama_permute(weight, heads)
        pairs.setdefault((layer, module), {})["A" if m.group(3) == "a" else "B"] = weight

    def scale_of(name: str, rank: int) -> float:
        return alpha / rank if alpha else 1.0
    return pairs, scale_of
