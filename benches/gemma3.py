"""A Gemma 3 checkpoint on the CPU: single-stream greedy decoding through ferrobatch and
through transformers, the same checkpoint, side by side in one process.

    python benches/gemma3.py [--hf-dir /tmp/gemma3-270m-bf16] [--contexts 256,2048]
                             [--tokens 64] [--repeat 3] [--threads 2] [--json PATH]
                             [--shape 270m|tiny]

The checkpoint is gemma-3-270m's shape (18 layers, 15 of them over a sliding window of 512
positions; a 262,144-token tied embedding) with transformers' random initialisation, saved in
bfloat16 as Google ships it (made in `--hf-dir` the first time; SmolLM2's tokenizer beside it,
for the engine's detokenizer: its ids are within the vocabulary). The weights are random, so
what is measured is speed; the tokens of both systems are compared and reported.

- **ferrobatch**: `LLM(model=<dir>)` as a user starts it (its linears and the tied embedding
  as 16-bit panels, the fused CPU step, windows in the decode kernel), drafts off; ms per output
  token from each request's own timings (first token to last) and the time to the first token.
- **transformers**: the same directory in float32 (the CPU's default dtype), `generate`
  greedy; ms per output token as (T(N + 1 new tokens) - T(1 new token)) / N, the first token
  as T(1 new token).

Each context (prompt length) is measured `--repeat` times after a warm-up, the two systems
alternating; medians. Contexts past 512 take the sliding layers past their window.
`--shape tiny` (a few layers of width 64, a window of 16) keeps the harness tested.
"""

# ruff: noqa: I001  (common must be imported before numpy / torch: it sets OpenMP defaults)
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, positive_int  # noqa: E402
from common import format_table, machine_info, write_json  # noqa: E402  (OpenMP defaults first)

import numpy as np  # noqa: E402

# google/gemma-3-270m's config.json, the fields that shape the model
GEMMA3_270M = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
               "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
               "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
               "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
# the same layout at a size for smoke tests: 7 layers (the sixth global), a window of 16, and
# the tokenizer's vocabulary
TINY = {**GEMMA3_270M, "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16,
        "max_position_embeddings": 4096}
SHAPES = {"270m": GEMMA3_270M, "tiny": TINY}


def make_checkpoint(hf_dir: Path, config: dict) -> None:
    """``config``'s shape with transformers' random weights, in bfloat16, and a tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ferrobatch.model.loader import smollm2_gguf_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config),
                                             dtype=torch.bfloat16)
    model.save_pretrained(hf_dir, safe_serialization=True)
    path = smollm2_gguf_path()
    AutoTokenizer.from_pretrained(os.path.dirname(path),
                                  gguf_file=os.path.basename(path)).save_pretrained(hf_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", default="/tmp/gemma3-270m-bf16")
    ap.add_argument("--contexts", type=int_list, default="256,2048")
    ap.add_argument("--tokens", type=positive_int, default=64)
    ap.add_argument("--repeat", type=positive_int, default=3)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="270m")
    args = ap.parse_args(argv)
    hf_dir = Path(args.hf_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        ap.error(f"--hf-dir {hf_dir} is not a directory")
    if any(c < 1 for c in args.contexts):
        ap.error("--contexts must be positive")

    import torch
    from transformers import AutoModelForCausalLM

    from ferrobatch import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    if not (hf_dir / "config.json").exists():
        print(f"writing the checkpoint to {hf_dir} ...", flush=True)
        make_checkpoint(hf_dir, SHAPES[args.shape])
    llm = LLM(model=str(hf_dir), num_speculative_tokens=0, cpu_threads=args.threads,
              max_model_len=max(args.contexts) + args.tokens + 8)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=args.tokens + 1, temperature=0.0, ignore_eos=True)
    results = []
    for context in args.contexts:
        per_token: dict[str, list[float]] = {"ferrobatch": [], "transformers": []}
        first: dict[str, list[float]] = {"ferrobatch": [], "transformers": []}
        same = 0
        for _ in range(args.repeat + 1):        # the first round warms both up
            ids = rng.integers(100, 40000, size=context).tolist()
            (out,) = llm.generate([ids], params)
            per_token["ferrobatch"].append(
                (out.metrics["e2e_s"] - out.metrics["ttft_s"]) / args.tokens * 1e3)
            first["ferrobatch"].append(out.metrics["ttft_s"] * 1e3)
            prompt = torch.tensor([ids])
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False)
                t1 = time.perf_counter()
                tokens = hf.generate(prompt, max_new_tokens=args.tokens + 1,
                                     min_new_tokens=args.tokens + 1, do_sample=False)
                t2 = time.perf_counter()
            per_token["transformers"].append(((t2 - t1) - (t1 - t0)) / args.tokens * 1e3)
            first["transformers"].append((t1 - t0) * 1e3)
            same += tokens[0, context:].tolist() == list(out.outputs[0].token_ids)
        ms = {k: float(np.median(v[1:])) for k, v in per_token.items()}
        ttft = {k: float(np.median(v[1:])) for k, v in first.items()}
        results.append({"context": context, "tokens": args.tokens,
                        "ferrobatch_ms_per_token": ms["ferrobatch"],
                        "transformers_ms_per_token": ms["transformers"],
                        "speedup": ms["transformers"] / ms["ferrobatch"],
                        "ferrobatch_ttft_ms": ttft["ferrobatch"],
                        "transformers_ttft_ms": ttft["transformers"],
                        "same_tokens": f"{same}/{args.repeat + 1}"})
        print(f"context {context}: ferrobatch {ms['ferrobatch']:.1f} ms a token, transformers "
              f"{ms['transformers']:.1f} ({results[-1]['speedup']:.2f}x); same tokens in "
              f"{same} of {args.repeat + 1} requests", flush=True)
    print(format_table(results, [
        ("context", "context", "d"), ("ferrobatch_ms_per_token", "ferrobatch ms/token", ".1f"),
        ("transformers_ms_per_token", "transformers ms/token", ".1f"), ("speedup", "x", ".2f"),
        ("ferrobatch_ttft_ms", "ferrobatch TTFT ms", ".0f"),
        ("transformers_ttft_ms", "transformers TTFT ms", ".0f"),
        ("same_tokens", "same tokens", "s")]))
    if args.json:
        write_json(args.json, {"bench": "gemma3", "machine": machine_info(),
                               "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
