"""Single-stream decode speed on the CPU: one request at a time through `ferrobatch.LLM` (SmolLM2,
greedy unless `--temperature`, drafts off), milliseconds per output token after prompts of a few lengths.

    python benches/single_stream.py --lengths 256,1024,2000 [--temperature T --top-p P] [--json PATH]

What one user chatting with a long history sees. For each length and repeat: a fresh prompt of
random token ids (no prefix-cache hit) with `max_tokens=N+1`; the request's own timings give
(end - first token) / N, the decode time per token at that context, with the prefill left out.
One request's two timestamps, not the difference of two runs: it cannot come out negative when the
machine is noisy. The median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, positive_int  # noqa: E402
from common import format_table, machine_info, write_json  # noqa: E402 - sets OpenMP defaults first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int_list, default="256,1024,2000")
    ap.add_argument("--tokens", type=positive_int, default=128,
                    help="decoded tokens per measurement")
    ap.add_argument("--repeat", type=positive_int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above: sampled (seeded), as a chat client would ask")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.temperature < 0:
        ap.error(f"--temperature {args.temperature}: expected a number >= 0")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p {args.top_p}: expected a number in (0, 1]")

    import numpy as np

    from ferrobatch import LLM, SamplingParams

    llm = LLM(model="smollm2", num_speculative_tokens=0)
    rng = np.random.default_rng(1)

    def timed(length: int, max_tokens: int) -> float:
        ids = rng.integers(100, 40000, size=length).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=0 if args.temperature > 0 else None,
                                ignore_eos=True)
        (out,) = llm.generate([ids], params)
        if len(out.outputs[0].token_ids) != max_tokens:
            raise SystemExit(f"prompt {length}: {len(out.outputs[0].token_ids)} tokens, "
                             f"asked {max_tokens}")
        return out.metrics["e2e_s"] - out.metrics["ttft_s"]

    rows = []
    for length in args.lengths:
        per_token = sorted(timed(length, args.tokens + 1) / args.tokens * 1e3
                           for _ in range(args.repeat))
        rows.append({"prompt_tokens": length, "ms_per_token": per_token[len(per_token) // 2],
                     "samples_ms": [round(v, 2) for v in per_token]})
        print(f"prompt {length}: {rows[-1]['ms_per_token']:.2f} ms per output token", flush=True)
    print()
    print(format_table(rows, [("prompt_tokens", "prompt tokens", "d"),
                              ("ms_per_token", "ms / output token", ".2f"),
                              ("samples_ms", "samples", "")]))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "tokens": args.tokens,
                               "temperature": args.temperature, "top_p": args.top_p,
                               "results": rows})
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
