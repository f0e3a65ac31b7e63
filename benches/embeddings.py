"""Embeddings side by side: ferrobatch (`LLM.embed`, every prompt a request of its own,
continuously batched) against transformers (padded batches through the model, the last real
token's final hidden state), on the same seeded random-token prompts of SmolLM2, alternating.

    python benches/embeddings.py [--num 128] [--min-len 16] [--max-len 256] [--hf-batch 16] \
        [--repeat 2] [--systems ferrobatch,hf] [--json PATH]

Reports embeddings/s and prompt tokens/s per system, the ratio, and how far the two systems'
vectors are apart (they are the same model's: the largest absolute difference of the
normalized vectors). ferrobatch runs without its prefix cache, so every repeat computes every
prompt token as transformers does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import format_table, machine_info, write_json  # noqa: E402

SYSTEMS = ("ferrobatch", "hf")


def prompts_of(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, size=int(rng.integers(min_len, max_len + 1))).tolist()
            for _ in range(num)]


def run_ferrobatch(llm, prompts: list[list[int]]) -> np.ndarray:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return np.asarray([o.outputs.embedding for o in outs])


def run_hf(model, prompts: list[list[int]], batch: int) -> np.ndarray:
    """Right-padded batches in arrival order; the last real token's final-normed state."""
    import torch
    out = []
    with torch.inference_mode():
        for lo in range(0, len(prompts), batch):
            group = prompts[lo:lo + batch]
            width = max(map(len, group))
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for i, p in enumerate(group):
                ids[i, :len(p)] = torch.tensor(p)
                mask[i, :len(p)] = 1
            states = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            last = torch.tensor([len(p) - 1 for p in group])
            vec = states[torch.arange(len(group)), last].double()
            out.append(torch.nn.functional.normalize(vec, dim=-1).numpy())
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    systems = [s for s in a.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems):
        parser.error(f"--systems: a comma-separated subset of {', '.join(SYSTEMS)}")
    if not 1 <= a.min_len <= a.max_len or a.num < 1 or a.hf_batch < 1 or a.repeat < 1:
        parser.error("need 1 <= --min-len <= --max-len and positive --num, --hf-batch, --repeat")
    prompts = prompts_of(a.num, a.min_len, a.max_len, a.seed)
    tokens = sum(map(len, prompts))
    runners = {}
    if "ferrobatch" in systems:
        from ferrobatch import LLM
        # no prefix cache: a repeat would find every prompt cached and compute one token each
        llm = LLM("smollm2", max_model_len=max(2048, a.max_len + 1), enable_prefix_caching=False)
        runners["ferrobatch"] = lambda: run_ferrobatch(llm, prompts)
    if "hf" in systems:
        from hf_baselines import build_hf_model
        from workloads import WORKLOADS
        model = build_hf_model(WORKLOADS["cpu-small"], "cpu")
        runners["hf"] = lambda: run_hf(model, prompts, a.hf_batch)
    times: dict[str, list[float]] = {s: [] for s in systems}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(a.repeat):                      # the systems alternate
        for s in systems:
            t0 = time.perf_counter()
            vectors[s] = runners[s]()
            times[s].append(time.perf_counter() - t0)
    rows = []
    for s in systems:
        best = min(times[s])
        rows.append({"system": s, "embeddings_per_s": a.num / best,
                     "prompt_tokens_per_s": tokens / best, "time_s": best,
                     "times_s": times[s]})
    if len(rows) == 2:
        rows[0]["ratio"] = rows[0]["embeddings_per_s"] / rows[1]["embeddings_per_s"]
    diff = (float(np.abs(vectors["ferrobatch"] - vectors["hf"]).max())
            if set(vectors) == set(SYSTEMS) else None)
    print(f"{a.num} prompts of {a.min_len}..{a.max_len} tokens ({tokens} in all), "
          f"best of {a.repeat}, systems alternating")
    print(format_table(rows, [("system", "system", ""), ("embeddings_per_s", "emb/s", ".1f"),
                              ("prompt_tokens_per_s", "prompt tok/s", ".0f"),
                              ("time_s", "time (s)", ".2f"), ("ratio", "ratio", ".2f")]))
    if diff is not None:
        print(f"largest |ferrobatch - hf| over the normalized vectors: {diff:.2e}")
    if a.json:
        write_json(a.json, {"machine": machine_info(), "args": vars(a), "prompt_tokens": tokens,
                            "results": rows, "max_abs_diff": diff})
    if "ferrobatch" in systems:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
