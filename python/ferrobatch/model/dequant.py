"""Vectorized torch dequantization of GGML block formats (F32/F16/BF16/Q4_0/Q4_1/Q8_0).

Other quantization types fall back to ``gguf.quants.dequantize`` (pure numpy, slower). Every
function takes the raw tensor bytes as ``uint8 [rows, bytes_per_row]`` and returns ``float32
[rows, cols]`` (the ``nn.Linear.weight`` layout).
"""

from __future__ import annotations

import numpy as np
import torch

# type id -> (elements per block, bytes per block); ids from ggml's GGMLQuantizationType.
_Q4_0, _Q4_1, _Q8_0 = 2, 3, 8
_BLOCK_SHAPES = {_Q4_0: (32, 18), _Q4_1: (32, 20), _Q8_0: (32, 34)}


def _half_scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Reads the little-endian f16 at byte ``start`` of every block as float32 ``[rows, nb, 1]``."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: element j < 16 is the low nibble of byte j, j >= 16 the high nibble."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def _dequant_blocks(raw: torch.Tensor, type_id: int) -> torch.Tensor:
    block_elems, block_bytes = _BLOCK_SHAPES[type_id]
    rows = raw.shape[0]
    blocks = raw.view(rows, -1, block_bytes)
    if type_id == _Q8_0:
        values = _half_scale(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif type_id == _Q4_1:
        values = _half_scale(blocks, 0) * _unpack_nibbles(blocks[..., 4:]) + _half_scale(blocks, 2)
    else:  # Q4_0
        values = _half_scale(blocks, 0) * (_unpack_nibbles(blocks[..., 2:]) - 8.0)
    return values.reshape(rows, blocks.shape[1] * block_elems)


def dequantize_tensor(data: np.ndarray, type_id: int, type_name: str) -> torch.Tensor:
    """Dequantizes one GGUF tensor (as exposed by ``gguf.GGUFReader``) to a float32 torch tensor.

    Raises ValueError for a quantization type neither path supports.
    """
    data = np.asarray(data)
    if type_id in (0, 1):  # F32 / F16, given typed or as raw bytes
        dtype = np.float32 if type_id == 0 else np.float16
        values = data.view(dtype) if data.dtype == np.uint8 else data.astype(dtype, copy=False)
        return torch.from_numpy(np.array(values, dtype=np.float32))
    if type_id in _BLOCK_SHAPES:
        raw = torch.from_numpy(np.array(data, dtype=np.uint8))
        if raw.dim() == 1:
            return _dequant_blocks(raw[None], type_id)[0]
        return _dequant_blocks(raw.reshape(-1, raw.shape[-1]), type_id).reshape(
            *raw.shape[:-1], -1)
    from gguf.quants import dequantize

    try:
        from gguf import GGMLQuantizationType

        values = dequantize(np.asarray(data), GGMLQuantizationType(type_id))
    except (NotImplementedError, ValueError) as exc:
        raise ValueError(f"unsupported GGUF quantization type {type_name} (id {type_id})") from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
