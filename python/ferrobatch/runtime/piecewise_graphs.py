"""Piecewise CUDA graphs: the steps decode graphs cannot serve (prefill chunks, mixed prefill +
decode, speculative verification) replay the model *between* its attention calls.

Why: on the H200 a mixed step of SmolLM2-135M ran eagerly in ~38 ms while a decode graph's replay
took 4-6 ms (benches/results/gpu-2026-12-04): ~35 kernel launches per layer, each a few µs of
host time, for a GPU that finishes the work in a fraction of that. Everything outside attention
(embedding, norms, projections, rope, MLP, residuals) works row by row, so its kernel sequence
depends only on the step's token count; attention alone depends on how the tokens split into
sequences (its grid comes from host-side lengths). So, per token *bucket* ``T``
(``piecewise_buckets``), the model is captured as ``num_layers + 1`` graphs:

* piece 0: embed ``input_ids`` -> residual stream; the step's rotary tables; layer 0's norm and
  QKV projection;
* piece i (1 <= i < L): finish layer i-1 after its attention (o_proj, residual, MLP), begin
  layer i (norm, QKV projection);
* piece L: finish the last layer.

A step of ``n <= T`` tokens copies its ids and positions into static buffers, replays piece 0,
then for each layer rotates q and k, writes K/V and runs attention **eagerly** on the first ``n``
rows of the static QKV buffer (``LlamaAttention.attend``: with the fused CUDA ops, rotary and the
K/V write are one kernel; the step's ordinary attention metadata, so any mix of sequences works)
and replays the next piece. Rows ``n..T`` are padding: they hold earlier steps' (finite) values, flow
through the row-wise pieces and are never read; attention never sees them, so the KV cache is
written only at the step's own slots. The final norm and LM head run eagerly on the sampled rows.
(Launches per layer: ~35 eager -> 1 replay + the attention's few.)

Every piece reads and writes only the static buffers (sized for the largest bucket), so what a
piece allocates inside its graph is scratch, and all graphs share one memory pool: the pool holds
about one eager step's activations at the largest bucket, whatever the number of graphs.

``emulate=True`` captures nothing and "replays" by calling the piece: the whole data flow
(padding, static buffers, the attention between pieces) is tested on any device.

With ``lora=(hooks, weights)`` every piece runs inside a LoRA step of the static adapter
weights (``runtime.lora_graphs``) and one more static buffer, each token's block (-1: a
base-model token, and the padding): the pieces of steps with adapter tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def piecewise_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token buckets up to ``max_tokens``: 16, 32, 64, 128, then every 128 up to 1024, every 256
    up to 2048, every 512 beyond (from 512 tokens on a step pads at most 1/4 of its tokens); the
    cap itself is always a bucket."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    candidates = [16, 32, 64, *range(128, 1025, 128), *range(1280, 2049, 256),
                  *range(2560, max(max_tokens, 2560) + 1, 512)]
    return tuple(sorted({b for b in candidates if b < max_tokens} | {max_tokens}))


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket >= ``num_tokens`` (None when the step is larger than every bucket)."""
    for b in buckets:
        if b >= num_tokens:
            return b
    return None


def pool_bytes_estimate(config, max_tokens: int, dtype: torch.dtype) -> int:
    """A bound on what the graphs keep: the static buffers plus one piece's scratch at
    ``max_tokens`` rows (the fused gate/up output and its activation dominate)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    per_row = (3 * config.hidden_size + 2 * (q + 2 * kv) + q     # static + qkv scratch
               + 3 * config.intermediate_size) * elem \
        + 2 * config.head_dim * (4 + 2 * elem)                   # rope tables: float32, cast, static
    return int(max_tokens * per_row)


class PiecewiseGraphRunner:
    """Captures a Llama-style model (``embed_tokens``, ``rotary``, ``layers[i].begin / finish``,
    ``norm``, ``compute_logits``) in pieces around attention, per token bucket, and runs steps
    through them (see the module docstring).

    ``attention(layer, qkv, rope_tables)`` runs layer ``layer``'s rotary, K/V write and attention
    eagerly on its QKV projection ``[n, (Hq + 2 Hkv) * D]`` for the step at hand (the caller binds
    the step's metadata) and returns ``[n, Hq * D]``.
    """

    def __init__(self, model, *, buckets: tuple[int, ...], device: torch.device | str,
                 emulate: bool = False, lora: tuple | None = None, pool=None) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError("buckets must be positive token counts")
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        self.device = torch.device(device)
        self.emulate = emulate
        cfg = model.config
        self.num_layers = len(model.layers)
        dtype = model.embed_tokens.weight.dtype
        big = self.buckets[-1]
        dev = self.device
        self._input_ids = torch.zeros(big, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(big, dtype=torch.int64, device=dev)
        self._hidden = torch.zeros(big, cfg.hidden_size, dtype=dtype, device=dev)
        self._qkv = torch.zeros(big, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
                                dtype=dtype, device=dev)
        self._attn = torch.zeros(big, cfg.num_heads * cfg.head_dim, dtype=dtype, device=dev)
        # each token's rotary tables, looked up once per step (piece 0) for every layer
        self._cos = torch.zeros(big, 1, cfg.head_dim, dtype=dtype, device=dev)
        self._sin = torch.zeros(big, 1, cfg.head_dim, dtype=dtype, device=dev)
        self._graphs: dict[int, list] = {}
        self._pool = pool            # another runner's pool may be shared: never run at once
        self._lora = lora
        self._lora_blocks = None if lora is None else \
            torch.full((big,), -1, dtype=torch.int64, device=dev)
        self._staging: torch.Tensor | None = None     # host side of _copy_in: [2, big] int64
        self._staged = None           # CUDA event after the last copies out of _staging
        self.replays = 0          # steps run through the pieces

    # ---- the pieces ---------------------------------------------------------------------------
    def _begin(self, layer: int, residual: torch.Tensor, delta: torch.Tensor | None,
               t: int) -> None:
        """Layer ``layer`` up to attention: its residual stream into ``_hidden``, its QKV
        projection into ``_qkv``."""
        residual, qkv = self.model.layers[layer].begin(residual, delta)
        self._hidden[:t].copy_(residual)
        self._qkv[:t].copy_(qkv)

    def _piece(self, index: int, t: int) -> Callable[[], None]:
        """Piece ``index`` for bucket ``t`` as a function of the static buffers alone."""
        model = self.model

        def first() -> None:
            hidden = model.embed(self._input_ids[:t])
            cos, sin = model.rotary.tables(self._positions[:t], hidden.dtype)
            self._cos[:t].copy_(cos)
            self._sin[:t].copy_(sin)
            self._begin(0, hidden, None, t)

        def middle() -> None:
            residual, delta = model.layers[index - 1].finish(self._hidden[:t], self._attn[:t])
            if index < self.num_layers:
                self._begin(index, residual, delta, t)
            else:
                self._hidden[:t].copy_(residual + delta)

        piece = first if index == 0 else middle
        if self._lora is None:
            return piece
        hooks, weights = self._lora

        def with_lora() -> None:
            with hooks.step(weights.step(self._lora_blocks[:t])):
                piece()

        return with_lora

    # ---- capture ------------------------------------------------------------------------------
    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @property
    def pool(self):
        """The captured pieces' memory pool (None before capture, or emulated)."""
        return self._pool

    def capture(self, warmup_iters: int = 2,
                progress: Callable[[int, int], None] | None = None) -> None:
        """Captures every piece of every bucket, largest bucket first, into one shared pool.
        The pieces touch only the static buffers, never the KV cache. ``progress(done, total)``
        is called after each bucket."""
        if self.device.type != "cuda" and not self.emulate:
            raise RuntimeError("CUDA graphs need a CUDA device")
        pieces = {t: [self._piece(i, t) for i in range(self.num_layers + 1)]
                  for t in self.buckets}
        if self.emulate:
            self._graphs = {t: [_EmulatedPiece(p) for p in ps] for t, ps in pieces.items()}
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for t in reversed(self.buckets):
                for _ in range(warmup_iters):
                    for piece in pieces[t]:
                        piece()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for done, t in enumerate(reversed(self.buckets), 1):
            graphs = []
            for piece in pieces[t]:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    piece()
                if self._pool is None:
                    self._pool = graph.pool()
                graphs.append(graph)
            self._graphs[t] = graphs
            if progress is not None:
                progress(done, len(self.buckets))
        torch.cuda.synchronize(self.device)

    # ---- replay -------------------------------------------------------------------------------
    def can_run(self, num_tokens: int) -> bool:
        return bool(self._graphs) and 0 < num_tokens <= self.captured_buckets[-1]

    def run(self, input_ids: np.ndarray, positions: np.ndarray,
            attention: Callable[[int, torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
                                torch.Tensor],
            lora_blocks: np.ndarray | None = None) -> torch.Tensor:
        """Runs one step of ``n`` tokens (with each token's LoRA block, which a runner made
        with ``lora`` needs); returns the last layer's residual stream ``[n, hidden]`` (a view
        of the static buffer: valid until the next run)."""
        n = int(np.asarray(input_ids).shape[0])
        t = bucket_for(n, self.captured_buckets)
        if t is None:
            raise ValueError(f"no captured bucket holds {n} tokens")
        if (lora_blocks is None) != (self._lora is None):
            raise ValueError("LoRA blocks go with, and only with, pieces made with lora")
        if lora_blocks is not None and np.shape(lora_blocks) != (n,):
            raise ValueError(f"lora_blocks must hold one block per token ({n})")
        self._copy_in(input_ids, positions, n, t, lora_blocks)
        graphs = self._graphs[t]
        qkv, attn = self._qkv[:n], self._attn[:n]                     # views, once per step
        tables = (self._cos[:n], self._sin[:n])
        graphs[0].replay()
        for layer in range(self.num_layers):
            attn.copy_(attention(layer, qkv, tables))
            graphs[layer + 1].replay()
        self.replays += 1
        return self._hidden[:n]

    def _copy_in(self, input_ids: np.ndarray, positions: np.ndarray, n: int, t: int,
                 lora_blocks: np.ndarray | None = None) -> None:
        """The step's ids and positions (and tokens' LoRA blocks, -1 on the padding up to the
        bucket ``t``) into the static device buffers, through one host staging buffer made once
        (pinned on CUDA: no page-locked allocation per step); the previous step's copies out of
        it are waited for before it is overwritten."""
        if self._staging is None:
            cuda = self.device.type == "cuda"
            self._staging = torch.empty(3, self.buckets[-1], dtype=torch.int64, pin_memory=cuda)
            self._staged = torch.cuda.Event() if cuda else None
        elif self._staged is not None:
            self._staged.synchronize()
        host = self._staging.numpy()
        host[0, :n] = input_ids
        host[1, :n] = positions
        self._input_ids[:n].copy_(self._staging[0, :n], non_blocking=True)
        self._positions[:n].copy_(self._staging[1, :n], non_blocking=True)
        if lora_blocks is not None:
            host[2, :n] = lora_blocks
            host[2, n:t] = -1
            self._lora_blocks[:t].copy_(self._staging[2, :t], non_blocking=True)
        if self._staged is not None:
            self._staged.record()


class _EmulatedPiece:
    """A stand-in for a captured piece (``emulate=True``): replay calls the piece."""

    def __init__(self, piece: Callable[[], None]) -> None:
        self.piece = piece
        piece()            # as capture runs it once

    def replay(self) -> None:
        self.piece()
