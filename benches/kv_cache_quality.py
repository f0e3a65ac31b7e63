"""What a smaller KV cache dtype does to SmolLM2's answers (CPU), against the float32 cache.

    python benches/kv_cache_quality.py [--dtypes float16,fp8,int8] [--max-tokens 128]
                                       [--json benches/results/cpu/kv_cache_quality.json]

Sixteen chat questions (below), greedy, through `LLM(kv_cache_dtype=...)`, one engine per
dtype on the same loaded model:
- **same replies**: the replies identical token for token to the float32 cache's;
- **tokens before the first difference**: per reply, averaged (a reply that never differs counts
  its whole length);
- **top-1 agreement** (teacher-forced): each question followed by the float32 cache's reply, as
  one prompt, with `prompt_logprobs=1`; the share of the reply's positions where the dtype's
  most likely token is the one float32 chose. Unlike the greedy replies, one difference does
  not carry into every later token, so this is the per-step rate;
- **mean |delta logprob|**: of the float32 reply's tokens, the same prompts, dtype vs float32;
- **perplexity** of the float32 replies under each dtype (float32's own is the floor: greedy
  tokens are its likeliest).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, machine_info, write_json  # noqa: E402  (sets GOMP_SPINCOUNT first)

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give three tips for a good night's sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a short email asking a colleague for a meeting on Friday.",
    "What is 17 times 23? Show your steps.",
    "Name four planets of the solar system and one fact about each.",
    "How does a bicycle stay upright?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What are the main ingredients of a pancake?",
    "Describe a cat to someone who has never seen one.",
]


def _greedy_replies(llm, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each question's greedy reply and its prompt (chat template applied), as token ids."""
    from ferrobatch import SamplingParams
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [list(o.prompt_token_ids) for o in outs]


def _teacher_forced(llm, prompts: list[list[int]], replies: list[list[int]]):
    """Per reply position: (logprob of the float32 token, whether it is the dtype's top-1)."""
    from ferrobatch import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, replies)],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                        use_tqdm=False)
    per_reply = []
    for o, p, r in zip(outs, prompts, replies):
        entries = o.prompt_logprobs[len(p):len(p) + len(r)]
        per_reply.append([(e.logprob, e.top[0][0] == e.token_id) for e in entries])
    return per_reply


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float16,fp8,int8",
                    help="comma-separated kv_cache_dtype values compared with float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from ferrobatch import LLM
    from ferrobatch.model.loader import load_model
    loaded = load_model("smollm2")
    results: dict[str, dict] = {}
    rows = []
    base_replies = base_prompts = base_forced = None
    for dtype in ["float32", *args.dtypes.split(",")]:
        t0 = time.perf_counter()
        llm = LLM("smollm2", loaded_model=loaded, kv_cache_dtype=dtype, device="cpu",
                  enable_prefix_caching=False)
        try:
            replies, prompts = _greedy_replies(llm, args.max_tokens)
            if base_replies is None:
                base_replies, base_prompts = replies, prompts
            forced = _teacher_forced(llm, base_prompts, base_replies)
        finally:
            llm.close()
        if base_forced is None:
            base_forced = forced
        same = sum(a == b for a, b in zip(replies, base_replies))
        prefix = []
        for a, b in zip(replies, base_replies):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            prefix.append(n)
        flat = [x for reply in forced for x in reply]
        flat_base = [x for reply in base_forced for x in reply]
        top1 = sum(hit for _, hit in flat) / len(flat)
        delta = sum(abs(a - b) for (a, _), (b, _) in zip(flat, flat_base)) / len(flat)
        ppl = math.exp(-sum(lp for lp, _ in flat) / len(flat))
        row = {"kv_cache_dtype": dtype, "same_replies": same, "replies": len(replies),
               "mean_tokens_before_difference": sum(prefix) / len(prefix),
               "mean_reply_tokens": sum(map(len, base_replies)) / len(base_replies),
               "top1_agreement": top1, "mean_abs_delta_logprob": delta, "perplexity": ppl,
               "seconds": time.perf_counter() - t0}
        results[dtype] = row
        rows.append(row)
        print(f"{dtype}: {same}/{len(replies)} replies the same, top-1 {top1:.4f}, "
              f"|dlogprob| {delta:.4f}, perplexity {ppl:.4f}", flush=True)
    print()
    print(format_table(rows, [("kv_cache_dtype", "KV cache", "s"),
                              ("same_replies", "same replies", "d"),
                              ("mean_tokens_before_difference", "tokens before a difference",
                               ".1f"),
                              ("top1_agreement", "top-1 agreement", ".4f"),
                              ("mean_abs_delta_logprob", "mean |d logprob|", ".4f"),
                              ("perplexity", "perplexity", ".4f")]))
    print(f"({len(QUESTIONS)} questions, greedy, at most {args.max_tokens} tokens; float32 "
          f"replies average {rows[0]['mean_reply_tokens']:.1f} tokens; teacher-forced columns "
          "over the float32 replies)")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "max_tokens": args.max_tokens,
                               "questions": QUESTIONS, "results": rows})
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
