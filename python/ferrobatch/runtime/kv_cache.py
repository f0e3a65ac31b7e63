"""Paged KV cache tensors: one ``[2, num_blocks, block_size, num_kv_heads, row]`` per layer, where
a head's ``row`` is its ``head_dim`` values (an int8 cache: then the 4 bytes of their scale).

The cache holds the model's dtype, or on the CPU optionally float16, FP8 E4M3
(``float8_e4m3fn``, ``--kv-cache-dtype fp8``) or int8 with a scale per token and KV head
(``--kv-cache-dtype int8``, llama.cpp's ``q8_0`` cache) beside a float32 model: a half, a quarter
or (int8, head_dim 64) 0.27 of the bytes per token (that many times more tokens in the same
``--kv-cache-gb``, that much less memory for decode attention to read), each K/V value rounded once
when written (FP8: saturated to +-448 first, as vLLM's conversion does; int8: each head row to
``round(x / scale)`` with ``scale = max|x| / 127``, :func:`quantize_rows`) and computed with in
float32 (the Rust kernels convert on load, ``rust_scheduler/src/cpu_kv.rs``, ``cpu_kv_fp8.rs``
and ``cpu_kv_q8.rs``; the torch reference converts what it gathers, :func:`cache_values`).
Greedy output then no longer matches a float32 reference token for token on every prompt, which
is why none is the default; FP8's three mantissa bits move the logits more than int8's seven
(relative to the row's largest value) and float16's ten (``tests/model/test_kv_cache_fp8.py``,
``test_kv_cache_int8.py``).

torch has no CPU ``index_copy_`` / ``index_put_`` for float8 and numpy no float8 at all, so an
FP8 cache is moved as its bytes (:func:`storage_view`, :func:`cache_array`).
"""

from __future__ import annotations

import numpy as np
import torch

from ferrobatch.config import KV_CACHE_TORCH_DTYPES
from ferrobatch.model.config import ModelConfig

# (device type, model dtype) -> the KV cache dtypes other than the model's that the attention
# backends there read
EXTRA_KV_CACHE_DTYPES = {
    ("cpu", torch.float32): (torch.float16, torch.float8_e4m3fn, torch.int8)}
# the largest finite float8_e4m3fn value: what is written saturates to it
FP8_E4M3_MAX = 448.0
# an int8 cache's head row ends in its float32 scale's bytes; its values are in -127..127
INT8_SCALE_BYTES = 4
INT8_MAX = 127.0


def cache_row_len(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one token's one KV head in a cache of ``dtype``."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` float32 as int8 cache rows ``[..., D + 4]``, each row with its own scale
    (the byte the Rust writer, ``cpu_kv_q8::quantize_head``, writes for every input): ``scale =
    max|x| / 127`` and ``round(x / scale)`` (to nearest, ties to even); a row whose scale is 0, inf
    or NaN gets bytes 0 and keeps that scale, so a NaN or infinity reads back as NaN."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    ok = (scale > 0) & torch.isfinite(scale)
    q = torch.where(ok, x / torch.where(ok, scale, 1.0), 0.0).round()
    q = q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def cache_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (any leading dims) as the values they hold, in ``dtype``: an int8 cache's
    bytes times their row's scale, any other cache converted."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].to(torch.float32) * scale).to(dtype)


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for an FP8 cache its bytes (uint8, the same memory): what copies and
    index writes work on."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def cache_array(t: torch.Tensor) -> np.ndarray:
    """A CPU cache tensor as the numpy array the Rust kernels take (FP8: its bytes, uint8)."""
    return storage_view(t).numpy()


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., D]`` as the rows a cache of ``dtype`` stores (to nearest, ties to even; FP8
    saturates at +-448 as the Rust kernels' writes do, where torch's own conversion gives NaN;
    int8: :func:`quantize_rows`, ``[..., D + 4]``)."""
    if dtype == torch.int8:
        return quantize_rows(x)
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


def check_kv_cache_dtype(kv_dtype: torch.dtype | None, model_dtype: torch.dtype,
                         device: torch.device | str) -> torch.dtype:
    """The KV cache dtype to use (None: the model's); ValueError for one not supported there."""
    if kv_dtype is None or kv_dtype == model_dtype:
        return model_dtype
    device_type = torch.device(device).type
    allowed = EXTRA_KV_CACHE_DTYPES.get((device_type, model_dtype), ())
    if kv_dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in (model_dtype, *allowed))
        article = "an" if kv_dtype in (torch.float8_e4m3fn, torch.int8) else "a"  # "an fp8"
        raise ValueError(f"{article} {_dtype_name(kv_dtype)} KV cache is not supported beside a "
                         f"{_dtype_name(model_dtype)} model on {device_type}; supported: {names}")
    return kv_dtype


def kv_cache_dtype_flag(dtype: torch.dtype) -> str | None:
    """The ``--kv-cache-dtype`` value that asks for ``dtype`` (None: no value does)."""
    name = str(dtype).removeprefix("torch.")
    return next((flag for flag, torch_name in KV_CACHE_TORCH_DTYPES.items()
                 if torch_name == name), None)


def _dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype, with the --kv-cache-dtype value where that differs."""
    name = str(dtype).removeprefix("torch.")
    flag = kv_cache_dtype_flag(dtype)
    return name if flag in (None, name) else f"{flag} ({name})"


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    row_bytes = cache_row_len(config.head_dim, dtype) * element_size
    return 2 * config.num_layers * config.num_kv_heads * row_bytes * block_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype,
                          budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes``; ValueError if fewer than 2 (null block + one)."""
    num_blocks = int(budget_bytes // kv_block_bytes(config, block_size, dtype))
    if num_blocks < 2:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds fewer than 2 blocks")
    return num_blocks


def available_memory_bytes() -> int | None:
    """The memory the kernel says new allocations can take without swapping (MemAvailable,
    Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# Of the memory available once the weights are loaded, the most the KV cache may take: the rest
# is for the step's activations, the sampler and the server.
CPU_KV_MEMORY_FRACTION = 0.9


def check_cpu_kv_fits(num_bytes: int, available: int | None = None) -> None:
    """ValueError when a CPU KV cache of ``num_bytes`` would not fit in memory (its zero-fill
    would otherwise swap or have the process killed, with no message)."""
    available = available_memory_bytes() if available is None else available
    if available is None or num_bytes <= CPU_KV_MEMORY_FRACTION * available:
        return
    raise ValueError(
        f"the KV cache would take {num_bytes / 2**30:.2f} GiB but only {available / 2**30:.2f} "
        f"GiB of memory is available (at most {CPU_KV_MEMORY_FRACTION:.0%} of it may go to the "
        "cache); lower --kv-cache-gb or num_blocks")


def num_blocks_for_gpu(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       memory_fraction: float, device: torch.device, reserve_bytes: int = 0) -> int:
    """Blocks fitting in ``memory_fraction`` of the device memory still free *now*, less
    ``reserve_bytes`` (memory the engine will need later, e.g. CUDA-graph outputs) and less the
    activation peak since the last ``torch.cuda.reset_peak_memory_stats`` (call after the weights
    are loaded and a warm-up pass has run, see ``model_runner.num_kv_blocks``)."""
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    torch.cuda.empty_cache()
    free_bytes, _ = torch.cuda.mem_get_info(device)
    # activations of the warm-up pass were freed, but the next steps will need them again
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = int(free_bytes * memory_fraction) - peak_extra - reserve_bytes
    return num_blocks_for_budget(config, block_size, dtype, budget)


class KVCache:
    """The per-layer paged KV tensors plus block copies (copy-on-write for parallel sampling);
    ``dtype`` is what they store (see the module docstring)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("KV cache needs num_blocks >= 2 and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_blocks, block_size, config.num_kv_heads,
                 cache_row_len(config.head_dim, dtype))
        self.layers: list[torch.Tensor] = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        """What the cache stores (the model's dtype, or float16 / float8_e4m3fn / int8 on the
        CPU)."""
        return self.layers[0].dtype

    @property
    def num_bytes(self) -> int:
        """Total bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for t in self.layers)

    def copy_blocks(self, pairs: np.ndarray | torch.Tensor) -> None:
        """Copies block ``src`` to ``dst`` for every ``(src, dst)`` row, in every layer (K and V)."""
        pairs = torch.as_tensor(np.asarray(pairs, dtype=np.int64).reshape(-1, 2))
        if pairs.numel() == 0:
            return
        if int(pairs.min()) < 0 or int(pairs.max()) >= self.num_blocks:
            raise ValueError("block_copies refers to a block outside the KV cache")
        pairs = pairs.to(self.layers[0].device)
        src, dst = pairs[:, 0], pairs[:, 1]
        for layer in self.layers:
            layer = storage_view(layer)
            layer[:, dst] = layer[:, src]
