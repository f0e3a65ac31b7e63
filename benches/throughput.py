"""Offline throughput: the same seeded requests through several systems, one after another.

    python benches/throughput.py --workload cpu-small \
        --systems ferrobatch,ferrobatch-static,hf-static,hf-continuous \
        --json benches/results/cpu/throughput_cpu-small.json

Systems (append `@N` to override the batch size / concurrency cap, e.g. `hf-static@16`):
  ferrobatch         the engine as shipped (all requests submitted at once, continuous batching)
  ferrobatch-static  the same engine fed max_num_seqs requests at a time, next group only when the
                     whole group is done (the ablation of iteration-level refill)
  ferrobatch-eager   the engine without decode CUDA graphs (`--enforce-eager`; on the CPU the
                     same as ferrobatch): the ablation of graph replay
  ferrobatch-decodegraphs the engine with decode CUDA graphs only (`--piecewise-max-tokens 0`:
                     prefill and mixed steps eager; on the CPU the same as ferrobatch): the
                     ablation of piecewise graphs
  ferrobatch-nativeprefill the engine with ferrobatch's own prefill-attention kernel instead
                     of FlashAttention-2 (`--no-flash-prefill`; CUDA bf16/fp16 only, on the CPU
                     the same as ferrobatch): the ablation of tensor-core prefill attention
  ferrobatch-splitmixed the engine with a mixed step's decode rows on the decode kernel and
                     only its prefill sequences on FlashAttention-2
                     (`FERROBATCH_FLASH_WHOLE_STEP=0`; CUDA only): the ablation of one varlen
                     call per layer for the whole mixed step
  ferrobatch-rotaryapart the engine with rotary and the K/V write as two kernels per layer
                     instead of one (`FERROBATCH_ROTARY_CACHE=0`; CUDA only): the ablation of
                     that fusion
  ferrobatch-reducepass the engine with the decode kernel's KV splits combined by a second
                     kernel instead of in the kernel (`FERROBATCH_DECODE_FUSED_REDUCE=0`; CUDA
                     only): the ablation of the fused reduce
  ferrobatch-refill4  the engine admitting waiting requests four at a time while others run
                     (`--admission-batch 4`): fewer, larger refill steps
  ferrobatch-torchops the engine with torch's elementwise modules instead of the fused CUDA
                     kernels (RMSNorm with the residual add, SiLU-and-mul, rotary;
                     `FERROBATCH_CUDA_FUSED_OPS=0`; on the CPU the same as ferrobatch). The
                     other ferrobatch systems swap the shared model's modules: list it first
  ferrobatch-nodraft the engine without speculative drafts (`--num-speculative-tokens 0`; on a
                     GPU the same as ferrobatch, where drafting is off by default): the ablation
                     of prompt lookup, which transformers' `generate` and CB do not do
  ferrobatch-kv16    the engine with a float16 KV cache (`--kv-cache-dtype float16`, CPU): half
                     the bytes decode attention reads (not token-identical to the others)
  ferrobatch-kv8     the same with an FP8 E4M3 KV cache (`--kv-cache-dtype fp8`, CPU): a quarter
                     of the bytes (greedy replies differ more: benches/kv_cache_quality.py)
  ferrobatch-kvi8    the same with an int8 KV cache, a scale per token and KV head
                     (`--kv-cache-dtype int8`, CPU): 68 / 256 of the bytes at head_dim 64
  ferrobatch-f32panels the engine with float32 panels for steps of 6+ rows instead of the GGUF
                     blocks packed as quantized panels (`FERROBATCH_QUANT_PANELS=0`, CPU without
                     AMX): the ablation of the quantized panels (token-identical)
  hf-static          transformers `generate` on fixed left-padded batches (arrival order)
  hf-continuous      transformers' ContinuousBatchingManager (per-request max_new_tokens)

EOS is ignored everywhere; each request produces exactly its requested tokens, and only those
count as output (static batching's extra tokens are reported as `wasted_tokens`). Model loading
and a short warm-up are excluded from the timings. See README "Results" for measured numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import positive_int
from common import REPO, format_table, load_1min, machine_info, ratio_table, write_json
from workloads import (
    WORKLOADS,
    Request,
    Workload,
    build_requests,
    ideal_decode_steps,
    summarize,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FB_VARIANTS = {"ferrobatch": "", "ferrobatch-static": "", "ferrobatch-eager": "eager",
               "ferrobatch-decodegraphs": "decodegraphs", "ferrobatch-torchops": "torchops",
               "ferrobatch-nativeprefill": "nativeprefill", "ferrobatch-splitmixed": "splitmixed",
               "ferrobatch-rotaryapart": "rotaryapart", "ferrobatch-reducepass": "reducepass",
               "ferrobatch-refill4": "refill4",
               "ferrobatch-nodraft": "nodraft", "ferrobatch-kv16": "kv16",
               "ferrobatch-kv8": "kv8", "ferrobatch-kvi8": "kvi8",
               "ferrobatch-f32panels": "f32panels"}   # system -> engine variant (static: same engine)
SYSTEMS = (*FB_VARIANTS, "hf-static", "hf-continuous")
DEFAULT_SYSTEMS = "ferrobatch,ferrobatch-static,hf-static,hf-continuous"


def parse_systems(spec: str) -> list[tuple[str, str, int | None]]:
    """`--systems` as (name, system, cap or None); ValueError for an unknown system or a bad cap."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        base, at, n = item.partition("@")
        if base not in SYSTEMS:
            raise ValueError(f"unknown system {base!r}; known: {', '.join(SYSTEMS)}")
        cap = None
        if at:
            try:
                cap = int(n)
            except ValueError:
                cap = 0
            if cap < 1:
                raise ValueError(f"{item!r}: the cap after '@' must be an integer >= 1")
        out.append((item, base, cap))
    if not out:
        raise ValueError(f"no system in {spec!r}; known: {', '.join(SYSTEMS)}")
    first_fb = next(base for _, base, _ in out if base in FB_VARIANTS) \
        if any(base in FB_VARIANTS for _, base, _ in out) else None
    if any(base == "ferrobatch-torchops" for _, base, _ in out) \
            and first_fb != "ferrobatch-torchops":
        raise ValueError("list ferrobatch-torchops before the other ferrobatch systems: on a GPU "
                         "they swap the shared model's elementwise modules for the fused kernels")
    return out


def warmup_requests(reqs: list[Request]) -> list[Request]:
    return [Request(r.prompt_ids[:32], min(r.output_len, 4)) for r in reqs[:2]]


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True,
                            dynamic_ncols=True)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Systems:
    """Loads each family's model once and frees it when no later system needs it."""

    def __init__(self, w: Workload, args) -> None:
        self.w, self.args = w, args
        self.fb = {}          # (cap, variant) -> FerrobatchRunner (variant: FB_VARIANTS)
        self.hf_model = None
        self.setup_s: dict[str, float] = {}

    def ferrobatch(self, cap: int, variant: str = ""):
        key = (cap, variant)
        if key not in self.fb:
            from fb_systems import FerrobatchRunner
            extra = {"max_num_batched_tokens": self.args.max_num_batched_tokens}
            if self.args.kv_cache_gb is not None:
                extra["kv_cache_gb"] = self.args.kv_cache_gb
            if variant == "eager":
                extra["cuda_graphs"] = False
            if variant == "decodegraphs":
                extra["piecewise_max_tokens"] = 0
            if variant == "nativeprefill":
                extra["flash_prefill"] = False
            if variant == "nodraft":
                extra["num_speculative_tokens"] = 0
            if variant == "refill4":
                extra["admission_batch"] = 4
            if variant == "kv16":
                extra["kv_cache_dtype"] = "float16"
            if variant == "kv8":
                extra["kv_cache_dtype"] = "fp8"
            if variant == "kvi8":
                extra["kv_cache_dtype"] = "int8"
            env = {"f32panels": ("FERROBATCH_QUANT_PANELS", "0"),   # read when the engine
                   "torchops": ("FERROBATCH_CUDA_FUSED_OPS", "0"),      # builds
                   "splitmixed": ("FERROBATCH_FLASH_WHOLE_STEP", "0"),
                   "rotaryapart": ("FERROBATCH_ROTARY_CACHE", "0"),
                   "reducepass": ("FERROBATCH_DECODE_FUSED_REDUCE", "0")}.get(variant)
            if env:
                os.environ[env[0]] = env[1]
            try:
                self.fb[key] = FerrobatchRunner(self.w, cap, **extra)
            finally:
                if env:
                    os.environ.pop(env[0], None)
            self.setup_s[f"ferrobatch{'-' + variant if variant else ''}@{cap}"] = \
                self.fb[key].load_s
        return self.fb[key]

    def hf(self):
        if self.hf_model is None:
            from hf_baselines import build_hf_model
            t0 = time.perf_counter()
            self.hf_model = build_hf_model(self.w, self.args.device or self.w.device)
            self.setup_s["hf"] = time.perf_counter() - t0
        return self.hf_model

    def release_unneeded(self, remaining: list[tuple[str, str, int | None]]) -> None:
        keys = {(self.cap_of(base, n), FB_VARIANTS[base])
                for _, base, n in remaining if base in FB_VARIANTS}
        for key in list(self.fb):
            if key not in keys:
                self.fb.pop(key).close()
        if self.hf_model is not None and not any(b.startswith("hf") for _, b, _ in remaining):
            self.hf_model = None
        gc.collect()

    def cap_of(self, base: str, n: int | None) -> int:
        if n is not None:
            return n
        if base == "hf-static":
            return self.args.hf_static_batch_size or self.w.hf_static_batch_size
        return self.args.max_num_seqs or self.w.max_num_seqs

    def run(self, base: str, n: int | None, reqs: list[Request], progress) -> dict:
        cap = self.cap_of(base, n)
        if base in FB_VARIANTS:
            return self.ferrobatch(cap, FB_VARIANTS[base]).run(
                reqs, static=(base == "ferrobatch-static"), progress=progress)
        if base == "hf-static":
            from hf_baselines import run_hf_static
            return run_hf_static(self.hf(), reqs, cap, progress=progress)
        from hf_baselines import hf_cb_config, run_hf_continuous
        model = self.hf()
        cfg = hf_cb_config(_with_cap(self.w, cap), reqs, self.args.max_num_batched_tokens)
        return run_hf_continuous(model, reqs, cfg, progress=progress)


def _with_cap(w: Workload, cap: int) -> Workload:
    import dataclasses
    return dataclasses.replace(w, max_num_seqs=cap)


def summarize_run(name: str, base: str, cap: int, res: dict, reqs: list[Request],
                  load_before: float | None) -> dict:
    el = res["elapsed_s"]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    occ = res.get("occupancy") or []
    row = {
        "system": name, "batch_cap": cap,
        "elapsed_s": el,
        "output_tokens_per_s": res["output_tokens"] / el,
        "requests_per_s": len(reqs) / el,
        "total_tokens_per_s": (res["output_tokens"] + prompt_tokens) / el,
        "num_requests": len(reqs), "prompt_tokens": prompt_tokens,
        "output_tokens": res["output_tokens"],
        "generated_tokens": res.get("generated_tokens"),
        "wasted_tokens": res.get("wasted_tokens"),
        "num_steps": res.get("num_steps"),
        "decode_graph_steps": res.get("decode_graph_steps"),
        "piecewise_graph_steps": res.get("piecewise_graph_steps"),
        "drafted_tokens": res.get("drafted_tokens"),
        "accepted_drafts": res.get("accepted_drafts"),
        "mean_occupancy": (sum(occ) / len(occ)) if occ else None,
        "loadavg_1m_before": load_before, "loadavg_1m_after": load_1min(),
        "params": res.get("params", {}),
    }
    if res.get("cuda_paths"):
        row["cuda_paths"] = res["cuda_paths"]
    if base in FB_VARIANTS or base == "hf-static":
        mode = "static" if base in ("ferrobatch-static", "hf-static") else "continuous"
        row["ideal_decode_steps"] = ideal_decode_steps(reqs, cap, mode)
    if occ:
        row["occupancy_per_step"] = occ
    if res.get("running"):
        row["running_per_step"] = res["running"]
    if res.get("batch_rows"):
        row["rows_per_step"] = res["batch_rows"]
    if res.get("step_times"):  # seconds between consecutive steps' sampled tokens
        row["step_seconds"] = [round(t, 5) for t in res["step_times"]]
    return row


def plot_occupancy(rows: list[dict], w: Workload, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no occupancy plot (pip install matplotlib)",
              file=sys.stderr)
        return None
    series = [r for r in rows if r.get("occupancy_per_step")
              and r["system"].startswith("ferrobatch")]
    hf = [r for r in rows if r.get("occupancy_per_step") and r["system"].startswith("hf-static")]
    series += hf[:1]      # one static HF batch size is enough to show padding waste
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(10, 4.2))
    styles = [("-", 2.0), ("--", 1.6), (":", 2.2)]
    for k, r in enumerate(series):
        occ = r["occupancy_per_step"]
        label = f"{r['system']} ({r['output_tokens_per_s']:.1f} tok/s, {len(occ)} steps)"
        if r["system"].startswith("hf-static"):
            label += "; computes all rows, rest is padding"
        ls, lw = styles[k % len(styles)]
        ax.step(range(len(occ)), occ, where="post", label=label, linewidth=lw, linestyle=ls)
    caps = sorted({r["batch_cap"] for r in series})
    for cap in caps:
        ax.axhline(cap, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("step (steps that sampled at least one token)")
    ax.set_ylabel("sequences producing a wanted token")
    ax.set_title(f"Batch occupancy per step — {w.name} ({w.model}, "
                 f"cap {' / '.join(str(c) for c in caps)})")
    ax.set_ylim(0, cap * 1.1)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ablation_summary(rows: list[dict], reqs: list) -> list[dict]:
    """For each cap run as both `ferrobatch` and `ferrobatch-static`: their measured ratio and
    its bound from the schedule alone (ideal decode steps, static over continuous): what the
    ratio would be if a step cost the same whatever its rows, since continuous batching saves
    steps, not rows."""
    by_cap: dict[int, dict[str, dict]] = {}
    for r in rows:
        base = r["system"].split("@")[0]
        if base in ("ferrobatch", "ferrobatch-static"):
            by_cap.setdefault(r["batch_cap"], {})[base] = r
    out = []
    for cap, pair in sorted(by_cap.items()):
        if len(pair) == 2:
            out.append({"cap": cap, "measured": pair["ferrobatch"]["output_tokens_per_s"]
                        / pair["ferrobatch-static"]["output_tokens_per_s"],
                        "step_bound": ideal_decode_steps(reqs, cap, "static")
                        / ideal_decode_steps(reqs, cap, "continuous")})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="cpu-small", choices=sorted(WORKLOADS))
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="batch-occupancy PNG (default: next to --json)")
    ap.add_argument("--num-requests", type=positive_int,
                    help="run only the first N requests (dev runs)")
    ap.add_argument("--max-num-seqs", type=positive_int,
                    help="override the workload's concurrency cap")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                    help="per-step token budget (ferrobatch and hf-continuous); default 512 on "
                    "CPU workloads, 8192 on GPU ones (the engine's defaults)")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="ferrobatch systems: the KV cache's size in GiB (default: the engine's), "
                    "e.g. small enough that the cache, not the cap, bounds the batch")
    ap.add_argument("--hf-static-batch-size", type=positive_int,
                    help="override the workload's hf-static batch")
    ap.add_argument("--device", help="override the workload's device for the HF baselines")
    ap.add_argument("--threads", type=positive_int,
                    help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of a result JSON")
    args = ap.parse_args(argv)
    if args.replot:
        import json
        try:
            d = json.loads(Path(args.replot).read_text())
            w = WORKLOADS[d["workload"]["name"]]
            rows = d["results"]
            if not rows or any("system" not in r for r in rows):   # e.g. a serving result
                raise KeyError("results[].system")
        except OSError as e:
            ap.error(f"--replot: cannot read {args.replot}: {e.strerror}")
        except ValueError as e:
            ap.error(f"--replot: {args.replot} is not JSON: {e}")
        except (KeyError, TypeError) as e:
            ap.error(f"--replot: {args.replot} is not a throughput result "
                     f"({type(e).__name__} {e})")
        print(plot_occupancy(rows, w, args.plot
                             or str(Path(args.replot).with_suffix("")) + "_occupancy.png"))
        return 0
    try:
        systems = parse_systems(args.systems)
    except ValueError as e:
        ap.error(f"--systems: {e}")

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    if args.max_num_batched_tokens is None:   # the engine's own default for the device
        from ferrobatch.config import EngineConfig
        args.max_num_batched_tokens = EngineConfig().step_token_budget(w.device)
    reqs = build_requests(w)
    if args.num_requests:
        if args.num_requests > len(reqs):
            ap.error(f"--num-requests {args.num_requests}: workload {w.name} has "
                     f"{len(reqs)} requests")
        reqs = reqs[:args.num_requests]
    info = machine_info()
    summary = summarize(reqs)
    print(f"workload {w.name}: {w.description}\n  model {w.model} ({w.dtype}, {w.device}); "
          f"{summary['num_requests']} requests, {summary['prompt_tokens']} prompt tokens, "
          f"{summary['output_tokens']} output tokens, digest {summary['digest']}\n"
          f"  machine: {info.get('cpu_model')} x{info.get('cpu_count')}, torch "
          f"{info.get('torch')} ({info.get('torch_threads')} threads), load(1m) "
          f"{info.get('loadavg_1m_at_start')}", flush=True)

    sysm = Systems(w, args)
    rows: list[dict] = []

    def meta() -> dict:
        return {
            "workload": {"name": w.name, "description": w.description, "model": w.model,
                         "dtype": w.dtype, "device": w.device, "seed": w.seed,
                         "max_num_seqs": args.max_num_seqs or w.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens,
                         "kv_cache_gb": args.kv_cache_gb,
                         "hf_static_batch_size": args.hf_static_batch_size
                         or w.hf_static_batch_size,
                         "ideal_decode_steps_longest_first": ideal_decode_steps(
                             reqs, args.max_num_seqs or w.max_num_seqs, "longest-first"),
                         **summary},
            "machine": {**info, "loadavg_1m_at_end": load_1min()},
            "setup_s": sysm.setup_s,
            "command": "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        }

    for i, (name, base, n) in enumerate(systems):
        cap = sysm.cap_of(base, n)
        if not args.no_warmup:
            sysm.run(base, n, warmup_requests(reqs), None)
        load_before = load_1min()
        # ferrobatch (continuous) shows LLM.generate's own progress bar
        own_bar = base in FB_VARIANTS and base != "ferrobatch-static"
        bar = Progress(len(reqs), name, not args.no_progress and not own_bar)
        try:
            res = sysm.run(base, n, reqs, None if args.no_progress else bar)
        finally:
            bar.close()
        row = summarize_run(name, base, cap, res, reqs, load_before)
        rows.append(row)
        paths = ", ".join(f"{k}: {v}" for k, v in row.get("cuda_paths", {}).items())
        print(f"  {name}: {row['output_tokens_per_s']:.1f} output tok/s, "
              f"{row['requests_per_s']:.3f} req/s, {row['elapsed_s']:.1f} s"
              + (f" [{paths}]" if paths else ""), flush=True)
        sysm.release_unneeded(systems[i + 1:])
        if args.json:   # partial results survive an interrupted run
            write_json(args.json, {**meta(), "partial": True, "results": rows})

    cols = [("system", "system", ""), ("batch_cap", "cap", "d"),
            ("requests_per_s", "req/s", ".3f"), ("output_tokens_per_s", "out tok/s", ".1f"),
            ("total_tokens_per_s", "total tok/s", ".1f"), ("elapsed_s", "time s", ".1f"),
            ("num_steps", "steps", "d"), ("ideal_decode_steps", "ideal", "d"),
            ("mean_occupancy", "mean occ", ".1f"), ("accepted_drafts", "drafts kept", "d"),
            ("wasted_tokens", "wasted tok", "d"), ("loadavg_1m_before", "load1m", ".2f")]
    print()
    print(format_table(rows, cols))
    print()
    print(ratio_table(rows))
    ablation = ablation_summary(rows, reqs)
    for a in ablation:
        print(f"ablation at cap {a['cap']}: continuous / static = {a['measured']:.2f}x measured; "
              f"{a['step_bound']:.2f}x = ideal static / continuous decode steps, the most it "
              f"can be if a step cost the same whatever its rows")

    out = {**meta(), "results": rows, "ablation": ablation}
    plot = args.plot
    if plot is None and args.json:
        plot = str(Path(args.json).with_suffix("")) + "_occupancy.png"
    if plot:
        made = plot_occupancy(rows, w, plot)
        if made:
            out["plot"] = os.path.relpath(made, REPO)
            print(f"\nplot: {made}")
    if args.json:
        write_json(args.json, out)
        print(f"json: {args.json}")
    sysm.release_unneeded([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
