"""Every decoder layer of a CPU step in one Rust call (``ferrobatch._scheduler.CpuDecoderStack``,
source ``rust_scheduler/src/cpu_decoder.rs``).

With the linear layers, norms, RoPE and attention already in Rust kernels, a one-row decode step
of SmolLM2 still spent about as long in Python and small torch ops between those kernels (~15
module calls and ops per layer, 30 layers) as in the kernels themselves. ``FusedLayers`` hands
the whole layer stack to Rust for every step whose attention the Rust kernels do (decodes,
speculative drafts, short chunks through the decode kernel; longer chunks through the prefill
kernel; any mix of them): the same kernels back to back, the K/V written into the same paged
cache, one call. Steps with prefill chunks on SDPA (``CpuPagedBackend(prefill_kernel=False)``)
keep the module-by-module path. SiLU- and GELU-tanh-and-mul are the only ops computed
differently (Rust's polynomial ``exp`` instead of torch's ``silu`` / ``gelu``; float32 rounding
apart, the same values). Gemma 3's parts run fused too: sliding windows per layer, the sliding
layers' own RoPE tables, the attention and MLP output norms, the embedding scale. The
step's embedding rows and RoPE tables are looked up, and its sampled rows' final RMSNorm run, on
numpy views of the model's own tensors (``FusedLayers.embed_and_run`` / ``final_norm``): the
same values, without torch's per-op dispatch.

``install_fused_decode(model, backend, num_threads)`` sets ``model.fused_layers`` when the model
is a packed llama stack on the CPU backend; ``FERROBATCH_FUSED_DECODE=0`` turns it off (A/B runs).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from ferrobatch import _scheduler
from ferrobatch.model.llama import GeluTanhAndMul, LlamaDecoderLayer, LlamaForCausalLM, SiluAndMul
from ferrobatch.model.quantized_embedding import QuantizedEmbedding, check_token_ids
from ferrobatch.runtime.attention.cpu import CpuPagedBackend, CpuPagedMetadata
from ferrobatch.runtime.cpu_elementwise import RustApplyRotary, RustRMSNorm
from ferrobatch.runtime.cpu_linear import PanelLinear
from ferrobatch.runtime.kv_cache import cache_array


def unsupported(model: nn.Module, backend) -> str | None:
    """None if ``model``'s layers can run fused on ``backend``, else the reason."""
    if os.environ.get("FERROBATCH_FUSED_DECODE", "1") == "0":
        return "turned off by FERROBATCH_FUSED_DECODE=0"
    if not hasattr(_scheduler, "CpuDecoderStack"):
        return "the compiled extension has no CpuDecoderStack (rebuild it)"
    if not isinstance(backend, CpuPagedBackend):
        return f"the attention backend is {getattr(backend, 'name', backend)!r}, not 'cpu'"
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the llama decoder stack"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (type(layer) is LlamaDecoderLayer, type(layer.input_layernorm) is RustRMSNorm,
                 type(layer.post_attention_layernorm) is RustRMSNorm,
                 attn.q_norm is None or (type(attn.q_norm) is RustRMSNorm
                                         and type(attn.k_norm) is RustRMSNorm),
                 (layer.attn_out_norm is None) == (layer.mlp_out_norm is None),
                 layer.attn_out_norm is None or (type(layer.attn_out_norm) is RustRMSNorm
                                                 and type(layer.mlp_out_norm) is RustRMSNorm
                                                 and attn.q_norm is not None),
                 type(attn.rope) is RustApplyRotary, type(mlp.act) in _ACTIVATIONS,
                 *(type(m) is PanelLinear for m in (attn.qkv_proj, attn.o_proj,
                                                    mlp.gate_up_proj, mlp.down_proj)))
        if not all(parts):
            return "a layer is not packed for the Rust kernels"
    if type(model.norm) is not RustRMSNorm:
        return "the final norm is not the Rust one"
    return None


# the MLP activations the fused step computes, by the name CpuDecoderStack takes
_ACTIVATIONS = {SiluAndMul: "silu", GeluTanhAndMul: "gelu_tanh"}


def _head_norms(layer) -> tuple:
    """Qwen3's per-head q / k norm weights and Gemma 3's output norms, or nothing."""
    attn = layer.self_attn
    if attn.q_norm is None:
        return ()
    heads = attn.q_norm.weight.numpy(), attn.k_norm.weight.numpy()
    if layer.attn_out_norm is None:
        return heads
    return *heads, layer.attn_out_norm.weight.numpy(), layer.mlp_out_norm.weight.numpy()


def _linear_spec(linear) -> tuple:
    blocks = tiles = qpanels = None
    if linear.half is not None:     # 16-bit float panels, every step
        blocks, qpanels = (linear.half[0],), linear.half[1]
    elif linear.blocks is not None:
        arrays = linear.blocks.arrays
        # the kind alone: the panels or tiles alone (the panels' own: "q8_s16" has no minimums)
        blocks = (linear.blocks.kind, *arrays) if arrays else (linear.blocks.panel_kind,)
        tiles, qpanels = linear.blocks.tiles, linear.blocks.qpanels
    bias = None if linear.bias is None else linear.bias.numpy()
    return (linear.out_features, linear.in_features, linear.packed_weight.numpy(), bias, blocks,
            tiles, qpanels)


class FusedLayers:
    """``model.fused_layers``: runs a step's hidden rows through every layer in Rust."""

    def __init__(self, model: nn.Module, num_threads: int, amx: bool = True) -> None:
        config = model.config
        first = model.layers[0]
        layers = [(layer.input_layernorm.weight.numpy(), _linear_spec(layer.self_attn.qkv_proj),
                   _linear_spec(layer.self_attn.o_proj),
                   layer.post_attention_layernorm.weight.numpy(),
                   _linear_spec(layer.mlp.gate_up_proj), _linear_spec(layer.mlp.down_proj),
                   *_head_norms(layer))
                  for layer in model.layers]
        norms = [n for layer in model.layers for n in (
            layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
            layer.self_attn.k_norm, layer.attn_out_norm, layer.mlp_out_norm) if n is not None]
        epsilons = {n.eps for n in norms}
        if len(epsilons) != 1:
            raise ValueError(f"the layers' RMSNorms differ in eps: {sorted(epsilons)}")
        local_layers = [] if model.local_rotary is None else \
            [i for i, layer in enumerate(model.layers) if layer.self_attn.local_rope]
        self._stack = _scheduler.CpuDecoderStack(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, epsilons.pop(), first.self_attn.scale, layers,
            [i for i, layer in enumerate(model.layers) if not layer.self_attn.use_rope],
            activation=_ACTIVATIONS[type(first.mlp.act)],
            windows=[layer.self_attn.window for layer in model.layers],
            local_rope_layers=local_layers)
        self.embedding_scale = np.float32(config.embedding_scale)
        # numpy views of the tables a step looks rows up in (``embed_and_run``), and of the
        # final norm (``final_norm``): at decode sizes torch's per-op dispatch cost more than
        # the look-ups themselves (0.06-0.15 ms per step on the Zen 3 dev VM, the same logits)
        embedding = model.embed_tokens     # an nn.Embedding, or a QuantizedEmbedding's rows
        self._embedding_rows = embedding.rows if isinstance(embedding, QuantizedEmbedding) \
            else _rows_of(embedding.weight.detach().numpy())
        self._cos = model.rotary.cos_cached.numpy()
        self._sin = model.rotary.sin_cached.numpy()
        # Gemma 3's sliding layers' own RoPE tables, or None
        local = model.local_rotary if local_layers else None
        self._local_cos = None if local is None else local.cos_cached.numpy()
        self._local_sin = None if local is None else local.sin_cached.numpy()
        self._norm = model.norm
        self.num_threads = num_threads
        self.amx = amx     # long prompt chunks' attention on AMX where the CPU has it
        self.steps = 0     # steps run fused
        # the model's weights_generation its views were taken at (runtime.weight_update)
        self.generation = getattr(model, "weights_generation", 0)

    @staticmethod
    def accepts(meta) -> bool:
        """True for a step whose attention is all in the Rust kernels (no SDPA groups)."""
        return type(meta) is CpuPagedMetadata and not meta.groups and \
            (meta.decode is not None or meta.prefill is not None)

    def embed_and_run(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], meta, lora: tuple | None = None
                      ) -> torch.Tensor:
        """The step's tokens -> the last layer's output ``[T, H]``: the model's embedding rows
        and RoPE tables looked up here (the same values as ``embed_tokens`` and
        ``RotaryEmbedding.tables``), then every layer in one Rust call; with ``lora``
        (``LoraStep.fused``: the stacked adapters and each row's block) each linear layer
        adds the adapter rows' updates.

        Keeps no state between calls: runners sharing one model (two engines on one loaded
        model) call it from their step threads at once, each with its own caches (~20 us per
        step to view them as numpy arrays)."""
        pos = positions.numpy()
        hidden = torch.from_numpy(self._embedding_rows(input_ids.numpy()))
        if self.embedding_scale != 1.0:     # Gemma's sqrt(hidden), as LlamaForCausalLM.embed
            hidden.numpy()[...] *= self.embedding_scale
        local = None if self._local_cos is None else (self._local_cos[pos], self._local_sin[pos])
        self._run(hidden.numpy(), self._cos[pos], self._sin[pos], kv_caches, meta, lora, local)
        return hidden

    def final_norm(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The model's final RMSNorm (a ``RustRMSNorm``) of ``hidden[rows]``."""
        picked = hidden.numpy()
        index = rows.numpy()
        if index.shape[0] != picked.shape[0] or np.any(index != np.arange(index.shape[0])):
            picked = picked[index]
        return torch.from_numpy(self._norm.of_rows(picked))

    def _run(self, hidden: np.ndarray, cos: np.ndarray, sin: np.ndarray,
             kv_caches: list[torch.Tensor], meta, lora: tuple | None = None,
             local: tuple | None = None) -> None:
        rows, chunks = meta.decode, meta.prefill
        if rows is None:
            tables, ctx_lens, decode_rows = _NO_TABLES, _NO_CTX, _NO_ROWS
        else:
            tables, ctx_lens = rows.block_tables, rows.ctx_lens
            decode_rows = None if rows.every_token else rows.token_index.numpy()
        prefill = None if chunks is None else \
            (chunks.q_starts, chunks.q_lens, chunks.seq_lens, chunks.block_tables)
        self._stack.forward(hidden, cos, sin, [cache_array(t) for t in kv_caches],
                            meta.slot_mapping.numpy(), tables, ctx_lens, self.num_threads,
                            decode_rows, prefill, amx=self.amx, lora=lora,
                            local_cos=None if local is None else local[0],
                            local_sin=None if local is None else local[1])
        self.steps += 1


def _rows_of(table: np.ndarray):
    """A float32 table's row lookup, as ``QuantizedEmbedding.rows`` (IndexError out of range)."""
    def rows(ids: np.ndarray) -> np.ndarray:
        check_token_ids(ids, table.shape[0])
        return table[ids]
    return rows


# a step without decode-kernel rows
_NO_TABLES = np.zeros((0, 1), np.int32)
_NO_CTX = np.zeros(0, np.int32)
_NO_ROWS = np.zeros(0, np.int64)


def rebuild_fused_layers(model: nn.Module, stale: FusedLayers) -> FusedLayers:
    """A FusedLayers over the model's arrays as they are now, with ``stale``'s settings and
    step count (after the weights were replaced in place)."""
    fresh = FusedLayers(model, stale.num_threads, amx=stale.amx)
    fresh.steps = stale.steps
    return fresh


def install_fused_decode(model: nn.Module, backend, num_threads: int) -> str | None:
    """Gives ``model`` a :class:`FusedLayers`; returns None, or why it was not given one."""
    reason = unsupported(model, backend)
    if reason is None:
        model.fused_layers = FusedLayers(model, num_threads, amx=getattr(backend, "amx", True))
    return reason
