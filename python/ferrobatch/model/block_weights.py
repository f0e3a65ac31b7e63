"""A GGUF model's linear weights as the file stores them (Q4_1 / Q8_0 blocks), for the CPU kernel
that reads them directly when a step has only a few rows (``rust_scheduler/src/cpu_quant_linear.rs``).

The float32 model keeps its own weights; these blocks describe *the same* numbers in 4.5 or 8.5
bits: each block of 32 inputs is ``scale * q + min`` (Q4_1) or ``scale * q`` (Q8_0), exactly
what the loader's dequantization computed. ``block_weights_for_modules`` lays them out like the
model's fused modules (q/k/v rows un-permuted and concatenated, gate/up concatenated, the LM head
from the tied embedding) and proves each against the module's float32 weight, bit for bit,
before anything uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferrobatch.model.dequant import _dequant_blocks

Q4_1, Q8_0 = 3, 8
_BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
BLOCK = 32


@dataclass
class BlockWeight:
    """One ``[N, K]`` weight as ``uint8 [N, K / 32, bytes per block]`` raw GGUF blocks."""

    type_id: int
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, num_blocks, _ = self.blocks.shape
        return rows, num_blocks * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight, computed as the loader computes it."""
        rows = self.blocks.shape[0]
        return _dequant_blocks(self.blocks.reshape(rows, -1), self.type_id)

    def kernel_arrays(self) -> tuple[np.ndarray, ...]:
        """What the kernel reads: ``(scale, min, qs)`` for Q4_1, ``(scale, qs)`` for Q8_0."""
        b = self.blocks
        scale = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0].numpy()
        if self.type_id == Q4_1:
            minimum = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0].numpy()
            return scale, minimum, np.ascontiguousarray(b[..., 4:].numpy())
        return scale, np.ascontiguousarray(b[..., 2:].numpy().view(np.int8))


def read_block_weights(path: str, config) -> dict[str, BlockWeight]:
    """The Q4_1 / Q8_0 tensors of a GGUF file under their Hugging Face names (``...q_proj.weight``),
    Llama Q/K rows un-permuted as the loader does; other types are left out."""
    from ferrobatch.model.gguf_file import GGUFFile
    from ferrobatch.model.gguf_loader import _hf_name, reverse_llama_permute

    reader = GGUFFile(path)
    out: dict[str, BlockWeight] = {}
    for tensor in reader.tensors.values():
        name = _hf_name(tensor.name, config.arch)
        size = _BLOCK_BYTES.get(tensor.type_id)
        if name is None or size is None or len(tensor.shape) != 2:
            continue
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        blocks = raw.reshape(tensor.shape[0], -1, size)
        if config.arch == "llama" and ".q_proj." in name:
            blocks = reverse_llama_permute(blocks, config.num_heads).contiguous()
        elif config.arch == "llama" and ".k_proj." in name:
            blocks = reverse_llama_permute(blocks, config.num_kv_heads).contiguous()
        out[name] = BlockWeight(tensor.type_id, blocks)
    return out


def _concat(parts: list[BlockWeight | None]) -> BlockWeight | None:
    if any(p is None for p in parts) or len({p.type_id for p in parts}) != 1:
        return None
    return BlockWeight(parts[0].type_id, torch.cat([p.blocks for p in parts]))


def block_weights_for_modules(model, blocks: dict[str, BlockWeight]) -> dict[str, BlockWeight]:
    """Module path (``layers.3.self_attn.qkv_proj``, ``lm_head``) -> its blocks, for every linear
    module whose float32 weight the blocks reproduce exactly; the rest are left out. Call it
    before the weights are packed (it reads each ``nn.Linear.weight``)."""
    wanted: dict[str, tuple[BlockWeight | None, torch.Tensor]] = {}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = blocks.get(f"{p}self_attn.qkv_proj.weight") or _concat(
            [blocks.get(f"{p}self_attn.{n}_proj.weight") for n in "qkv"])     # fused: Phi-3
        gate_up = blocks.get(f"{p}mlp.gate_up_proj.weight") or _concat(
            [blocks.get(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")])
        wanted[f"layers.{i}.self_attn.qkv_proj"] = (qkv, _weight(attn.qkv_proj))
        wanted[f"layers.{i}.self_attn.o_proj"] = (blocks.get(f"{p}self_attn.o_proj.weight"),
                                                  _weight(attn.o_proj))
        wanted[f"layers.{i}.mlp.gate_up_proj"] = (gate_up, _weight(mlp.gate_up_proj))
        wanted[f"layers.{i}.mlp.down_proj"] = (blocks.get(f"{p}mlp.down_proj.weight"),
                                               _weight(mlp.down_proj))
    head = blocks.get("lm_head.weight") if model.lm_head is not None else blocks.get(
        "model.embed_tokens.weight")
    wanted["lm_head"] = (head, model.lm_head_weight)
    out = {}
    for name, (bw, weight) in wanted.items():
        if bw is not None and weight is not None and tuple(weight.shape) == bw.shape \
                and torch.equal(bw.dequantize(), weight):
            out[name] = bw
    return out


def _weight(module) -> torch.Tensor | None:
    """A linear module's float32 ``[N, K]`` weight (None once it has been packed away)."""
    return getattr(module, "weight", None)
