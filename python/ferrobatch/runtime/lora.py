"""Multi-LoRA in one batch: each token row of a step adds its own adapter's low-rank update.

``install_lora(model)`` gives the model a :class:`LoraHooks` (``model.lora``) and each attention
/ MLP module a :class:`LayerLora` hook (``.lora``). An engine keeps its adapters in numbered
slots (:class:`LoraSlots`, 1..max_loras) and, beside them, every loaded adapter stacked into one
pair of matrices per layer and module (:class:`StackedLora`: adapter ``i``'s A columns and B rows
in block ``i`` of width W, the module's largest rank, zero-padded). For a step with adapter rows
the runner activates a :class:`LoraStep` (``LoraHooks.step``): the step's adapter rows and each
row's block. Each hooked linear then adds ``((x[rows] @ A_all) * mask) @ B_all`` into those rows,
the mask keeping each row's own block: five torch ops per module whatever the number of
adapters in the step (per-adapter matmuls cost four per adapter); a step whose adapter rows all
use one adapter takes that adapter's own matrices, without the mask (`benches/lora.py` measured
the choices, README Results). A row of another adapter's block adds exact zeros; base-model rows
are not touched. Outside such a step the hooks return the output as it is, so steps without adapter rows
run exactly as without LoRA (fused CPU steps, CUDA graphs included). On the CPU a step with
adapter rows still runs fused (``LoraStep.fused``: the stack as a ``CpuLoraStack``, each row's
block; ``rust_scheduler/src/cpu_lora.rs`` adds the updates after each linear layer); on CUDA a
decode step replays the LoRA decode graphs (``runtime.lora_graphs``: the adapters at fixed
addresses by slot), any other step runs eagerly, layer by layer, through the hooks.

Threads: slots are filled and emptied on the asyncio thread (the engine's registry), which
replaces the ``adapters`` dict and the stack whole (copy-on-write); the step thread reads
``LoraSlots.stacked`` once per step, and a slot is emptied only when no running request holds it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ferrobatch.model.lora_adapter import LoraAdapter

MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(eq=False)
class StackedLora:
    """Every loaded adapter in one pair per layer and module: ``layers[i][module] = (a_t
    [in, K * W], b_t [K * W, out])``, adapter ``k`` (slot ``slots[k]``) in columns / rows
    ``k * W .. k * W + rank`` (``W = widths[module]``), zeros elsewhere; modules no adapter
    adapts in a layer are absent there."""

    slots: tuple[int, ...]
    adapters: tuple[LoraAdapter, ...]          # the adapter of each block
    widths: dict[str, int]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    owners: dict[str, torch.Tensor] = field(default_factory=dict)   # column -> its block k
    _cpu: tuple | None = None        # (CpuLoraStack, the arrays it views), made on first use

    def cpu_stack(self):
        """The stack as the fused CPU step takes it (``_scheduler.CpuLoraStack``: per layer and
        module A ``[K * W, in]`` and B transposed ``[K * W, out]``, float32), made on first use
        and kept; None when the adapters are not float32 on the CPU."""
        if self._cpu is None:
            first = next((a for layer in self.layers for a, _ in layer.values()), None)
            if first is None or first.device.type != "cpu" or first.dtype != torch.float32:
                return None
            from ferrobatch import _scheduler
            arrays = [[None if m not in layer else _cpu_arrays(*layer[m], self.widths[m])
                       for m in MODULES] for layer in self.layers]
            self._cpu = (_scheduler.CpuLoraStack(arrays), arrays)
        return self._cpu[0]

    @classmethod
    def of(cls, adapters: dict[int, LoraAdapter], num_layers: int) -> StackedLora | None:
        """The stack of ``adapters`` (by slot), or None when there are none."""
        if not adapters:
            return None
        slots = tuple(sorted(adapters))
        stacked = [adapters[s] for s in slots]
        widths = {m: max((layer[m].a_t.shape[1] for a in stacked for layer in a.layers
                          if m in layer), default=0) for m in MODULES}
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for i in range(num_layers):
            here: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for m in MODULES:
                present = [(k, a.layers[i][m]) for k, a in enumerate(stacked)
                           if m in a.layers[i]]
                if not present:
                    continue
                w, first = widths[m], present[0][1]
                a_t = first.a_t.new_zeros(first.a_t.shape[0], len(slots) * w)
                b_t = first.b_t.new_zeros(len(slots) * w, first.b_t.shape[1])
                for k, weights in present:
                    rank = weights.a_t.shape[1]
                    a_t[:, k * w:k * w + rank] = weights.a_t
                    b_t[k * w:k * w + rank] = weights.b_t
                here[m] = (a_t, b_t)
            layers.append(here)
        device = next(w.a_t.device for a in stacked for layer in a.layers
                      for w in layer.values())
        owners = {m: torch.arange(len(slots), device=device).repeat_interleave(w)
                  for m, w in widths.items() if w}
        return cls(slots, tuple(stacked), widths, layers, owners)


def _cpu_arrays(a_t: torch.Tensor, b_t: torch.Tensor, width: int) -> tuple:
    """One module of the stack as ``CpuLoraStack`` takes it: A ``[K * W, in]``, B transposed
    ``[K * W, out]`` (numpy views of contiguous float32 copies) and each B row's nonzero
    columns ``lo..hi`` (a fused module's B is block-diagonal; a padding row is empty)."""
    b = b_t.contiguous()
    nonzero = (b != 0).numpy()
    any_col = nonzero.any(axis=1)
    lo = np.where(any_col, nonzero.argmax(axis=1), 0)
    hi = np.where(any_col, b.shape[1] - nonzero[:, ::-1].argmax(axis=1), 0)
    cols = np.ascontiguousarray(np.stack([lo, hi], axis=1), dtype=np.int32)
    return a_t.t().contiguous().numpy(), b.numpy(), width, cols


class LoraSlots:
    """One engine's adapters by slot (``adapters``: slot 1..max_loras -> :class:`LoraAdapter`,
    ranks up to ``max_rank``) and their :class:`StackedLora` (``stacked``, rebuilt whenever a
    slot changes)."""

    def __init__(self, num_layers: int, max_loras: int, max_rank: int = 16) -> None:
        self.num_layers = num_layers
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.adapters: dict[int, LoraAdapter] = {}
        self.stacked: StackedLora | None = None

    def put(self, slot: int, adapter: LoraAdapter) -> None:
        """Places ``adapter`` in ``slot`` (replacing what was there)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of 1..{self.max_loras}")
        if len(adapter.layers) != self.num_layers:
            raise ValueError(f"the adapter has {len(adapter.layers)} layers, the model "
                             f"{self.num_layers}")
        if adapter.rank > self.max_rank:
            raise ValueError(f"the adapter's rank {adapter.rank} exceeds max_lora_rank "
                             f"{self.max_rank}")
        self._replace({**self.adapters, slot: adapter})

    def clear(self, slot: int) -> None:
        """Empties ``slot``."""
        self._replace({s: a for s, a in self.adapters.items() if s != slot})

    def _replace(self, adapters: dict[int, LoraAdapter]) -> None:
        stacked = StackedLora.of(adapters, self.num_layers)
        if stacked is not None:
            stacked.cpu_stack()      # made here, not in the first fused step (CPU float32 only)
        self.adapters, self.stacked = adapters, stacked      # the step thread reads `stacked`


@dataclass(eq=False)
class LoraStep:
    """One step's adapter rows: ``rows`` (a slice when they are one run of the flat batch, else
    an index tensor) and either ``single``, the one adapter they all use (its own matrices, no
    mask), or each row's block of ``stacked`` (``blocks``) with, per module, the mask keeping
    each row's own block (made on first use, shared by every layer)."""

    stacked: StackedLora
    rows: slice | torch.Tensor
    blocks: torch.Tensor | None
    single: LoraAdapter | None = None
    # int32 [T]: each token row's block of ``stacked`` (-1 for base-model rows), for the fused
    # CPU step (``fused``)
    row_blocks: np.ndarray | None = None
    _masks: dict[str, torch.Tensor] = field(default_factory=dict)

    def fused(self) -> tuple | None:
        """``(CpuLoraStack, row_blocks)`` for ``FusedLayers.embed_and_run``, or None when the
        adapters cannot run in the fused CPU step (not float32 on the CPU)."""
        stack = self.stacked.cpu_stack()
        return None if stack is None or self.row_blocks is None else (stack, self.row_blocks)

    def weights(self, layer: int, module: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``(a_t, b_t, mask or None)`` of ``module`` in ``layer``; None where no adapter of
        the step adapts it."""
        if self.single is not None:
            w = self.single.layers[layer].get(module)
            return None if w is None else (w.a_t, w.b_t, None)
        pair = self.stacked.layers[layer].get(module)
        if pair is None:
            return None
        mask = self._masks.get(module)
        if mask is None:        # [rows, K * W]: 1 in each row's own block, 0 elsewhere
            mask = self._masks[module] = (self.stacked.owners[module][None, :]
                                          == self.blocks[:, None]).to(pair[0].dtype)
        return (*pair, mask)


def lora_step(stacked: StackedLora, query_start_loc, seq_slots,
              device: torch.device) -> LoraStep | None:
    """The :class:`LoraStep` of a step from its per-sequence query starts (``[S + 1]``) and
    each sequence's slot (0: the base model); None when no sequence has a loaded adapter."""
    block_of = {slot: k for k, slot in enumerate(stacked.slots)}
    rows: list[int] = []
    blocks: list[int] = []
    for i, slot in enumerate(seq_slots):
        k = block_of.get(int(slot)) if slot else None
        if k is not None:
            lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
            rows.extend(range(lo, hi))
            blocks.extend([k] * (hi - lo))
    if not rows:
        return None
    row_blocks = np.full(int(query_start_loc[len(seq_slots)]), -1, dtype=np.int32)
    row_blocks[rows] = blocks
    run = rows[-1] - rows[0] + 1 == len(rows)       # ascending: one run iff no gap
    index = slice(rows[0], rows[-1] + 1) if run else \
        torch.tensor(rows, dtype=torch.int64, device=device)
    if blocks.count(blocks[0]) == len(blocks):      # one adapter: its own matrices
        return LoraStep(stacked, index, None, single=stacked.adapters[blocks[0]],
                        row_blocks=row_blocks)
    return LoraStep(stacked, index, torch.tensor(blocks, dtype=torch.int64, device=device),
                    row_blocks=row_blocks)


class LoraHooks:
    """``model.lora``: the :class:`LoraStep` the calling thread runs (``active``, per thread:
    two engines may share one loaded model and step at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def active(self) -> LoraStep | None:
        return getattr(self._local, "active", None)

    @contextlib.contextmanager
    def step(self, active: LoraStep):
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
        """``out`` (``module``'s output for the step's rows ``x``) with each adapter row's
        update added in place; ``out`` unchanged outside a LoRA step."""
        step = self.hooks.active
        if step is None:
            return out
        weights = step.weights(self.layer, module)
        if weights is None:
            return out
        a_t, b_t, mask = weights
        rows = step.rows
        one_run = isinstance(rows, slice)
        xa = (x[rows] if one_run else x.index_select(0, rows)) @ a_t
        if mask is not None:
            xa.mul_(mask)
        if one_run:
            out[rows].addmm_(xa, b_t)
        else:
            out.index_add_(0, rows, xa @ b_t)
        return out


def reserve_bytes(config, max_loras: int, max_rank: int, dtype: torch.dtype, *,
                  graphs: bool = False) -> int:
    """Device memory ``max_loras`` adapters of rank ``max_rank`` on every projection can take:
    each adapter's own matrices plus its share of the stack (twice its size), and with decode
    graphs its block of the graphs' static weights (``runtime.lora_graphs``; three times)."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    # per layer and rank, the fused modules' A [in, parts * r] and B [parts * r, out] (B is
    # block-diagonal, zeros included): qkv (3 parts), o, gate_up (2 parts), down
    per_rank = 3 * h + 3 * (q + 2 * kv) + (q + h) + (2 * h + 4 * inter) + (inter + h)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return (3 if graphs else 2) * max_loras * config.num_layers * max_rank * per_rank * itemsize


def install_lora(model: nn.Module) -> LoraHooks:
    """Hooks every decoder layer of ``model`` (a ``LlamaForCausalLM``); returns ``model.lora``.
    Hooks already in place for this model's layers, at their positions, are kept (engines
    sharing one loaded model share them); any other layer is (re)hooked. The hooks cost one
    attribute look-up per module outside LoRA steps."""
    hooks = getattr(model, "lora", None) or LoraHooks()
    for i, layer in enumerate(model.layers):
        hook = getattr(layer.self_attn, "lora", None)
        if hook is None or hook.hooks is not hooks or hook.layer != i or layer.mlp.lora is not hook:
            hook = LayerLora(hooks, i)
            layer.self_attn.lora = hook
            layer.mlp.lora = hook
    model.lora = hooks
    return hooks
