"""Random sampling on the CPU: the Rust draw (`cpu_sampling.rs`) against the torch sampler it
replaced, side by side in one process, on SmolLM2's own logits.

    python benches/sampler.py [--rows 1,16,64] [--repeats 30] [--requests 16] [--tokens 96]
                              [--rounds 2] [--json PATH]

1. **The sampler alone.** Logits rows are captured from a sampled `LLM.generate` run (the
   model's real decode-step logits, peaked as a language model's are), then `Sampler.sample`
   draws S rows of them under each setting (temperature, top-p, top-k, min-p, the penalties
   and top-5 logprobs as chat clients send them and models' generation configs set them; each
   row's request with a 1,000-token prompt and 200 output tokens), the torch path (`rust_kernels=False`) and the
   Rust path alternating call by call;
   medians of `--repeats`. Both paths run from the same seeded uniforms, so the bench also counts
   how often they pick the same token (they differ only where a uniform lands within float
   rounding of a boundary of the cumulative distribution, or of the top-p cut).
2. **The engine.** `--requests` chat-like requests of `--tokens` sampled tokens each (seeded,
   EOS ignored), all submitted at once through `LLM.generate`, under two settings (temperature
   0.7 and top-p 0.9; Qwen2.5-Instruct's defaults: temperature 0.7, top-p 0.8, top-k 20,
   repetition penalty 1.05), the engine's sampler switched between the two paths run by run
   (`--rounds` each, alternating): output tokens per second and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, positive_int  # noqa: E402
from common import format_table, machine_info, write_json  # noqa: E402 - sets OpenMP defaults first

SETTINGS = [  # (name, temperature, top_p, top_k, min_p, repetition, frequency, presence)
    ("T 0.7, top-p 0.9", 0.7, 0.9, 0, 0.0, 1.0, 0.0, 0.0),
    ("T 1.0, top-k 50", 1.0, 1.0, 50, 0.0, 1.0, 0.0, 0.0),
    ("T 0.8, top-p 0.95, top-k 40", 0.8, 0.95, 40, 0.0, 1.0, 0.0, 0.0),
    ("T 1.0, min-p 0.05", 1.0, 1.0, 0, 0.05, 1.0, 0.0, 0.0),
    ("T 0.7", 0.7, 1.0, 0, 0.0, 1.0, 0.0, 0.0),
    # Qwen2.5-Instruct's generation_config.json, which `--generation-config auto` applies
    ("T 0.7, top-p 0.8, top-k 20, rep 1.05", 0.7, 0.8, 20, 0.0, 1.05, 0.0, 0.0),
    ("T 1.0, freq 0.5, pres 0.5", 1.0, 1.0, 0, 0.0, 1.0, 0.5, 0.5),
    ("greedy, logprobs 5", 0.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0),
    ("T 0.7, top-p 0.9, logprobs 5", 0.7, 0.9, 0, 0.0, 1.0, 0.0, 0.0),
]
# the settings whose requests ask for the top-5 logprobs of each token
LOGPROBS = {"greedy, logprobs 5", "T 0.7, top-p 0.9, logprobs 5"}
# each row's token history for the penalties: a prompt and an output this long
HISTORY = (1000, 200)

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five ideas for a rainy weekend and say why each is fun.",
    "What are the main differences between a violin and a viola?",
]


def _batch(rows: int, temperature: float, top_p: float, top_k: int, min_p: float,
           repetition: float, frequency: float, presence: float, seed0: int):
    from types import SimpleNamespace

    import numpy as np

    return SimpleNamespace(
        temperature=np.full(rows, temperature, np.float32), top_k=np.full(rows, top_k, np.int32),
        top_p=np.full(rows, top_p, np.float32), min_p=np.full(rows, min_p, np.float32),
        seed=np.arange(seed0, seed0 + rows, dtype=np.int64),
        sample_output_lens=np.zeros(rows, np.int32), sample_seq_indices=np.zeros(rows, np.int32),
        suppress_eos=np.zeros(rows, np.uint8),
        repetition_penalty=np.full(rows, repetition, np.float32),
        presence_penalty=np.full(rows, presence, np.float32),
        frequency_penalty=np.full(rows, frequency, np.float32),
        sample_req_ids=np.arange(rows), input_ids=np.zeros(rows, np.int32),
        logits_indices=np.arange(rows, dtype=np.int64))


def _histories(rows: int, vocab: int, logprobs: int | None = None) -> dict:
    """Each row's request: a random prompt and output of ``HISTORY``'s lengths (and top
    ``logprobs`` asked for)."""
    import numpy as np

    from ferrobatch.runtime.sampler import RequestExtras

    rng = np.random.default_rng(0)
    return {r: RequestExtras(prompt_token_ids=rng.integers(0, vocab, HISTORY[0]).tolist(),
                             output_token_ids=[rng.integers(0, vocab, HISTORY[1]).tolist()],
                             logprobs=logprobs)
            for r in range(rows)}


def sampler_alone(sampler, pool, rows_list: list[int], repeats: int) -> list[dict]:
    """Times ``sampler.sample`` on ``rows`` rows of the captured ``pool``, torch and Rust
    alternating; counts agreeing tokens over the whole pool."""

    results = []
    plain = _histories(pool.shape[0], pool.shape[1])
    with_logprobs = _histories(pool.shape[0], pool.shape[1], logprobs=5)
    for name, *setting in SETTINGS:
        extras = with_logprobs if name in LOGPROBS else plain
        # agreement: every pool row once per path, the same seeds (the same uniforms)
        batch = _batch(pool.shape[0], *setting, seed0=1000)
        tokens = {}
        for rust in (False, True):
            sampler.rust_kernels = rust
            tokens[rust] = sampler.sample(pool, batch, extras).token_ids
        same = float((tokens[False] == tokens[True]).mean())
        for rows in rows_list:
            logits = pool[:rows].contiguous()
            batch = _batch(rows, *setting, seed0=0)
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(repeats + 2):
                for rust in (False, True):
                    sampler.rust_kernels = rust
                    t0 = time.perf_counter()
                    sampler.sample(logits, batch, extras)
                    if i >= 2:      # two warm-up rounds
                        times[rust].append(time.perf_counter() - t0)
            torch_ms = 1e3 * statistics.median(times[False])
            rust_ms = 1e3 * statistics.median(times[True])
            results.append({"setting": name, "rows": rows, "torch_ms": torch_ms,
                            "rust_ms": rust_ms, "speedup": torch_ms / rust_ms,
                            "same_token_fraction": same})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int_list, default="1,16,64")
    ap.add_argument("--repeats", type=positive_int, default=30)
    ap.add_argument("--requests", type=positive_int, default=16)
    ap.add_argument("--tokens", type=positive_int, default=96)
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from ferrobatch import LLM, SamplingParams

    llm = LLM("smollm2", max_num_seqs=max(64, args.requests), kv_cache_gb=0.5)
    core = llm.engine._core
    sampler = core.sampler
    captured: list[torch.Tensor] = []
    sample = sampler.sample

    def capturing(logits, batch, extras=None):
        if sum(t.shape[0] for t in captured) < max(args.rows) * 2:
            captured.append(logits.detach().float().clone())
        return sample(logits, batch, extras)

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i) for i in range(64)]
    sampler.sample = capturing
    llm.generate(prompts, params, use_tqdm=False)
    sampler.sample = sample
    pool = torch.cat(captured)[:max(args.rows) * 2].contiguous()
    print(f"captured {pool.shape[0]} logits rows of {pool.shape[1]} from SmolLM2's decode steps; "
          f"sampler threads {sampler.cpu_threads}")

    alone = sampler_alone(sampler, pool, args.rows, args.repeats)
    print(format_table(alone, [("setting", "setting", ""), ("rows", "rows", "d"),
                               ("torch_ms", "torch ms", ".3f"), ("rust_ms", "rust ms", ".3f"),
                               ("speedup", "speed-up", ".1f"),
                               ("same_token_fraction", "same token", ".3f")]))

    engine_runs = []
    reqs = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    settings = {  # the engine's two workloads: a chat client's draw, and Qwen2.5's defaults
        "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
        "T 0.7, top-p 0.8, top-k 20, rep 1.05": dict(temperature=0.7, top_p=0.8, top_k=20,
                                                     repetition_penalty=1.05),
    }
    llm.generate(reqs[:2], [SamplingParams(temperature=0.7, max_tokens=4)] * 2,
                 use_tqdm=False)     # warm-up
    for name, setting in settings.items():
        params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=i, **setting)
                  for i in range(args.requests)]
        for rnd in range(args.rounds):
            for rust in (False, True):
                sampler.rust_kernels = rust
                t0 = time.perf_counter()
                outs = llm.generate(reqs, params, use_tqdm=False)
                wall = time.perf_counter() - t0
                produced = sum(len(o.outputs[0].token_ids) for o in outs)
                engine_runs.append({"setting": name, "sampler": "rust" if rust else "torch",
                                    "round": rnd, "output_tokens": produced, "wall_s": wall,
                                    "output_tokens_per_s": produced / wall})
    sampler.rust_kernels = True
    llm.close()
    print(format_table(engine_runs, [("setting", "setting", ""), ("sampler", "sampler", ""),
                                     ("round", "round", "d"),
                                     ("output_tokens_per_s", "out tok/s", ".1f"),
                                     ("wall_s", "wall s", ".2f")]))
    ratios = {}
    for name in settings:
        by = {s: statistics.median(r["output_tokens_per_s"] for r in engine_runs
                                   if r["sampler"] == s and r["setting"] == name)
              for s in ("torch", "rust")}
        ratios[name] = by["rust"] / by["torch"]
        print(f"engine, {args.requests} requests x {args.tokens} sampled tokens ({name}): "
              f"rust {by['rust']:.1f} vs torch {by['torch']:.1f} out tok/s = "
              f"{ratios[name]:.2f}x")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "sampler_alone": alone,
                               "engine": engine_runs, "engine_ratios": ratios,
                               "command": "python benches/sampler.py " + " ".join(
                                   sys.argv[1:] if argv is None else argv)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
