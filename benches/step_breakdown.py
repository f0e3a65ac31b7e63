"""Where one CPU decode step's time goes, against this machine's own ceilings (SmolLM2 GGUF).

    python benches/step_breakdown.py [--rows 1,4,16] [--context 256] [--kv-cache-dtype float16|fp8|int8]
                                     [--json PATH]

For B sequences with `context` cached tokens each, one decode step through the `ModelRunner`
(what the engine runs per step, minus scheduling and sampling), split by the fused step's own
phase accounting (`cpu_step_timing.rs`, switched on for every other run of the step):
- **layers' linears**: the 30 layers' qkv / o / gate_up / down, through whichever kernel the
  runner picks for B rows (GGUF blocks, quantized panels or AMX tiles);
- **attention**: paged decode attention over the step's KV, 30 layers;
- **other (Rust)**: norms, RoPE, KV writes, SiLU, residual adds, buffers, checks;
- **LM head**: `compute_logits` on B rows, timed alone (one call);
- **Python and torch** = the step with timing off - all of the above: embedding, RoPE tables,
  the final norm, metadata, the calls themselves.

Two ceilings are measured in the same run: float32 multiply-add throughput as torch's GEMM
reaches it on in-cache matrices (`torch.mm`, [256, 576] @ [576, 1536], torch's threads), and
memory read bandwidth (`torch.sum` over 512 MiB). The linears are reported in GFLOP/s (2 FLOPs
per weight per row: the float32 arithmetic every kernel does, since each forms the loader's
float32 weights) against the first; the LM head (bytes of its GGUF blocks) and attention (bytes
of KV) in GB/s against the second. Medians of `--repeats`, the runs alternating.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from step_builder import ToyScheduler  # noqa: E402

from argtypes import int_list, positive_int  # noqa: E402
from common import format_table, machine_info, median_ms, write_json  # noqa: E402  (OpenMP defaults first)
from ferrobatch.model.loader import load_model  # noqa: E402
from ferrobatch.runtime.cpu_threads import torch_single_threaded  # noqa: E402
from ferrobatch.runtime.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16


def gemm_gflops(repeats: int) -> float:
    """float32 GFLOP/s of torch.mm on in-cache matrices, torch's own threads."""
    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    out = torch.empty(256, 1536)
    torch.mm(a, b, out=out)

    def run():
        for _ in range(20):
            torch.mm(a, b, out=out)
    return 20 * 2 * 256 * 576 * 1536 / median_ms(run, repeats) / 1e6


def read_gb_per_s(repeats: int) -> float:
    """GB/s of torch.sum over 512 MiB of float32 (from DRAM), torch's own threads."""
    big = torch.ones(128 << 20)
    return big.nbytes / median_ms(lambda: big.sum(), repeats) / 1e6


def decode_step(runner: ModelRunner, rows: int, context: int):
    """A decode step of `rows` sequences with `context` cached tokens (their prefill run)."""
    sched = ToyScheduler(runner.num_blocks, BLOCK_SIZE, token_budget=1 << 20)
    rng = np.random.default_rng(rows)
    for i in range(rows):
        sched.add(i, rng.integers(10, 40000, context).tolist(), max_new_tokens=4)
    prefill = sched.schedule()
    sched.update(runner.execute(prefill).argmax(-1).numpy())
    return sched.schedule()


def breakdown(runner: ModelRunner, rows: int, context: int, repeats: int) -> dict:
    from ferrobatch import _scheduler

    model, cfg = runner.model, runner.model.config
    batch = decode_step(runner, rows, context)
    layer_linears = [m for layer in model.layers
                     for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    head = model.packed_lm_head
    normed = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(0))

    def step():
        runner.execute(batch)

    def lm_head():
        with torch_single_threaded(), torch.inference_mode():
            model.compute_logits(normed)

    step(), lm_head()                                   # warm: weights and KV streamed once
    samples: dict[str, list[float]] = {k: [] for k in (
        "step", "step_timed", "linear", "attention", "other", "lm_head")}
    _scheduler.set_decoder_phase_timing(False)
    for _ in range(repeats):
        samples["step"].append(median_ms(step, 1, warm=False))
        _scheduler.take_decoder_phase_times()
        _scheduler.set_decoder_phase_timing(True)
        try:
            samples["step_timed"].append(median_ms(step, 1, warm=False))
            phases = _scheduler.take_decoder_phase_times()
        finally:
            _scheduler.set_decoder_phase_timing(False)
        if phases["steps"] != 1:
            raise RuntimeError(f"expected one fused step, the accounting saw {phases['steps']}")
        for k in ("linear", "attention", "other"):
            samples[k].append(phases[f"{k}_ns"] / 1e6)
        samples["lm_head"].append(median_ms(lm_head, 1, warm=False))
    ms = {k: float(np.median(v)) for k, v in samples.items()}
    weights = sum(m.in_features * m.out_features for m in layer_linears)
    # the bytes of the GGUF blocks themselves (not their AMX tiles or quantized panels)
    head_bytes = sum(a.nbytes for a in head.blocks.arrays) if head.blocks else 0
    kv_bytes = 2 * rows * context * cfg.num_kv_heads * cfg.head_dim \
        * runner.kv_cache.layers[0].element_size() * cfg.num_layers
    res = {"rows": rows, "context": context, "step_ms": ms["step"],
           "step_timed_ms": ms["step_timed"], "linears_ms": ms["linear"],
           "attention_ms": ms["attention"], "other_ms": ms["other"], "lm_head_ms": ms["lm_head"],
           "python_ms": ms["step"] - ms["linear"] - ms["attention"] - ms["other"]
           - ms["lm_head"],
           "linears_gflops": 2 * rows * weights / ms["linear"] / 1e6,
           "lm_head_gb_per_s": head_bytes / ms["lm_head"] / 1e6 if head_bytes else None,
           "lm_head_gflops": 2 * rows * head.in_features * head.out_features / ms["lm_head"]
           / 1e6,
           "attention_gb_per_s": kv_bytes / ms["attention"] / 1e6, "kv_mb": kv_bytes / 2**20}
    for part in ("linears", "attention", "other", "lm_head", "python"):
        res[f"{part}_share"] = res[f"{part}_ms"] / res["step_ms"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int_list, default="1,4,16")
    ap.add_argument("--context", type=positive_int, default=256)
    ap.add_argument("--repeats", type=positive_int, default=9)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float16", "fp8", "int8"], default="auto",
                    help="what the KV cache stores (auto: the model's float32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows_list = args.rows

    loaded = load_model("smollm2")
    blocks_needed = max(rows_list) * (-(-(args.context + 8) // BLOCK_SIZE)) + 2
    kv_dtype = {"auto": None, "float16": torch.float16,
                "fp8": torch.float8_e4m3fn, "int8": torch.int8}[args.kv_cache_dtype]
    runner = ModelRunner(loaded, num_blocks=blocks_needed, block_size=BLOCK_SIZE,
                         kv_cache_dtype=kv_dtype)
    print(f"linear layers: {runner.linear_kernels}", flush=True)
    gemm, bandwidth = gemm_gflops(args.repeats), read_gb_per_s(args.repeats)
    print(f"ceilings: torch.mm {gemm:.0f} GFLOP/s (in-cache float32), torch.sum "
          f"{bandwidth:.1f} GB/s (512 MiB)", flush=True)
    rows = []
    for r in rows_list:
        res = breakdown(runner, r, args.context, args.repeats)
        res["linears_of_gemm"] = res["linears_gflops"] / gemm
        res["lm_head_of_gemm"] = res["lm_head_gflops"] / gemm
        res["lm_head_of_bandwidth"] = (res["lm_head_gb_per_s"] or 0) / bandwidth
        res["attention_of_bandwidth"] = res["attention_gb_per_s"] / bandwidth
        rows.append(res)
        print(f"rows={r}: step {res['step_ms']:.2f} ms = linears {res['linears_ms']:.2f} + "
              f"attention {res['attention_ms']:.2f} + other {res['other_ms']:.2f} + LM head "
              f"{res['lm_head_ms']:.2f} + Python/torch {res['python_ms']:.2f} (timed step "
              f"{res['step_timed_ms']:.2f})", flush=True)
    print()
    print(format_table(rows, [
        ("rows", "rows", "d"), ("context", "context", "d"), ("step_ms", "step ms", ".2f"),
        ("linears_ms", "layers' linears", ".2f"), ("linears_share", "%", ".0%"),
        ("attention_ms", "attention", ".2f"), ("attention_share", "%", ".0%"),
        ("other_ms", "other (Rust)", ".2f"), ("other_share", "%", ".0%"),
        ("lm_head_ms", "LM head", ".2f"), ("lm_head_share", "%", ".0%"),
        ("python_ms", "Python+torch", ".2f"), ("python_share", "%", ".0%")]))
    print()
    print(format_table(rows, [
        ("rows", "rows", "d"),
        ("linears_gflops", "linears GFLOP/s", ".0f"), ("linears_of_gemm", "of torch.mm", ".0%"),
        ("lm_head_gflops", "LM head GFLOP/s", ".0f"), ("lm_head_of_gemm", "of torch.mm", ".0%"),
        ("lm_head_gb_per_s", "LM head GB/s", ".1f"),
        ("lm_head_of_bandwidth", "of torch.sum", ".0%"),
        ("attention_gb_per_s", "KV GB/s", ".1f"),
        ("attention_of_bandwidth", "of torch.sum", ".0%")]))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "linear_kernels": runner.linear_kernels,
                               "gemm_gflops": gemm, "read_gb_per_s": bandwidth,
                               "kv_cache_dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
                               "results": rows})
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
