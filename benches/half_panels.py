"""A bfloat16 Hugging Face checkpoint on the CPU: its linear layers as float32 panels (4 bytes a
weight, as before session 51) and as 16-bit panels (`cpu_half_panels.rs`, 2 bytes: the same
float32 values, the same outputs bit for bit), side by side in one process.

    python benches/half_panels.py [--hf-dir /tmp/smollm2-bf16] [--rows 1,4,16,64]
                                  [--tokens 128] [--threads 2] [--json PATH]

The checkpoint is the embedded SmolLM2 GGUF as transformers reads it (dequantized), rounded to
bfloat16 and saved with `save_pretrained` (made in `--hf-dir` the first time): what a user
downloading SmolLM2-135M-Instruct from the Hub gets, in shape and in type.

- **layers**: every linear layer and the LM head called once per form per round (537 MiB of
  float32 panels: each call streams its weights from memory, as a step does), the forms
  alternating round by round, medians of `--rounds`; both forms' outputs must be equal bit for
  bit (the run fails otherwise).
- **decode**: two `LLM`s of the checkpoint (one with `FERROBATCH_QUANT_PANELS=0`: float32
  panels), single-stream greedy decoding of `--tokens` tokens after a fresh `--prompt-tokens`
  prompt, alternating, ms per output token from the requests' own timings (first token to
  last) and the time to the first token (the prompt's prefill), medians of `--repeat`; both
  must produce the same tokens.
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


def make_checkpoint(hf_dir: Path) -> None:
    """The embedded SmolLM2 in transformers, in bfloat16, saved to ``hf_dir`` with its
    tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from ferrobatch.model.loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(torch.bfloat16).save_pretrained(hf_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(hf_dir)


def layer_rounds(hf_dir: Path, rows_list: list[int], rounds: int, threads: int) -> tuple:
    """Per row count, the medians of both forms over every linear layer (module header)."""
    import torch

    from ferrobatch._scheduler import half_panels_amx_rows
    from ferrobatch.model.loader import load_model
    from ferrobatch.runtime.cpu_linear import PanelLinear

    model = load_model(str(hf_dir)).model
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if getattr(model, "lm_head", None) is None:
        weights.append(model.lm_head_weight.detach())
    forms = {"float32": [PanelLinear(w, num_threads=threads) for w in weights],
             "bf16": [PanelLinear(w, num_threads=threads, half_panels=True) for w in weights]}
    for layer in forms["bf16"]:
        if layer.half is None or layer.half[0] != "bf16":
            raise SystemExit("a weight of the bfloat16 checkpoint is not bfloat16")
        layer.drop_panels()
    mib = {"float32": sum(m.packed_weight.nbytes for m in forms["float32"]) / 2**20,
           "bf16": sum(m.half[1].nbytes for m in forms["bf16"]) / 2**20}
    rng = np.random.default_rng(0)
    results = []
    amx_rows = half_panels_amx_rows()
    with torch.inference_mode():
        for rows in rows_list:
            xs = {k: torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
                  for k in {w.shape[1] for w in weights}}
            times: dict[str, list[float]] = {kind: [] for kind in forms}
            outs: dict[str, list] = {}
            for i in range(rounds + 1):
                for kind, layers in forms.items():
                    start = time.perf_counter()
                    outs[kind] = [layer(xs[layer.in_features]) for layer in layers]
                    if i:                  # the first round warms both up
                        times[kind].append(time.perf_counter() - start)
            # bit for bit, but for steps on AMX tiles (float32 accuracy, another order)
            amx = amx_rows is not None and rows >= amx_rows
            same = (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))) \
                if amx else torch.equal
            if not all(same(a, b) for a, b in zip(outs["float32"], outs["bf16"])):
                raise SystemExit("the two forms gave different outputs")
            ms = {kind: float(np.median(t)) * 1e3 for kind, t in times.items()}
            results.append({"rows": rows, "float32_ms": ms["float32"], "bf16_ms": ms["bf16"],
                            "speedup": ms["float32"] / ms["bf16"],
                            "float32_gb_per_s": mib["float32"] * 2**20 / ms["float32"] / 1e6,
                            "bf16_gb_per_s": mib["bf16"] * 2**20 / ms["bf16"] / 1e6})
            print(f"layers, rows={rows}: float32 {ms['float32']:.2f} ms, bf16 {ms['bf16']:.2f} "
                  f"ms ({results[-1]['speedup']:.2f}x)", flush=True)
    return len(weights), mib, results


def decode_rounds(hf_dir: Path, tokens: int, repeat: int, prompt_tokens: int) -> dict:
    """Single-stream greedy ms per output token and time to first token, both forms
    alternating (module header)."""
    from ferrobatch import LLM, SamplingParams

    llms = {}
    for kind, env in (("bf16", None), ("float32", "0")):
        if env is None:
            os.environ.pop("FERROBATCH_QUANT_PANELS", None)
        else:
            os.environ["FERROBATCH_QUANT_PANELS"] = env
        llms[kind] = LLM(model=str(hf_dir), num_speculative_tokens=0)
    os.environ.pop("FERROBATCH_QUANT_PANELS", None)
    rng = np.random.default_rng(1)
    params = {"max_tokens": tokens + 1, "temperature": 0.0, "ignore_eos": True}
    per_token: dict[str, list[float]] = {kind: [] for kind in llms}
    ttft: dict[str, list[float]] = {kind: [] for kind in llms}
    for _ in range(repeat + 1):
        ids = rng.integers(100, 40000, size=prompt_tokens).tolist()
        answers = {}
        for kind, llm in llms.items():
            (out,) = llm.generate([ids], SamplingParams(**params))
            answers[kind] = out.outputs[0].token_ids
            per_token[kind].append((out.metrics["e2e_s"] - out.metrics["ttft_s"]) / tokens * 1e3)
            ttft[kind].append(out.metrics["ttft_s"] * 1e3)
        if answers["bf16"] != answers["float32"]:
            raise SystemExit("the two forms decoded different tokens")
    ms = {kind: float(np.median(v[1:])) for kind, v in per_token.items()}   # the first warms up
    first = {kind: float(np.median(v[1:])) for kind, v in ttft.items()}
    print(f"decode: float32 panels {ms['float32']:.2f} ms a token, bf16 panels "
          f"{ms['bf16']:.2f} ({ms['float32'] / ms['bf16']:.2f}x); first token after "
          f"{prompt_tokens} prompt tokens: {first['float32']:.0f} vs {first['bf16']:.0f} ms "
          f"({first['float32'] / first['bf16']:.2f}x)", flush=True)
    return {"prompt_tokens": prompt_tokens, "float32_ms_per_token": ms["float32"],
            "bf16_ms_per_token": ms["bf16"], "speedup": ms["float32"] / ms["bf16"],
            "float32_ttft_ms": first["float32"], "bf16_ttft_ms": first["bf16"],
            "ttft_speedup": first["float32"] / first["bf16"],
            "samples_ms": {k: [round(v, 2) for v in vs] for k, vs in per_token.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", default="/tmp/smollm2-bf16")
    ap.add_argument("--rows", type=int_list, default="1,4,16,64")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--tokens", type=positive_int, default=128,
                    help="decoded tokens per single-stream measurement")
    ap.add_argument("--repeat", type=positive_int, default=5)
    ap.add_argument("--prompt-tokens", type=positive_int, default=512,
                    help="each single-stream request's prompt (its first token is timed too)")
    ap.add_argument("--skip-decode", action="store_true", help="the layers alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    hf_dir = Path(args.hf_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        ap.error(f"--hf-dir {hf_dir}: not a directory")
    if not (hf_dir / "config.json").is_file():
        print(f"writing the bfloat16 checkpoint to {hf_dir}", flush=True)
        make_checkpoint(hf_dir)
    count, mib, results = layer_rounds(hf_dir, args.rows, args.rounds, args.threads)
    print(f"\n{count} weights: {mib['float32']:.0f} MiB of float32 panels, "
          f"{mib['bf16']:.0f} MiB of bf16 panels\n")
    print(format_table(results, [
        ("rows", "rows", "d"), ("float32_ms", "float32 ms", ".2f"), ("bf16_ms", "bf16 ms", ".2f"),
        ("speedup", "x", ".3f"), ("float32_gb_per_s", "float32 GB/s", ".1f"),
        ("bf16_gb_per_s", "bf16 GB/s", ".1f")]))
    decode = None if args.skip_decode else decode_rounds(hf_dir, args.tokens, args.repeat,
                                                         args.prompt_tokens)
    if args.json:
        write_json(args.json, {"machine": machine_info(), "hf_dir": str(hf_dir),
                               "threads": args.threads, "rounds": args.rounds, "mib": mib,
                               "layers": results, "decode": decode})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
