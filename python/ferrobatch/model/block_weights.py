"""A GGUF model's linear weights as the file stores them (4-bit or Q8_0 blocks), for the CPU
kernels that read them directly (``rust_scheduler/src/cpu_quant_linear.rs`` and the AMX /
quantized-panel packings of the same arrays).

The float32 model keeps its own weights; these arrays describe *the same* numbers in 4.5 to 8.5
bits: each group of 32 inputs is ``scale * q + minimum`` with 4-bit ``q`` (the ``Q4_1`` kernel:
GGUF Q4_1, and Q4_0 and Q4_K rewritten in that form, ``dequant.q4_parts`` / ``q4_nibbles``) or ``scale * q``
with 8-bit ``q`` (``Q8_0``), and each group of 16 ``scale * q + minimum`` with 8-bit ``q``
(``Q8_G16``: Q5_0 / Q5_1 / Q5_K / Q6_K, ``dequant.g16_parts``, and a fused module whose parts
come in different formats), exactly what the loader's dequantization computed.
``block_weights_for_modules`` lays them out like the model's fused modules (q/k/v rows
un-permuted and concatenated, gate/up concatenated, the LM head from the tied embedding) and
proves each against the module's float32 weight, bit for bit, before anything uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferrobatch.model.dequant import (
    G16_TYPES,
    Q4_TYPES,
    g16_parts,
    k_quant_g16_into,
    per_16,
    q4_k_into,
    q4_nibbles,
)

Q4_1, Q8_0 = 3, 8           # two kernels: type ids of the GGUF formats they were made for
_Q4_K, _Q5_K, _Q6_K = 12, 13, 14     # converted in Rust straight into a module's arrays
Q8_G16 = 1016               # the third: int8 weights, a scale and a minimum per 16 (no GGUF id)
BLOCK = 32
_Q8_0_BYTES = 34


@dataclass(eq=False)
class BlockWeight:
    """One ``[N, K]`` weight as the kernel reads it: ``scale`` float32 ``[N, K / 32]``, for
    ``Q4_1`` ``minimum`` float32 ``[N, K / 32]`` and ``qs`` uint8 ``[N, K / 32, 16]`` (byte j:
    weight j in the low nibble, weight j + 16 in the high one), for ``Q8_0`` ``qs`` int8
    ``[N, K / 32, 32]`` and no minimum; for ``Q8_G16`` ``scale`` and ``minimum`` float32
    ``[N, K / 16]``, ``qs`` int8 ``[N, K / 32, 32]``."""

    type_id: int
    scale: torch.Tensor
    qs: torch.Tensor
    minimum: torch.Tensor | None = None

    @classmethod
    def from_gguf(cls, type_id: int, raw: torch.Tensor) -> BlockWeight | None:
        """A GGUF tensor's bytes ``uint8 [N, bytes per row]`` (Q4_0 / Q4_1 / Q4_K / Q8_0), or
        None for a type no kernel reads."""
        rows = raw.shape[0]
        if type_id in Q4_TYPES:
            scale, minimum, nibbles = q4_nibbles(raw, type_id)
            return cls(Q4_1, scale, nibbles, minimum)
        if type_id in G16_TYPES:
            scale, minimum, q = g16_parts(raw, type_id)
            return cls(Q8_G16, scale, q, minimum)
        if type_id == Q8_0:
            blocks = raw.view(rows, -1, _Q8_0_BYTES)
            scale = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
            return cls(Q8_0, scale, blocks[..., 2:].contiguous().view(torch.int8))
        return None

    @property
    def shape(self) -> tuple[int, int]:
        rows, num_blocks = self.qs.shape[:2]
        return rows, num_blocks * BLOCK

    def as_q8_g16(self) -> BlockWeight:
        """The same weight in the ``Q8_G16`` form (each group of 32's scale and minimum for both
        its halves; Q8_0's minimum 0, which leaves every weight's value as it was)."""
        if self.type_id == Q8_G16:
            return self
        scale = per_16(self.scale)
        if self.type_id == Q4_1:
            q = torch.cat((self.qs & 0x0F, self.qs >> 4), dim=-1).to(torch.int8)
            return BlockWeight(Q8_G16, scale, q, per_16(self.minimum))
        return BlockWeight(Q8_G16, scale, self.qs, torch.zeros_like(scale))

    def rows_permuted(self, permute) -> BlockWeight:
        """The same weight with its rows reordered by ``permute`` (a function of a tensor whose
        first dimension is the rows)."""
        minimum = None if self.minimum is None else permute(self.minimum).contiguous()
        return BlockWeight(self.type_id, permute(self.scale).contiguous(),
                           permute(self.qs).contiguous(), minimum)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight, computed as the loader computes it."""
        rows = self.scale.shape[0]
        if self.type_id == Q4_1:
            q = torch.cat((self.qs & 0x0F, self.qs >> 4), dim=-1).float()
            return (self.scale[..., None] * q + self.minimum[..., None]).reshape(rows, -1)
        if self.type_id == Q8_G16:
            q = self.qs.reshape(rows, -1, 16).float()
            return (self.scale[..., None] * q + self.minimum[..., None]).reshape(rows, -1)
        return (self.scale[..., None] * self.qs.float()).reshape(rows, -1)

    def kernel_arrays(self) -> tuple[np.ndarray, ...]:
        """What the kernel reads: ``(scale, min, qs)`` for Q4_1 and Q8_G16, ``(scale, qs)`` for
        Q8_0."""
        parts = (self.scale, self.qs) if self.type_id == Q8_0 else (self.scale, self.minimum, self.qs)
        return tuple(np.ascontiguousarray(t.numpy()) for t in parts)


KERNEL_TYPES = (*Q4_TYPES, *G16_TYPES, Q8_0)     # GGUF types some block kernel reads


def kept_as_blocks(name: str, type_id: int, ndim: int, config) -> bool:
    """True for a GGUF tensor (Hugging Face name ``name``) a block kernel can read as the model
    keeps it: a linear layer's weight (or the tied embedding, the LM head's) in a block format,
    not rescaled by the model's layout (Granite's folded multipliers)."""
    from ferrobatch.model.model_layout import folded_factor

    if ndim != 2 or type_id not in KERNEL_TYPES:
        return False
    linear = name.endswith("_proj.weight") or name == "lm_head.weight" or (
        name == "model.embed_tokens.weight" and config.tie_word_embeddings)
    return linear and folded_factor(name, config) == 1.0


def gguf_block_weight(tensor, name: str, config) -> BlockWeight:
    """A GGUF tensor (``gguf_file.GGUFTensorInfo`` of a :data:`KERNEL_TYPES` type, Hugging Face
    name ``name``) as blocks, rows in the checkpoint's Hugging Face order (Llama Q/K
    un-permuted as the loader does)."""
    from ferrobatch.model.gguf_loader import permuted_qk_heads, reverse_llama_permute

    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
    weight = BlockWeight.from_gguf(tensor.type_id, raw.reshape(tensor.shape[0], -1))
    heads = permuted_qk_heads(name, config)
    if heads is None:
        return weight
    return weight.rows_permuted(lambda t: reverse_llama_permute(t, heads))


def _in_model_layout(name: str, weight: BlockWeight, config) -> BlockWeight:
    """Blocks of checkpoint tensor ``name`` with the model's row order (partial rotary's
    q / k head dims); the model's folded factors are not applied (see :func:`kept_as_blocks`)."""
    from ferrobatch.model.partial_rotary import head_dim_order, reorder_heads

    if head_dim_order(config) is None or "self_attn." not in name:
        return weight
    return weight.rows_permuted(lambda t: reorder_heads(name, t, config))


def read_block_weights(path: str, config) -> dict[str, BlockWeight]:
    """The Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 tensors of a GGUF file under
    their Hugging Face names (``...q_proj.weight``), rows as the model keeps them; other types
    are left out."""
    from ferrobatch.model.gguf_file import GGUFFile
    from ferrobatch.model.gguf_loader import _hf_name

    reader = GGUFFile(path)
    out: dict[str, BlockWeight] = {}
    for tensor in reader.tensors.values():
        name = _hf_name(tensor.name, config.arch)
        if name is None or len(tensor.shape) != 2 or tensor.type_id not in KERNEL_TYPES:
            continue
        out[name] = _in_model_layout(name, gguf_block_weight(tensor, name, config), config)
    return out


def _concat(parts: list[BlockWeight | None]) -> BlockWeight | None:
    """The parts of a fused module stacked (in the ``Q8_G16`` form where their formats
    differ: Q4_K q / k beside a Q6_K v, as in llama.cpp's Q4_K_M)."""
    if any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    if len({p.type_id for p in parts}) != 1:
        parts = [p.as_q8_g16() for p in parts]
    minimum = None if parts[0].minimum is None else torch.cat([p.minimum for p in parts])
    return BlockWeight(parts[0].type_id, torch.cat([p.scale for p in parts]),
                       torch.cat([p.qs for p in parts]), minimum)


def _module_parts(config, names) -> list[tuple[str, list[str]]]:
    """Each linear module of the model (its path) with the checkpoint tensors stacked into its
    weight: q / k / v or a fused qkv, gate / up or a fused gate_up, the LM head or the tied
    embedding."""
    out = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv, gate_up = f"{p}self_attn.qkv_proj.weight", f"{p}mlp.gate_up_proj.weight"
        out += [
            (f"layers.{i}.self_attn.qkv_proj", [qkv] if qkv in names else
             [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]),
            (f"layers.{i}.self_attn.o_proj", [f"{p}self_attn.o_proj.weight"]),
            (f"layers.{i}.mlp.gate_up_proj", [gate_up] if gate_up in names else
             [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up")]),
            (f"layers.{i}.mlp.down_proj", [f"{p}mlp.down_proj.weight"])]
    out.append(("lm_head", ["model.embed_tokens.weight"] if config.tie_word_embeddings
                else ["lm_head.weight"]))
    return out


def module_block_weights(tensors: dict, state: dict[str, torch.Tensor], config,
                         progress=None) -> dict[str, BlockWeight]:
    """Module path -> its blocks in the model's layout, for every linear module whose
    checkpoint tensors are all in ``tensors`` (GGUF tensors, ``gguf_file.GGUFTensorInfo``, of
    :data:`KERNEL_TYPES`, under their Hugging Face names); the parts of a module only partly
    there are dequantized into ``state`` in place of their meta placeholders (the loader's
    float32 values), so ``state`` holds every other weight. ``progress(bytes)`` is told of each
    module's file bytes as they are converted."""
    modules: dict[str, BlockWeight] = {}
    for path, names in _module_parts(config, set(tensors) | set(state)):
        parts = [tensors.get(n) for n in names]
        if all(p is not None for p in parts):
            modules[path] = _fused_blocks(names, parts, config) or _concat(
                [_in_model_layout(n, gguf_block_weight(p, n, config), config)
                 for n, p in zip(names, parts, strict=True)])
        else:
            for name, part in zip(names, parts, strict=True):
                if part is not None and name in state and state[name].is_meta:
                    state[name] = gguf_block_weight(part, name, config).dequantize()
        if progress is not None:
            progress(sum(p.data.nbytes for p in parts if p is not None))
    return modules


def _fused_blocks(names: list[str], tensors: list, config) -> BlockWeight | None:
    """A module's blocks made in one pass from its parts' bytes in the file (no copy of them,
    no concatenation of converted parts): for parts all Q4_K (the Q4_1 form), or Q4_K / Q5_K /
    Q6_K in a mix (Q8G16, as :func:`_concat` makes a module of mixed formats: Q4_K_M's Q4_K q /
    k beside a Q6_K v), each converted in Rust straight into its rows of the module's arrays,
    its rows taken in the model's order; None for parts of other types (:func:`_concat`'s
    way)."""
    forms = {{_Q4_K: Q4_1, _Q5_K: Q8_G16, _Q6_K: Q8_G16}.get(t.type_id) for t in tensors}
    if None in forms:
        return None
    form = forms.pop() if len(forms) == 1 else Q8_G16    # mixed: all in Q8G16's form
    counts = [t.shape[0] for t in tensors]
    rows, cols = sum(counts), tensors[0].shape[1]
    if form == Q4_1:
        weight = BlockWeight(Q4_1, torch.empty(rows, cols // BLOCK),
                             torch.empty(rows, cols // BLOCK, 16, dtype=torch.uint8),
                             torch.empty(rows, cols // BLOCK))
    else:
        weight = BlockWeight(Q8_G16, torch.empty(rows, cols // 16),
                             torch.empty(rows, cols // BLOCK, BLOCK, dtype=torch.int8),
                             torch.empty(rows, cols // 16))
    start = 0
    for name, tensor, count in zip(names, tensors, counts, strict=True):
        raw = np.asarray(tensor.data).reshape(count, -1)      # the file's mapped bytes
        order = _model_row_order(name, count, config)
        if order is not None:
            raw = raw[order]
        end = start + count
        scale, minimum, qs = weight.scale[start:end], weight.minimum[start:end], \
            weight.qs[start:end]
        if form == Q4_1:
            q4_k_into(raw, scale, minimum, qs)
        else:
            k_quant_g16_into(raw, tensor.type_id, scale, minimum, qs)
        start = end
    return weight


def _model_row_order(name: str, rows: int, config) -> np.ndarray | None:
    """Which checkpoint row of tensor ``name`` each of the model's rows is (Llama's Q / K rows
    un-permuted as :func:`gguf_block_weight` does them, then :func:`_in_model_layout`'s
    partial-rotary order); None where the model keeps the file's order."""
    from ferrobatch.model.gguf_loader import permuted_qk_heads, reverse_llama_permute
    from ferrobatch.model.partial_rotary import head_dim_order, reorder_heads

    index = torch.arange(rows)[:, None]
    heads = permuted_qk_heads(name, config)
    if heads is not None:
        index = reverse_llama_permute(index, heads)
    if head_dim_order(config) is not None and "self_attn." in name:
        index = reorder_heads(name, index, config)
    index = index[:, 0]
    return None if torch.equal(index, torch.arange(rows)) else index.numpy()


def block_weights_for_modules(model, blocks: dict[str, BlockWeight]) -> dict[str, BlockWeight]:
    """Module path (``layers.3.self_attn.qkv_proj``, ``lm_head``) -> its blocks, for every linear
    module whose float32 weight the blocks (:func:`read_block_weights`) reproduce exactly; the
    rest are left out. Call it before the weights are packed (it reads each
    ``nn.Linear.weight``)."""
    out = {}
    for path, names in _module_parts(model.config, blocks):
        weight = model.lm_head_weight if path == "lm_head" else _weight(model.get_submodule(path))
        bw = _concat([blocks.get(n) for n in names])
        if bw is not None and weight is not None and tuple(weight.shape) == bw.shape \
                and torch.equal(bw.dequantize(), weight):
            out[path] = bw
    return out


def materialize_block_linears(model, blocks: dict[str, BlockWeight]) -> int:
    """Gives each linear module of ``model`` whose weight is still on the meta device (a model
    loaded with ``load_gguf_blocks``) its float32 weight, dequantized from ``blocks``, and a
    tied LM head kept in the file's format its float32 matrix (the embedding dequantized);
    returns how many."""
    from ferrobatch.model.quantized_embedding import QuantizedEmbedding

    made = 0
    if model.lm_head is None and isinstance(model.embed_tokens, QuantizedEmbedding):
        model.embed_tokens = model.embed_tokens.dequantized()
        made += 1
    for path, weight in blocks.items():
        module = getattr(model, "lm_head", None) if path == "lm_head" else \
            model.get_submodule(path)
        if module is not None and getattr(module, "weight", None) is not None \
                and module.weight.is_meta:
            module.weight = torch.nn.Parameter(weight.dequantize(), requires_grad=False)
            made += 1
    return made


def _weight(module) -> torch.Tensor | None:
    """A linear module's float32 ``[N, K]`` weight (None once it has been packed away)."""
    return getattr(module, "weight", None)
