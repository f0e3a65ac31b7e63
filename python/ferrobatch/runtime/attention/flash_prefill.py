"""Prefill attention on tensor cores: torch's FlashAttention-2 varlen kernel over K/V gathered
from the paged cache (bf16 / fp16 on CUDA).

ferrobatch's own prefill kernel (``cuda/prefill_attention.cu``) computes its inner products on
the FP32 pipes. For the prompts of ``gpu-8b`` (128..1024 tokens, 8B shape) that is an estimated
20-30 % of a full-budget prefill step on the H200. For bf16 / fp16 the CUDA backend sends the
prefill sequences of a step here instead:

1. ``plan_flash_prefill`` (host, once per step, shared by every layer): the flat query rows of
   the prefill sequences, the cache slot of every token of their contexts (prior context and
   this chunk: ``write_kv`` has already stored the chunk's K/V), and the cumulative lengths.
2. ``flash_prefill_attention`` (per layer): gather those K and V rows ``[Tk, Hkv, D]`` from the
   cache, run the varlen kernel, causal with the mask aligned at the bottom right (query i of a
   chunk of n tokens sits at position L - n + i of its sequence of L tokens, so it sees keys
   0..L-n+i), and write the rows into the step's output.

The gather reads and writes each context token's K and V once per layer: ~0.6 ms per 8192-token
step of the 8B shape, against tens of ms of attention arithmetic.

``check_flash_prefill`` compares this path with ferrobatch's prefill kernel on a random step of
the model's shape before its first use (an exception or a mismatch turns the path off, with a
warning): it has not yet run on a GPU, and the varlen op is a private torch op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

FLASH_DTYPES = (torch.bfloat16, torch.float16)
# Steps with fewer prefill query tokens keep ferrobatch's kernel: their attention is a few us of
# arithmetic, and this path launches ~4 more kernels per layer (gathers, scatter) than the
# kernel's one. A guess, not a measurement: `benches/prefill_attention_cuda.py`'s "small" step
# measures both at 128 tokens.
MIN_QUERY_TOKENS = 128
# Steps whose prefill sequences hold more context tokens than this keep ferrobatch's kernel too,
# which reads the paged cache in place: the gathered K/V copy ([2, tokens, Hkv, D] per layer,
# 134 MB at this size for Llama-3-8B) is not in the start-up warm-up's memory peak (one fresh
# prompt of the step budget), so it must stay small next to the memory left out of the KV cache.
# A mixed step within it is planned whole (decode rows too, ``CudaPagedBackend.build_metadata``):
# gathering its decode rows' contexts costs less than the decode kernel's launches around it.
MAX_CONTEXT_TOKENS = 32768
# relative error (norm of the difference / norm of the kernel's output) the start-up check
# accepts between this path and ferrobatch's kernel: FlashAttention rounds the probabilities to
# the input dtype before P @ V, ferrobatch keeps them in fp32; a wrong mask or a wrong gather
# gives errors of order 1
CHECK_REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class FlashPrefillPlan:
    """One step's prefill sequences laid out for the varlen kernel (device tensors + host ints)."""

    q_rows: torch.Tensor | None  # int64 [Tq] flat rows of the prefill sequences; None: all rows
    kv_slots: torch.Tensor       # int64 [Tk] cache slot of every context token, sequence by sequence
    cu_q: torch.Tensor           # int32 [P+1] cumulative query lengths
    cu_k: torch.Tensor           # int32 [P+1] cumulative context lengths
    max_q: int
    max_k: int
    # decode rows among them (sequences of one query: a mixed step planned whole)
    one_query_seqs: bool = False


def plan_arrays(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                block_size: int, seqs: np.ndarray) -> dict[str, np.ndarray | int | None]:
    """The plan's host arrays for the sequences ``seqs`` (indices into the step's sequences, in
    order): ``q_rows`` (None when ``seqs`` is every sequence), ``kv_slots``, ``cu_q``, ``cu_k``,
    ``max_q``, ``max_k``, ``one_query_seqs``."""
    qsl = np.asarray(query_start_loc, np.int64)
    lens = np.asarray(seq_lens, np.int64)[seqs]
    first = qsl[seqs]
    qlens = qsl[seqs + 1] - first
    cu_q = np.concatenate([[0], np.cumsum(qlens)])
    cu_k = np.concatenate([[0], np.cumsum(lens)])
    q_rows = None
    if len(seqs) != len(seq_lens):
        q_rows = np.repeat(first - cu_q[:-1], qlens) + np.arange(int(cu_q[-1]))
    pos = np.arange(int(cu_k[-1])) - np.repeat(cu_k[:-1], lens)     # position in its sequence
    seq_of = np.repeat(np.asarray(seqs, np.int64), lens)
    blocks = np.asarray(block_tables)[seq_of, pos // block_size].astype(np.int64)
    return {"q_rows": q_rows, "kv_slots": blocks * block_size + pos % block_size,
            "cu_q": cu_q, "cu_k": cu_k, "max_q": int(qlens.max(initial=0)),
            "max_k": int(lens.max(initial=0)), "one_query_seqs": bool((qlens == 1).any())}


def plan_flash_prefill(query_start_loc: np.ndarray, seq_lens: np.ndarray,
                       block_tables: np.ndarray, block_size: int, seqs: np.ndarray,
                       to_device: Callable[[np.ndarray, np.dtype], torch.Tensor]
                       ) -> FlashPrefillPlan:
    """``plan_arrays`` copied to the device by ``to_device(array, numpy dtype)``."""
    a = plan_arrays(query_start_loc, seq_lens, block_tables, block_size, seqs)
    return FlashPrefillPlan(
        q_rows=None if a["q_rows"] is None else to_device(a["q_rows"], np.int64),
        kv_slots=to_device(a["kv_slots"], np.int64), cu_q=to_device(a["cu_q"], np.int32),
        cu_k=to_device(a["cu_k"], np.int32), max_q=a["max_q"], max_k=a["max_k"],
        one_query_seqs=a["one_query_seqs"])


VarlenFn = Callable[..., torch.Tensor]


def varlen_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """torch's FlashAttention-2 varlen forward (causal, bottom-right aligned; GQA when
    ``Hq % Hkv == 0``): ``[Tq, Hq, D]``. Only arguments that torch 2.1+ knows are passed."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """``varlen_flash``'s semantics in plain torch (float32 math), one sequence at a time: the
    CPU tests' stand-in for the kernel."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = q.shape[1] // k.shape[1]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        n, length = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        assert n <= max_q and length <= max_k and n <= length
        qi = q[cq[i]:cq[i + 1]].float()
        ki = k[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        vi = v[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,lhd->hnl", qi, ki) * scale
        visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
        s = s.masked_fill(~visible.to(s.device)[None], float("-inf"))
        out[cq[i]:cq[i + 1]] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), vi).to(q.dtype)
    return out


def flash_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: FlashPrefillPlan,
                            scale: float, out: torch.Tensor | None = None,
                            attn: VarlenFn | None = None) -> torch.Tensor:
    """Attention of the plan's prefill rows of ``query [T, Hq, D]`` over the paged ``kv_cache``
    ``[2, NB, BS, Hkv, D]``. With ``out`` (``[T, Hq, D]``) those rows of it are written and it
    is returned; without, the plan must cover every row and a new tensor is returned. ``attn``:
    the varlen kernel (default ``varlen_flash``)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # K and V in one gather from the contiguous cache: [2, Tk, Hkv, D]
    kv = kv_cache.view(2, -1, num_kv_heads, head_dim).index_select(1, plan.kv_slots)
    k, v = kv[0], kv[1]
    # (a strided view, e.g. q of the fused QKV projection, is copied: ~1 % of the kernel's time)
    q = query.contiguous() if plan.q_rows is None else query.index_select(0, plan.q_rows)
    attn = varlen_flash if attn is None else attn
    res = attn(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale)
    if out is None:
        if plan.q_rows is not None:
            raise ValueError("flash_prefill_attention: a plan of some rows needs `out`")
        return res
    if plan.q_rows is None:
        out.copy_(res)
    else:
        out.index_copy_(0, plan.q_rows, res)
    return out


# (context length after the step, query length) of the start-up check's step: a fresh prompt, a
# chunk after prior context that ends inside a block, a decode row (left out of the plan of the
# prefill sequences, in the plan of the whole step: ``whole_step``), a one-block prompt, a chunk
# of all but the first token
CHECK_STEP = ((37, 37), (300, 45), (130, 1), (16, 16), (97, 96))


def check_flash_prefill(kernel: Callable[..., torch.Tensor], num_heads: int, num_kv_heads: int,
                        head_dim: int, dtype: torch.dtype, block_size: int,
                        device: torch.device, attn: VarlenFn | None = None,
                        whole_step: bool = False) -> tuple[bool, str]:
    """Runs this path and ``kernel`` (``cuda_ops.paged_prefill_attention``'s signature) on
    ``CHECK_STEP`` with random inputs of the model's shape, planned as a mixed step's prefill
    sequences or (``whole_step``) as the whole step with its decode row: ``(agree, what was
    found)`` (the relative error, or an exception's text)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    lens = np.array([L for L, _ in CHECK_STEP], np.int64)
    qlens = np.array([n for _, n in CHECK_STEP], np.int64)
    nblk = -(-lens // block_size)
    perm = torch.randperm(int(nblk.sum()) + 3, generator=gen).numpy() + 1
    tables = np.zeros((len(lens), int(nblk.max()) + 2), np.int32)
    tables[np.arange(len(lens)).repeat(nblk), np.concatenate([np.arange(n) for n in nblk])] = \
        perm[:int(nblk.sum())]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    seqs = np.arange(len(lens)) if whole_step else np.flatnonzero(qlens > 1)
    try:
        cache = torch.randn(2, int(perm.max()) + 1, block_size, num_kv_heads, head_dim,
                            generator=gen).to(device=device, dtype=dtype)
        q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(device=device,
                                                                              dtype=dtype)
        scale = head_dim ** -0.5

        def dev(a, np_dtype):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np_dtype)).to(device)

        plan = plan_flash_prefill(qsl, lens, tables, block_size, seqs, dev)
        got = flash_prefill_attention(q, cache, plan, scale, out=torch.zeros_like(q), attn=attn)
        want = kernel(q, cache, dev(tables, np.int32), dev(lens, np.int32), dev(qsl, np.int32),
                      scale, int(qlens[seqs].max()), out=torch.zeros_like(q),
                      seq_ids=dev(seqs, np.int32))
        if plan.q_rows is not None:
            got, want = got.index_select(0, plan.q_rows), want.index_select(0, plan.q_rows)
        got, want = got.double(), want.double()
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this path
        return False, f"{type(exc).__name__}: {exc}"
    tol = CHECK_REL_TOL.get(dtype, 0.0)
    return err < tol, (f"relative error {err:.1e} against ferrobatch's prefill kernel "
                       f"(limit {tol:.0e})")
