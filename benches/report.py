"""Render the result JSONs of throughput.py / serving.py / engine_overhead.py as Markdown tables
(what README "Results" shows), so no number is copied by hand.

    python benches/report.py benches/results/cpu/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ideal(w: dict, r: dict) -> int | None:
    """Ideal decode steps (recomputed from the seeded workload when the JSON predates them)."""
    if r.get("ideal_decode_steps") is not None:
        return r["ideal_decode_steps"]
    base = r["system"].split("@")[0]
    if base not in ("ferrobatch", "ferrobatch-static", "ferrobatch-eager", "ferrobatch-nodraft",
                    "ferrobatch-kv16", "ferrobatch-kv8", "ferrobatch-kvi8", "hf-static"):
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import WORKLOADS, build_requests, ideal_decode_steps
    reqs = build_requests(WORKLOADS[w["name"]])[:w["num_requests"]]
    return ideal_decode_steps(reqs, r["batch_cap"],
                              "static" if base in ("ferrobatch-static", "hf-static")
                              else "continuous")


def throughput_md(d: dict) -> str:
    w = d["workload"]
    m = d["machine"]
    rows = d["results"]
    lines = [(f"**{w['name']}** — {w['num_requests']} requests, {w['prompt_tokens']} prompt / "
             f"{w['output_tokens']} output tokens (digest `{w['digest']}`), model `{w['model']}` "
             f"{w['dtype']}; cap (max_num_seqs) {w['max_num_seqs']}, step budget "
             f"{w['max_num_batched_tokens']} tokens. {m['date_utc']}, {m.get('cpu_model')} "
             f"x{m.get('cpu_count')}, torch {m.get('torch')} ({m.get('torch_threads')} threads), "
             f"transformers {m.get('transformers')}, git `{m.get('git_rev')}`; load(1m) "
             f"{_f(m.get('loadavg_1m_at_start'), '.2f')} at start, "
             f"{_f(m.get('loadavg_1m_at_end'), '.2f')} at end."), "",
             ("| system | batch / cap | out tok/s | req/s | total tok/s | time (s) | steps | "
             "ideal decode steps | mean occupancy | wasted tokens | load(1m) before |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['batch_cap']} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['requests_per_s']:.3f} | {r['total_tokens_per_s']:.1f} | "
                     f"{r['elapsed_s']:.1f} | {_f(r.get('num_steps'), 'd')} | "
                     f"{_f(_ideal(w, r), 'd')} | "
                     f"{_f(r.get('mean_occupancy'), '.1f')} | {_f(r.get('wasted_tokens'), 'd')} | "
                     f"{_f(r.get('loadavg_1m_before'), '.2f')} |")
    names = [r["system"] for r in rows]
    lines += ["", "Ratios of output tokens/s (row / column):", "",
              "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        cells = [f"{r['output_tokens_per_s'] / c['output_tokens_per_s']:.2f}x" for c in rows]
        lines.append(f"| {r['system']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serving_md(d: dict) -> str:
    m = d["machine"]
    w = d["workload"]
    cap = d.get("max_num_seqs")    # null: only an already running server, its cap unknown
    cap = f"max_num_seqs {cap}" if cap is not None else "not known (an already running server)"
    lines = [(f"**serving** — workload `{w['name']}` ({w['num_prompts']} requests per rate, "
             f"{w['output_tokens']} output tokens), server cap {cap}. "
             f"{m['date_utc']}, load(1m) {_f(m.get('loadavg_1m_at_start'), '.2f')} at start, "
             f"{_f(m.get('loadavg_1m_at_end'), '.2f')} at end."), "",
             ("| server | rate (req/s) | ok / failed | req/s | out tok/s | TTFT mean / p50 / p99 "
             "(ms) | TPOT mean / p50 / p99 (ms) | ITL p50 / p99 (ms) | E2EL p50 / p99 (ms) | "
             "load(1m) |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["results"]:
        t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2el_ms"]
        lines.append(
            f"| {r['server']} | {r['request_rate']} | {r['completed']} / {r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{_f(t['mean'], '.0f')} / {_f(t['median'], '.0f')} / {_f(t['p99'], '.0f')} | "
            f"{_f(p['mean'], '.0f')} / {_f(p['median'], '.0f')} / {_f(p['p99'], '.0f')} | "
            f"{_f(i['median'], '.0f')} / {_f(i['p99'], '.0f')} | "
            f"{_f(e['median'], '.0f')} / {_f(e['p99'], '.0f')} | "
            f"{_f(r.get('loadavg_1m_before'), '.2f')} |")
    return "\n".join(lines)


def overhead_md(d: dict) -> str:
    m = d["machine"]
    lines = [(f"**engine overhead** — {d['method']}; L1={d['l1']}, L2={d['l2']}, prompts of "
             f"{d['prompt_len']} tokens. {m['date_utc']}, torch threads {m.get('torch_threads')}, "
             f"load(1m) {_f(m.get('loadavg_1m_at_start'), '.2f')} at start, "
             f"{_f(m.get('loadavg_1m_at_end'), '.2f')} at end."), "",
             ("| system | running | µs / step | steps/s | µs / step / seq | decode tok/s | "
              "load(1m) |"), "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["results"]:
        lines.append(f"| {r['system']} | {r['running']} | {r['us_per_step']:.0f} | "
                     f"{_f(r.get('steps_per_s'), '.1f')} | {r['us_per_step_per_seq']:.2f} | "
                     f"{_f(r.get('decode_tokens_per_s'), '.0f')} | "
                     f"{_f(r.get('loadavg_1m_before'), '.2f')} |")
    return "\n".join(lines)


def render(path: str) -> str:
    """Markdown for one JSON; other benches' JSONs (kernels, speculative, ...) get one line
    naming their fields instead of a traceback."""
    d = json.loads(Path(path).read_text())
    if not isinstance(d, dict):
        return f"(not a result of the benches: a JSON {type(d).__name__})\n"
    results = d.get("results")
    first = results[0] if isinstance(results, list) and results else None
    first = first if isinstance(first, dict) else {}
    try:
        if "method" in d:
            body = overhead_md(d)
        elif not results:
            body = f"(no results table in this JSON; its fields: {', '.join(sorted(d))})"
        elif "request_rate" in first:
            body = serving_md(d)
        elif "workload" in d and "system" in first:
            body = throughput_md(d)
        else:
            body = (f"(no throughput / serving / overhead table in this JSON; its fields: "
                    f"{', '.join(sorted(d))})")
    except (KeyError, TypeError) as e:
        body = f"(not a throughput / serving / overhead result: {type(e).__name__} {e})"
    return f"{body}\n\nCommand: `{d.get('command', '?')}`\n"


def main() -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="result JSONs of the benches")
    for p in parser.parse_args().json:
        if not Path(p).is_file():
            parser.error(f"no such file: {p}")
        try:
            text = render(p)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            parser.error(f"{p} is not JSON: {e}")
        print(f"<!-- {p} -->")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
