"""The AMX linear kernel (``rust_scheduler/src/cpu_amx_linear.rs``): GGUF Q4_1 / Q8_0 blocks packed
as tiles, against a float64 reference of the dequantized weights on fresh random inputs; bad
input is a ValueError that writes nothing; ``FERROBATCH_CPU_ISA`` below ``amx`` switches it off."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ferrobatch._scheduler import amx_available, linear_amx_f32, pack_amx_q4_1, pack_amx_q8_0

needs_amx = pytest.mark.skipif(not amx_available(),
                               reason="this CPU has no AMX (or FERROBATCH_CPU_ISA caps it)")


def _q4_1(rng, n: int, k: int):
    nb = k // 32
    scale = rng.uniform(0.001, 0.05, (n, nb)).astype(np.float32)
    mins = rng.uniform(-0.4, 0.0, (n, nb)).astype(np.float32)
    qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float64)   # element j, j + 16
    dense = (scale[..., None].astype(np.float64) * q + mins[..., None]).reshape(n, k)
    return (scale, mins, qs), dense


def _q8_0(rng, n: int, k: int):
    nb = k // 32
    scale = rng.uniform(0.001, 0.05, (n, nb)).astype(np.float32)
    qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8)
    dense = (scale[..., None].astype(np.float64) * qs).reshape(n, k)
    return (scale, qs), dense


@needs_amx
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (9, 200, 576), (16, 33, 64), (17, 576, 1536),
                                   (70, 100, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_a_float64_reference(kind, m, n, k, threads):
    rng = np.random.default_rng(m * 1000 + n + k + threads)
    arrays, dense = (_q4_1 if kind == "q4_1" else _q8_0)(rng, n, k)
    tiles = (pack_amx_q4_1 if kind == "q4_1" else pack_amx_q8_0)(*arrays)
    # per 16 features x 32 inputs: 4-bit integers + 16 scales + 16 mins, or int8 + 16 scales
    chunk = 192 if kind == "q4_1" else 288
    assert tiles.dtype == np.uint16 and tiles.size == -(-n // 16) * (k // 32) * chunk
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    bias = rng.standard_normal(n).astype(np.float32) if threads == 2 else None
    out = np.full((m, n), np.nan, np.float32)          # every element must be written
    linear_amx_f32(x, tiles, kind, bias, out, threads)
    want = x.astype(np.float64) @ dense.T + (0 if bias is None else bias)
    # float32 accumulation of k products: bounded by the sum of their magnitudes
    bound = 4e-7 * (np.abs(x.astype(np.float64)) @ np.abs(dense).T + 1)
    assert np.all(np.abs(out - want) <= bound), np.max(np.abs(out - want) / bound)


def test_rejects_bad_input_without_writing():
    rng = np.random.default_rng(0)
    (scale, mins, qs), _ = _q4_1(rng, 20, 64)
    tiles = pack_amx_q4_1(scale, mins, qs)
    x = np.ones((3, 64), np.float32)
    out = np.full((3, 20), 7.0, np.float32)
    bad = [
        (x, tiles[:-1], "q4_1", None, out, "packed tiles"),
        (x, tiles, "q8_0", None, out, "packed tiles"),     # the other format's length
        (x, tiles, "q4_0", None, out, "'q4_1' or 'q8_0'"),
        (x, tiles, "q4_1", None, np.full((2, 20), 7.0, np.float32), "rows"),
        (np.ones((3, 48), np.float32), tiles, "q4_1", None, out, "multiple of 32"),
        (x, tiles, "q4_1", np.zeros(19, np.float32), out, "bias"),
        (np.ones((64, 3), np.float32).T, tiles, "q4_1", None, out, "C-contiguous"),
    ]
    for args in bad:
        with pytest.raises(ValueError, match=args[-1]):
            linear_amx_f32(*args[:-1], 2)
    assert np.all(out == 7.0)
    with pytest.raises(ValueError, match="multiple of 32|scale|qs"):
        pack_amx_q4_1(scale, mins, qs[:, :, :8].copy())


def test_nibble_tiles_hold_two_rows_per_byte():
    rng = np.random.default_rng(2)
    (scale, mins, qs), _ = _q4_1(rng, 16, 32)
    tiles = pack_amx_q4_1(scale, mins, qs)
    ints = tiles[:128].view(np.uint8).reshape(8, 32)      # [row group, byte]
    q = np.concatenate([qs & 15, qs >> 4], axis=2)[:, 0]  # [feature, input]
    # byte j of group g: row 2g's value j (low nibble), row 2g + 1's (high); value j of row r
    # is feature j // 2, input 2r + j % 2
    for g, j in [(0, 0), (3, 7), (7, 31)]:
        assert ints[g, j] & 15 == q[j // 2, 4 * g + j % 2]
        assert ints[g, j] >> 4 == q[j // 2, 4 * g + 2 + j % 2]
    params = tiles[128:].copy().view(np.float32)
    assert np.array_equal(params[:16], scale[:, 0]) and np.array_equal(params[16:], mins[:, 0])


def _int8_slot(pos: int) -> int:
    """The byte of an int8 tile row holding position ``pos`` of the bfloat16 row the tile loads
    read (``INT8_SLOT`` in cpu_amx_linear.rs): widened 16 bytes at a time, packed 4 + 4 per lane."""
    lane, j = divmod(pos, 8)
    return 4 * lane + j if j < 4 else 16 + 4 * lane + j - 4


def test_int8_tiles_interleave_input_pairs_and_pad_features():
    rng = np.random.default_rng(1)
    (scale, qs), _ = _q8_0(rng, 20, 64)
    tiles = pack_amx_q8_0(scale, qs).reshape(2, 2, 288)   # [feature tiles, blocks, chunk]
    ints = tiles[..., :256].copy().view(np.int8).reshape(2, 2, 16, 32)   # [.., pair row, byte]
    # feature 17 = tile 1 column 1; inputs 32 + 4, 32 + 5 = pair row 2 of block 1, positions 2, 3
    assert ints[1, 1, 2, _int8_slot(2)] == qs[17, 1, 4]
    assert ints[1, 1, 2, _int8_slot(3)] == qs[17, 1, 5]
    for t, b, c, i in np.ndindex(2, 2, 16, 32):          # every integer, padding zero
        feature = 16 * t + c
        want = qs[feature, b, i] if feature < 20 else 0
        assert ints[t, b, i // 2, _int8_slot(2 * c + i % 2)] == want, (t, b, c, i)
    scales = tiles[1, 1, 256:].copy().view(np.float32)   # 16 scales (Q8_0 has no mins)
    assert scales[1] == scale[17, 1] and np.all(scales[4:] == 0)   # features 20..31: padding


def test_cpu_isa_env_below_amx_turns_it_off():
    """FERROBATCH_CPU_ISA=avx512 (read once per process): no AMX, the kernel refuses to run and
    the linear layers build no tiles; `amx` keeps what the CPU has."""
    probe = ("import numpy as np; from ferrobatch import _scheduler as s;"
             "from ferrobatch.model.block_weights import BlockWeight, Q8_0;"
             "from ferrobatch.runtime.cpu_linear import BlockKernel;"
             "print(s.amx_available());"
             "t = np.zeros(288, np.uint16); o = np.zeros((1, 16), np.float32)\n"
             "try: s.linear_amx_f32(np.zeros((1, 32), np.float32), t, 'q8_0', None, o, 1); print('ran')\n"
             "except ValueError as e: print('AMX' in str(e))\n"
             "import torch; w = BlockWeight.from_gguf(Q8_0, torch.zeros(16, 34, dtype=torch.uint8));"
             "print(BlockKernel(w).tiles is not None)")

    def run(value: str) -> list[str]:
        env = {**os.environ, "FERROBATCH_CPU_ISA": value}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, check=True, timeout=120)
        return out.stdout.split()

    assert run("avx512") == ["False", "True", "False"]
    widest = run("amx")
    assert widest in (["True", "ran", "True"], ["False", "True", "False"])
    if "FERROBATCH_CPU_ISA" not in os.environ:
        assert widest[0] == str(amx_available())
