"""Random paged batches and a float64 oracle for the kernel tests (GPU tests only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Relative error bound ||out - ref|| / ||ref|| per output dtype, against a float64 reference on the
# same (already rounded) inputs. The kernels accumulate in fp32, so the error is dominated by the
# final rounding of the output: at most 2^-8 relative per element for bf16, 2^-11 for fp16. The
# bounds are ~2x those, tight enough that dropping or double-counting one key out of ~1000 fails.
REL_TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 2e-5}


@dataclass
class PagedBatch:
    """README step arrays (numpy) for a flat batch + its cache geometry."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    block_size: int
    num_blocks: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


def make_batch(rng: np.random.Generator, seq_lens, query_lens, block_size: int,
               extra_blocks: int = 7, extra_columns: int = 3) -> PagedBatch:
    """Sequences with the given context lengths (after the step) and query lengths; blocks are
    drawn in shuffled order from 1..num_blocks-1 (0 = null block pads the tables)."""
    seq_lens = np.asarray(seq_lens, np.int64)
    query_lens = np.asarray(query_lens, np.int64)
    assert np.all(query_lens >= 1) and np.all(query_lens <= seq_lens)
    nblk = (seq_lens + block_size - 1) // block_size
    num_blocks = int(nblk.sum()) + 1 + extra_blocks
    perm = rng.permutation(np.arange(1, num_blocks))
    width = int(nblk.max()) + extra_columns
    tables = np.zeros((len(seq_lens), width), np.int32)
    off = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[off:off + n]
        off += n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(L - q, L) for L, q in zip(seq_lens, query_lens)])
    seq_of_tok = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = tables[seq_of_tok, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return PagedBatch(
        input_ids=np.zeros(len(positions), np.int32),
        positions=positions.astype(np.int32),
        slot_mapping=slots.astype(np.int32),
        query_start_loc=qsl,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables,
        block_size=block_size,
        num_blocks=num_blocks,
    )


def random_cache(batch: PagedBatch, num_kv_heads: int, head_dim: int, dtype, device,
                 gen: torch.Generator) -> torch.Tensor:
    shape = (2, batch.num_blocks, batch.block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def reference_attention(q: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch,
                        scale: float) -> torch.Tensor:
    """float64, one sequence at a time, straight from the definition (causal over the context)."""
    T, Hq, D = q.shape
    Hkv = kv_cache.shape[-2]
    G = Hq // Hkv
    bs = batch.block_size
    out = torch.empty(T, Hq, D, dtype=torch.float64, device=q.device)
    flat = kv_cache.reshape(2, -1, Hkv, D)
    for i in range(batch.num_seqs):
        L = int(batch.seq_lens[i])
        q0, q1 = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        pos = np.arange(L)
        slots = batch.block_tables[i, pos // bs].astype(np.int64) * bs + pos % bs
        idx = torch.from_numpy(slots).to(q.device)
        k = flat[0][idx].double().repeat_interleave(G, dim=1)  # [L, Hq, D]
        v = flat[1][idx].double().repeat_interleave(G, dim=1)
        qq = q[q0:q1].double()  # [n, Hq, D]
        s = torch.einsum("nhd,lhd->hnl", qq, k) * scale
        qpos = torch.arange(L - (q1 - q0), L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
        s = s.masked_fill(~mask[None], float("-inf"))
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten poison or NaN)"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"{what}: relative error {err:.3e} >= {REL_TOL[dtype]:.1e}"
    # Also per row: a single wrong sequence must not hide in a large batch's norm.
    per_row = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-30)
    worst = float(per_row.max())
    assert worst < 2 * REL_TOL[dtype], f"{what}: worst row relative error {worst:.3e}"


def poison(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
