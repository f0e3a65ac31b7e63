"""The CPU fast paths against what they replace, side by side in one run (SmolLM2-135M shapes).

    python benches/cpu_kernels.py [--only attention|prefill|linear|blocks|kv16] [--json benches/results/cpu/cpu_kernels.json]

1. Decode attention over a paged float32 cache, all 30 layers' worth of KV (so it is read from
   DRAM, as in a real step): the Rust kernel (`CpuPagedBackend`) vs the torch reference
   (`TorchReferenceBackend`: block gather + masked SDPA), per 30 layers, at rows x context.
2. Prefill attention of one prompt chunk (Q queries after P keys of context), 30 layers' worth:
   the Rust prefill kernel as shipped (`CpuPagedBackend`: chunks long enough go to its AMX path
   where the CPU has AMX, `cpu_amx_prefill.rs`), the same kernel kept on its AVX-512 / AVX2 path
   (`amx=False`), and torch's SDPA as the backend ran it before
   (`CpuPagedBackend(prefill_kernel=False)`: block gather + causal SDPA on the kernels' threads).
3. The 30 layers' linear layers plus the LM head, at M rows (decode sizes and a 512-token
   prefill chunk): the Rust kernel over panel-packed weights (`PanelLinear`, torch
   single-threaded as in the model runner, the kernel on torch's thread count) vs oneDNN's
   inner product on a weight prepacked once (what the CPU path used before) vs `F.linear`.

4. SmolLM2's own weights (the GGUF file's Q4_1 layers and Q8_0 LM head) through the kernels the
   runner chooses between: float32 panels, the GGUF blocks (steps of <= 8 rows), the blocks as
   quantized panels (`cpu_quant_panels.rs`, where the CPU has no AMX) and as AMX tiles (CPUs
   with AMX, `cpu_amx_linear.rs`), at M rows (`--only blocks`; `--only amx` is the same).
5. A float16, an FP8 E4M3 and an int8 KV cache (`--kv-cache-dtype float16` / `fp8` / `int8`)
   against the float32 one, the same values in the first three (int8: them quantized per head
   row): the Rust decode kernel at rows x context (it reads a half / a quarter / 68 / 256 of the
   bytes) and the prefill kernel on a chunk after prior context (it converts the chunk's keys
   and values once).

Medians of repeated runs; the two sides alternate so machine noise hits both alike.
"""

# ruff: noqa: I001  (common must be imported before torch: it sets GOMP_SPINCOUNT)
from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, positive_int  # noqa: E402
from common import format_table, machine_info, median_ms, write_json  # noqa: E402  (sets GOMP_SPINCOUNT first)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ferrobatch.runtime.attention import TorchReferenceBackend  # noqa: E402
from ferrobatch.runtime.attention.cpu import CpuPagedBackend  # noqa: E402
from ferrobatch.runtime.cpu_linear import PanelLinear  # noqa: E402
from ferrobatch.runtime.cpu_threads import torch_single_threaded  # noqa: E402
from ferrobatch.runtime.kv_cache import quantize_rows  # noqa: E402

LAYERS, HQ, HKV, D, HIDDEN, FFN, VOCAB, BS = 30, 9, 3, 64, 576, 1536, 49152, 16


def _attend_all_layers(backend, meta, query, caches):
    for cache in caches:
        backend.forward(query, cache, meta, D ** -0.5)


def _dense_all(weights, xs):
    for layer in weights:
        for w in layer:
            F.linear(xs[w.shape[1]], w)


def _onednn_all(packed, xs):
    for layer in packed:
        for w, in_features in layer:
            torch.ops.mkldnn._linear_pointwise(xs[in_features], w, None, "none", [], "")


def _rust_all(packed, xs):
    with torch_single_threaded():
        for layer in packed:
            for p in layer:
                p(xs[p.in_features])


def attention_rows(rows_list, ctx_list, repeats):
    rng = np.random.default_rng(0)
    out = []
    for ctx in ctx_list:
        for rows in rows_list:
            blocks_per_seq = -(-ctx // BS)
            num_blocks = rows * blocks_per_seq + 1
            caches = [torch.randn(2, num_blocks, BS, HKV, D) for _ in range(LAYERS)]
            table = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
            table = table.reshape(rows, blocks_per_seq)
            batch = type("Step", (), dict(
                query_start_loc=np.arange(rows + 1, dtype=np.int32),
                seq_lens=np.full(rows, ctx, np.int32), block_tables=table,
                input_ids=np.zeros(rows, np.int32), slot_mapping=np.zeros(rows, np.int32)))
            query = torch.randn(rows, HQ, D)
            result = {"rows": rows, "context": ctx,
                      "kv_mb_per_step": round(2 * rows * ctx * HKV * D * 4 * LAYERS / 2**20, 1)}
            backends = {"rust": CpuPagedBackend(BS), "torch": TorchReferenceBackend(BS)}
            runs = {name: partial(_attend_all_layers, b, b.build_metadata(batch, "cpu"), query, caches)
                    for name, b in backends.items()}
            for name in ("rust", "torch", "rust", "torch"):  # alternate; keep the 2nd pair
                result[f"{name}_ms"] = median_ms(runs[name], repeats)
            result["speedup"] = result["torch_ms"] / result["rust_ms"]
            result["rust_gb_per_s"] = result["kv_mb_per_step"] * 2**20 / result["rust_ms"] / 1e6
            out.append(result)
            print(f"attention rows={rows} ctx={ctx}: rust {result['rust_ms']:.1f} ms, torch "
                  f"{result['torch_ms']:.1f} ms per 30 layers ({result['speedup']:.1f}x)", flush=True)
            del caches
    return out


def prefill_chunks(shapes, repeats):
    """(queries, prior keys) chunks: the Rust prefill kernel vs gather + SDPA, per 30 layers."""
    rng = np.random.default_rng(1)
    out = []
    for q_len, prior in shapes:
        seq_len = q_len + prior
        num_blocks = -(-seq_len // BS) + 1
        caches = [torch.randn(2, num_blocks, BS, HKV, D) for _ in range(LAYERS)]
        table = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)[None]
        batch = type("Step", (), dict(
            query_start_loc=np.array([0, q_len], np.int32), seq_lens=np.array([seq_len], np.int32),
            block_tables=table, input_ids=np.zeros(q_len, np.int32),
            slot_mapping=np.zeros(q_len, np.int32)))
        query = torch.randn(q_len, HQ, D)
        pairs = q_len * prior + q_len * (q_len + 1) // 2          # causal (query, key) pairs
        result = {"queries": q_len, "prior_keys": prior,
                  "gflop_per_step": round(4 * pairs * HQ * D * LAYERS / 1e9, 2)}
        # rust: as shipped (AMX for long chunks where the CPU has it); rust_vector: amx=False
        backends = {"rust": CpuPagedBackend(BS), "rust_vector": CpuPagedBackend(BS, amx=False),
                    "sdpa": CpuPagedBackend(BS, prefill_kernel=False)}
        runs = {name: partial(_attend_all_layers, b, b.build_metadata(batch, "cpu"), query, caches)
                for name, b in backends.items()}
        for name in list(runs) * 2:  # alternate; keep the 2nd round
            result[f"{name}_ms"] = median_ms(runs[name], repeats)
        result["speedup"] = result["sdpa_ms"] / result["rust_ms"]
        result["amx_vs_vector"] = result["rust_vector_ms"] / result["rust_ms"]
        for name in runs:
            result[f"{name}_gflops"] = result["gflop_per_step"] / result[f"{name}_ms"] * 1e3
        out.append(result)
        print(f"prefill q={q_len} prior={prior}: rust {result['rust_ms']:.1f} ms "
              f"(vector path {result['rust_vector_ms']:.1f} ms), sdpa {result['sdpa_ms']:.1f} ms "
              f"per 30 layers ({result['speedup']:.2f}x SDPA)", flush=True)
        del caches
    return out


def _paged_step(rng, rows, q_lens, ctx):
    """A step of `rows` sequences with `q_lens` queries each after `ctx - q_lens` cached
    tokens, over shuffled blocks: (batch, number of blocks)."""
    blocks_per_seq = -(-ctx // BS)
    num_blocks = rows * blocks_per_seq + 1
    table = rng.permutation(np.arange(1, num_blocks)).astype(np.int32).reshape(rows, blocks_per_seq)
    return type("Step", (), dict(
        query_start_loc=np.arange(rows + 1, dtype=np.int32) * q_lens,
        seq_lens=np.full(rows, ctx, np.int32), block_tables=table,
        input_ids=np.zeros(rows * q_lens, np.int32),
        slot_mapping=np.zeros(rows * q_lens, np.int32))), num_blocks


def kv16_rows(decode_shapes, prefill_shapes, repeats):
    """The Rust kernels over a float32 cache vs a float16 and an FP8 cache holding the same
    values (the FP8 ones) and an int8 cache of them quantized per head row, per 30 layers:
    decode (rows, context) and prefill (queries, prior keys)."""
    rng = np.random.default_rng(2)
    out = []
    for kind, rows, q_lens, ctx in ([("decode", r, 1, c) for r, c in decode_shapes]
                                    + [("prefill", 1, q, q + p) for q, p in prefill_shapes]):
        batch, num_blocks = _paged_step(rng, rows, q_lens, ctx)
        caches8 = [torch.randn(2, num_blocks, BS, HKV, D).to(torch.float8_e4m3fn)
                   for _ in range(LAYERS)]
        caches16 = [c.half() for c in caches8]
        caches32 = [c.float() for c in caches8]
        caches_i8 = [quantize_rows(c) for c in caches32]
        query = torch.randn(rows * q_lens, HQ, D)
        backend = CpuPagedBackend(BS)
        meta = backend.build_metadata(batch, "cpu")
        runs = {"f32": partial(_attend_all_layers, backend, meta, query, caches32),
                "f16": partial(_attend_all_layers, backend, meta, query, caches16),
                "fp8": partial(_attend_all_layers, backend, meta, query, caches8),
                "int8": partial(_attend_all_layers, backend, meta, query, caches_i8)}
        kv_mb = 2 * rows * ctx * HKV * D * 4 * LAYERS / 2**20
        result = {"kind": kind, "rows": rows, "queries": q_lens, "context": ctx,
                  "f32_kv_mb": round(kv_mb, 1)}
        for name in ("f32", "f16", "fp8", "int8") * 2:  # alternate; keep the 2nd round
            result[f"{name}_ms"] = median_ms(runs[name], repeats)
        result["speedup"] = result["f32_ms"] / result["f16_ms"]
        result["fp8_speedup"] = result["f32_ms"] / result["fp8_ms"]
        result["f32_gb_per_s"] = kv_mb * 2**20 / result["f32_ms"] / 1e6
        result["f16_gb_per_s"] = kv_mb / 2 * 2**20 / result["f16_ms"] / 1e6
        result["fp8_gb_per_s"] = kv_mb / 4 * 2**20 / result["fp8_ms"] / 1e6
        result["int8_speedup"] = result["f32_ms"] / result["int8_ms"]
        result["int8_gb_per_s"] = kv_mb * (D + 4) / (4 * D) * 2**20 / result["int8_ms"] / 1e6
        out.append(result)
        print(f"kv16 {kind} rows={rows} q={q_lens} ctx={ctx}: f32 {result['f32_ms']:.1f} ms, f16 "
              f"{result['f16_ms']:.1f} ms ({result['speedup']:.2f}x), fp8 {result['fp8_ms']:.1f} "
              f"ms ({result['fp8_speedup']:.2f}x), int8 {result['int8_ms']:.1f} ms "
              f"({result['int8_speedup']:.2f}x) per 30 layers", flush=True)
        del caches8, caches16, caches32, caches_i8
    return out


def linear_rows(m_list, repeats):
    torch.manual_seed(0)
    shapes = [(HQ * D + 2 * HKV * D, HIDDEN), (HIDDEN, HQ * D), (2 * FFN, HIDDEN), (HIDDEN, FFN)]
    weights = [[torch.randn(n, k) * 0.02 for n, k in shapes] for _ in range(LAYERS)]
    weights.append([torch.randn(VOCAB, HIDDEN) * 0.02])
    threads = torch.get_num_threads()
    rust = [[PanelLinear(w, num_threads=threads) for w in layer] for layer in weights]
    onednn = [[(torch.ops.mkldnn._reorder_linear_weight(w), w.shape[1]) for w in layer]
              for layer in weights]
    out = []
    for m in m_list:
        xs = {k: torch.randn(m, k) for k in (HIDDEN, HQ * D, FFN)}
        runs = {"rust": partial(_rust_all, rust, xs), "onednn": partial(_onednn_all, onednn, xs),
                "f_linear": partial(_dense_all, weights, xs)}
        r = {"rows": m}
        for name in ("rust", "onednn", "f_linear") * 2:  # alternate; keep the 2nd round
            r[f"{name}_ms"] = median_ms(runs[name], repeats)
        r["vs_onednn"] = r["onednn_ms"] / r["rust_ms"]
        r["vs_f_linear"] = r["f_linear_ms"] / r["rust_ms"]
        flops = 2 * m * sum(w.numel() for layer in weights for w in layer)
        r["rust_gflops"] = flops / r["rust_ms"] / 1e6
        out.append(r)
        print(f"linear M={m}: rust {r['rust_ms']:.1f} ms, oneDNN packed {r['onednn_ms']:.1f} ms, "
              f"F.linear {r['f_linear_ms']:.1f} ms", flush=True)
    return out


def _smollm2_block_kernels():
    """SmolLM2's 30 layers' linears and LM head as the runner packs them: float32 panels and
    their GGUF blocks (with AMX tiles where the CPU has AMX)."""
    from ferrobatch.model.block_weights import block_weights_for_modules, read_block_weights
    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.cpu_linear import pack_linear_layers

    loaded = load_model("smollm2")
    blocks = block_weights_for_modules(loaded.model, read_block_weights(loaded.source,
                                                                         loaded.config))
    pack_linear_layers(loaded.model, torch.get_num_threads(), blocks, keep_panels=True)
    model = loaded.model
    layers = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    return layers + [model.packed_lm_head]


def block_rows(m_list, repeats):
    """The same weights (SmolLM2's, from the GGUF file) through the CPU linear kernels: float32
    panels, the GGUF blocks (at most 8 rows), the blocks as quantized panels and, where the CPU
    has AMX, as AMX tiles."""
    from ferrobatch import _scheduler
    from ferrobatch.runtime.cpu_linear import _aligned_64
    linears = _smollm2_block_kernels()
    threads = torch.get_num_threads()
    for lin in linears:   # the runner packs these only where there are no AMX tiles
        if lin.blocks.qpanels is None:
            pack = _scheduler.pack_quant_panels_q4_1 if lin.blocks.kind == "q4_1" \
                else _scheduler.pack_quant_panels_q8_0
            lin.blocks.qpanels = _aligned_64(pack(*lin.blocks.arrays))
    amx = _scheduler.amx_available()

    def run(kind, xs, outs):
        for lin in linears:
            x, out = xs[lin.in_features], outs[id(lin)]
            if kind == "panels":
                _scheduler.linear_f32(x, lin.packed_weight.numpy(), None, out, threads)
            elif kind == "blocks":
                lin.blocks(x, None, out, threads)
            elif kind == "qpanels":
                lin.blocks.panels(x, None, out, threads)
            else:
                lin.blocks.amx(x, None, out, threads)

    out = []
    for m in m_list:
        rng = np.random.default_rng(m)
        xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in (HIDDEN, FFN)}
        outs = {id(lin): np.empty((m, lin.out_features), np.float32) for lin in linears}
        kinds = ("panels", "blocks")[:2 if m <= 8 else 1] + ("qpanels",) + (("amx",) if amx else ())
        r = {"rows": m}
        with torch_single_threaded():
            for kind in kinds * 2:  # alternate; keep the 2nd round
                r[f"{kind}_ms"] = median_ms(partial(run, kind, xs, outs), repeats)
        best_other = min(r[f"{k}_ms"] for k in ("panels", "blocks") if f"{k}_ms" in r)
        r["qpanels_vs_panels"] = r["panels_ms"] / r["qpanels_ms"]
        r["qpanels_vs_best_other"] = best_other / r["qpanels_ms"]
        if amx:
            r["amx_vs_panels"] = r["panels_ms"] / r["amx_ms"]
            r["amx_vs_blocks"] = r["blocks_ms"] / r["amx_ms"] if "blocks_ms" in r else None
            flops = 2 * m * sum(lin.in_features * lin.out_features for lin in linears)
            r["amx_gflops"] = flops / r["amx_ms"] / 1e6
        out.append(r)
        print(f"SmolLM2 linears M={m}: " + ", ".join(f"{k} {r[k + '_ms']:.1f} ms" for k in kinds),
              flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--only", choices=["attention", "prefill", "linear", "blocks", "amx", "kv16"],
                   default=None, help="run one of the five parts ('amx' = 'blocks')")
    p.add_argument("--block-rows", type=int_list, default="1,4,5,6,8,13,16,32,64,512",
                   help="step sizes (rows) of part 4, comma-separated")
    a = p.parse_args()
    att = attention_rows([1, 16, 32, 64], [256, 1024], a.repeats) \
        if a.only in (None, "attention") else []
    pre = prefill_chunks([(64, 0), (256, 0), (512, 0), (512, 512), (512, 1536), (512, 3584)],
                         a.repeats) \
        if a.only in (None, "prefill") else []
    lin = linear_rows([1, 4, 16, 32, 64, 512], a.repeats) if a.only in (None, "linear") else []
    blk = block_rows(a.block_rows, a.repeats) \
        if a.only in (None, "blocks", "amx") else []
    kv16 = kv16_rows([(1, 1024), (13, 256), (16, 1024), (64, 256)], [(512, 0), (512, 1536)],
                     a.repeats) if a.only in (None, "kv16") else []
    print()
    print(format_table(att, [("rows", "rows", "d"), ("context", "context", "d"),
                             ("kv_mb_per_step", "KV MB / step", ".1f"), ("rust_ms", "rust ms", ".1f"),
                             ("rust_gb_per_s", "rust GB/s", ".1f"),
                             ("torch_ms", "torch ref ms", ".1f"), ("speedup", "speed-up", ".1f")]))
    print()
    print(format_table(pre, [("queries", "queries", "d"), ("prior_keys", "prior keys", "d"),
                             ("gflop_per_step", "GFLOP / step", ".2f"), ("rust_ms", "rust ms", ".1f"),
                             ("rust_gflops", "rust GFLOP/s", ".0f"),
                             ("rust_vector_ms", "amx=False ms", ".1f"),
                             ("amx_vs_vector", "vs amx=False", ".2f"), ("sdpa_ms", "SDPA ms", ".1f"),
                             ("sdpa_gflops", "SDPA GFLOP/s", ".0f"), ("speedup", "vs SDPA", ".2f")]))
    print()
    print(format_table(lin, [("rows", "rows", "d"), ("rust_ms", "rust ms", ".1f"),
                             ("onednn_ms", "oneDNN packed ms", ".1f"), ("f_linear_ms", "F.linear ms", ".1f"),
                             ("vs_onednn", "vs oneDNN", ".2f"), ("vs_f_linear", "vs F.linear", ".2f"),
                             ("rust_gflops", "rust GFLOP/s", ".0f")]))
    if blk:
        print()
        columns = [("rows", "rows", "d"), ("panels_ms", "panels ms", ".1f"),
                   ("blocks_ms", "blocks ms", ".1f"), ("qpanels_ms", "quant panels ms", ".1f"),
                   ("qpanels_vs_panels", "qp vs panels", ".2f"),
                   ("qpanels_vs_best_other", "qp vs best other", ".2f")]
        if "amx_ms" in blk[0]:
            columns += [("amx_ms", "AMX ms", ".1f"), ("amx_vs_panels", "AMX vs panels", ".2f"),
                        ("amx_vs_blocks", "AMX vs blocks", ".2f"),
                        ("amx_gflops", "AMX GFLOP/s", ".0f")]
        print(format_table(blk, columns))
    if kv16:
        print()
        print(format_table(kv16, [("kind", "step", "s"), ("rows", "rows", "d"),
                                  ("queries", "queries", "d"), ("context", "context", "d"),
                                  ("f32_ms", "f32 cache ms", ".1f"), ("f16_ms", "f16 cache ms", ".1f"),
                                  ("fp8_ms", "fp8 cache ms", ".1f"),
                                  ("int8_ms", "int8 cache ms", ".1f"),
                                  ("f32_gb_per_s", "f32 GB/s", ".1f"),
                                  ("f16_gb_per_s", "f16 GB/s", ".1f"),
                                  ("fp8_gb_per_s", "fp8 GB/s", ".1f"),
                                  ("int8_gb_per_s", "int8 GB/s", ".1f"),
                                  ("speedup", "f16 speed-up", ".2f"),
                                  ("fp8_speedup", "fp8 speed-up", ".2f"),
                                  ("int8_speedup", "int8 speed-up", ".2f")]))
    if a.json:
        write_json(a.json, {"machine": machine_info(), "attention_30_layers": att,
                            "kv_cache_f16_vs_f32_30_layers": kv16,
                            "prefill_attention_30_layers": pre,
                            "linear_30_layers_plus_head": lin,
                            "smollm2_linears_panels_blocks_quant_panels_amx": blk})
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
