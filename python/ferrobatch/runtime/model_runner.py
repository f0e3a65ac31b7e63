"""ModelRunner: one step's arrays -> tensors -> forward -> float32 logits at ``logits_indices``.

Decode-only steps replay a captured CUDA graph when ``capture_decode_graphs`` was called (the
engine does so on CUDA; steps with LoRA adapter rows replay graphs of their own,
``runtime.lora_graphs``); other steps up to the largest token bucket replay the model's pieces
between eager attention calls when ``capture_piecewise_graphs`` was called
(``runtime.piecewise_graphs``); the rest run the model eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np
import torch

from ferrobatch.runtime.attention import AttentionBackend, get_attention_backend
from ferrobatch.runtime.attention.base import check_step_arrays
from ferrobatch.runtime.cpu_decoder import install_fused_decode, rebuild_fused_layers
from ferrobatch.runtime.cpu_elementwise import swap_elementwise_ops
from ferrobatch.runtime.cpu_linear import (
    QUANT_MAX_ROWS,
    TILES_ALONE_MIN_INPUTS,
    PanelLinear,
    pack_linear_layers,
    packing_unsupported,
    quant_panels_min_rows,
)
from ferrobatch.runtime.cpu_threads import torch_single_threaded
from ferrobatch.runtime.cuda_graphs import DecodeGraphRunner, decode_buckets
from ferrobatch.runtime.heap import return_freed_memory
from ferrobatch.runtime.kv_cache import KVCache, check_kv_cache_dtype
from ferrobatch.runtime.lora import LoraSlots, install_lora, lora_step
from ferrobatch.runtime.lora_graphs import GraphLoraWeights
from ferrobatch.runtime.piecewise_graphs import PiecewiseGraphRunner, piecewise_buckets
from ferrobatch.runtime.sampler import greedy_rows
from ferrobatch.runtime.weight_update import apply_update, plan_update

logger = logging.getLogger(__name__)


def _to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class ModelRunner:
    """Owns the KV cache and the attention backend; executes duck-typed StepBatch objects."""

    def __init__(self, loaded, *, num_blocks: int, block_size: int,
                 device: torch.device | str | None = None,
                 attn_backend: AttentionBackend | str | None = None,
                 validate_steps: bool = True, pack_weights: bool = True,
                 gguf_blocks: bool = True, amx_tiles: bool = True,
                 fused_decode: bool = True, kv_cache_dtype: torch.dtype | None = None,
                 flash_prefill: bool = True) -> None:
        """``pack_weights``: CPU float32 linears in the Rust panel kernel; ``gguf_blocks``: for a
        GGUF model, steps of at most ``QUANT_MAX_ROWS`` (8) rows read the file's Q4_1 / Q8_0
        blocks instead (``cpu_linear.BlockKernel``); ``amx_tiles``: where the CPU has AMX, steps
        of at least ``amx_min_rows(in_features)`` (4; 3 for layers of 2048 inputs or more)
        rows read those blocks packed as AMX tiles
        (``cpu_amx_linear.rs``); elsewhere steps of at least ``quant_panels_min_rows()`` (4 on
        AVX2, 6 on AVX-512) rows read them packed as quantized panels (``cpu_quant_panels.rs``; ``FERROBATCH_QUANT_PANELS=0``
        keeps float32 panels for them instead). All only when the model is first packed.
        ``fused_decode``: with packed weights on the CPU backend, steps (decode, prefill, mixed)
        run every layer in one Rust call (``runtime.cpu_decoder``). ``kv_cache_dtype``: what the
        KV cache stores (None: the model's dtype; ``kv_cache.check_kv_cache_dtype`` says which
        others are allowed). ``flash_prefill``: on the CUDA backend, bf16 / fp16 prefill
        attention through torch's FlashAttention-2 (``attention.flash_prefill``)."""
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = torch.device(device) if device is not None else loaded.device
        if self.device != loaded.device:
            raise ValueError(f"model is on {loaded.device}, runner asked for {self.device}")
        if isinstance(attn_backend, AttentionBackend):
            self.attn_backend = attn_backend
        else:
            shape = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim, loaded.dtype)
            self.attn_backend = get_attention_backend(attn_backend, self.device, block_size=block_size,
                                                      model_shape=shape,
                                                      windows=bool(self.config.sliding_layers))
        if self.config.sliding_layers and not self.attn_backend.supports_window:
            raise ValueError(
                f"this {self.config.arch} model's sliding-window layers need an attention "
                f"backend that attends over a window ('cpu' or 'torch', "
                f"--attention-backend); the {self.attn_backend.name!r} backend does not yet")
        # the model's defaults (for direct calls); this runner's own steps run with its own
        # backend and fused layers (``model.bound``), whatever another runner sets here
        self.model.attn_backend = self.attn_backend
        if hasattr(self.model, "fused_layers"):   # bound to an earlier runner's backend
            self.model.fused_layers = None
        self.fused_layers = None     # FusedLayers: every layer of a CPU step in one Rust call
        logger.info("attention backend: %s (%s)", self.attn_backend.name, self.device)
        # CPU float32: linear layers (and decode attention) in the Rust kernels, which then own
        # the threads torch had; torch runs single-threaded during the forward (cpu_threads.py).
        self.kernel_threads = torch.get_num_threads()
        self.rust_linears = pack_weights and packing_unsupported(self.device, loaded.dtype) is None
        self.linear_kernels = "torch"      # in words, for the startup log and the serve banner
        self.attention_kernels = self.attn_backend.name   # likewise
        # a model loaded with gguf_blocks=True: its block-format linears have no float32 weight
        loaded_blocks, self.model.gguf_block_weights = self.model.gguf_block_weights or {}, None
        if loaded_blocks and not (self.rust_linears and gguf_blocks):
            from ferrobatch.model.block_weights import materialize_block_linears
            logger.info("linear layers: %d dequantized from their GGUF blocks",
                        materialize_block_linears(self.model, loaded_blocks))
        _log_embedding_table(self.model.embed_tokens)
        if self.rust_linears:
            blocks = (loaded_blocks or _gguf_block_weights(loaded)) if gguf_blocks else {}
            quant_panels = os.environ.get("FERROBATCH_QUANT_PANELS", "1") != "0"
            num_packed = pack_linear_layers(self.model, self.kernel_threads, blocks,
                                            amx=amx_tiles, quant_panels=quant_panels)
            if quant_panels:    # a 16-bit checkpoint's token embedding kept in 16 bits too
                _embedding_in_16_bits(self.model)
            # the kernels keep what they read: drop the rest (blocks whose quantized panels
            # alone are kept) before the freed memory goes back to the OS below
            blocks, loaded_blocks = bool(blocks), None
            swap_elementwise_ops(self.model)
            if getattr(self.attn_backend, "num_threads", 0) is None:
                self.attn_backend.num_threads = self.kernel_threads
            if hasattr(self.attn_backend, "amx"):   # AMX for long prompt chunks' attention too
                self.attn_backend.amx = amx_tiles
            from ferrobatch._scheduler import linear_isa, one_row_int16_available
            kernels = {id(m.blocks): m.blocks for m in self.model.modules()
                       if getattr(m, "blocks", None) is not None}
            # the layers that keep their blocks (the others keep their tiles or panels alone)
            kept = [k for k in kernels.values() if k.arrays is not None]
            tiled = [k for k in kept if k.tiles is not None]
            amx_from = sorted({k.amx_min_rows for k in tiled})
            qpanels = any(k.qpanels is not None for k in kernels.values())
            blocks_up_to = amx_from[-1] - 1 if amx_from else \
                quant_panels_min_rows() - 1 if qpanels else QUANT_MAX_ROWS
            wider = ", ".join(f"<= {m - 1} on layers of "
                              f"{min(k.shape[1] for k in tiled if k.amx_min_rows == m)}+ inputs"
                              for m in amx_from[:-1])
            blocks_steps = f"steps of <= {blocks_up_to} rows" + (f" ({wider})" if wider else "")
            if one_row_int16_available() and any(k.kind == "q4_1" for k in kept):
                blocks_steps += " (one row of Q4_1 through int16 dot products)"
            amx = any(k.tiles is not None for k in kernels.values())
            larger = " as AMX tiles" if amx else " as quantized panels" if qpanels else ""
            alone = sum(k.panels_alone for k in kernels.values())
            no_minimums = sum(k.panels_alone and k.panel_kind == "q8_s16"
                              for k in kernels.values())
            tiles_alone = sum(k.tiles_alone for k in kernels.values())
            self.linear_kernels = f"Rust {linear_isa()} kernels" + (
                f", GGUF blocks for {blocks_steps}" if blocks and kept else
                f", GGUF blocks packed{larger}" if blocks else "") + (
                f",{larger} for more" if larger and kept else "") + (
                f" ({alone} Q8G16 layers: the quantized panels alone, every step"
                + (f"; {no_minimums} without minimums" if no_minimums else "") + ")" if alone
                else "") + (
                f" ({tiles_alone} layers of {TILES_ALONE_MIN_INPUTS}+ inputs: the AMX tiles "
                "alone, fewer rows without tile instructions)" if tiles_alone else "")
            half = [m for m in self.model.modules()
                    if isinstance(m, PanelLinear) and m.half is not None]
            half_kinds = sorted({m.half[0] for m in half})
            if half:
                self.linear_kernels += f", {' / '.join(half_kinds)} weights as 16-bit panels"
            not_fused = install_fused_decode(self.model, self.attn_backend, self.kernel_threads) \
                if fused_decode else "fused_decode=False"
            if not_fused is None:
                self.fused_layers = self.model.fused_layers
                self.linear_kernels += ", steps fused (one Rust call for all layers)"
            logger.info("steps: %s", "all layers in one Rust call" if not_fused is None
                        else f"layer by layer ({not_fused})")
            logger.info("linear layers: %d prepacked for the Rust kernel (%s), %d threads",
                        num_packed, linear_isa(), self.kernel_threads)
            if blocks and kept:
                logger.info("linear layers: %d also read from their GGUF blocks in %s%s "
                            "(%.0f MiB)", len(kept), blocks_steps,
                            f" and from those blocks{larger} in larger steps" if larger else "",
                            sum(k.nbytes for k in kept) / 2**20)
            if tiles_alone:
                logger.info("linear layers: %d of %d+ inputs keep their AMX tiles alone (no GGUF "
                            "blocks beside them: fewer rows read the tiles without tile "
                            "instructions; %.0f MiB)", tiles_alone, TILES_ALONE_MIN_INPUTS,
                            sum(k.nbytes for k in kernels.values() if k.tiles_alone) / 2**20)
            if half:
                from ferrobatch._scheduler import half_panels_amx_rows
                amx_rows = half_panels_amx_rows() if "bf16" in half_kinds else None
                logger.info("linear layers: %d hold %s values: 16-bit panels (%.0f MiB), read "
                            "by every step as the float32 ones would be (the same outputs%s), "
                            "half the bytes", len(half), " / ".join(half_kinds),
                            sum(m.half[1].nbytes for m in half) / 2**20,
                            "" if amx_rows is None else f"; bfloat16 steps of {amx_rows}+ rows "
                            "on AMX tiles, float32 accuracy")
            released = [m for m in self.model.modules()
                        if isinstance(m, PanelLinear) and m.packed_weight.numel() == 0
                        and m.half is None]
            if released:
                logger.info("linear layers: %d keep no float32 panels (%.0f MiB less): their "
                            "blocks cover every step size (larger ones%s)", len(released),
                            sum(-(-m.out_features // 16) * 16 * m.in_features * 4
                                for m in released) / 2**20, larger)
            freed = return_freed_memory()   # the load's float32 copies and released panels
            if freed:
                logger.info("returned %.0f MiB freed while loading to the OS", freed / 2**20)
        if self.device.type == "cuda" and self.attn_backend.name == "cuda":
            self.linear_kernels += "; elementwise ops: " + _use_fused_elementwise_ops(
                self.model, loaded.dtype) + _use_rotary_kv_write(self.model, loaded.dtype,
                                                                 self.attn_backend)
        self.block_size = block_size
        self.validate_steps = validate_steps
        self.kv_cache = KVCache(self.config, num_blocks, block_size, self.device,
                                check_kv_cache_dtype(kv_cache_dtype, loaded.dtype, self.device))
        logger.info("KV cache: %d blocks of %d tokens, %s, %.0f MiB", num_blocks, block_size,
                    str(self.kv_cache.dtype).removeprefix("torch."), self.kv_cache.num_bytes / 2**20)
        if hasattr(self.attn_backend, "use_fused_reduce"):
            self.attn_backend.use_fused_reduce(self.config.num_heads, self.config.num_kv_heads,
                                               self.config.head_dim, self.kv_cache.dtype)
        if hasattr(self.attn_backend, "flash_prefill"):   # FlashAttention has no float32
            from ferrobatch.runtime.attention.flash_prefill import FLASH_DTYPES
            self.attn_backend.flash_prefill = self.attn_backend.flash_prefill and \
                flash_prefill and self.kv_cache.dtype in FLASH_DTYPES
        self.attention_kernels = getattr(self.attn_backend, "description", self.attention_kernels)
        logger.info("attention: %s", self.attention_kernels)
        self.decode_graphs: DecodeGraphRunner | None = None
        self.piecewise_graphs: PiecewiseGraphRunner | None = None
        self.graph_steps = 0       # steps served by a decode graph replay
        self.piecewise_steps = 0   # steps served by the piecewise graphs (prefill / mixed)
        self.eager_steps = 0       # steps run eagerly (too big for the graphs / graphs off)
        # the last decode graph replay's logits and their greedy_rows (computed in the graph)
        self._graph_logits: torch.Tensor | None = None
        self._graph_greedy_rows: torch.Tensor | None = None
        self.lora_slots: LoraSlots | None = None   # enable_lora()
        # decode graphs for steps with adapter rows (captured with the plain ones once LoRA is
        # enabled), the adapters' weights they read, and the steps they served
        self.lora_decode_graphs: DecodeGraphRunner | None = None
        self.lora_piecewise_graphs: PiecewiseGraphRunner | None = None
        self.graph_lora: GraphLoraWeights | None = None
        self.lora_graph_steps = 0          # LoRA steps replaying decode graphs
        self.lora_piecewise_steps = 0      # LoRA steps through the piecewise graphs

    def enable_lora(self, max_loras: int, max_rank: int = 16) -> LoraSlots:
        """Hooks the model for LoRA (``runtime.lora``) and gives this runner ``max_loras``
        adapter slots for ranks up to ``max_rank``; ``execute(..., lora_slots=...)`` then
        applies them. Before ``capture_decode_graphs`` for decode steps with adapters to replay
        graphs too."""
        if self.lora_slots is None:
            install_lora(self.model)
            self.lora_slots = LoraSlots(self.config.num_layers, max_loras, max_rank)
        return self.lora_slots

    def update_weights(self, weights) -> dict:
        """Replaces the model's weights named in ``weights`` (``(Hugging Face name, tensor)``
        pairs, any subset; ``runtime.weight_update``), every one checked before any is
        written (ValueError). Between steps only. Returns ``{"tensors", "skipped",
        "gguf_layers_unblocked"}``."""
        plan = plan_update(self.model, weights)
        unblocked = apply_update(self.model, plan)
        stale = self.fused_layers
        if self._current_fused() is not stale and self.model.fused_layers is stale:
            self.model.fused_layers = self.fused_layers
        if unblocked:
            freed = return_freed_memory()
            logger.info("weights update: %d linear layers read float32 panels instead of their "
                        "GGUF blocks from now on (%.0f MiB returned to the OS)", unblocked,
                        freed / 2**20)
            self.linear_kernels += f"; {unblocked} layers' GGUF blocks replaced by updated weights"
        return {"tensors": plan.num_tensors, "skipped": plan.skipped,
                "gguf_layers_unblocked": unblocked}

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV cache (block 0 is the scheduler's null block)."""
        return self.kv_cache.num_blocks

    def _current_fused(self):
        """This runner's FusedLayers, rebuilt first when the model's weights were replaced
        since it was built (its views would hold arrays no longer the model's)."""
        fused = self.fused_layers
        if fused is not None and fused.generation != self.model.weights_generation:
            fused = self.fused_layers = rebuild_fused_layers(self.model, fused)
        return fused

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                 logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None):
        with self.model.bound(self.attn_backend, self._current_fused()), \
                torch_single_threaded() if self.rust_linears else contextlib.nullcontext():
            return self.model(input_ids, positions, self.kv_cache.layers, meta, logits_indices,
                              hidden_indices)

    @torch.inference_mode()
    def logits_of(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states (``execute(..., hidden_rows=...)``)."""
        if self.rust_linears:
            with torch_single_threaded():
                return self.model.compute_logits(normed_hidden)
        return self.model.compute_logits(normed_hidden)

    @torch.inference_mode()
    def greedy_rows(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``sampler.greedy_rows`` of ``logits`` (argmax and finite flag per row, ``int64
        [S, 2]``): the decode graph's own when ``logits`` is what the last step's replay
        returned (computed inside the graph), else computed here: on CUDA by torch, on the CPU
        (float32 logits, the Rust kernels on) by ``_scheduler.greedy_rows_f32`` in one pass
        over each row on the kernels' threads, where the engine's finite check and the
        sampler's argmax took two. None otherwise (the engine's general path)."""
        if self._graph_greedy_rows is not None and logits is self._graph_logits:
            return self._graph_greedy_rows
        if logits.is_cuda:
            return greedy_rows(logits)
        if self.rust_linears and logits.dtype == torch.float32 and logits.dim() == 2:
            from ferrobatch._scheduler import greedy_rows_f32

            out = np.empty((logits.shape[0], 2), np.int64)
            greedy_rows_f32(logits.contiguous().numpy(), out, self.kernel_threads)
            return torch.from_numpy(out)
        return None

    @torch.inference_mode()
    def execute(self, batch, *, allow_graph: bool = True, hidden_rows: np.ndarray | None = None,
                lora_slots=None):
        """Applies ``batch.block_copies``, runs the forward, returns logits ``[S, vocab]`` float32.

        A decode-only step that samples every row replays a decode graph when one fits
        (``allow_graph=False`` forces the eager forward); the logits are then a view of the
        graph's output buffer, valid until the next step. With ``hidden_rows`` (token rows of
        the flat batch; prompt logprobs) the step runs eagerly and returns ``(logits, hidden)``,
        ``hidden`` the final-normed states at those rows, for ``logits_of``. ``lora_slots``
        (per scheduled sequence: its LoRA slot, 0 for none; ``enable_lora`` first) applies
        those adapters; a decode step with adapter rows replays the LoRA decode graphs when
        they fit it, any other such step runs eagerly."""
        self._graph_logits = self._graph_greedy_rows = None
        if lora_slots is not None and any(lora_slots):
            if self.lora_slots is None:
                raise RuntimeError("a step asks for LoRA adapters; call enable_lora first")
            stacked = self.lora_slots.stacked
            if stacked is not None and allow_graph and hidden_rows is None \
                    and self._fits_decode_graphs(batch, self.lora_decode_graphs):
                self._apply_block_copies(batch)
                self.graph_lora.sync(stacked)
                self.graph_steps += 1
                self.lora_graph_steps += 1
                self._graph_logits, self._graph_greedy_rows = self.lora_decode_graphs.run(
                    batch, lora_blocks=self.graph_lora.row_blocks(stacked, lora_slots))
                return self._graph_logits
            pieces = self.lora_piecewise_graphs
            if stacked is not None and allow_graph and pieces is not None \
                    and pieces.can_run(int(np.asarray(batch.input_ids).shape[0])):
                self._apply_block_copies(batch)
                if self.validate_steps:
                    self._validate(batch)
                self.graph_lora.sync(stacked)
                self.piecewise_steps += 1
                self.lora_piecewise_steps += 1
                meta = self.attn_backend.build_metadata(batch, self.device)
                logits_indices = _to_device(batch.logits_indices, self.device, torch.int64)
                rows = None if hidden_rows is None else \
                    _to_device(np.asarray(hidden_rows), self.device, torch.int64)
                blocks = self.graph_lora.token_blocks(stacked, batch.query_start_loc, lora_slots)
                return self._run_pieces(batch, meta, logits_indices, rows, pieces, blocks)
            step = None if stacked is None else \
                lora_step(stacked, batch.query_start_loc, lora_slots, self.device)
            if step is not None:
                with self.model.lora.step(step):
                    return self.execute(batch, allow_graph=False, hidden_rows=hidden_rows)
        self._apply_block_copies(batch)
        num_samples = int(np.asarray(batch.logits_indices).shape[0])
        if int(np.asarray(batch.input_ids).shape[0]) == 0:
            empty = torch.empty(num_samples, self.config.vocab_size, device=self.device)
            if hidden_rows is not None:
                return empty, torch.empty(0, self.config.hidden_size, device=self.device)
            return empty
        if self.validate_steps:
            self._validate(batch)
        if allow_graph and hidden_rows is None and \
                self._fits_decode_graphs(batch, self.decode_graphs, checked=True):
            self.graph_steps += 1
            self._graph_logits, self._graph_greedy_rows = self.decode_graphs.run(batch)
            return self._graph_logits
        meta = self.attn_backend.build_metadata(batch, self.device)
        logits_indices = _to_device(batch.logits_indices, self.device, torch.int64)
        rows = None if hidden_rows is None else \
            _to_device(np.asarray(hidden_rows), self.device, torch.int64)
        pieces = self.piecewise_graphs
        if allow_graph and pieces is not None and pieces.can_run(int(batch.input_ids.shape[0])):
            self.piecewise_steps += 1
            return self._run_pieces(batch, meta, logits_indices, rows)
        self.eager_steps += 1
        input_ids = _to_device(batch.input_ids, self.device, torch.int64)
        positions = _to_device(batch.positions, self.device, torch.int64)
        return self._forward(input_ids, positions, meta, logits_indices, rows)

    def _apply_block_copies(self, batch) -> None:
        copies = getattr(batch, "block_copies", None)
        if copies is not None and len(copies):
            self.kv_cache.copy_blocks(copies)

    def _fits_decode_graphs(self, batch, graphs: DecodeGraphRunner | None, *,
                            checked: bool = False) -> bool:
        """Whether ``graphs`` can replay ``batch`` (a decode step sampling every row that fits a
        bucket), its arrays checked first with ``validate_steps`` unless ``checked``."""
        if graphs is None or not _samples_every_row(batch) or not graphs.can_run(batch):
            return False
        if self.validate_steps and not checked:
            self._validate(batch)
        return True

    def _validate(self, batch) -> None:
        """``validate_steps``: the step's arrays against the cache and the model (ValueError)."""
        check_step_arrays(batch, self.block_size, self.kv_cache.num_blocks)
        if int(np.asarray(batch.positions).max()) >= self.config.max_position_embeddings:
            raise ValueError("a position exceeds the model's max_position_embeddings")

    def _run_pieces(self, batch, meta, logits_indices: torch.Tensor,
                    hidden_rows: torch.Tensor | None,
                    pieces: PiecewiseGraphRunner | None = None,
                    lora_blocks: np.ndarray | None = None):
        """One step through the piecewise graphs (``pieces``: the LoRA ones, with each token's
        block), attention eager between them."""
        pieces = pieces or self.piecewise_graphs
        backend, model, caches = self.attn_backend, self.model, self.kv_cache.layers

        def attention(layer: int, qkv: torch.Tensor, rope_tables):
            return model.layers[layer].self_attn.attend(qkv, rope_tables, caches[layer], meta,
                                                        backend)

        with torch_single_threaded() if self.rust_linears else contextlib.nullcontext():
            hidden = pieces.run(batch.input_ids, batch.positions, attention, lora_blocks)
            return model.logits_from_hidden(hidden, logits_indices, hidden_rows)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, *,
                              buckets: tuple[int, ...] | None = None,
                              emulate: bool = False) -> tuple[int, ...]:
        """Captures the model's decode step once per batch bucket (default
        ``decode_buckets(max_num_seqs)``) for contexts up to ``max_model_len``; returns the
        buckets. Needs a backend with ``static_decode_metadata`` (CUDA kernels; the torch
        reference for ``emulate``). ``emulate=True`` replays by re-running the forward (tests on
        any device: same data flow, no speed-up)."""
        backend = self.attn_backend
        if not emulate and not backend.supports_decode_graphs:
            raise RuntimeError(f"attention backend {backend.name!r} cannot be captured in CUDA "
                               f"graphs (use the 'cuda' backend, or run eagerly)")
        buckets = tuple(buckets) if buckets else decode_buckets(max_num_seqs)
        cfg = self.config
        max_seq_len = min(int(max_model_len), int(cfg.max_position_embeddings))
        # workspaces for every decode step the engine can run, eager ones past the last bucket too
        backend.prepare_decode_graphs(max(max(buckets), max_num_seqs), cfg.num_heads, cfg.head_dim)
        rows = torch.arange(max(buckets), dtype=torch.int64, device=self.device)

        def decode_step(inputs) -> tuple[torch.Tensor, torch.Tensor]:
            meta = backend.static_decode_metadata(inputs)
            logits = self._forward(inputs.input_ids, inputs.positions, meta, rows[:inputs.bucket])
            return logits, greedy_rows(logits)

        graphs = DecodeGraphRunner(
            decode_step, max_blocks_per_seq=-(-max_seq_len // self.block_size),
            max_seq_len=max_seq_len, device=self.device, buckets=buckets, emulate=emulate,
            num_splits_for=lambda b: backend.decode_graph_splits(b, cfg.num_kv_heads, max_seq_len))
        with torch.inference_mode():
            graphs.capture()
        self.decode_graphs = graphs
        if self.lora_slots is not None:
            self._capture_lora_decode_graphs(decode_step, graphs, emulate)
        return graphs.captured_buckets

    def _capture_lora_decode_graphs(self, decode_step, plain: DecodeGraphRunner,
                                    emulate: bool) -> None:
        """The decode step with every slot's adapter applied by row (``runtime.lora_graphs``),
        captured at ``plain``'s buckets into its memory pool. Each writes its logits and greedy
        rows into the plain graph's outputs of its bucket (one step replays one graph, and its
        outputs are read before the next), so the LoRA graphs keep no outputs of their own."""
        weights, hooks = self._graph_lora_weights(), self.model.lora

        def lora_decode_step(inputs):
            with hooks.step(weights.step(inputs.lora_blocks)):
                fresh = decode_step(inputs)
            shared = plain.output_of(inputs.bucket)
            for dst, src in zip(shared, fresh, strict=True):
                dst.copy_(src)
            return shared

        graphs = DecodeGraphRunner(
            lora_decode_step, max_blocks_per_seq=plain.max_blocks, max_seq_len=plain.max_seq_len,
            device=self.device, buckets=plain.captured_buckets, emulate=emulate,
            num_splits_for=plain.num_splits_for, lora_blocks=True, pool=plain.pool)
        with torch.inference_mode():
            graphs.capture()
        self.lora_decode_graphs = graphs

    def _graph_lora_weights(self) -> GraphLoraWeights:
        """The adapters' static weights every LoRA graph reads (made on first use)."""
        if self.graph_lora is None:
            slots = self.lora_slots
            self.graph_lora = GraphLoraWeights(self.config, slots.max_loras, slots.max_rank,
                                               self.loaded.dtype, self.device)
            logger.info("LoRA graphs: %d slots of rank <= %d, static weights %.0f MiB",
                        slots.max_loras, slots.max_rank, self.graph_lora.num_bytes / 2**20)
        return self.graph_lora

    def capture_piecewise_graphs(self, max_tokens: int, *, buckets: tuple[int, ...] | None = None,
                                 emulate: bool = False, progress=None) -> tuple[int, ...]:
        """Captures the model between its attention calls once per token bucket (default
        ``piecewise_buckets(max_tokens)``) for the steps decode graphs do not serve; returns the
        buckets. ``emulate=True`` replays by calling the pieces (tests on any device)."""
        if not hasattr(self.model, "logits_from_hidden") or \
                not all(hasattr(layer, "begin") for layer in self.model.layers):
            raise RuntimeError(f"{type(self.model).__name__} cannot run in pieces")
        if self.model.rotary is None:
            raise RuntimeError("the model has no rotary tables yet")
        if getattr(self.model, "local_rotary", None) is not None:
            raise RuntimeError("the pieces hand every layer one set of RoPE tables; this "
                               "model's sliding-window layers have their own")
        buckets = tuple(buckets) if buckets else piecewise_buckets(max_tokens)
        pieces = PiecewiseGraphRunner(self.model, buckets=buckets, device=self.device,
                                      emulate=emulate)
        with torch.inference_mode(), \
                torch_single_threaded() if self.rust_linears else contextlib.nullcontext():
            pieces.capture(progress=progress)
        self.piecewise_graphs = pieces
        if self.lora_slots is not None:     # the same pieces with every slot's adapter
            lora = PiecewiseGraphRunner(
                self.model, buckets=buckets, device=self.device, emulate=emulate,
                lora=(self.model.lora, self._graph_lora_weights()), pool=pieces.pool)
            with torch.inference_mode(), \
                    torch_single_threaded() if self.rust_linears else contextlib.nullcontext():
                lora.capture()
            self.lora_piecewise_graphs = lora
        return pieces.captured_buckets


def _embedding_in_16_bits(model) -> None:
    """Replaces a float32 ``nn.Embedding`` whose values bfloat16 (or float16) holds exactly by
    a ``QuantizedEmbedding`` of those 16-bit rows (the same rows, half the bytes), once its
    tied LM head is packed (the head reads its own copy)."""
    from torch import nn

    from ferrobatch.model.quantized_embedding import QuantizedEmbedding

    table = getattr(model, "embed_tokens", None)
    if type(table) is not nn.Embedding or table.weight.dtype != torch.float32 or (
            getattr(model, "lm_head", None) is None
            and getattr(model, "packed_lm_head", None) is None):
        return
    kept = QuantizedEmbedding.from_dense(table.weight)
    if kept is not None:
        model.embed_tokens = kept
        _log_embedding_table(kept)


def _log_embedding_table(table) -> None:
    """Says, for a token embedding kept in the GGUF file's format or in 16 bits, what it holds."""
    from ferrobatch.model.quantized_embedding import QuantizedEmbedding

    if isinstance(table, QuantizedEmbedding):
        mib = 1 << 20
        logger.info("token embedding: %s rows, each dequantized as it is looked up "
                    "(%.0f MiB; %.0f MiB in float32)", table.type_name, table.nbytes / mib,
                    table.num_embeddings * table.embedding_dim * 4 / mib)


def _gguf_block_weights(loaded) -> dict:
    """Module path -> GGUF blocks for a GGUF model's not-yet-packed linears (each proven equal
    to its float32 weight); {} for other models or when the extension lacks the kernels."""
    from ferrobatch import _scheduler

    source = str(getattr(loaded, "source", ""))
    if not source.endswith(".gguf") or not hasattr(_scheduler, "linear_q4_1_f32") \
            or not any(type(m) is torch.nn.Linear for m in loaded.model.modules()):
        return {}
    from ferrobatch.model.block_weights import block_weights_for_modules, read_block_weights

    t0 = time.perf_counter()
    blocks = block_weights_for_modules(loaded.model, read_block_weights(source, loaded.config))
    logger.debug("GGUF blocks read and checked in %.2f s", time.perf_counter() - t0)
    return blocks


def _use_fused_elementwise_ops(model, dtype: torch.dtype) -> str:
    """On CUDA: the fused elementwise kernels in place of torch's modules, once their start-up
    check agrees (``runtime.cuda_elementwise``); the log says which and why, and so does the
    returned phrase (for the serve banner)."""
    from ferrobatch.runtime.cuda_elementwise import (
        ENV_FLAG,
        CudaRMSNorm,
        check_fused_ops,
        fused_ops_requested,
        swap_cuda_elementwise_ops,
    )
    fused = "fused CUDA kernels (RMSNorm with the residual add, SiLU-and-mul, rotary)"
    if any(isinstance(m, CudaRMSNorm) for m in model.modules()):   # e.g. the KV-sizing warm-up
        if fused_ops_requested():
            logger.info("elementwise ops: the fused CUDA kernels (swapped in earlier)")
        else:
            logger.warning("elementwise ops: %s=0, but an earlier runner swapped this model's "
                           "modules for the fused CUDA kernels; they stay", ENV_FLAG)
        return fused
    if not fused_ops_requested():
        logger.info("elementwise ops: torch's modules (%s=0)", ENV_FLAG)
        return f"torch's modules ({ENV_FLAG}=0)"
    ok, detail = check_fused_ops(model, dtype)
    if not ok:
        logger.warning("elementwise ops: torch's modules; the fused CUDA kernels disagree with "
                       "them in the start-up check (%s)", detail)
        return f"torch's modules (the fused kernels failed their start-up check: {detail})"
    logger.info("elementwise ops: %d modules on the fused CUDA kernels (start-up check: %s)",
                swap_cuda_elementwise_ops(model), detail)
    return fused


def _use_rotary_kv_write(model, dtype: torch.dtype, backend) -> str:
    """On CUDA with the fused rotary kernel swapped in: rotary and the K/V write as one kernel
    (``backend.rotary_with_kv_write``, this runner only) once its start-up check agrees
    (``cuda_elementwise.check_rotary_cache``); the returned phrase says which and why."""
    from ferrobatch.runtime.cuda_elementwise import (
        ROTARY_CACHE_FLAG,
        CudaApplyRotary,
        check_rotary_cache,
        rotary_cache_requested,
    )
    backend.rotary_with_kv_write = False
    if not any(isinstance(m, CudaApplyRotary) for m in model.modules()):
        return ""
    if not rotary_cache_requested():
        logger.info("rotary and the K/V write: two kernels (%s=0)", ROTARY_CACHE_FLAG)
        return f"; rotary apart from the K/V write ({ROTARY_CACHE_FLAG}=0)"
    ok, detail = check_rotary_cache(model, dtype)
    if not ok:
        logger.warning("rotary and the K/V write stay two kernels: the fused one disagrees with "
                       "torch in the start-up check (%s)", detail)
        return f"; rotary apart from the K/V write (its fused kernel failed its check: {detail})"
    backend.rotary_with_kv_write = True
    logger.info("rotary and the K/V write: one kernel (start-up check: %s)", detail)
    return "; rotary fused with the K/V write"


def _samples_every_row(batch) -> bool:
    """logits_indices is 0..n-1: every row is sampled, in order (what a graph's output holds)."""
    indices = np.asarray(batch.logits_indices)
    n = int(np.asarray(batch.seq_lens).shape[0])
    return indices.shape == (n,) and bool(np.array_equal(indices, np.arange(n)))


def _warm_up_batch(num_tokens: int, block_size: int, vocab_size: int):
    """One sequence prefilling ``num_tokens`` tokens into blocks 1..N (block 0 = null)."""
    from types import SimpleNamespace

    num_blocks = -(-num_tokens // block_size)
    positions = np.arange(num_tokens, dtype=np.int32)
    return SimpleNamespace(
        input_ids=(positions % vocab_size).astype(np.int32), positions=positions,
        slot_mapping=(positions + block_size).astype(np.int32),
        query_start_loc=np.array([0, num_tokens], np.int32), seq_lens=np.array([num_tokens], np.int32),
        block_tables=np.arange(1, num_blocks + 1, dtype=np.int32)[None, :],
        block_copies=np.zeros((0, 2), np.int32), logits_indices=np.array([num_tokens - 1], np.int32),
    ), num_blocks + 1


def num_kv_blocks(loaded, *, block_size: int, max_num_batched_tokens: int,
                  cpu_kv_cache_bytes: int = 1 << 30, gpu_memory_fraction: float = 0.9,
                  attn_backend: AttentionBackend | str | None = None,
                  reserve_bytes: int = 0, kv_cache_dtype: torch.dtype | None = None,
                  flash_prefill: bool = True) -> int:
    """KV blocks to allocate: on CPU from ``cpu_kv_cache_bytes``; on GPU from ``gpu_memory_fraction``
    of the memory left after the weights, the peak of a warm-up forward of
    ``max_num_batched_tokens`` (one prompt, at most the model's context; prefill attention as
    ``flash_prefill`` chooses) and ``reserve_bytes``; blocks of ``kv_cache_dtype`` (None: the
    model's dtype)."""
    from ferrobatch.runtime.kv_cache import num_blocks_for_budget, num_blocks_for_gpu

    kv_dtype = check_kv_cache_dtype(kv_cache_dtype, loaded.dtype, loaded.device)
    if loaded.device.type != "cuda":
        return num_blocks_for_budget(loaded.config, block_size, kv_dtype, cpu_kv_cache_bytes)
    warm_tokens = min(max_num_batched_tokens, int(loaded.config.max_position_embeddings))
    batch, warm_blocks = _warm_up_batch(warm_tokens, block_size, loaded.config.vocab_size)
    torch.cuda.synchronize(loaded.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(loaded.device)
    runner = ModelRunner(loaded, num_blocks=warm_blocks, block_size=block_size,
                         attn_backend=attn_backend, flash_prefill=flash_prefill)
    runner.execute(batch)
    torch.cuda.synchronize(loaded.device)
    del runner
    loaded.model.attn_backend = None
    return num_blocks_for_gpu(loaded.config, block_size, kv_dtype, gpu_memory_fraction,
                              loaded.device, reserve_bytes=reserve_bytes)
