"""Linear layers on the CPU (float32) in the Rust kernel, weights prepacked once into panels.

``PanelLinear`` computes ``y = x @ W.T + b`` with ``ferrobatch._scheduler.linear_f32`` (source
``rust_scheduler/src/cpu_linear.rs``): ``W`` is stored as ``[ceil(N / 16), K, 16]`` column panels,
each one contiguous stream that the kernel reads once per call while a 6x16 block of outputs
sits in AVX2 registers; the work is split over the kernels' persistent thread pool
(``cpu_pool.rs``), which is why the forward runs torch single-threaded
(:mod:`ferrobatch.runtime.cpu_threads`). Measured on the 2-core EPYC dev box over SmolLM2's 30
layers plus LM head, weights streaming from DRAM (``benches/cpu_kernels.py``, README "Results"):
faster than oneDNN's prepacked inner product at every decode size and level with it at prefill
sizes. Results agree with ``F.linear`` to float32 rounding (relative ~1e-6), not bit for bit.

``pack_linear_layers(model, num_threads)`` swaps every ``nn.Linear`` for a :class:`PanelLinear`
(the dense weight is released, so memory stays the same) and gives the model a packed LM head.

Where the CPU has AMX, a GGUF layer's blocks are also packed as AMX tiles
(``cpu_amx_linear.rs``), read by steps of :func:`amx_min_rows` rows or more (4, or 3 on layers
of 2048 inputs or more); elsewhere they are
packed as 16-feature panels of their quantized integers (``cpu_quant_panels.rs``), read by steps
of :func:`quant_panels_min_rows` rows or more (4 on AVX2, 6 on AVX-512) and unpacked chunk by chunk into the float32 panel
kernel's tiles (the same output, bit for bit, from 5.3x fewer bytes). Either way the blocks
cover the smaller steps and the tiles or quantized panels all others, so the layer's float32
panels are released (SmolLM2: 537 MB less, :meth:`PanelLinear.drop_panels`).
``FERROBATCH_QUANT_PANELS=0`` keeps the float32 panels instead of the quantized ones (A/B runs).

A weight that is not in GGUF blocks but that bfloat16 (or float16) holds exactly (a Hugging
Face checkpoint stored in bfloat16, as most are, loaded as float32) is packed as 16-bit panels
(``cpu_half_panels.rs``) read by the same quantized-panel kernel at every step size: the float32
panel kernel's output bit for bit from half its bytes (bfloat16 steps of 16+ rows on AMX tiles
where the CPU has them: float32 accuracy, not those bits; ``FERROBATCH_QUANT_PANELS=0`` too
keeps the float32 panels).

A step of at most ``QUANT_MAX_ROWS`` rows (one to eight decode sequences) is bound by reading the
weights, not by arithmetic: for layers whose GGUF blocks are known (``model.block_weights``)
such a call reads the Q4_1 / Q8_0 blocks instead, ~6x fewer bytes, and forms each weight exactly
as the loader did (``cpu_quant_linear.rs``; same float32 weights, float32-rounding-level
differences in the sums). On AVX2 a one-row Q4_1 call forms no weight: it sums
``scale * (q . x) + min * sum(x)`` per block, the same dot up to float32 rounding.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PANEL_WIDTH = 16
QUANT_MAX_ROWS = 8      # the quantized kernel's limit (cpu_quant_linear.rs MAX_ROWS: accumulators in registers)
AMX_MIN_ROWS = 4        # from here the AMX tiles beat the blocks on any layer (cpu_amx_linear.rs MIN_ROWS)
TILES_ALONE_MIN_INPUTS = 4096   # layers this wide keep their AMX tiles alone (BlockKernel)


@functools.cache
def amx_min_rows(in_features: int) -> int:
    """From this many rows a step reads a GGUF layer's AMX tiles rather than its blocks: 3 for
    layers of 2048 inputs or more, else ``AMX_MIN_ROWS`` (``cpu_amx_linear.rs``
    ``min_rows``, where the measurements are; the fused decoder asks the same function)."""
    from ferrobatch._scheduler import amx_min_rows as min_rows
    return min_rows(in_features)


@functools.cache
def quant_panels_min_rows() -> int:
    """From this many rows a step reads a GGUF layer's quantized panels rather than its blocks
    (CPUs without AMX): 4 where the kernels run AVX2, 6 on AVX-512 (``cpu_quant_panels.rs``
    ``min_rows``, where the measurements are; the fused decoder asks the same function)."""
    from ferrobatch._scheduler import quant_panels_min_rows as min_rows
    return min_rows()


def packing_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if linear layers on ``device``/``dtype`` run faster prepacked, else the reason."""
    if device.type != "cpu":
        return f"prepacked weights are for the CPU (device {device})"
    if dtype != torch.float32:
        return f"prepacked weights are float32 only (dtype {dtype})"
    from ferrobatch import _scheduler
    if not hasattr(_scheduler, "linear_f32"):
        return "the compiled extension has no linear_f32 kernel (rebuild it)"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        # the kernel's portable path is slower than torch's BLAS
        return f"the linear kernel needs AVX2 + FMA (this CPU: {capability})"
    return None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``W`` ``[N, K]`` -> ``[ceil(N / 16), K, 16]``: panel ``p``, row ``k`` = ``W[16p:16p+16, k]``,
    zeros past ``N`` (the layout ``linear_f32`` reads)."""
    n, k = weight.shape
    panels = -(-n // PANEL_WIDTH)
    padded = weight.new_zeros(panels * PANEL_WIDTH, k)
    padded[:n] = weight
    return padded.view(panels, PANEL_WIDTH, k).transpose(1, 2).contiguous()


class PanelLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed by :func:`pack_panels` (inference only, float32 CPU).

    ``half_panels``: where bfloat16 (or float16) holds every value of ``W`` exactly (a
    checkpoint stored in that type, as most Hugging Face ones are), ``W`` is packed as 16-bit
    panels instead (``half``: ``(kind, panels)``, ``cpu_half_panels.rs``) that every step reads
    through ``linear_quant_panels_f32``: the same float32 weights, the same output bit for bit
    (bfloat16 steps of ``half_panels_amx_rows()``+ rows on AMX tiles, where the CPU has them:
    float32 accuracy, ``cpu_half_amx.rs``), half the bytes (no float32 panels beside them unless
    ``pack_linear_layers`` keeps them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 num_threads: int = 1, half_panels: bool = False) -> None:
        super().__init__()
        from ferrobatch._scheduler import linear_f32, linear_quant_panels_f32
        self._kernel = linear_f32
        self._panels_kernel = linear_quant_panels_f32
        self.out_features, self.in_features = weight.shape
        self.half: tuple[str, object] | None = None   # ("bf16" | "f16", uint8 panels)
        if half_panels and not weight.is_meta:
            self.half = _half_panels(weight.detach().float())
        # (no float32 panels beside 16-bit ones: a load's time and peak memory)
        self.register_buffer("packed_weight", torch.empty(0) if weight.is_meta or self.half
                             else pack_panels(weight.detach().float()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.num_threads = num_threads
        self.blocks: BlockKernel | None = None    # the same weights as GGUF blocks, if known

    @classmethod
    def from_blocks(cls, blocks: BlockKernel, bias: torch.Tensor | None = None,
                    num_threads: int = 1) -> PanelLinear:
        """The layer of a weight known only as GGUF blocks (never dequantized whole): float32
        panels only where the blocks' tiles or quantized panels do not cover every step size
        (then dequantized from the blocks)."""
        layer = cls(torch.empty(*blocks.shape, device="meta"), bias, num_threads)
        layer.blocks = blocks
        if not layer.covered_without_panels():
            layer.packed_weight = pack_panels(blocks.block_weight().dequantize())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"PanelLinear takes float32 CPU input, got {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        bias = None if self.bias is None else self.bias.numpy()
        blocks, num_rows = self.blocks, rows.shape[0]
        if self.half is not None:
            kind, panels = self.half
            self._panels_kernel(rows.numpy(), panels, kind, bias, out.numpy(), self.num_threads)
        elif blocks is not None and blocks.tiles is not None and num_rows >= blocks.amx_min_rows:
            blocks.amx(rows.numpy(), bias, out.numpy(), self.num_threads)
        elif blocks is not None and blocks.qpanels is not None \
                and (num_rows >= quant_panels_min_rows() or blocks.panels_alone):
            blocks.panels(rows.numpy(), bias, out.numpy(), self.num_threads)
        elif blocks is not None and num_rows <= QUANT_MAX_ROWS:
            blocks(rows.numpy(), bias, out.numpy(), self.num_threads)
        elif self.packed_weight.numel() == 0:   # drop_panels() checked this cannot happen
            raise RuntimeError(f"PanelLinear: {num_rows} rows and no kernel for them (the "
                               "panels were released, AMX tiles and quantized panels unusable)")
        else:
            self._kernel(rows.numpy(), self.packed_weight.numpy(), bias, out.numpy(),
                         self.num_threads)
        return out.view(*x.shape[:-1], self.out_features)

    def covered_without_panels(self) -> bool:
        """True when the 16-bit panels take every step, or the blocks every step below
        :func:`amx_min_rows` (or :func:`quant_panels_min_rows`) rows and their AMX tiles (or
        quantized panels) every other, so ``forward`` never reads the float32 panels."""
        assert max(AMX_MIN_ROWS, quant_panels_min_rows()) <= QUANT_MAX_ROWS + 1
        return self.half is not None or self.blocks is not None and (
            self.blocks.tiles is not None or self.blocks.qpanels is not None)

    def drop_panels(self) -> int:
        """Releases the float32 panels if :meth:`covered_without_panels`; returns the bytes
        freed (0 when they are still needed or already gone)."""
        if not self.covered_without_panels() or self.packed_weight.numel() == 0:
            return 0
        freed = self.packed_weight.nbytes
        self.packed_weight = torch.empty(0)
        return freed

    def dense_weight(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` (a copy): from the panels, or from the GGUF blocks
        once the panels are released (the loader's own dequantization of them)."""
        if self.packed_weight.numel():
            panels, k, width = self.packed_weight.shape
            return self.packed_weight.transpose(1, 2).reshape(panels * width, k)[
                :self.out_features].clone()
        if self.half is not None:
            return _unpack_half_panels(*self.half, self.out_features, self.in_features)
        return self.blocks.block_weight().dequantize()

    @torch.no_grad()
    def write_rows(self, start: int, rows: torch.Tensor) -> None:
        """Weight rows ``start ..`` become ``rows`` (float32 ``[R, K]``), in the panels in
        place (views of them, the fused step's included, see the new values). A layer also
        read from GGUF blocks stops reading them (they no longer hold its weights), and gets
        its float32 panels back if they were released."""
        stop = start + rows.shape[0]
        if not 0 <= start <= stop <= self.out_features or rows.shape[1:] != (self.in_features,):
            raise ValueError(f"rows {start}..{stop} of {tuple(rows.shape)} do not fit a "
                             f"[{self.out_features}, {self.in_features}] weight")
        if self.half is not None:
            # 16-bit panels packed again (float32 ones where the new rows need them)
            weight = self.dense_weight()
            weight[start:stop] = rows
            self.half = _half_panels(weight)
            if self.half is None or self.packed_weight.numel():
                self.packed_weight = pack_panels(weight)
            self.blocks = None
            return
        if self.packed_weight.numel() == 0:
            weight = self.dense_weight()
            weight[start:stop] = rows
            self.packed_weight = pack_panels(weight)
        elif start % PANEL_WIDTH == 0 and (stop % PANEL_WIDTH == 0 or stop == self.out_features):
            first, end = start // PANEL_WIDTH, -(-stop // PANEL_WIDTH)    # whole panels
            padded = rows.new_zeros((end - first) * PANEL_WIDTH, self.in_features,
                                    dtype=torch.float32)
            padded[:rows.shape[0]] = rows
            self.packed_weight[first:end] = padded.view(end - first, PANEL_WIDTH,
                                                        self.in_features).transpose(1, 2)
        else:
            index = torch.arange(start, stop)
            self.packed_weight[index // PANEL_WIDTH, :, index % PANEL_WIDTH] = rows.float()
        self.blocks = None

    def extra_repr(self) -> str:
        blocks = f", blocks={self.blocks.kind} (rows <= {QUANT_MAX_ROWS})" if self.blocks else ""
        if self.blocks is not None and self.blocks.tiles_alone:
            blocks = f", {self.blocks.kind} amx tiles alone (rows >= " \
                f"{self.blocks.amx_min_rows} on tile instructions, fewer without)"
        elif self.blocks is not None and self.blocks.tiles is not None:
            blocks += f", amx tiles (rows >= {self.blocks.amx_min_rows})"
        if self.blocks is not None and self.blocks.qpanels is not None:
            blocks += f", quantized panels (rows >= {quant_panels_min_rows()})"
        panels = "panels16" if self.packed_weight.numel() else "none"
        if self.half is not None:
            blocks = f", {self.half[0]} panels (every step)"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed={panels}{blocks}, threads={self.num_threads}")


class BlockKernel:
    """A weight's Q4_1 / Q8_0 / Q8_G16 block arrays bound to their Rust kernel
    (``linear_q4_1_f32`` / ``linear_q8_0_f32`` / ``linear_q8_g16_f32``):
    ``kernel(x, bias, out, num_threads)``; and (not for Q8_G16), with ``amx`` where the
    CPU has AMX (``amx_available()``), the same blocks packed as tiles for ``linear_amx_f32``
    (``kernel.amx(...)``, for steps of ``amx_min_rows`` or more: ``cpu_amx_linear.rs``;
    ``tiles`` is None otherwise); where they are not, with ``quant_panels``, the blocks packed
    as panels for ``linear_quant_panels_f32`` (``kernel.panels(...)``, for steps of
    :func:`quant_panels_min_rows` or more: ``cpu_quant_panels.rs``; ``qpanels`` is None
    otherwise). A Q8_G16 weight with quantized panels keeps them alone (``panels_alone``:
    ``arrays`` is None and the panels take every step)."""

    def __init__(self, block_weight, amx: bool = True, quant_panels: bool = True) -> None:
        from ferrobatch import _scheduler
        from ferrobatch.model.block_weights import Q4_1, Q8_G16

        self.type_id = block_weight.type_id
        self.kind = {Q4_1: "q4_1", Q8_G16: "q8_g16"}.get(block_weight.type_id, "q8_0")
        self.arrays = block_weight.kernel_arrays()
        self._fn = getattr(_scheduler, f"linear_{self.kind}_f32")
        self._amx = _scheduler.linear_amx_f32
        self._tile_rows = _scheduler.linear_tile_rows_f32
        self._panels = _scheduler.linear_quant_panels_f32
        # Q8G16 has no AMX tiles: its larger steps take the quantized panels even with AMX
        use_amx = amx and _scheduler.amx_available() and self.kind != "q8_g16"
        self.tiles = _aligned_64(getattr(_scheduler, f"pack_amx_{self.kind}")(*self.arrays)) \
            if use_amx else None
        pack = getattr(_scheduler, f"pack_quant_panels_{self.kind}")
        self.qpanels = _aligned_64(pack(*self.arrays)) if quant_panels and not use_amx else None
        self.shape = block_weight.shape
        # the panels' kind, as cpu_quant_panels.rs packed them: Q8G16 blocks whose minimums are
        # all +0 (Q6_K's, Q5_0's, Q3_K's, IQ4's forms) take 640-byte records without them,
        # "q8_s16" (10 bits a weight instead of 12)
        records = -(-self.shape[0] // PANEL_WIDTH) * (self.shape[1] // 32)
        self.panel_kind = "q8_s16" if self.kind == "q8_g16" and self.qpanels is not None \
            and self.qpanels.nbytes == 640 * records else self.kind
        self.amx_min_rows = amx_min_rows(self.shape[1]) if self.tiles is not None else None
        # Q8G16's quantized panels took 0.83-0.99x its blocks' time at 1-4 rows (a 14336 x 4096
        # layer, 2 threads, session 41): they alone take every step, the blocks are not kept
        # (1.5 bytes a weight less). Q4_1's blocks stay: 1.3-1.5x faster at 1-2 rows.
        if self.kind == "q8_g16" and self.qpanels is not None:
            self.arrays = None
        # AMX tiles of layers of TILES_ALONE_MIN_INPUTS inputs or more: their few-row kernel
        # (cpu_tile_rows.rs) took 0.76-0.98x the blocks' time at 1-2 rows there (Q4_1 at one
        # row 0.96-1.01x; 2048 inputs: Q4_1 1.1-1.4x slower; session 43), so the blocks are not
        # kept (0.75 / 1.06 bytes a weight less for Q4_1 / Q8_0)
        if self.tiles is not None and self.shape[1] >= TILES_ALONE_MIN_INPUTS:
            self.arrays = None

    @property
    def panels_alone(self) -> bool:
        """True when the quantized panels take every step (the blocks were not kept)."""
        return self.arrays is None and self.qpanels is not None

    @property
    def tiles_alone(self) -> bool:
        """True when the AMX tiles take every step (the blocks were not kept): steps of
        ``amx_min_rows`` or more on the tile instructions, smaller ones through
        ``linear_tile_rows_f32``."""
        return self.arrays is None and self.tiles is not None

    def block_weight(self):
        """The ``BlockWeight`` these arrays came from, value for value (unpacked from the
        quantized panels or the AMX tiles where the blocks were not kept)."""
        from ferrobatch.model.block_weights import BlockWeight

        if self.tiles_alone:
            return _blocks_from_tiles(self.tiles, self.kind, *self.shape)
        if self.arrays is None:
            return _q8_g16_from_panels(self.qpanels, *self.shape,
                                       minimums=self.panel_kind == "q8_g16")
        tensors = [torch.from_numpy(a) for a in self.arrays]
        minimum = tensors[1] if self.kind != "q8_0" else None
        return BlockWeight(self.type_id, tensors[0], tensors[-1], minimum)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays or ()) + \
            sum(a.nbytes for a in (self.tiles, self.qpanels) if a is not None)

    def __call__(self, x, bias, out, num_threads: int) -> None:
        if self.arrays is None:     # tiles alone: steps below amx_min_rows (at most 2 rows)
            self._tile_rows(x, self.tiles, self.kind, bias, out, num_threads)
            return
        self._fn(x, *self.arrays, bias, out, num_threads)

    def amx(self, x, bias, out, num_threads: int) -> None:
        self._amx(x, self.tiles, self.kind, bias, out, num_threads)

    def panels(self, x, bias, out, num_threads: int) -> None:
        self._panels(x, self.qpanels, self.panel_kind, bias, out, num_threads)


def _half_panels(weight: torch.Tensor) -> tuple[str, object] | None:
    """``("bf16" | "f16", panels)`` of a float32 ``[N, K]`` weight that 16-bit floats hold
    exactly (``pack_half_panels``), else None."""
    from ferrobatch import _scheduler
    return _scheduler.pack_half_panels(weight.contiguous().numpy())


def _unpack_half_panels(kind: str, panels, rows: int, cols: int) -> torch.Tensor:
    """The float32 ``[rows, cols]`` weight of ``pack_half_panels``' panels: records of
    ``[32 inputs][16 features]`` 16-bit values, ``cols / 32`` a panel."""
    import numpy as np
    halves = np.asarray(panels).view(np.uint16).reshape(-1, cols // 32, 32, PANEL_WIDTH)
    if kind == "bf16":
        values = (halves.astype(np.uint32) << 16).view(np.float32)
    else:
        values = halves.view(np.float16).astype(np.float32)
    dense = values.transpose(0, 3, 1, 2).reshape(-1, cols)[:rows]
    return torch.from_numpy(np.ascontiguousarray(dense))


def _q8_g16_from_panels(qpanels, rows: int, cols: int, minimums: bool = True):
    """The Q8G16 ``BlockWeight`` of ``[rows, cols]`` packed as ``pack_quant_panels_q8_g16``
    packs it (``cpu_quant_panels.rs``): per 16 features and 32 inputs a 768-byte record of the
    features' two scales (16 float32 each), their two minimums, then ``q[i] [16]`` for i < 32;
    without ``minimums`` (the "q8_s16" panels of blocks whose minimums were all +0) a 640-byte
    record of the scales and the integers."""
    from ferrobatch.model.block_weights import Q8_G16, BlockWeight

    panels, nb = -(-rows // PANEL_WIDTH), cols // 32
    record = 768 if minimums else 640
    records = torch.from_numpy(qpanels).view(panels, nb, record)

    def per_feature(start: int) -> torch.Tensor:      # [panels, nb, 2 halves, 16] -> [N, 2 nb]
        values = records[..., start:start + 128].contiguous().view(torch.float32)
        return values.view(panels, nb, 2, PANEL_WIDTH).permute(0, 3, 1, 2).reshape(
            panels * PANEL_WIDTH, 2 * nb)[:rows].contiguous()

    q = records[..., record - 512:].contiguous().view(torch.int8).view(panels, nb, 32,
                                                                        PANEL_WIDTH)
    q = q.permute(0, 3, 1, 2).reshape(panels * PANEL_WIDTH, nb, 32)[:rows].contiguous()
    scale = per_feature(0)
    minimum = per_feature(128) if minimums else torch.zeros_like(scale)
    return BlockWeight(Q8_G16, scale, q, minimum)


def _int8_slot(pos):
    """The byte of an int8 AMX tile row holding position ``pos`` (``INT8_SLOT``,
    ``cpu_amx_linear.rs``)."""
    lane, j = pos // 8, pos % 8
    return 4 * lane + j + 12 * (j >= 4)


def _blocks_from_tiles(tiles, kind: str, rows: int, cols: int):
    """The Q4_1 / Q8_0 ``BlockWeight`` of ``[rows, cols]`` packed as ``pack_amx_q4_1`` /
    ``pack_amx_q8_0`` pack it (``cpu_amx_linear.rs``): per 16 features and 32 inputs a chunk of
    16 rows of interleaved input pairs (row ``r``: inputs ``2r, 2r + 1``; position ``2c + i % 2``
    for feature ``c``) as nibbles (two rows per 32 bytes, low and high) or int8 bytes (in
    ``INT8_SLOT`` order), then the 16 scales (and, for Q4_1, the 16 minimums) as float32."""
    import numpy as np

    from ferrobatch.model.block_weights import Q4_1, Q8_0, BlockWeight

    tiles_n, nb = -(-rows // 16), cols // 32
    nibbles = kind == "q4_1"
    chunk = 192 if nibbles else 288
    chunks = np.asarray(tiles).reshape(tiles_n, nb, chunk)
    ints = np.ascontiguousarray(chunks[..., :128 if nibbles else 256]).view(np.uint8)
    params = np.ascontiguousarray(chunks[..., 128 if nibbles else 256:]).view(np.float32)
    c, i = np.meshgrid(np.arange(16), np.arange(32), indexing="ij")    # [feature, input]
    pos, row = 2 * c + i % 2, i // 2
    if nibbles:
        groups = ints.reshape(tiles_n, nb, 8, 32)
        q = groups[:, :, row // 2, pos] >> (4 * (row % 2)) & 15   # [tiles, nb, 16, 32]
    else:
        q = ints.view(np.int8).reshape(tiles_n, nb, 16, 32)[:, :, row, _int8_slot(pos)]

    def per_feature(values):                       # [tiles, nb, 16, ...] -> [rows, nb, ...]
        values = np.moveaxis(values, 2, 1)
        return torch.from_numpy(np.ascontiguousarray(
            values.reshape(tiles_n * 16, nb, *values.shape[3:])[:rows]))

    scale = per_feature(params[..., :16, None])[..., 0]
    if not nibbles:
        return BlockWeight(Q8_0, scale, per_feature(q))
    q = per_feature(q.astype(np.uint8))
    qs = q[..., :16] | (q[..., 16:] << 4)
    return BlockWeight(Q4_1, scale, qs.contiguous(), per_feature(params[..., 16:, None])[..., 0])


def _aligned_64(array):
    """1-D ``array`` starting on a 64-byte boundary (a copy where it does not): the AMX kernel's tile rows are
    64 bytes, and one that straddles two cache lines costs two accesses (~1.5x slower); the
    quantized panels' records are multiples of 64 bytes. The pack bindings' arrays already start
    on one (no copy: a copy's fresh pages cost ~2 s per GB to fault in on this VM)."""
    import numpy as np
    if array.ctypes.data % 64 == 0:
        return array
    buffer = np.empty(array.size + 64 // array.itemsize, array.dtype)
    skip = (-buffer.ctypes.data % 64) // array.itemsize
    aligned = buffer[skip:skip + array.size]
    aligned[...] = array
    return aligned


@torch.no_grad()
def pack_linear_layers(model: nn.Module, num_threads: int = 1,
                       block_weights: dict | None = None, amx: bool = True,
                       keep_panels: bool = False, quant_panels: bool = True) -> int:
    """Replaces each ``nn.Linear`` under ``model`` by a :class:`PanelLinear` using ``num_threads``
    and, for a model with a ``packed_lm_head`` slot, fills it (the packed ``lm_head``, or a packed
    copy of the tied embedding matrix). ``block_weights`` (module path -> ``BlockWeight``, from
    ``model.block_weights.block_weights_for_modules``, or the ``gguf_block_weights`` of a model
    loaded with ``gguf_blocks=True``, whose weights are still on the meta device) makes those
    layers from their blocks: their block kernel (and, with ``amx`` where the CPU has AMX, their
    AMX tiles; elsewhere, with ``quant_panels``, their quantized panels), and float32 panels only
    where those do not cover every step size, or with ``keep_panels``. With ``quant_panels``
    the other layers whose weights bfloat16 or float16 holds exactly take 16-bit panels
    (``PanelLinear.half``) instead of float32 ones.
    Returns how many weights were packed (0 when already packed; the thread count of packed
    layers is updated)."""
    num_packed = 0
    block_weights = block_weights or {}
    wants_head = hasattr(model, "packed_lm_head") and model.packed_lm_head is None
    if wants_head and getattr(model, "lm_head", None) is None:  # tied to the embeddings
        model.packed_lm_head = PanelLinear.from_blocks(
            BlockKernel(block_weights["lm_head"], amx, quant_panels), None, num_threads) \
            if "lm_head" in block_weights else PanelLinear(model.lm_head_weight,
                                                           num_threads=num_threads,
                                                           half_panels=quant_panels)
        num_packed += 1
    targets = [(prefix, parent, name, child) for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    from ferrobatch.model.progress import load_progress
    bar = load_progress(sum(4 * child.in_features * child.out_features
                            for *_, child in targets), "Packing weights for the CPU kernels")
    for prefix, parent, name, linear in targets:
        path = f"{prefix}.{name}" if prefix else name
        if path in block_weights:
            packed = PanelLinear.from_blocks(BlockKernel(block_weights[path], amx, quant_panels),
                                             linear.bias, num_threads)
        elif linear.weight.is_meta:
            raise ValueError(f"{path}: the weight was never loaded and no GGUF blocks hold it")
        else:
            packed = PanelLinear(linear.weight, linear.bias, num_threads,
                                 half_panels=quant_panels)
        setattr(parent, name, packed)
        bar.update(4 * linear.in_features * linear.out_features)   # (as float32: a bar of work)
    bar.close()
    if wants_head and model.packed_lm_head is None:
        model.packed_lm_head = model.lm_head
    for module in model.modules():
        if isinstance(module, PanelLinear):
            module.num_threads = num_threads
            if not keep_panels:
                module.drop_panels()
            elif (module.blocks is not None or module.half is not None) \
                    and not module.packed_weight.numel():
                module.packed_weight = pack_panels(module.dense_weight())
    return num_packed + len(targets)
