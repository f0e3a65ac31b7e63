"""Engine overhead: everything except the model, at 64 / 256 / 1024 running requests.

    python benches/engine_overhead.py --running 64,256,1024 \
        --json benches/results/cpu/engine_overhead.json

Systems, each with N requests (8-token prompts, `ignore_eos`, greedy) all running at once
(`max_num_seqs = N`, per-step token budget >= N so one step decodes all N):
  ferrobatch-stub   the real engine (`ferrobatch.LLM`: Rust scheduler, sampler, step thread,
                    per-step hand-off to asyncio, incremental detokenization) with the model
                    runner replaced by a stub whose `execute` returns a preallocated logits slice
                    (no forward, no KV cache): the engine's own cost per step.
  ferrobatch-stub-stream  the stub engine with every request consumed as a "delta" stream
                    (`AsyncEngine.generate`): the per-token wake-up and output building a
                    streaming door adds (its HTTP/WS encoding not included).
  ferrobatch-1layer the same engine with a real one-layer tiny Llama (hidden 64, vocab 512).
  hf-cb-1layer      transformers' ContinuousBatchingManager on the same one-layer weights.

Per-step cost is measured differentially: run every request to L1 and to L2 output tokens
(separate runs, same N, alternating, `--repeat` times each; medians); (T(L2) - T(L1)) / (L2 - L1) is the time of one decode step with N
running, with prefill, admission and start-up cancelled out. The stub's step is also broken down
(schedule / runner / sampler / update / hand-off) by timing EngineCore's pieces directly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, name_list, positive_int
from common import REPO, format_table, load_1min, machine_info, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPT_LEN = 8
SYSTEMS = ("ferrobatch-stub", "ferrobatch-stub-stream", "ferrobatch-1layer", "hf-cb-1layer")
STUB_TOKEN = 10


class StubRunner:
    """Drop-in for ferrobatch's ModelRunner: no model, no KV cache, logits returned at once."""

    def __init__(self, loaded, *, num_blocks: int, block_size: int, device=None,
                 attn_backend=None, **_ignored) -> None:
        import torch
        self.loaded = loaded
        self.config = loaded.config
        self.device = torch.device("cpu")
        self._num_blocks = num_blocks
        self.block_size = block_size
        self._logits = self._make(1024)
        self.calls = 0

    def _make(self, rows: int):
        import torch
        t = torch.zeros(rows, self.config.vocab_size, dtype=torch.float32)
        t[:, STUB_TOKEN] = 1.0          # greedy picks a plain word token
        return t

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def execute(self, batch):
        self.calls += 1
        s = len(batch.logits_indices)
        if s > self._logits.shape[0]:
            self._logits = self._make(s)
        return self._logits[:s]


def make_requests(n: int, out_len: int, vocab: int):
    from workloads import Request
    return [Request(tuple(3 + (i * 7 + j) % (vocab - 3) for j in range(PROMPT_LEN)), out_len)
            for i in range(n)]


def num_blocks_for(n: int, max_len: int, block_size: int = 16) -> int:
    return n * (-(-max_len // block_size) + 1) + 16


# -- ferrobatch --------------------------------------------------------------------------------

def ferrobatch_times(model_dir: str, n: int, lengths: tuple[int, int], repeat: int,
                     stub: bool) -> tuple[list[list[float]], dict]:
    """Wall times of LLM.generate for n requests of each output length, on one warm engine,
    the lengths alternating `repeat` times: ([times for lengths[0]], [times for lengths[1]])."""
    import ferrobatch.runtime.model_runner as mr
    from ferrobatch import LLM, SamplingParams

    real = mr.ModelRunner
    if stub:
        mr.ModelRunner = StubRunner   # EngineCore.build looks the class up at build time
    try:
        llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=n,
                  max_num_batched_tokens=max(512, n), enable_prefix_caching=False,
                  num_blocks=num_blocks_for(n, PROMPT_LEN + max(lengths)))
    finally:
        mr.ModelRunner = real
    try:
        vocab = llm.engine.vocab_size
        warm = make_requests(min(n, 8), 4, vocab)
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                  for r in warm]
        llm.generate([list(r.prompt_ids) for r in warm], params, use_tqdm=False)
        times: list[list[float]] = [[], []]
        steps: list[int] = [0, 0]
        for _ in range(repeat):
            for k, out_len in enumerate(lengths):
                reqs = make_requests(n, out_len, vocab)
                params = [SamplingParams(max_tokens=out_len, ignore_eos=True,
                                         temperature=0.0)] * n
                steps0 = llm.engine._loop_thread.num_steps
                t0 = time.perf_counter()
                outs = llm.generate([list(r.prompt_ids) for r in reqs], params, use_tqdm=False)
                times[k].append(time.perf_counter() - t0)
                steps[k] = llm.engine._loop_thread.num_steps - steps0
                bad = [o for o in outs if len(o.outputs[0].token_ids) != out_len]
                if bad:
                    raise RuntimeError(f"{len(bad)} requests generated the wrong number of "
                                       "tokens")
        return times, {"steps_short_run": steps[0], "steps_long_run": steps[1]}
    finally:
        llm.close()


def stream_times(model_dir: str, n: int, lengths: tuple[int, int],
                 repeat: int) -> tuple[list[list[float]], dict]:
    """`ferrobatch_times` with the stub model, but every request consumed as a stream
    (`AsyncEngine.generate`, output_kind "delta"): adds the per-token wake-up and output
    building a streaming door pays (not the HTTP/WS encoding itself)."""
    import asyncio

    import ferrobatch.runtime.model_runner as mr
    from ferrobatch.engine.async_engine import AsyncEngine
    from ferrobatch.sampling_params import SamplingParams

    async def run() -> list[list[float]]:
        real = mr.ModelRunner
        mr.ModelRunner = StubRunner
        try:
            engine = AsyncEngine(model=model_dir, device="cpu", dtype="float32", max_num_seqs=n,
                                 max_num_batched_tokens=max(512, n),
                                 enable_prefix_caching=False,
                                 num_blocks=num_blocks_for(n, PROMPT_LEN + max(lengths)))
            await engine.start()
        finally:
            mr.ModelRunner = real

        async def one(prompt: list[int], out_len: int) -> int:
            p = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0,
                               output_kind="delta")
            got = 0
            async for out in engine.generate(prompt, p):
                got += len(out.outputs[0].token_ids)
            if got != out_len:
                raise RuntimeError(f"a stream delivered {got} tokens, not {out_len}")
            return got

        try:
            vocab = engine.vocab_size
            await asyncio.gather(*(one(list(r.prompt_ids), 4)
                                   for r in make_requests(min(n, 8), 4, vocab)))
            times: list[list[float]] = [[], []]
            for _ in range(repeat):
                for k, out_len in enumerate(lengths):
                    reqs = make_requests(n, out_len, vocab)
                    t0 = time.perf_counter()
                    await asyncio.gather(*(one(list(r.prompt_ids), out_len) for r in reqs))
                    times[k].append(time.perf_counter() - t0)
            return times
        finally:
            await engine.shutdown()

    return asyncio.run(run()), {}


def core_breakdown(model_dir: str, n: int, steps: int = 30) -> dict:
    """A standalone EngineCore (real scheduler + sampler, stub runner, no step thread, no
    asyncio): N requests admitted, then `steps` full decode steps timed piece by piece."""
    import numpy as np

    import ferrobatch.runtime.model_runner as mr
    from ferrobatch import EngineConfig, SamplingParams
    from ferrobatch.engine.core import EngineCore

    cfg = EngineConfig(model=model_dir, device="cpu", dtype="float32", max_num_seqs=n,
                       max_num_batched_tokens=max(512, n), enable_prefix_caching=False,
                       num_blocks=num_blocks_for(n, PROMPT_LEN + steps + 300))
    real = mr.ModelRunner
    mr.ModelRunner = StubRunner
    try:
        core = EngineCore.build(cfg)
    finally:
        mr.ModelRunner = real
    sch, runner, sampler = core.scheduler, core.runner, core.sampler
    p = SamplingParams(max_tokens=steps + 250, ignore_eos=True, temperature=0.0)
    for i in range(n):
        core.submit(i + 1, [3 + (i + j) % 500 for j in range(PROMPT_LEN)], p, p.max_tokens, None)
    t = {"schedule": 0.0, "runner": 0.0, "sampler": 0.0, "update": 0.0}
    timed = 0
    for _ in range(steps + 200):
        a = time.perf_counter()
        batch = sch.schedule()
        b = time.perf_counter()
        logits = runner.execute(batch) if batch.num_samples else None
        c = time.perf_counter()
        sampled = (np.ascontiguousarray(sampler.sample(logits, batch, {}).token_ids,
                                        dtype=np.int32)
                   if batch.num_samples else np.zeros(0, dtype=np.int32))
        d = time.perf_counter()
        sch.update(sampled)
        e = time.perf_counter()
        if batch.num_seqs == n and batch.num_prefill_tokens == 0:
            t["schedule"] += b - a
            t["runner"] += c - b
            t["sampler"] += d - c
            t["update"] += e - d
            timed += 1
            if timed == steps:
                break
    out = {f"core_{k}_us": v / max(timed, 1) * 1e6 for k, v in t.items()}
    out["core_total_us"] = sum(t.values()) / max(timed, 1) * 1e6
    out["core_timed_steps"] = timed
    return out


# -- transformers ------------------------------------------------------------------------------

def hf_times(model_dir: str, n: int, lengths: tuple[int, int],
             repeat: int) -> list[list[float]]:
    """Like `ferrobatch_times`, for transformers' continuous batching (one manager per length:
    its generation config carries max_new_tokens)."""
    times: list[list[float]] = [[], []]
    for _ in range(repeat):
        for k, out_len in enumerate(lengths):
            times[k].append(hf_time(model_dir, n, out_len))
    return times


def hf_time(model_dir: str, n: int, out_len: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    vocab = model.config.vocab_size
    page = 16
    cfg = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks_for(n, PROMPT_LEN + out_len, page),
                                   max_batch_tokens=max(512, n), max_requests_per_batch=n,
                                   use_cuda_graph=False, auto_switch_to_flash=False,
                                   allow_block_sharing=False)
    gen = GenerationConfig(do_sample=False, max_new_tokens=out_len, eos_token_id=-1,
                           pad_token_id=0)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cfg)
        manager.start()
        try:
            def run(reqs):
                for i, r in enumerate(reqs):
                    manager.add_request(input_ids=list(r.prompt_ids), request_id=f"{id(reqs)}-{i}",
                                        max_new_tokens=r.output_len, eos_token_id=-1)
                done = 0
                while done < len(reqs):
                    res = manager.get_result(timeout=1.0)
                    if res is None:
                        if not manager.is_running():
                            raise RuntimeError("transformers' CB thread died")
                        continue
                    if res.is_finished():
                        if len(res.generated_tokens) != res_len(reqs):
                            raise RuntimeError("hf-cb generated the wrong number of tokens")
                        done += 1

            def res_len(reqs):
                return reqs[0].output_len

            run(make_requests(min(n, 8), 4, vocab))
            reqs = make_requests(n, out_len, vocab)
            t0 = time.perf_counter()
            run(reqs)
            el = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()
    return el


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int_list, default="64,256,1024")
    ap.add_argument("--systems", type=name_list(SYSTEMS),
                    default="ferrobatch-stub,ferrobatch-1layer,hf-cb-1layer")
    ap.add_argument("--l1", type=positive_int, default=16, help="short run's output tokens")
    ap.add_argument("--l2", type=positive_int, default=80, help="long run's output tokens")
    ap.add_argument("--repeat", type=positive_int, default=3,
                    help="timed runs per length (alternating); medians are used")
    ap.add_argument("--threads", type=positive_int)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.l2 <= args.l1:
        ap.error(f"--l2 {args.l2} must be above --l1 {args.l1}")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    from bench_models import materialize_tiny_hf_dir
    model_dir = materialize_tiny_hf_dir(num_layers=1)
    info = machine_info()
    print(f"machine: {info.get('cpu_model')} x{info.get('cpu_count')}, torch threads "
          f"{info.get('torch_threads')}, load(1m) {info.get('loadavg_1m_at_start')}", flush=True)
    rows = []
    for n in args.running:
        for system in args.systems:
            load = load_1min()
            extra: dict = {}
            lengths = (args.l1, args.l2)
            if system == "hf-cb-1layer":
                times = hf_times(model_dir, n, lengths, args.repeat)
            elif system == "ferrobatch-stub-stream":
                times, extra = stream_times(model_dir, n, lengths, args.repeat)
            elif system in ("ferrobatch-stub", "ferrobatch-1layer"):
                stub = system == "ferrobatch-stub"
                times, extra = ferrobatch_times(model_dir, n, lengths, args.repeat, stub)
                if stub:
                    extra.update(core_breakdown(model_dir, n))
            else:
                raise SystemExit(f"unknown system {system!r}")
            t1, t2 = statistics.median(times[0]), statistics.median(times[1])
            extra["t_short_all_s"], extra["t_long_all_s"] = times
            step_s = (t2 - t1) / (args.l2 - args.l1)
            row = {"system": system, "running": n, "t_short_s": t1, "t_long_s": t2,
                   "us_per_step": step_s * 1e6, "steps_per_s": 1.0 / step_s if step_s > 0 else None,
                   "us_per_step_per_seq": step_s * 1e6 / n,
                   "decode_tokens_per_s": n / step_s if step_s > 0 else None,
                   "loadavg_1m_before": load, "loadavg_1m_after": load_1min(), **extra}
            rows.append(row)
            if step_s > 0:
                print(f"  {system} N={n}: {row['us_per_step']:.0f} us/step "
                      f"({row['steps_per_s']:.1f} steps/s, {row['us_per_step_per_seq']:.2f} "
                      f"us/step/seq)", flush=True)
            else:   # noise larger than the steps between the two lengths: no step time to show
                print(f"  {system} N={n}: the {args.l2}-step runs ({t2 * 1e3:.1f} ms) were not "
                      f"slower than the {args.l1}-step ones ({t1 * 1e3:.1f} ms): too noisy to "
                      "separate a step (raise --l2 or --repeat)", flush=True)
    cols = [("system", "system", ""), ("running", "running", "d"),
            ("us_per_step", "us/step", ".0f"), ("steps_per_s", "steps/s", ".1f"),
            ("us_per_step_per_seq", "us/step/seq", ".2f"),
            ("decode_tokens_per_s", "tok/s", ".0f"),
            ("core_schedule_us", "sched us", ".0f"), ("core_sampler_us", "sampler us", ".0f"),
            ("core_update_us", "update us", ".0f"), ("core_total_us", "core us", ".0f"),
            ("loadavg_1m_before", "load1m", ".2f")]
    print()
    print(format_table(rows, cols))
    if args.json:
        write_json(args.json, {
            "machine": {**info, "loadavg_1m_at_end": load_1min()},
            "method": "differential: (T(L2) - T(L1)) / (L2 - L1), N requests all running; "
                      f"T = median of {args.repeat} runs per length, lengths alternating",
            "repeat": args.repeat,
            "l1": args.l1, "l2": args.l2, "prompt_len": PROMPT_LEN,
            "command": "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
            "results": rows})
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
