"""What guided decoding (structured outputs) costs, measured side by side in one run.

    python benches/guided.py [--requests 16] [--json benches/results/cpu/guided.json]

1. Masks: the first visit of a grammar state (the walk over the vocabulary's byte trie; cached
   afterwards), for a permissive state (inside a JSON string: almost every token is allowed)
   and a restrictive one (right after '{').
2. End to end: the same chat prompts through the engine, first guided by a JSON Schema, then
   unguided with each request's `max_tokens` set to the token count its guided run produced
   (and EOS ignored), so both runs generate exactly the same number of tokens, alternating for
   `--rounds` rounds. Reported as output tokens/s, their ratio, and the time the sampler's mask
   step took in place (timed on the step thread, per guided step and as a share of the run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# the checkout's package last: one already on the path (the editable install's, or a copy named
# by PYTHONPATH for an A/B of two builds) wins
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from argtypes import model_ref, positive_int
from ferrobatch import LLM, SamplingParams
from ferrobatch.guided.json_schema import schema_to_regex

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                    "maxItems": 3},
    },
    "required": ["name", "age", "city"],
}
TOPICS = ["a baker", "a pilot", "a painter", "a child", "a doctor", "a farmer", "a student",
          "a sailor", "a poet", "a chef", "a nurse", "a runner", "a judge", "a miner",
          "a singer", "a teacher"]


def mask_costs(llm: LLM) -> dict:
    core = llm.engine._core
    tok = core.tokenizer
    out: dict = {"vocab_size": core.vocab_size}
    # first visits: a fresh grammar each time (a distinct, equivalent pattern: the schema's
    # regex plus k empty groups), so no state is cached
    fresh = iter(range(1, 1000))
    for name, text in (("restrictive (after '{')", "{"),
                       ("permissive (inside a string)", '{"name": "Al')):
        ids = tok.encode(text)
        times = []
        for _ in range(5):
            g = core.guided.grammar(schema_to_regex(PERSON) + "(?:)" * next(fresh))
            s = g.start()
            for t in ids:
                s.advance(t)
            t0 = time.perf_counter()
            n = s.num_allowed
            times.append(time.perf_counter() - t0)
        out[f"first_visit_ms {name}"] = round(1e3 * float(np.median(times)), 3)
        out[f"allowed {name}"] = n
    return out


def end_to_end(llm: LLM, n: int, rounds: int) -> dict:
    prompts = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}]
               for i in range(n)]
    guided = SamplingParams(max_tokens=160, temperature=0.7, seed=0, guided_json=PERSON)
    # warm-up: the grammar compiles, and every prompt's prefill lands in the prefix cache, so
    # that no round (guided or plain) pays a prefill the other does not
    llm.chat(prompts[:2], guided, use_tqdm=False)
    llm.chat(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    # time the sampler's mask step in place, on the step thread, for every guided step
    sampler = llm.engine._core.sampler
    inner = sampler._apply_guides
    mask_s: list[float] = []

    def timed(*a, **kw):
        t0 = time.perf_counter()
        inner(*a, **kw)
        mask_s.append(time.perf_counter() - t0)

    sampler._apply_guides = timed
    out: dict = {"requests": n}
    for r in range(rounds):                                      # alternating, same requests
        mask_s.clear()
        t0 = time.perf_counter()
        outs = llm._run(_gather(llm, prompts, [guided] * n))
        t_guided = time.perf_counter() - t0
        masks = {"steps": len(mask_s), "mask_ms_per_step": round(1e3 * float(np.mean(mask_s)), 3),
                 "mask_share_of_run": round(sum(mask_s) / t_guided, 4)}
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(_is_json(o.outputs[0].text) for o in outs)
        plain = [SamplingParams(max_tokens=k, temperature=0.7, seed=0, ignore_eos=True)
                 for k in lengths]
        t0 = time.perf_counter()
        plain_outs = llm._run(_gather(llm, prompts, plain))
        t_plain = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in plain_outs] == lengths
        total = sum(lengths)
        out[f"round {r}"] = {
            "output_tokens": total, "valid_json": valid,
            "guided_tok_s": round(total / t_guided, 1), "plain_tok_s": round(total / t_plain, 1),
            "guided_over_plain": round(t_plain / t_guided, 3), **masks}
    sampler._apply_guides = inner
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


async def _gather(llm, prompts, params):
    import asyncio

    async def one(m, p):
        last = None
        async for out in llm.engine.generate(None, p.replace(output_kind="final"), messages=m):
            last = out
        return last
    return await asyncio.gather(*(one(m, p) for m, p in zip(prompts, params)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=model_ref, default="smollm2")
    ap.add_argument("--requests", type=positive_int, default=16)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=64)
    try:
        result = {"masks": mask_costs(llm), "end_to_end": end_to_end(llm, args.requests, args.rounds)}
    finally:
        llm.close()
    for part, values in result.items():
        print(f"== {part}")
        for k, v in values.items():
            print(f"  {k:45s} {v}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
