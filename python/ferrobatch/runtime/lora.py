"""Multi-LoRA in one batch: each token row of a step adds its own adapter's low-rank update.

``install_lora(model)`` gives the model a :class:`LoraHooks` (``model.lora``) and each attention
/ MLP module a :class:`LayerLora` hook (``.lora``). An engine keeps its adapters in numbered
slots (:class:`LoraSlots`, 1..max_loras). For a step with adapter rows, the runner activates
``[(adapter, token rows), ...]`` (``LoraHooks.step``); each hooked linear then adds, for every
adapter, ``(x[rows] @ A.T) @ B.T`` into its output rows (``index_add_``: rows of other adapters,
and base-model rows, are untouched). Outside such a step the hooks return the output as it is,
so steps without adapter rows run exactly as without LoRA (fused CPU steps, CUDA graphs
included); steps with adapter rows run eagerly, layer by layer.

Threads: slots are filled and emptied on the asyncio thread (the engine's registry) by replacing
the ``adapters`` dict whole (copy-on-write); the step thread only reads it, and a slot is
emptied only when no running request holds it.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from ferrobatch.model.lora_adapter import LoraAdapter


class LoraSlots:
    """One engine's adapters by slot (``adapters``: slot 1..max_loras -> :class:`LoraAdapter`)."""

    def __init__(self, num_layers: int, max_loras: int) -> None:
        self.num_layers = num_layers
        self.max_loras = max_loras
        self.adapters: dict[int, LoraAdapter] = {}

    def put(self, slot: int, adapter: LoraAdapter) -> None:
        """Places ``adapter`` in ``slot`` (replacing what was there)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of 1..{self.max_loras}")
        if len(adapter.layers) != self.num_layers:
            raise ValueError(f"the adapter has {len(adapter.layers)} layers, the model "
                             f"{self.num_layers}")
        self.adapters = {**self.adapters, slot: adapter}

    def clear(self, slot: int) -> None:
        """Empties ``slot``."""
        self.adapters = {s: a for s, a in self.adapters.items() if s != slot}


class LoraHooks:
    """``model.lora``: the step the calling thread runs, as ``[(adapter, token rows), ...]``
    (``active``, per thread: two engines may share one loaded model and step at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def active(self) -> list[tuple[LoraAdapter, torch.Tensor]] | None:
        return getattr(self._local, "active", None)

    @contextlib.contextmanager
    def step(self, active: list[tuple[LoraAdapter, torch.Tensor]]):
        """Applies ``active`` to the forward passes this thread runs inside the block."""
        self._local.active = active
        try:
            yield
        finally:
            self._local.active = None


class LayerLora:
    """The hook of one decoder layer's attention or MLP: ``add(module, x, out)``."""

    def __init__(self, hooks: LoraHooks, layer: int) -> None:
        self.hooks = hooks
        self.layer = layer

    def add(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``module``'s output for the step's rows ``x``) with each active adapter's
        update added in place on that adapter's rows; ``out`` unchanged outside a LoRA step."""
        active = self.hooks.active
        if not active:
            return out
        for adapter, rows in active:
            weights = adapter.layers[self.layer].get(module)
            if weights is None:
                continue
            xa = x.index_select(0, rows) @ weights.a.T
            for out_start, out_stop, a_start, a_stop, b in weights.parts:
                out[:, out_start:out_stop].index_add_(0, rows, xa[:, a_start:a_stop] @ b.T)
        return out


def install_lora(model: nn.Module) -> LoraHooks:
    """Hooks every decoder layer of ``model`` (a ``LlamaForCausalLM``) once; returns
    ``model.lora``. The hooks cost one attribute look-up per module outside LoRA steps."""
    hooks = getattr(model, "lora", None)
    if hooks is not None:
        return hooks
    hooks = LoraHooks()
    for i, layer in enumerate(model.layers):
        hook = LayerLora(hooks, i)
        layer.self_attn.lora = hook
        layer.mlp.lora = hook
    model.lora = hooks
    return hooks


def token_rows_by_slot(query_start_loc, seq_slots, device: torch.device
                       ) -> dict[int, torch.Tensor]:
    """``{slot: token rows}`` of a step from its per-sequence query starts (``[S + 1]``) and
    each sequence's slot (0 = the base model); {} when no sequence has an adapter."""
    by_slot: dict[int, list[int]] = {}
    for i, slot in enumerate(seq_slots):
        if slot:
            by_slot.setdefault(int(slot), []).extend(
                range(int(query_start_loc[i]), int(query_start_loc[i + 1])))
    return {slot: torch.tensor(rows, dtype=torch.int64, device=device)
            for slot, rows in by_slot.items()}
