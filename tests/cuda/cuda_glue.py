"""CPU stand-ins for the CUDA attention backend's ops, and random paged steps, shared by the
glue tests of tests/cuda (the ``backend`` fixture in conftest.py puts them in place)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ferrobatch.runtime.attention.torch_ref import static_decode_attention

BLOCK_SIZE = 16


def _attend_rows(q, kv_cache, table, length, first_pos, scale):
    """Causal attention of query rows at positions first_pos.. over one sequence's cache."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    pos = torch.arange(length)
    slots = table[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    flat = kv_cache.reshape(2, -1, num_kv_heads, head_dim).float()
    k = flat[0][slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = flat[1][slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    qpos = first_pos + torch.arange(num_rows)
    s = s.masked_fill(~(pos[None, :] <= qpos[:, None])[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


class FakeOps:
    """CPU stand-ins for the three CUDA ops, asserting what the kernels assume."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reshape_and_cache(self, key, value, kv_cache, slot_mapping) -> None:
        self.calls.append("cache")
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        keep = slot_mapping >= 0
        flat[0][slot_mapping[keep].long()] = key[keep].to(kv_cache.dtype)
        flat[1][slot_mapping[keep].long()] = value[keep].to(kv_cache.dtype)

    def paged_decode_attention(self, q, kv_cache, block_tables, seq_lens, scale, *, num_splits,
                               workspace=None, out=None, fused_reduce=False):
        self.calls.append(f"decode/{num_splits}" + ("/fused" if fused_reduce else ""))
        batch = q.shape[0]
        assert block_tables.shape[0] >= batch and seq_lens.shape[0] >= batch
        assert block_tables.dtype == seq_lens.dtype == torch.int32
        assert num_splits >= 1
        if num_splits > 1:   # the kernel writes partials for every (row, head, split)
            assert workspace is not None and workspace.partial_out.shape[0] >= batch
            assert workspace.max_splits >= num_splits
            if fused_reduce:   # one arrival counter per (row, KV head), indexed b * Hq + kvh
                assert workspace.split_counters.numel() >= batch * q.shape[1]
        res = static_decode_attention(q.float(), kv_cache.float(), block_tables[:batch],
                                      seq_lens[:batch], scale).to(q.dtype)
        if out is None:
            return res
        out.copy_(res)
        return out

    def paged_prefill_attention(self, q, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                max_query_len, *, out=None, seq_ids=None):
        self.calls.append("prefill" + ("/subset" if seq_ids is not None else ""))
        qsl = query_start_loc.tolist()
        ids = range(len(seq_lens)) if seq_ids is None else seq_ids.tolist()
        if out is None:
            out = torch.full_like(q, float("nan"))
        for i in ids:
            n, length = qsl[i + 1] - qsl[i], int(seq_lens[i])
            assert n <= max_query_len, "the grid (sized by max_query_len) would skip rows"
            out[qsl[i]:qsl[i + 1]] = _attend_rows(q[qsl[i]:qsl[i + 1]], kv_cache,
                                                  block_tables[i], length, length - n,
                                                  scale).to(out.dtype)
        return out


def make_step(rng, seq_lens, query_lens):
    seq_lens, query_lens = np.asarray(seq_lens), np.asarray(query_lens)
    nblk = -(-seq_lens // BLOCK_SIZE)
    perm = rng.permutation(np.arange(1, int(nblk.sum()) + 8))
    tables = np.zeros((len(seq_lens), int(nblk.max()) + 2), np.int32)
    off = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[off:off + n]
        off += n
    positions = np.concatenate([np.arange(L - q, L) for L, q in zip(seq_lens, query_lens)])
    seq_of = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = tables[seq_of, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return SimpleNamespace(
        input_ids=np.zeros(len(positions), np.int32), positions=positions.astype(np.int32),
        slot_mapping=slots.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
        block_tables=tables), int(perm.max()) + 1
