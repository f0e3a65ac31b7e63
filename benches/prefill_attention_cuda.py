"""Prefill-attention microbenchmark on CUDA: ferrobatch's paged prefill kernel against the
FlashAttention-2 path (``runtime.attention.flash_prefill``: K/V gathered from the paged cache,
then torch's varlen kernel), on the same steps, side by side in one run.

Steps (per model shape, bf16, block 16, shuffled block tables):
  fresh    a full-budget step of fresh prompts (the ``gpu-8b`` workload's prompts: 128..1024
           tokens, seeded), as many as fit in --tokens
  chunk    one 2048-token chunk after 6144 tokens of prior context (chunked prefill)
  mixed    --decode-rows decode rows (context 512..1024) beside the fresh prompts of half the
           budget: the decode rows go to the decode kernel in both systems and are not timed
  small    the decode rows beside 128 prefill tokens (a chunk of 48 after 252 tokens of
           context, a fresh prompt of 80): the engine's threshold (flash_prefill.MIN_QUERY_TOKENS)
           sends steps below 128 to ferrobatch's kernel, this measures the crossover

Each system's call is timed with CUDA events (median of --reps, after 3 warm-ups); the flash
time includes the gather. Reported: ms per call (one layer), the attention FLOP rate (causal:
2 * 2 * D * Hq * sum over queries of the keys they see), the ratio, and the relative difference
of the outputs. The engine's start-up check (``check_flash_prefill``) is run and reported too.

    python benches/prefill_attention_cuda.py [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import name_list, positive_int  # noqa: E402

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}   # (Hq, Hkv, D)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=name_list(SHAPES), default=list(SHAPES),
                   help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--tokens", type=positive_int, default=8192,
                   help="query tokens of the fresh step (half of them in the mixed step)")
    p.add_argument("--decode-rows", type=positive_int, default=64)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--reps", type=positive_int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def step_lengths(kind: str, tokens: int, decode_rows: int, rng) -> tuple[list[int], list[int]]:
    """(context lengths after the step, query lengths) of one step."""
    if kind == "chunk":
        return [6144 + 2048], [2048]
    if kind == "small":
        ctx = rng.integers(512, 1025, size=decode_rows).tolist()
        return ctx + [300, 80], [1] * decode_rows + [48, 80]
    budget = tokens if kind == "fresh" else tokens // 2
    lens: list[int] = []
    while sum(lens) < budget:          # at least one prompt, even when the budget is small
        n = min(int(rng.integers(128, 1025)), max(budget, 2))
        if lens and sum(lens) + n > budget:
            break
        lens.append(n)
    if kind == "fresh":
        return lens, list(lens)
    ctx = rng.integers(512, 1025, size=decode_rows).tolist()
    return ctx + lens, [1] * decode_rows + lens


def causal_flops(seq_lens, query_lens, seqs, num_heads: int, head_dim: int) -> float:
    """2 (QK and PV) * 2 (multiply-add) * D * Hq * the keys each query of ``seqs`` sees."""
    keys = 0
    for b in seqs:
        L, n = int(seq_lens[b]), int(query_lens[b])
        keys += n * (L - n) + n * (n + 1) // 2
    return 4.0 * head_dim * num_heads * keys


def time_call(torch, fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure_step(torch, lens: np.ndarray, qlens: np.ndarray, shape: tuple[int, int, int],
                 bs: int, reps: int, rng) -> dict:
    """Times ferrobatch's kernel and the flash path on one random step (bf16, shuffled block
    tables) and compares their outputs on the prefill rows."""
    from ferrobatch.runtime import cuda_ops
    from ferrobatch.runtime.attention import flash_prefill as flash

    hq, hkv, d = shape
    dev = torch.device("cuda")
    nblk = -(-lens // bs)
    perm = rng.permutation(int(nblk.sum())) + 1
    tables = np.zeros((len(lens), int(nblk.max())), np.int32)
    off = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[off:off + n]
        off += n
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    seqs = np.flatnonzero(qlens > 1)
    cache = torch.randn(2, int(nblk.sum()) + 1, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(int(qsl[-1]), hq, d, device=dev, dtype=torch.bfloat16)

    def to_dev(a, np_dtype):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np_dtype)).to(dev)

    bt, sl, qs = to_dev(tables, np.int32), to_dev(lens, np.int32), to_dev(qsl, np.int32)
    ids, max_q = to_dev(seqs, np.int32), int(qlens[seqs].max())
    plan = flash.plan_flash_prefill(qsl, lens, tables, bs, seqs, to_dev)
    out_k, out_f = torch.zeros_like(q), torch.zeros_like(q)
    scale = d ** -0.5
    ms_k = time_call(torch, lambda: cuda_ops.paged_prefill_attention(
        q, cache, bt, sl, qs, scale, max_q, out=out_k, seq_ids=ids), reps)
    ms_f = time_call(torch, lambda: flash.flash_prefill_attention(q, cache, plan, scale,
                                                                  out=out_f), reps)
    rows = to_dev(np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in seqs]), np.int64)
    a, b = out_f.index_select(0, rows).double(), out_k.index_select(0, rows).double()
    flops = causal_flops(lens, qlens, seqs, hq, d)
    return {"query_tokens": int(qlens[seqs].sum()), "prefill_seqs": int(len(seqs)),
            "decode_rows": int((qlens == 1).sum()), "ferrobatch_ms": ms_k, "flash_ms": ms_f,
            "speedup": ms_k / ms_f, "ferrobatch_tflops": flops / ms_k / 1e9,
            "flash_tflops": flops / ms_f / 1e9,
            "rel_diff": float((a - b).norm() / b.norm())}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("prefill_attention_cuda: needs a CUDA device", file=sys.stderr)
        return 2
    from ferrobatch.runtime import cuda_ops
    from ferrobatch.runtime.attention import flash_prefill as flash

    cuda_ops.load_ops()
    dev, bs = torch.device("cuda"), args.block_size
    rng = np.random.default_rng(args.seed)
    rows = []
    header = (f"{'shape':<13} {'step':<6} {'q tok':>6} {'seqs':>5} {'ferrobatch ms':>13} "
              f"{'TFLOP/s':>8} {'flash ms':>9} {'TFLOP/s':>8} {'speed-up':>8} {'rel diff':>9}")
    print(header)
    for shape in args.shapes:
        hq, hkv, d = SHAPES[shape]
        ok, detail = flash.check_flash_prefill(cuda_ops.paged_prefill_attention, hq, hkv, d,
                                               torch.bfloat16, bs, dev)
        print(f"{shape}: start-up check {'passed' if ok else 'FAILED'}: {detail}")
        for kind in ("fresh", "chunk", "mixed", "small"):
            lens, qlens = step_lengths(kind, args.tokens, args.decode_rows, rng)
            row = measure_step(torch, np.asarray(lens), np.asarray(qlens), (hq, hkv, d),
                               bs, args.reps, rng)
            row.update(shape=shape, step=kind, check_passed=ok)
            rows.append(row)
            print(f"{shape:<13} {kind:<6} {row['query_tokens']:>6} {row['prefill_seqs']:>5} "
                  f"{row['ferrobatch_ms']:>13.3f} {row['ferrobatch_tflops']:>8.1f} "
                  f"{row['flash_ms']:>9.3f} {row['flash_tflops']:>8.1f} "
                  f"{row['speedup']:>7.2f}x {row['rel_diff']:>9.1e}")
    if args.json:
        meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "dtype": "bf16", "block_size": bs,
                "command": " ".join([sys.executable, *sys.argv])}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
