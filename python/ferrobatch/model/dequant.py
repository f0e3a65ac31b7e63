"""Vectorized torch dequantization of GGML block formats (F32/F16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0,
Q4_K/Q5_K/Q6_K).

Other quantization types fall back to ``gguf.quants.dequantize`` (pure numpy, slower). Every
function takes the raw tensor bytes as ``uint8 [rows, bytes_per_row]`` and returns ``float32
[rows, cols]`` (the ``nn.Linear.weight`` layout). Q4_0 and Q4_K are computed through
:func:`q4_parts`, the form ``scale * q + minimum`` per 32 values that the CPU's Q4_1 kernel reads
(``model.block_weights``), so the two agree bit for bit; Q5_0 / Q5_1 / Q5_K / Q6_K through
:func:`g16_parts`, the form ``scale * q + minimum`` per 16 values of its Q8G16 kernel. The two
forms of the k-quants of Q4_K_M / Q5_K_M files that a large model's load spends its time on,
Q4_K's nibbles and Q5_K's and Q6_K's Q8G16 arrays, come from Rust (``rust_scheduler/src/gguf_blocks.rs``: one pass over the bytes, on
every core; the same values).
"""

from __future__ import annotations

import numpy as np
import torch

from ferrobatch import _scheduler

# type id -> (elements per block, bytes per block); ids from ggml's GGMLQuantizationType.
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = 2, 3, 6, 7, 8
_Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K, _IQ4_NL, _IQ4_XS = 10, 11, 12, 13, 14, 20, 23
_BLOCK_SHAPES = {_Q4_0: (32, 18), _Q4_1: (32, 20), _Q5_0: (32, 22), _Q5_1: (32, 24),
                 _Q8_0: (32, 34), _Q2_K: (256, 84), _Q3_K: (256, 110), _Q4_K: (256, 144),
                 _Q5_K: (256, 176), _Q6_K: (256, 210), _IQ4_NL: (32, 18), _IQ4_XS: (256, 136)}
Q4_TYPES = (_Q4_0, _Q4_1, _Q4_K)          # those :func:`q4_parts` reads
# those :func:`g16_parts` reads
G16_TYPES = (_Q5_0, _Q5_1, _Q2_K, _Q3_K, _Q5_K, _Q6_K, _IQ4_NL, _IQ4_XS)
# IQ4's sixteen levels (llama.cpp's kvalues_iq4nl)
_IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                            113], dtype=torch.int8)


def _half_scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Reads the little-endian f16 at byte ``start`` of every block as float32 ``[rows, nb, 1]``."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: element j < 16 is the low nibble of byte j, j >= 16 the high nibble."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def q4_parts(raw: torch.Tensor, type_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K tensor ``uint8 [rows, bytes]`` as ``(scale, minimum, q)``: float32
    ``[rows, cols / 32]`` twice and uint8 ``[rows, cols / 32, 32]`` values 0..15, each group of
    32 weights being ``scale * q + minimum``, exactly (Q4_0: ``d * (q - 8)``: minimum ``-8 d``;
    Q4_K: a 256-weight super-block's 6-bit scales and minimums times its two fp16 factors, each
    product exact in float32)."""
    rows = raw.shape[0]
    if type_id in (_Q4_0, _Q4_1):
        blocks = raw.view(rows, -1, _BLOCK_SHAPES[type_id][1])
        scale = _half_scale(blocks, 0)[..., 0]
        if type_id == _Q4_1:
            return scale, _half_scale(blocks, 2)[..., 0], _unpack_nibbles(blocks[..., 4:])
        return scale, -8.0 * scale, _unpack_nibbles(blocks[..., 2:])
    scale, minimum = _k_scales(raw.view(rows, -1, 144))     # Q4_K
    # 4 chunks of 32 bytes: sub-block 2c is the low nibbles of chunk c, 2c + 1 the high ones
    qs = raw.view(rows, -1, 144)[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-2).reshape(rows, -1, 32)
    return scale, minimum, q


def q4_nibbles(raw: torch.Tensor, type_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`q4_parts` with the values packed as the Q4_1 kernel reads them, ``uint8 [rows,
    cols / 32, 16]`` (byte j: value j in the low nibble, value j + 16 in the high one), straight
    from the file's nibbles: Q4_0 / Q4_1 store exactly that; Q4_K's 32-byte chunk c holds
    sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    rows = raw.shape[0]
    if type_id in (_Q4_0, _Q4_1):
        blocks = raw.view(rows, -1, _BLOCK_SHAPES[type_id][1])
        scale = _half_scale(blocks, 0)[..., 0]
        if type_id == _Q4_1:
            return scale, _half_scale(blocks, 2)[..., 0], blocks[..., 4:].contiguous()
        return scale, -8.0 * scale, blocks[..., 2:].contiguous()
    groups = raw.shape[1] // 144 * 8
    scale, minimum = torch.empty(rows, groups), torch.empty(rows, groups)
    nibbles = torch.empty(rows, groups, 16, dtype=torch.uint8)
    q4_k_into(raw.numpy(), scale, minimum, nibbles)
    return scale, minimum, nibbles


def q4_k_into(raw: np.ndarray, scale: torch.Tensor, minimum: torch.Tensor,
              nibbles: torch.Tensor) -> None:
    """:func:`q4_nibbles` of Q4_K bytes ``uint8 [rows, bytes]`` written into contiguous
    ``scale`` / ``minimum`` ``[rows, cols / 32]`` and ``nibbles`` ``[rows, cols / 32, 16]``
    (rows of a fused module's arrays), in Rust: :func:`_k_scales`' values, chunk c's low
    nibbles as group 2c and its high ones as 2c + 1."""
    _scheduler.q4_k_to_q4_1(np.ascontiguousarray(raw), scale.numpy(), minimum.numpy(),
                            nibbles.numpy())


def per_16(per_32: torch.Tensor) -> torch.Tensor:
    """Scales (or minimums) of groups of 32 ``[..., n]`` as those of groups of 16 ``[..., 2n]``."""
    return per_32.repeat_interleave(2, dim=-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 bytes of high bits (a little-endian uint32, bit i: element i) as
    ``[..., 32]`` values 0 / 16."""
    bits = torch.arange(32, dtype=torch.int32)
    word = qh.to(torch.int32)
    word = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16) | (word[..., 3] << 24)
    return ((word[..., None] >> bits) & 1) << 4


def g16_parts(raw: torch.Tensor, type_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q5_0 / Q5_1 / Q5_K / Q6_K tensor ``uint8 [rows, bytes]`` as ``(scale, minimum, q)``:
    float32 ``[rows, cols / 16]`` twice and int8 ``[rows, cols / 32, 32]``, each group of 16
    weights being ``scale * q + minimum``, exactly the values gguf-py's dequantization gives
    (Q5_0: ``d * (q - 16)``; Q5_K: a 6-bit scale and minimum per 32 times the super-block's
    fp16 factors; Q6_K: ``d`` times a signed 8-bit scale per 16, ``q - 32``; minimum 0)."""
    rows = raw.shape[0]
    if type_id in (_Q2_K, _Q3_K, _IQ4_NL, _IQ4_XS):
        return _low_bit_parts(raw.view(rows, -1, _BLOCK_SHAPES[type_id][1]), type_id)
    if type_id in (_Q5_0, _Q5_1):
        size = _BLOCK_SHAPES[type_id][1]
        blocks = raw.view(rows, -1, size)
        d = _half_scale(blocks, 0)[..., 0]
        start = 2 if type_id == _Q5_0 else 4
        q = _unpack_nibbles(blocks[..., start + 4:]).to(torch.int32) | _fifth_bits(
            blocks[..., start:start + 4])
        if type_id == _Q5_0:
            q, minimum = q - 16, torch.zeros_like(d)
        else:
            minimum = _half_scale(blocks, 2)[..., 0]
        return per_16(d), per_16(minimum), q.to(torch.int8)
    nb = raw.shape[1] // _BLOCK_SHAPES[type_id][1]      # Q5_K / Q6_K, in Rust
    scale, minimum = torch.empty(rows, nb * 16), torch.empty(rows, nb * 16)
    q = torch.empty(rows, nb * 8, 32, dtype=torch.int8)
    k_quant_g16_into(raw.numpy(), type_id, scale, minimum, q)
    return scale, minimum, q


def k_quant_g16_into(raw: np.ndarray, type_id: int, scale: torch.Tensor,
                     minimum: torch.Tensor, q: torch.Tensor) -> None:
    """Q4_K, Q5_K or Q6_K bytes ``uint8 [rows, bytes]`` in Q8G16's form (:func:`g16_parts`'
    values; Q4_K's those of its Q4_1 form per 16) written into contiguous ``scale`` /
    ``minimum`` ``[rows, cols / 16]`` and ``q`` ``[rows, cols / 32, 32]``, in Rust. Q4_K / Q5_K:
    :func:`_k_scales`' value per 32 for both its halves; chunk c of the low-bit bytes gives
    group 2c its low nibbles and 2c + 1 its high ones, and for Q5_K bit s of the high-bit
    bytes group s's fifth bit. Q6_K: ``d`` times a signed 8-bit scale per 16 (minimum 0); in
    each half of 128 weights, 64 bytes of low bits give 4 runs of 32 (low nibbles of bytes
    0-31, of 32-63, then their high nibbles) and 32 bytes of high bits 2 bits each; ``q - 32``."""
    _scheduler.k_quant_to_q8_g16(type_id, np.ascontiguousarray(raw), scale.numpy(),
                                 minimum.numpy(), q.numpy())


def _low_bit_parts(blocks: torch.Tensor,
                   type_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`g16_parts` of Q2_K, Q3_K (a scale, for Q2_K a minimum too, per 16 weights times
    the super-block's fp16 factors), IQ4_NL and IQ4_XS (a scale per 32 times llama.cpp's
    sixteen non-uniform levels), ``blocks`` ``uint8 [rows, nb, bytes per block]``."""
    rows, nb = blocks.shape[:2]
    if type_id == _Q2_K:
        scales = blocks[..., :16]
        d, dmin = _half_scale(blocks, 80), _half_scale(blocks, 82)
        scale = (d * (scales & 0x0F).float()).reshape(rows, nb * 16)
        minimum = -(dmin * (scales >> 4).float()).reshape(rows, nb * 16)
        qs = blocks[..., 16:80].reshape(rows, nb, 2, 1, 32)
        q = (qs >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3
        return scale, minimum, q.reshape(rows, nb * 8, 32).to(torch.int8)
    if type_id == _Q3_K:
        hmask, qs, packed = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108]
        low = (packed[..., :8].reshape(rows, nb, 1, 8)
               >> torch.tensor([0, 4], dtype=torch.uint8).reshape(2, 1)).reshape(rows, nb, 16)
        high = (packed[..., 8:12].reshape(rows, nb, 1, 4)
                >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)).reshape(rows, nb, 16)
        sub = ((low & 0x0F) | ((high & 3) << 4)).to(torch.int8) - 32
        scale = (_half_scale(blocks, 108) * sub.float()).reshape(rows, nb * 16)
        q_low = (qs.reshape(rows, nb, 2, 1, 32)
                 >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3
        q_high = (hmask.reshape(rows, nb, 1, 32)
                  >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1
        # a set high bit means no offset, a clear one 4 less (as ggml lays it out)
        q = q_low.reshape(rows, nb, 8, 32).to(torch.int8) - ((q_high ^ 1) << 2).to(torch.int8)
        return scale, torch.zeros_like(scale), q.reshape(rows, nb * 8, 32)
    if type_id == _IQ4_NL:
        d = _half_scale(blocks, 0)[..., 0]
        q = _IQ4_LEVELS[_unpack_nibbles(blocks[..., 2:]).long()]
        return per_16(d), torch.zeros_like(per_16(d)), q
    # IQ4_XS: per super-block d, 8 six-bit scales (low 4 bits in bytes 4-7's nibbles, high 2
    # bits in the uint16 at bytes 2-3), then 8 groups of 32 as IQ4_NL's nibbles
    d = _half_scale(blocks, 0)
    high_word = blocks[..., 2].to(torch.int32) | (blocks[..., 3].to(torch.int32) << 8)
    low = (blocks[..., 4:8].reshape(rows, nb, 4, 1)
           >> torch.tensor([0, 4], dtype=torch.uint8)).reshape(rows, nb, 8) & 0x0F
    high = (high_word[..., None] >> (2 * torch.arange(8, dtype=torch.int32))) & 3
    sub = (low.to(torch.int32) | (high << 4)).to(torch.int8) - 32
    scale = (d * sub.float()).reshape(rows, nb * 8)
    q = _IQ4_LEVELS[_unpack_nibbles(blocks[..., 8:].reshape(rows, nb, 8, 16)).long()]
    return per_16(scale), torch.zeros_like(per_16(scale)), q.reshape(rows, nb * 8, 32)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-blocks' 8 sub-block scales and minimums, ``[rows, nb * 8]`` float32:
    ``d * sc`` and ``-(dmin * m)``, each product exact. The 6-bit values: the first four in the
    low bits of bytes 4-7 / 8-11, the last four in the nibbles of bytes 12-15 with two high bits
    from bytes 4-7 / 8-11."""
    rows = blocks.shape[0]
    d, dmin = _half_scale(blocks, 0), _half_scale(blocks, 2)
    packed = blocks[..., 4:16].to(torch.int32)       # (not the whole block: 4 bytes per byte)
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sub_scale = torch.cat((low & 63, (mixed & 15) | ((low >> 6) << 4)), dim=-1)
    sub_min = torch.cat((high & 63, (mixed >> 4) | ((high >> 6) << 4)), dim=-1)
    return (d * sub_scale.float()).reshape(rows, -1), -(dmin * sub_min.float()).reshape(rows, -1)


def _dequant_blocks(raw: torch.Tensor, type_id: int) -> torch.Tensor:
    rows = raw.shape[0]
    if type_id in Q4_TYPES:
        scale, minimum, q = q4_parts(raw, type_id)
        return (scale[..., None] * q.float() + minimum[..., None]).reshape(rows, -1)
    if type_id in G16_TYPES:
        scale, minimum, q = g16_parts(raw, type_id)
        values = scale[..., None] * q.reshape(rows, -1, 16).float() + minimum[..., None]
        return values.reshape(rows, -1)
    blocks = raw.view(rows, -1, 34)       # Q8_0
    values = _half_scale(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    return values.reshape(rows, -1)


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
