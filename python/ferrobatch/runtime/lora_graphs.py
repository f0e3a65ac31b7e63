"""LoRA inside the decode CUDA graphs: adapter weights at fixed addresses, by slot.

A captured graph reads the tensors it was captured with, so decode steps with adapter rows
replay their own set of graphs (``ModelRunner.lora_decode_graphs``, captured beside the plain
ones when LoRA is enabled) that read:

* :class:`GraphLoraWeights`: per layer and module one pair ``a_t [in, max_loras * W]`` and
  ``b_t [max_loras * W, out]`` with ``W = parts * max_rank`` (3 parts for ``qkv_proj``, 2 for
  ``gate_up_proj``, 1 otherwise); the adapter in slot ``s`` sits in block ``s - 1`` (its own
  columns / rows first, zeros after them and in empty slots);
* the decode graphs' static ``lora_blocks`` buffer (``StaticDecodeInputs.lora_blocks``): each
  row's block, -1 for base-model rows and padding; the piecewise graphs' (``lora=...``,
  ``ModelRunner.lora_piecewise_graphs``) the same per token, for prefill and mixed steps.

Each hooked linear then adds ``((x @ a_t) * mask) @ b_t`` into every row, ``mask[row, c]`` being
1 where column ``c`` belongs to the row's block (computed inside the graph from the buffer, once
per module and step): a base-model row adds exact zeros. The same five ops as the eager stacked
step (``runtime.lora``), over every slot's block, so a graph's cost does not depend on which
adapters are loaded.

Threads: slots change on the asyncio thread (``LoraSlots``, copy-on-write); the step thread calls
:meth:`GraphLoraWeights.sync` before each replay, which copies the loaded adapters in when the
slots changed since its last copy. The copies are queued on the step's stream, so replays queued
before them read the old weights and later ones the new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferrobatch.runtime.lora import MODULES, StackedLora

PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


def module_features(config) -> dict[str, tuple[int, int]]:
    """Each fused module's ``(in_features, out_features)``."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * inter),
            "down_proj": (inter, h)}


class GraphLoraWeights:
    """Every slot's adapter at a fixed address (block ``slot - 1`` of each module's pair) for
    the LoRA decode graphs; :meth:`sync` copies the loaded adapters in."""

    def __init__(self, config, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be >= 1")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.widths = {m: PARTS[m] * max_rank for m in MODULES}
        features = module_features(config)
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {m: (torch.zeros(features[m][0], max_loras * self.widths[m], dtype=dtype,
                             device=device),
                 torch.zeros(max_loras * self.widths[m], features[m][1], dtype=dtype,
                             device=device))
             for m in MODULES} for _ in range(config.num_layers)]
        # column -> its block, per module (the mask compares it with each row's block)
        self.owners = {m: torch.arange(max_loras, device=device).repeat_interleave(w)
                       for m, w in self.widths.items()}
        self._synced: StackedLora | None = None   # the slots' stack last copied in
        self.syncs = 0                            # times the weights were (re)copied

    @property
    def num_bytes(self) -> int:
        """Bytes the static weights take."""
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for pair in layer.values() for t in pair)

    def sync(self, stacked: StackedLora | None) -> None:
        """Copies ``stacked``'s adapters (``LoraSlots.stacked``: slot ``s`` to block ``s - 1``)
        into the static weights, zeroing the rest, unless they are already there. Step thread
        only, before a replay."""
        if stacked is self._synced:
            return
        for layer in self.layers:
            for a_t, b_t in layer.values():
                a_t.zero_()
                b_t.zero_()
        if stacked is not None:
            for slot, adapter in zip(stacked.slots, stacked.adapters, strict=True):
                k = slot - 1
                if not 0 <= k < self.max_loras:
                    raise ValueError(f"LoRA slot {slot} out of 1..{self.max_loras}")
                for layer, weights in zip(self.layers, adapter.layers, strict=True):
                    for m, w in weights.items():
                        a_t, b_t = layer[m]
                        cols, width = w.a_t.shape[1], self.widths[m]
                        if cols > width:
                            raise ValueError(f"a LoRA adapter's {m} has {cols} columns; the "
                                             f"graphs hold {width} (max_lora_rank "
                                             f"{self.max_rank})")
                        a_t[:, k * width:k * width + cols].copy_(w.a_t)
                        b_t[k * width:k * width + cols].copy_(w.b_t)
        self._synced = stacked
        self.syncs += 1

    @staticmethod
    def row_blocks(stacked: StackedLora, seq_slots) -> np.ndarray:
        """Each sequence's block (int64; one row per sequence in a decode step): its slot less
        one, -1 for the base model (slot 0) or a slot ``stacked`` does not hold."""
        loaded = set(stacked.slots)
        return np.array([int(s) - 1 if s and int(s) in loaded else -1 for s in seq_slots],
                        dtype=np.int64)

    @staticmethod
    def token_blocks(stacked: StackedLora, query_start_loc, seq_slots) -> np.ndarray:
        """Each token row's block (int64 ``[T]``) for the piecewise graphs: its sequence's
        (``row_blocks``) over the sequence's query tokens."""
        starts = np.asarray(query_start_loc, dtype=np.int64)
        per_seq = GraphLoraWeights.row_blocks(stacked, seq_slots)
        return np.repeat(per_seq, np.diff(starts[:len(per_seq) + 1]))

    def step(self, blocks: torch.Tensor) -> GraphLoraStep:
        """The ``LoraHooks`` step of one captured forward: every row, each its ``blocks`` row's
        adapter (a static buffer's view)."""
        return GraphLoraStep(self, blocks)


@dataclass(eq=False)
class GraphLoraStep:
    """What ``LayerLora.add`` reads inside a LoRA decode graph (``runtime.lora.LoraStep``'s
    interface): all rows, the static weights, the masks made from the static blocks."""

    weights_of: GraphLoraWeights
    blocks: torch.Tensor                     # int64 [bucket]: each row's block, -1: none
    rows: slice = field(default_factory=lambda: slice(None))
    _masks: dict[str, torch.Tensor] = field(default_factory=dict)

    def fused(self) -> None:
        """Never the fused CPU step (the graphs run the model layer by layer)."""
        return None

    def weights(self, layer: int, module: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a_t, b_t = self.weights_of.layers[layer][module]
        mask = self._masks.get(module)
        if mask is None:
            mask = self._masks[module] = (self.weights_of.owners[module][None, :]
                                          == self.blocks[:, None]).to(a_t.dtype)
        return a_t, b_t, mask
