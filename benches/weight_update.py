"""How long a weight update stops serving: `update_weights` (every tensor, or one layer's, or
one tensor) and `update_weights_from_disk`, on a running engine, against the step it waits
behind.

    python benches/weight_update.py [--model smollm2] [--device cpu] [--repeats 3]
        [--json benches/results/cpu/weight_update.json]

Each update runs between two steps (the engine is idle here, so it runs at once) and its wall
time is what an RL loop's pause around it lasts, beyond the pause itself. The first update of
a GGUF model on the CPU also turns every layer it touches from GGUF blocks to float32 panels
(once); the rows after it are the steady state. For scale, the time of one decode step of 16
sequences is measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import format_table, machine_info, smollm2_gguf_path, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a model LLM() takes")
    parser.add_argument("--checkpoint", default=None,
                        help="what update_weights_from_disk reads (default: the model itself, "
                        "when it is the embedded SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    if a.repeats < 1:
        parser.error("--repeats must be >= 1")
    from tqdm import tqdm

    from ferrobatch import LLM, SamplingParams

    checkpoint = a.checkpoint or (smollm2_gguf_path() if a.model == "smollm2" else None)
    llm = LLM(a.model, device=a.device, enable_prefix_caching=False, num_speculative_tokens=0)

    def dense(module):
        w = getattr(module, "weight", None)
        return (w if w is not None else module.dense_weight()).detach().clone()

    def state_of(model):
        out = {"model.embed_tokens.weight": dense(model.embed_tokens),
               "model.norm.weight": model.norm.weight.detach().clone()}
        q = model.config.num_heads * model.config.head_dim
        kv = model.config.num_kv_heads * model.config.head_dim
        inter = model.config.intermediate_size
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            qkv = dense(layer.self_attn.qkv_proj)
            for name, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)),
                               ("v", slice(q + kv, q + 2 * kv))):
                out[f"{p}self_attn.{name}_proj.weight"] = qkv[rows].clone()
            out[f"{p}self_attn.o_proj.weight"] = dense(layer.self_attn.o_proj)
            gate_up = dense(layer.mlp.gate_up_proj)
            out[f"{p}mlp.gate_proj.weight"] = gate_up[:inter].clone()
            out[f"{p}mlp.up_proj.weight"] = gate_up[inter:].clone()
            out[f"{p}mlp.down_proj.weight"] = dense(layer.mlp.down_proj)
            out[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight.detach().clone()
            out[f"{p}post_attention_layernorm.weight"] = \
                layer.post_attention_layernorm.weight.detach().clone()
        return out

    state = llm.apply_model(state_of)[0]
    layer0 = {k: v for k, v in state.items() if k.startswith("model.layers.0.")}
    one = {"model.layers.0.mlp.down_proj.weight": state["model.layers.0.mlp.down_proj.weight"]}
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    prompts = [[100 + i] * 8 for i in range(16)]

    def decode_step_ms() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params.replace(max_tokens=1), use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - t1 - (t1 - t0)) / 16 * 1e3

    runs = [("all tensors, first (GGUF blocks -> panels)", lambda: llm.update_weights(state), 1),
            ("all tensors", lambda: llm.update_weights(state), a.repeats),
            ("one layer's 9 tensors", lambda: llm.update_weights(layer0), a.repeats),
            ("one tensor (a down_proj)", lambda: llm.update_weights(one), a.repeats)]
    if checkpoint is not None:
        runs.append(("from disk (read + all tensors)",
                     lambda: llm.update_weights_from_disk(checkpoint), a.repeats))
    rows = []
    with tqdm(total=sum(r for _, _, r in runs) + 1, desc="weight updates", unit="run") as bar:
        step_ms = decode_step_ms()
        bar.update(1)
        for name, fn, repeats in runs:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                summary = fn()
                times.append(time.perf_counter() - t0)
                bar.update(1)
            rows.append({"update": name, "tensors": summary["tensors"],
                         "best_ms": min(times) * 1e3, "times_ms": [t * 1e3 for t in times],
                         "decode_steps": min(times) * 1e3 / step_ms})
    assert llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    print(f"{a.model} on {a.device}: best of {a.repeats}; one decode step of 16 sequences "
          f"{step_ms:.1f} ms")
    print(format_table(rows, [("update", "update", ""), ("tensors", "tensors", "d"),
                              ("best_ms", "best (ms)", ".1f"),
                              ("decode_steps", "= decode steps", ".1f")]))
    if a.json:
        write_json(a.json, {"machine": machine_info(), "args": vars(a),
                            "decode_step_ms": step_ms, "results": rows})
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
