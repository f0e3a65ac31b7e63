"""Decode-attention microbenchmark: achieved HBM bandwidth of ferrobatch's paged decode kernel.

For each (model shape, batch, context) it builds a paged bf16 KV cache with shuffled block tables,
captures ``--calls-per-graph`` decode-attention calls in one CUDA graph (each call on a different,
disjoint set of blocks so that the data read is several times the L2 and launch gaps vanish),
replays it, and reports

    bandwidth = K/V bytes read / time per call      (B * ctx * Hkv * D * 2 (K and V) * 2 bytes)

against the device copy rate (4300 GB/s measured on this project's H200, re-measured with
``--measure-copy``). Where the split count is > 1 the splits are combined by the kernel itself
(the fused reduce, ``--reduce fused``, the engine's default once its start-up check agrees) and,
timed side by side in the same run, by the separate reduce pass (``pass us`` column); the
reduce is inside the timed region (it is part of the op);
query/output/workspace bytes are not counted (< 1% at ctx >= 512). The torch reference backend is
timed on the same inputs where its gathered copy fits ``--torch-ref-max-gb``, for a speed ratio.

Goal (issue #5): >= 70% of the copy rate at ctx >= 1k and batch >= 16.

    python benches/attention_bandwidth.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES = {
    # name: (num_q_heads, num_kv_heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
COPY_RATE_GBPS = 4300.0
GOAL = 0.70


@dataclass
class Row:
    shape: str
    batch: int
    context: int
    num_splits: int
    kv_bytes: int
    us_per_call: float
    gbps: float
    pct_of_copy: float
    torch_ref_us: float | None
    speedup_vs_torch: float | None
    reduce: str = "-"                 # how the splits were combined: fused / pass / - (1 split)
    pass_us: float | None = None      # the same call with the reduce pass (fused rows only)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama3-8b,smollm2-135m",
                   help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--batches", default="16,64,128,256")
    p.add_argument("--contexts", default="512,1024,2048,4096,8192")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-splits", type=int, default=0, help="0 = the backend's heuristic")
    p.add_argument("--reduce", choices=["fused", "pass"], default="fused",
                   help="how splits are combined in the reported time (fused: the pass is "
                        "timed too, side by side)")
    p.add_argument("--calls-per-graph", type=int, default=0,
                   help="calls captured per graph (0 = enough to read >= 4x L2, min 4)")
    p.add_argument("--reps", type=int, default=10, help="timed graph replays (median reported)")
    p.add_argument("--copy-rate", type=float, default=COPY_RATE_GBPS, help="GB/s reference")
    p.add_argument("--measure-copy", action="store_true", help="measure the device copy rate first")
    p.add_argument("--torch-ref-max-gb", type=float, default=1.0,
                   help="time the torch reference only when the K/V bytes are below this")
    p.add_argument("--quick", action="store_true", help="a small subset (smoke run)")
    p.add_argument("--json", type=Path, default=None, help="write rows + metadata here")
    return p.parse_args(argv)


def measure_copy_rate(torch, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, median of 10, GB/s."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return nbytes / statistics.median(times) / 1e9


def bench_one(torch, ops, backend_mod, shape: str, batch: int, ctx: int, args, l2_bytes: int,
              sm_count: int) -> Row:
    import numpy as np

    Hq, Hkv, D = SHAPES[shape]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    bs = args.block_size
    elem = 2
    kv_bytes = batch * ctx * Hkv * D * 2 * elem
    calls = args.calls_per_graph or max(4, min(64, math.ceil(4 * l2_bytes / kv_bytes)))
    blocks_per_seq = math.ceil(ctx / bs)
    blocks_per_set = batch * blocks_per_seq
    num_blocks = calls * blocks_per_set + 1
    cache = torch.empty(2, num_blocks, bs, Hkv, D, dtype=dtype, device="cuda")
    cache.normal_()  # random data, never zeros
    rng = np.random.default_rng(batch * 100003 + ctx)
    tables = []
    for c in range(calls):  # disjoint, shuffled block sets
        ids = 1 + c * blocks_per_set + rng.permutation(blocks_per_set)
        tables.append(torch.from_numpy(ids.reshape(batch, blocks_per_seq).astype(np.int32)).cuda())
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Hq, D, device="cuda").to(dtype)
    out = torch.empty_like(q)
    splits = args.num_splits or ops.choose_num_splits(batch, Hkv, ctx, sm_count)
    ws = ops.DecodeWorkspace.allocate(batch, Hq, D, max(splits, 1), "cuda")
    scale = 1.0 / math.sqrt(D)

    def time_calls(fused: bool) -> float:
        """Median seconds per call over graph replays of all ``calls`` calls."""
        def run_all():
            for t in tables:
                ops.paged_decode_attention(q, cache, t, seq_lens, scale, num_splits=splits,
                                           workspace=ws, out=out, fused_reduce=fused)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run_all()  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_all()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            g.replay()
            en.record()
            en.synchronize()
            times.append(st.elapsed_time(en) / 1e3 / calls)
        return statistics.median(times)

    fused = splits > 1 and args.reduce == "fused"
    t = time_calls(fused)
    pass_us = time_calls(False) * 1e6 if fused else None
    gbps = kv_bytes / t / 1e9

    torch_us = None
    if kv_bytes <= args.torch_ref_max_gb * 1e9:
        torch_us = time_torch_reference(torch, backend_mod, q, cache, tables[0], batch, ctx, bs, scale)
    return Row(shape, batch, ctx, splits, kv_bytes, t * 1e6, gbps, gbps / args.copy_rate,
               torch_us, (torch_us / (t * 1e6)) if torch_us else None,
               "fused" if fused else "pass" if splits > 1 else "-", pass_us)


def time_torch_reference(torch, backend_mod, q, cache, table, batch, ctx, bs, scale) -> float:
    from types import SimpleNamespace

    import numpy as np

    from ferrobatch.runtime.attention.torch_ref import TorchReferenceBackend

    tab = table.cpu().numpy()
    pos = np.full(batch, ctx - 1)
    step = SimpleNamespace(
        input_ids=np.zeros(batch, np.int32), positions=pos.astype(np.int32),
        slot_mapping=(tab[np.arange(batch), pos // bs].astype(np.int64) * bs + pos % bs),
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        seq_lens=np.full(batch, ctx, np.int32), block_tables=tab)
    ref = TorchReferenceBackend(bs)
    meta = ref.build_metadata(step, "cuda")
    for _ in range(2):
        ref.forward(q, cache, meta, scale)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        ref.forward(q, cache, meta, scale)
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) * 1e3)
    return statistics.median(times)


def format_table(rows: list[Row], copy_rate: float) -> str:
    header = (f"{'shape':<13} {'batch':>5} {'ctx':>5} {'splits':>6} {'reduce':>6} "
              f"{'us/call':>9} {'GB/s':>7} {'%copy':>6} {'pass us':>8} {'x pass':>6} "
              f"{'torch us':>9} {'x torch':>7}")
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.shape:<13} {r.batch:>5} {r.context:>5} {r.num_splits:>6} {r.reduce:>6} "
            f"{r.us_per_call:>9.1f} {r.gbps:>7.0f} {100 * r.pct_of_copy:>5.1f}% "
            f"{(f'{r.pass_us:.1f}' if r.pass_us else '-'):>8} "
            f"{(f'{r.pass_us / r.us_per_call:.2f}' if r.pass_us else '-'):>6} "
            f"{(f'{r.torch_ref_us:.0f}' if r.torch_ref_us else '-'):>9} "
            f"{(f'{r.speedup_vs_torch:.1f}' if r.speedup_vs_torch else '-'):>7}")
    goal = [r for r in rows if r.context >= 1024 and r.batch >= 16]
    if goal:
        worst = min(goal, key=lambda r: r.pct_of_copy)
        met = sum(r.pct_of_copy >= GOAL for r in goal)
        lines.append(f"goal >= {GOAL:.0%} of {copy_rate:.0f} GB/s at ctx >= 1k, batch >= 16: "
                     f"{met}/{len(goal)} configs meet it; worst {100 * worst.pct_of_copy:.1f}% "
                     f"({worst.shape} b={worst.batch} ctx={worst.context})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("attention_bandwidth: needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    from ferrobatch.runtime import cuda_ops as ops
    from ferrobatch.runtime.attention import cuda as backend_mod

    t0 = time.time()
    ops.load_ops()
    print(f"kernels loaded in {time.time() - t0:.1f}s", flush=True)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    if args.measure_copy:
        args.copy_rate = measure_copy_rate(torch)
        print(f"measured device copy rate: {args.copy_rate:.0f} GB/s", flush=True)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        batches, contexts = [16, 128], [1024, 4096]
    rows = []
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
        for batch in batches:
            for ctx in contexts:
                r = bench_one(torch, ops, backend_mod, shape, batch, ctx, args, l2,
                              props.multi_processor_count)
                rows.append(r)
                torch.cuda.empty_cache()  # the config's caches are garbage now
                extra = f" (reduce pass: {r.pass_us:.1f} us)" if r.pass_us else ""
                print(f"{shape} b={batch} ctx={ctx} splits={r.num_splits}: {r.us_per_call:.1f} us "
                      f"{r.gbps:.0f} GB/s ({100 * r.pct_of_copy:.1f}%){extra}", flush=True)
    table = format_table(rows, args.copy_rate)
    print(table)
    if args.json:
        meta = {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": props.name, "sm_count": props.multi_processor_count, "l2_bytes": l2,
            "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": args.dtype,
            "block_size": args.block_size, "copy_rate_gbps": args.copy_rate,
            "command": " ".join([sys.executable, *sys.argv]),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows],
                                         "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
