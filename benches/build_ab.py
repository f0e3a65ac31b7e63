"""Two builds of the Rust extension side by side in one process: the CPU decoder layers of another
build ("base", e.g. the commit before a kernel change) against this checkout's, interleaved.

    python benches/build_ab.py --base-so /tmp/base/ferrobatch/_scheduler.abi3.so \
        [--mode step --rows 1,2,3 --context 256] [--mode stream --tokens 128 --chat \
        --temperature 0.7] [--mode attention --rows 1,16 --contexts 256,1024 \
        --kv-dtypes float32,int8] [--control] [--json PATH]

Why: the development VMs' speed drifts by 10-50 % within minutes (other tenants), so two
processes run one after the other compare the machine's moods, not the builds. Here both builds
run in the same process on the same model and KV cache, alternating every step (`--mode step`:
`ModelRunner.execute` on one decode step of B sequences with `context` cached tokens; `--mode
attention`: the decode attention kernel alone, 30 layers over random caches) or every
request (`--mode stream`: one `LLM` request at a time, milliseconds per output token after the
prompt, as `single_stream.py` measures it; `--chat` asks for essays through the chat template
instead of random token ids, drafts as configured).

Only the runner's `fused_layers` (`cpu_decoder.FusedLayers`, i.e. every decoder layer of a CPU step:
linears, attention, norms) comes from the base build; the LM head, sampler and scheduler are this
checkout's in both arms. Each arm packs its own AMX tiles / quantized panels, the two taking
turns layer by layer (`arm_layers`: memory fresh from a free streamed slower for a while on the
dev VMs). Build the base with e.g. `git worktree add /tmp/base <commit> && cd
/tmp/base && maturin build --release -o /tmp/whl`, then unzip `ferrobatch/_scheduler*` from the
wheel. A 2 ms pause before each timed step lets the pool of the build that ran last go to sleep
(two pools spinning would slow whichever runs next).

Still, the arms are not alike: the base build's layers run on its own thread pool, everything
else (the LM head, the sampler) on this build's, so only the base arm switches pools inside a
step. Two copies of one build (an A/A control) came out 1.008-1.018x in step mode and
1.049-1.072x in stream mode on the Xeon dev VM (session 49), in this build's favour.
`--control` runs the same comparison a second time against a copy of this build and gives
each result `control_speedup` and `net_speedup` (speedup / control_speedup): quote that one.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list  # noqa: E402
from common import format_table, machine_info, write_json  # noqa: E402  (OpenMP defaults first)

ESSAY_TOPICS = ("the history of bridges", "how bees make honey", "the ocean tides",
                "learning to cook rice", "the life of a lighthouse keeper")


def load_extension(path: str):
    """The extension module at ``path`` under a private name (it keeps its own thread pool)."""
    name = "ferrobatch_base._scheduler"   # the last part must match the module's init symbol
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def arm_layers(model, base_module) -> dict:
    """The two arms, ``{"base": ..., "this": ...}``: a ``FusedLayers`` over ``model``'s weights
    whose Rust stack comes from ``base_module`` / this checkout's module, with the AMX tiles and
    quantized panels packed by that module too (the builds' layouts may differ).

    Every arm packs its own, the arms taking turns layer by layer, so that their weights' memory
    has the same history. Why: on the development VMs memory allocated right after other memory
    was freed (each layer's packing frees its unaligned first copy) streamed up to 2x slower for
    seconds afterwards than the weights the model was loaded with (session 44: 16 gate_up layers
    of a 1B Q8_0 shape at 8 rows, 50 ms on the loaded tiles, 85-100 ms on fresh copies packed
    by the same module, falling slowly over a minute). Session 43's version repacked only the base arm,
    which favoured this checkout by 1.06-1.16x (an A/A run of two equal builds)."""
    from ferrobatch.runtime import cpu_decoder
    from ferrobatch.runtime.cpu_linear import _aligned_64

    if model.fused_layers is None:
        raise SystemExit("the model runs without fused layers (not a packed CPU model)")
    current, spec = cpu_decoder._scheduler, cpu_decoder._linear_spec
    modules = {"base": base_module, "this": current}
    linears = [linear for layer in model.layers for linear in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj)]
    packed: dict[str, dict[int, tuple]] = {name: {} for name in modules}
    for linear in linears:
        kernel = linear.blocks
        if kernel is None or kernel.arrays is None:
            continue            # no blocks to pack from (tiles or panels alone): shared as loaded
        for name, module in modules.items():
            tiles = qpanels = None
            if kernel.tiles is not None:
                tiles = _aligned_64(getattr(module, f"pack_amx_{kernel.kind}")(*kernel.arrays))
            if kernel.qpanels is not None:
                pack = getattr(module, f"pack_quant_panels_{kernel.kind}")
                qpanels = _aligned_64(pack(*kernel.arrays))
            packed[name][id(linear)] = (tiles, qpanels)

    arms = {}
    for name, module in modules.items():
        def arm_spec(linear, mine=packed[name]):
            n, k, panels, bias, blocks, tiles, qpanels = spec(linear)
            if id(linear) in mine:
                tiles, qpanels = mine[id(linear)]
            return n, k, panels, bias, blocks, tiles, qpanels

        cpu_decoder._scheduler, cpu_decoder._linear_spec = module, arm_spec
        try:
            arms[name] = cpu_decoder.FusedLayers(model, model.fused_layers.num_threads,
                                                 model.fused_layers.amx)
        finally:
            cpu_decoder._scheduler, cpu_decoder._linear_spec = current, spec
    return arms


def interleaved(run, arms: dict, rounds: int) -> dict[str, list[float]]:
    """``run(arm_value)`` timed ``rounds`` times per arm, the arms' order flipping every round."""
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(float(run(arms[name])))
    return times


def step_mode(args, base_module) -> list[dict]:
    import numpy as np
    import torch

    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.model_runner import ModelRunner
    from step_breakdown import decode_step

    # as the engine loads a GGUF on the CPU: its block-format linears never dequantized (an 8B
    # Q4_K_M file as float32 first would not fit a 24 GB machine)
    loaded = load_model(args.model, gguf_blocks=True)
    kv_dtype = {"auto": None, "float16": torch.float16,
                "fp8": torch.float8_e4m3fn, "int8": torch.int8}[args.kv_cache_dtype]
    runner = ModelRunner(loaded, num_blocks=args.num_blocks, block_size=16,
                         kv_cache_dtype=kv_dtype)
    model = runner.model
    arms = arm_layers(model, base_module)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        batch = decode_step(runner, rows, args.context)
        logits = {}

        def run(layers, batch=batch, logits=logits):
            runner.fused_layers = layers
            time.sleep(0.002)
            t0 = time.perf_counter()
            out = runner.execute(batch)
            dt = (time.perf_counter() - t0) * 1e3
            logits[id(layers)] = out.clone()
            return dt

        interleaved(run, arms, 4)                       # warm-up
        times = interleaved(run, arms, args.rounds)
        a, b = logits[id(arms["base"])], logits[id(arms["this"])]
        res = {"mode": "step", "rows": rows, "context": args.context,
               "kv_cache_dtype": args.kv_cache_dtype,
               "base_ms": float(np.median(times["base"])), "this_ms": float(np.median(times["this"])),
               "logits_max_rel_diff": float((a - b).abs().max() / a.abs().max()),
               "same_argmax": bool((a.argmax(-1) == b.argmax(-1)).all())}
        res["speedup"] = res["base_ms"] / res["this_ms"]
        print(f"rows={rows}: base {res['base_ms']:.2f} ms, this {res['this_ms']:.2f} ms "
              f"({res['speedup']:.3f}x)", flush=True)
        results.append(res)
    runner.fused_layers = arms["this"]
    return results


def stream_mode(args, base_module) -> list[dict]:
    import numpy as np

    from ferrobatch import LLM, SamplingParams

    llm = LLM(model=args.model, **({} if args.drafts is None
                                   else {"num_speculative_tokens": args.drafts}))
    runner = llm.engine._core.runner
    model = runner.model
    arms = arm_layers(model, base_module)
    rng = np.random.default_rng(0)
    count = [0]

    def prompt():
        count[0] += 1
        if args.chat:
            topic = ESSAY_TOPICS[count[0] % len(ESSAY_TOPICS)]
            return [{"role": "user", "content": f"Write a long, detailed essay about {topic}."}]
        return [rng.integers(10, 40000, args.context).tolist()]

    def generate(p, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=7,
                                ignore_eos=True)
        t0 = time.perf_counter()
        (llm.chat if args.chat else llm.generate)(p, params)
        return time.perf_counter() - t0

    def run(layers):
        runner.fused_layers = layers
        first = generate(prompt(), 1)                     # prefill + one token
        return (generate(prompt(), args.tokens + 1) - first) / args.tokens * 1e3

    try:
        interleaved(run, arms, 2)
        times = interleaved(run, arms, args.rounds)
    finally:
        runner.fused_layers = arms["this"]
        llm.close()
    res = {"mode": "stream", "prompt": "chat essays" if args.chat else f"{args.context} random ids",
           "tokens": args.tokens, "temperature": args.temperature, "drafts": args.drafts,
           "base_ms_per_token": float(np.median(times["base"])),
           "this_ms_per_token": float(np.median(times["this"])),
           "base_samples": [round(v, 2) for v in times["base"]],
           "this_samples": [round(v, 2) for v in times["this"]]}
    res["speedup"] = res["base_ms_per_token"] / res["this_ms_per_token"]
    print(f"single stream: base {res['base_ms_per_token']:.2f} ms/token, this "
          f"{res['this_ms_per_token']:.2f} ({res['speedup']:.3f}x)", flush=True)
    return [res]


CACHE_DTYPES = ("float32", "float16", "fp8", "int8")   # --kv-dtypes


def as_cache_dtype(cache, dtype: str):
    """A float32 KV cache as ``dtype``, one of ``CACHE_DTYPES`` (int8: rows with their scales)."""
    import torch

    from ferrobatch.runtime.kv_cache import quantize_rows

    if dtype == "float16":
        return cache.half()
    if dtype == "fp8":
        return cache.to(torch.float8_e4m3fn)
    return quantize_rows(cache) if dtype == "int8" else cache


def attention_mode(args, base_module) -> list[dict]:
    """The decode attention kernel alone (``paged_decode_attention_f32``), SmolLM2's heads over
    30 layers of random caches, of each ``--kv-dtypes``: milliseconds per step of ``rows``
    sequences with ``context`` cached tokens each, the builds alternating every step."""
    import numpy as np
    import torch

    from ferrobatch.runtime.attention.cpu import CpuPagedBackend

    dtypes = args.kv_dtypes.split(",")
    if bad := [t for t in dtypes if t not in CACHE_DTYPES]:
        raise SystemExit(f"--kv-dtypes: {', '.join(bad)}: not among {', '.join(CACHE_DTYPES)}")
    layers, hq, hkv, d, bs = 30, 9, 3, 64, 16
    rng = np.random.default_rng(0)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for context in args.contexts:
            per_seq = -(-context // bs)
            num_blocks = rows * per_seq + 1
            table = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
            batch = type("Step", (), dict(
                query_start_loc=np.arange(rows + 1, dtype=np.int32),
                seq_lens=np.full(rows, context, np.int32), block_tables=table.reshape(rows, -1),
                input_ids=np.zeros(rows, np.int32), slot_mapping=np.zeros(rows, np.int32)))
            query = torch.randn(rows, hq, d)
            f32 = [torch.randn(2, num_blocks, bs, hkv, d) for _ in range(layers)]
            for dtype in dtypes:
                layer_caches = [as_cache_dtype(c, dtype) for c in f32]
                arms = {}
                for name, kernel in (("base", base_module.paged_decode_attention_f32),
                                     ("this", None)):
                    backend = CpuPagedBackend(bs)
                    if kernel is not None:      # else this checkout's, as the backend imports it
                        backend._kernel = kernel
                    arms[name] = (backend, backend.build_metadata(batch, "cpu"))
                outs = {}

                def run(arm, outs=outs, layer_caches=layer_caches, query=query):
                    backend, meta = arm
                    time.sleep(0.002)
                    t0 = time.perf_counter()
                    for cache in layer_caches:
                        out = backend.forward(query, cache, meta, d ** -0.5)
                    dt = (time.perf_counter() - t0) * 1e3
                    outs[id(arm)] = out
                    return dt

                interleaved(run, arms, 4)                       # warm-up
                times = interleaved(run, arms, args.rounds)
                a, b = outs[id(arms["base"])], outs[id(arms["this"])]
                res = {"mode": "attention", "rows": rows, "context": context, "kv_dtype": dtype,
                       "base_ms": float(np.median(times["base"])),
                       "this_ms": float(np.median(times["this"])),
                       "out_max_abs_diff": float((a - b).abs().max())}
                res["speedup"] = res["base_ms"] / res["this_ms"]
                print(f"rows={rows} context={context} {dtype}: base {res['base_ms']:.2f} ms, "
                      f"this {res['this_ms']:.2f} ms ({res['speedup']:.3f}x)", flush=True)
                results.append(res)
                del layer_caches
    return results


def with_control(args, mode, results: list[dict]) -> list[dict]:
    """``results`` with the same comparison's ``speedup`` against a copy of this build beside
    each (``control_speedup``) and their ratio (``net_speedup``)."""
    import shutil
    import tempfile

    from ferrobatch import _scheduler

    print("the control: the same runs against a copy of this build", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / Path(_scheduler.__file__).name
        shutil.copy(_scheduler.__file__, copy)
        control = mode(args, load_extension(str(copy)))
    for r, c in zip(results, control, strict=True):
        r["control_speedup"] = c["speedup"]
        r["net_speedup"] = r["speedup"] / c["speedup"]
        print(f"{_label(r)}: {r['speedup']:.3f}x, control {c['speedup']:.3f}x, net "
              f"{r['net_speedup']:.3f}x", flush=True)
    return results


def _label(r: dict) -> str:
    return ", ".join(f"{k}={r[k]}" for k in ("mode", "rows", "context", "kv_dtype", "prompt")
                     if k in r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-so", required=True, help="the other build's _scheduler*.so")
    ap.add_argument("--mode", choices=("step", "stream", "attention"), default="step")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="1,2,3", help="step mode: decode rows per step")
    ap.add_argument("--context", type=int, default=256, help="cached tokens (random-id prompts)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float16", "fp8", "int8"], default="auto",
                    help="step mode: what the KV cache stores (auto: the model's float32)")
    ap.add_argument("--contexts", type=int_list, default="256,1024",
                    help="attention mode: cached tokens per sequence")
    ap.add_argument("--kv-dtypes", default="float32,float16,fp8,int8",
                    help="attention mode: the caches' dtypes")
    ap.add_argument("--num-blocks", type=int, default=1024, help="step mode: KV blocks")
    ap.add_argument("--rounds", type=int, default=30, help="timed runs per build")
    ap.add_argument("--tokens", type=int, default=128, help="stream mode: tokens per request")
    ap.add_argument("--chat", action="store_true", help="stream mode: essays via the chat template")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--drafts", type=int, default=None,
                    help="stream mode: num_speculative_tokens (default: the engine's)")
    ap.add_argument("--control", action="store_true",
                    help="then the same runs against a copy of this build (an A/A control); "
                         "each result gains control_speedup and net_speedup")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not Path(args.base_so).is_file():
        raise SystemExit(f"no such file: {args.base_so}")
    base_module = load_extension(args.base_so)
    mode = {"step": step_mode, "stream": stream_mode, "attention": attention_mode}[args.mode]
    results = mode(args, base_module)
    if args.control:
        results = with_control(args, mode, results)
    print()
    control = [("control_speedup", "A/A x", ".3f"), ("net_speedup", "net x", ".3f")] \
        if args.control else []
    if args.mode == "attention":
        print(format_table(results, [("rows", "rows", "d"), ("context", "context", "d"),
                                     ("kv_dtype", "kv", "s"), ("base_ms", "base ms", ".2f"),
                                     ("this_ms", "this ms", ".2f"), ("speedup", "x", ".3f"),
                                     *control, ("out_max_abs_diff", "out diff", ".1e")]))
    if args.mode == "step":
        print(format_table(results, [("rows", "rows", "d"), ("base_ms", "base ms", ".2f"),
                                     ("this_ms", "this ms", ".2f"), ("speedup", "x", ".3f"),
                                     *control, ("logits_max_rel_diff", "logits diff", ".1e")]))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "base_so": args.base_so,
                               "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
