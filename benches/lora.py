"""What serving LoRA adapters costs, side by side in one run: the same greedy requests on the
base model, all on one adapter, and spread over several adapters in the same batches.

    python benches/lora.py [--num 16] [--max-tokens 64] [--adapters 4] [--rank 8] \
        [--rounds 2] [--model smollm2] [--device cpu] [--json benches/results/cpu/lora.json]

Systems (one engine, `enable_lora=True`, SmolLM2 GGUF on the CPU by default; rounds alternate):

- `base`: no adapter (steps run every layer in one Rust call on the CPU, replay CUDA graphs on
  a GPU, as without LoRA);
- `lora-1`: every request on one adapter (rank `--rank`, all seven projections);
- `lora-K`: requests spread round-robin over `--adapters` adapters (on the CPU, steps with
  adapter rows run fused too, the adapters' updates added in Rust: `cpu_lora.rs`);
- CPU: `base-layered` and `lora-K-layered`: the same engine with its runner's fused step taken
  away for those runs (`runner.fused_layers = None`), every step layer by layer from Python:
  what the fused step buys, with and without adapters (before session 37, every step with
  adapter rows ran so);
- CUDA: `base-eager`: no adapter, on a second engine over the same weights with
  `cuda_graphs=False`; `lora-K-eager`: `lora-K` with the LoRA decode and piecewise graphs
  taken away for those runs (`runner.lora_decode_graphs = runner.lora_piecewise_graphs =
  None`), every step with adapter rows eager: how they all ran before session 38
  (`runtime/lora_graphs.py`).

(Until session 37 the CPU's `base-layered` was a second engine with `fused_decode=False` over
the same loaded model, and building it took the fused step away from the first engine too:
session 36's CPU figures compared layered steps with layered steps.)

Prompts are seeded random token ids of 64..128 tokens; EOS is ignored, so every request
generates `--max-tokens` tokens. The prefix cache and prompt-lookup drafts are off, so every
round computes the same tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "model"))
from common import format_table, machine_info, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=16, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4, help="K of the lora-K system")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2", help="a model LLM() takes")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    if min(a.num, a.max_tokens, a.adapters, a.rank, a.rounds) < 1:
        parser.error("every count must be >= 1")
    from lora_files import ATTN, MLP, write_peft_adapter
    from tqdm import tqdm

    from ferrobatch import LLM, LoRARequest, SamplingParams

    options = dict(enable_lora=True, max_loras=max(a.adapters, 1), enable_prefix_caching=False,
                   num_speculative_tokens=0, max_model_len=1024, device=a.device,
                   max_lora_rank=max(16, a.rank))
    llm = LLM(a.model, **options)
    cuda = a.device.startswith("cuda")
    runner = llm.engine._core.runner
    fused = runner.fused_layers
    lora_graphs = (runner.lora_decode_graphs, runner.lora_piecewise_graphs)
    # CUDA: a second engine over the same weights without graphs (graphs belong to a runner);
    # CPU: the same engine with its runner's fused step taken away for the layered runs
    eager = LLM(a.model, loaded_model=llm.engine._core.loaded, cuda_graphs=False,
                **options) if cuda else None
    cfg = llm.engine._core.loaded.config
    rng = np.random.default_rng(a.seed)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, size=int(n)).tolist()}
               for n in rng.integers(64, 129, size=a.num)]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for k in range(a.adapters):
            path = os.path.join(tmp, f"adapter{k}")
            write_peft_adapter(path, cfg, targets=ATTN + MLP, r=a.rank, alpha=2 * a.rank,
                               seed=k + 1)
            adapters.append(LoRARequest(f"adapter{k}", k + 1, path))
        spread = [adapters[i % a.adapters] for i in range(a.num)]
        # name -> (engine, LoRA requests, what is taken away for its runs: None, "layered" (the
        # model's fused CPU step) or "lora-graphs" (the runner's LoRA decode graphs))
        systems = {"base": (llm, None, None), "lora-1": (llm, [adapters[0]] * a.num, None),
                   f"lora-{a.adapters}": (llm, spread, None)}
        if cuda:
            systems["base-eager"] = (eager, None, None)
            if lora_graphs[0] is not None:
                systems[f"lora-{a.adapters}-eager"] = (llm, spread, "lora-graphs")
        elif fused is not None:
            systems["base-layered"] = (llm, None, "layered")
            systems[f"lora-{a.adapters}-layered"] = (llm, spread, "layered")

        def run(engine, loras, without, count, params_):
            """The first `count` requests of a system, `without` taken away meanwhile."""
            runner.fused_layers = None if without == "layered" else fused
            runner.lora_decode_graphs, runner.lora_piecewise_graphs = \
                (None, None) if without == "lora-graphs" else lora_graphs
            try:
                return engine.generate(prompts[:count], params_, use_tqdm=False,
                                       lora_request=None if loras is None else loras[:count])
            finally:
                runner.fused_layers = fused
                runner.lora_decode_graphs, runner.lora_piecewise_graphs = lora_graphs

        for engine, loras, without in systems.values():  # warm-up (and every adapter loaded)
            run(engine, loras, without, 2, params.replace(max_tokens=2))
        times: dict[str, list[float]] = {s: [] for s in systems}
        lora_graph_steps: dict[str, int] = dict.fromkeys(systems, 0)
        with tqdm(total=a.rounds * len(systems), desc="lora bench", unit="run") as bar:
            for _ in range(a.rounds):
                for name, (engine, loras, without) in systems.items():
                    steps0 = runner.lora_graph_steps + runner.lora_piecewise_steps
                    t0 = time.perf_counter()
                    outs = run(engine, loras, without, a.num, params)
                    times[name].append(time.perf_counter() - t0)
                    lora_graph_steps[name] += \
                        runner.lora_graph_steps + runner.lora_piecewise_steps - steps0
                    assert all(len(o.outputs[0].token_ids) == a.max_tokens for o in outs)
                    bar.update(1)
    tokens = a.num * a.max_tokens
    base = tokens / min(times["base"])
    rows = [{"system": s, "output_tokens_per_s": tokens / min(t), "time_s": min(t),
             "vs_base": (tokens / min(t)) / base, "times_s": t,
             "lora_graph_steps": lora_graph_steps[s]} for s, t in times.items()]
    print(f"{a.model} on {a.device}: {a.num} requests x {a.max_tokens} tokens, prompts 64..128 "
          f"tokens, rank {a.rank}, best of {a.rounds} (systems alternating)")
    print(format_table(rows, [("system", "system", ""), ("output_tokens_per_s", "out tok/s", ".1f"),
                              ("time_s", "time (s)", ".2f"), ("vs_base", "vs base", ".2f"),
                              ("lora_graph_steps", "LoRA graph steps", "d")]))
    if a.json:
        write_json(a.json, {"machine": machine_info(), "args": vars(a), "results": rows})
    if eager is not None:
        eager.close()
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
