"""What speculative decoding by prompt lookup buys, measured side by side in one run.

    python benches/speculative.py [--rounds 3] [--max-tokens 128] [--drafts 3,6]
                                  [--json benches/results/cpu/speculative.json]

The same greedy chat requests go through engines that differ only in their speculative
setting (0 = off, then each of `--drafts`), sharing one loaded model, alternating for `--rounds`
rounds. A `--drafts` entry is `K` (K drafts, the engine's default limits) or `K/R/S[/L]`: K
drafts, `speculative_max_running` R and `speculative_max_step_tokens` S (0 = no limit; an empty
field keeps the engine's default), and the draft length L: `adaptive` (the default: after drafts
cut short at A accepted tokens, at most A + 1 next) or `fixed` (always K), e.g.
`--drafts 3/1/0,3/0/4` compares "draft only alone" with "fill steps up to 4 tokens at any load"
and `--drafts 3/0/16/fixed,3/0/16/adaptive` the two draft lengths. Three workloads: `copy`
(repeat a passage), `edit` (rewrite code with a small change), both where output repeats the
prompt, and `open` (open-ended answers, little to copy: what wrong drafts cost). Each of a
workload's `--requests` requests (its 4 prompts, cycled) runs at each `--concurrency` C: in
groups of C sent at once (C = 1: one after another).

Reported per workload and concurrency: output tokens/s of each engine and the ratio to "off",
the drafts' acceptance rate, and the share of output tokens that were accepted drafts (tokens
that took no model step of their own). Every engine's
token ids are compared with "off": greedy outputs must be identical, and any mismatch is
counted and printed (a correctness check, not a speed figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# the checkout's package last: one already on the path (the editable install's, or a copy named
# by PYTHONPATH for an A/B of two builds) wins
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from tqdm import tqdm

from argtypes import int_list, model_ref, name_list, positive_int
from ferrobatch import LLM, SamplingParams

PASSAGES = [
    "The river Seine flows through Paris. Its banks are lined with old bookstalls, and in "
    "the evening the bridges light up one after another while boats pass slowly below.",
    "To reset the router, unplug it for ten seconds, plug it back in, wait until the green "
    "light stops blinking, then connect to the network named HomeNet with your usual password.",
    "Mix two cups of flour with one teaspoon of salt. Add warm water slowly while stirring, "
    "knead the dough for ten minutes, cover it, and let it rest for one hour before baking.",
    "Our meeting moves from Tuesday to Thursday at three o'clock in room 204. Please bring the "
    "quarterly report and the list of open issues, and tell Maria if you cannot attend.",
]
CODE = [
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + item\n"
    "    return result\n",
    "def find(names, target):\n    for index, name in enumerate(names):\n        if name == "
    "target:\n            return index\n    return -1\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self):\n"
    "        self.count = self.count + 1\n        return self.count\n",
    "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n"
    "    return message\n",
]
OPEN = ["Write a short story about a dragon who learns to cook.",
        "What are three tips for staying focused while studying?",
        "Explain why the sky is blue to a ten-year-old.",
        "Describe a perfect weekend in the mountains."]


def workloads() -> dict[str, list[list[dict]]]:
    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]
    return {
        "copy": [user(f"Repeat the following text exactly, word for word.\n\n{p}")
                 for p in PASSAGES],
        "edit": [user("Rewrite this Python code with the variable names in the function "
                      f"renamed to longer, clearer names. Keep everything else.\n\n{c}")
                 for c in CODE],
        "open": [user(q) for q in OPEN],
    }


def run_once(llm: LLM, convs: list, params: SamplingParams, concurrency: int) -> dict:
    stats0 = llm.engine.stats()
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(convs), concurrency):
        outs += llm.chat(convs[i:i + concurrency], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats1 = llm.engine.stats()
    ids = [o.outputs[0].token_ids for o in outs]
    drafted = stats1["num_draft_tokens_total"] - stats0["num_draft_tokens_total"]
    accepted = stats1["num_accepted_tokens_total"] - stats0["num_accepted_tokens_total"]
    tokens = sum(len(t) for t in ids)
    return {"wall_s": wall, "tokens": tokens, "ids": ids, "drafted": drafted,
            "accepted": accepted}


def engine_options(setting: str) -> dict:
    """`K` or `K/R/S[/L]` (see the module docstring) as LLM keyword options; ValueError for
    anything else, or values the engine would refuse."""
    from ferrobatch.config import EngineConfig

    parts = setting.split("/")
    if len(parts) not in (1, 3, 4) or (len(parts) == 4 and parts[3] not in ("adaptive", "fixed")) \
            or not all(v.isdigit() for v in parts[:3] if v != ""):
        raise ValueError("expected K or K/R/S[/adaptive|fixed], integers >= 0")
    names = ("num_speculative_tokens", "speculative_max_running", "speculative_max_step_tokens")
    options = {n: int(v) for n, v in zip(names, parts[:3]) if v != ""}
    EngineConfig(**options)   # the engine's own checks (K <= 16, ...), before any model loads
    if len(parts) == 4:
        options["speculative_adaptive"] = parts[3] == "adaptive"
    return options


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=model_ref, default="smollm2")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the model loads in its default dtype there)")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--drafts", default="3,6",
                    help="speculative settings to compare with off: K or K/R/S[/L] (see above)")
    ap.add_argument("--concurrency", type=int_list, default="1,4")
    ap.add_argument("--workloads", type=name_list(workloads()), default="copy,edit,open")
    ap.add_argument("--requests", type=positive_int, default=4,
                    help="requests per workload: its 4 prompts, cycled (identical prompts give "
                    "identical greedy answers, so the load is what varies)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    settings = ["0"] + [x.strip() for x in a.drafts.split(",") if x.strip()]
    try:
        for k in settings:
            engine_options(k)
    except ValueError as e:
        ap.error(f"argument --drafts: entry {k!r}: {e}")
    if twice := sorted({k for k in settings if settings.count(k) > 1}):
        ap.error(f"argument --drafts: {', '.join(twice)} given twice ('0', off, is always run)")
    concurrency = a.concurrency
    chosen = {k: [v[i % len(v)] for i in range(a.requests)]
              for k, v in workloads().items() if k in a.workloads}

    from ferrobatch.model.loader import load_model
    loaded = load_model(a.model, device=a.device)
    engines = {name: LLM(a.model, loaded_model=loaded, device=a.device, **engine_options(name))
               for name in settings}
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    # warm-up: every prompt's prefill reaches each engine's prefix cache, so no round pays a
    # prefill another does not
    for llm in engines.values():
        for convs in chosen.values():
            llm.chat(convs, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)

    runs: dict[tuple[str, int, int], list[dict]] = {}
    total = a.rounds * len(chosen) * len(concurrency) * len(settings)
    with tqdm(total=total, desc="speculative bench", unit="run") as bar:
        for r in range(a.rounds):
            for name, convs in chosen.items():
                for c in concurrency:
                    order = settings if r % 2 == 0 else settings[::-1]
                    for k in order:
                        runs.setdefault((name, c, k), []).append(
                            run_once(engines[k], convs, params, c))
                        bar.update(1)

    results = []
    mismatches = 0
    w = max(8, *(len(k) for k in settings))
    print(f"\n{'workload':8} {'conc':>4} {'drafts':>{w}} {'tok/s':>8} {'vs off':>7} "
          f"{'accept':>7} {'free tok':>8} {'same ids':>8}")
    for name in chosen:
        for c in concurrency:
            base = runs[(name, c, "0")]
            for k in settings:
                xs = runs[(name, c, k)]
                rate = statistics.median(x["tokens"] / x["wall_s"] for x in xs)
                ratios = [x["tokens"] / x["wall_s"] / (b["tokens"] / b["wall_s"])
                          for x, b in zip(xs, base)]
                same = all(x["ids"] == b["ids"] for x, b in zip(xs, base))
                mismatches += not same
                drafted = sum(x["drafted"] for x in xs)
                accepted = sum(x["accepted"] for x in xs)
                free = accepted / sum(x["tokens"] for x in xs)
                row = {"workload": name, "concurrency": c, "setting": k,
                       **{opt: v for opt, v in engine_options(k).items()},
                       "output_tokens_per_s": round(rate, 2),
                       "ratio_vs_off_median": round(statistics.median(ratios), 3),
                       "ratio_vs_off_per_round": [round(x, 3) for x in ratios],
                       "output_tokens": xs[0]["tokens"], "drafted": drafted,
                       "accepted": accepted,
                       "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                       "accepted_share_of_output": round(free, 3),
                       "identical_to_off": same}
                results.append(row)
                acc = f"{accepted / drafted:.0%}" if drafted else "-"
                print(f"{name:8} {c:>4} {k:>{w}} {rate:>8.1f} {row['ratio_vs_off_median']:>6.2f}x "
                      f"{acc:>7} {free:>8.0%} {'yes' if same else 'NO':>8}")
    if mismatches:
        print(f"\n{mismatches} configuration(s) produced different token ids than 'off'")
    for llm in engines.values():
        llm.close()
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "model": a.model, "device": a.device,
                       "rounds": a.rounds, "max_tokens": a.max_tokens, "requests": a.requests,
                       "cpu_count": os.cpu_count(), "results": results}, f, indent=1)
        print(f"wrote {a.json}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
