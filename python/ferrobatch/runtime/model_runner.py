"""ModelRunner: one step's arrays -> tensors -> forward -> float32 logits at ``logits_indices``."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ferrobatch.runtime.attention import AttentionBackend, get_attention_backend
from ferrobatch.runtime.attention.base import check_step_arrays
from ferrobatch.runtime.cpu_elementwise import swap_elementwise_ops
from ferrobatch.runtime.cpu_linear import pack_linear_layers, packing_unsupported
from ferrobatch.runtime.cpu_threads import torch_single_threaded
from ferrobatch.runtime.kv_cache import KVCache

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
                 validate_steps: bool = True, pack_weights: bool = True) -> None:
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
                                                      model_shape=shape)
        self.model.attn_backend = self.attn_backend
        logger.info("attention backend: %s (%s)", self.attn_backend.name, self.device)
        # CPU float32: linear layers (and decode attention) in the Rust kernels, which then own
        # the threads torch had; torch runs single-threaded during the forward (cpu_threads.py).
        self.kernel_threads = torch.get_num_threads()
        self.rust_linears = pack_weights and packing_unsupported(self.device, loaded.dtype) is None
        if self.rust_linears:
            num_packed = pack_linear_layers(self.model, self.kernel_threads)
            swap_elementwise_ops(self.model)
            if getattr(self.attn_backend, "num_threads", 0) is None:
                self.attn_backend.num_threads = self.kernel_threads
            logger.info("linear layers: %d prepacked for the Rust kernel, %d threads", num_packed,
                        self.kernel_threads)
        self.block_size = block_size
        self.validate_steps = validate_steps
        self.kv_cache = KVCache(self.config, num_blocks, block_size, self.device, loaded.dtype)

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV cache (block 0 is the scheduler's null block)."""
        return self.kv_cache.num_blocks

    @torch.inference_mode()
    def execute(self, batch) -> torch.Tensor:
        """Applies ``batch.block_copies``, runs the forward, returns logits ``[S, vocab]`` float32."""
        copies = getattr(batch, "block_copies", None)
        if copies is not None and len(copies):
            self.kv_cache.copy_blocks(copies)
        num_samples = int(np.asarray(batch.logits_indices).shape[0])
        if int(np.asarray(batch.input_ids).shape[0]) == 0:
            return torch.empty(num_samples, self.config.vocab_size, device=self.device)
        if self.validate_steps:
            check_step_arrays(batch, self.block_size, self.kv_cache.num_blocks)
            if int(np.asarray(batch.positions).max()) >= self.config.max_position_embeddings:
                raise ValueError("a position exceeds the model's max_position_embeddings")
        meta = self.attn_backend.build_metadata(batch, self.device)
        input_ids = _to_device(batch.input_ids, self.device, torch.int64)
        positions = _to_device(batch.positions, self.device, torch.int64)
        logits_indices = _to_device(batch.logits_indices, self.device, torch.int64)
        if self.rust_linears:
            with torch_single_threaded():
                return self.model(input_ids, positions, self.kv_cache.layers, meta, logits_indices)
        return self.model(input_ids, positions, self.kv_cache.layers, meta, logits_indices)


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
                  attn_backend: AttentionBackend | str | None = None) -> int:
    """KV blocks to allocate: on CPU from ``cpu_kv_cache_bytes``; on GPU from ``gpu_memory_fraction``
    of the memory left after the weights and a warm-up forward of ``max_num_batched_tokens``."""
    from ferrobatch.runtime.kv_cache import num_blocks_for_budget, num_blocks_for_gpu

    if loaded.device.type != "cuda":
        return num_blocks_for_budget(loaded.config, block_size, loaded.dtype, cpu_kv_cache_bytes)
    batch, warm_blocks = _warm_up_batch(max_num_batched_tokens, block_size, loaded.config.vocab_size)
    torch.cuda.reset_peak_memory_stats(loaded.device)
    runner = ModelRunner(loaded, num_blocks=warm_blocks, block_size=block_size, attn_backend=attn_backend)
    runner.execute(batch)
    torch.cuda.synchronize(loaded.device)
    del runner
    loaded.model.attn_backend = None
    return num_blocks_for_gpu(loaded.config, block_size, loaded.dtype, gpu_memory_fraction, loaded.device)
