"""The whole engine with decode graphs (emulated on the CPU: each replay re-runs the forward on the
static buffers) against the same engine without: the scheduler's real batches — a batch that
shrinks through the buckets, prefix-cache hits, parallel sampling with copy-on-write block copies,
an abort mid-stream — give the same tokens and leave nothing behind."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from engine_support import REAL_ENGINE_OPTIONS

from ferrobatch.config import EngineConfig
from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.engine.core import EngineCore
from ferrobatch.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from lora_files import ATTN, MLP, write_peft_adapter  # noqa: E402

from ferrobatch.lora_request import LoRARequest  # noqa: E402

SHARED = "You are a careful assistant. Answer in one short sentence. Question: "
GREEDY = [(SHARED + "what is the capital of France?", 6), (SHARED + "why is the sky blue?", 30),
          ("def fibonacci(n):", 17), ("1, 2, 3, 4,", 11), ("Once upon a time", 24)]


async def _serve(loaded, graphs: bool, pieces: bool = False):
    config = EngineConfig(model="smollm2", **REAL_ENGINE_OPTIONS)
    core = await asyncio.to_thread(EngineCore.build, config, loaded)
    if graphs:
        # contexts up to 256 tokens (longer steps would run eagerly); max_num_seqs 64: buckets
        # 1, 2, 4, 8, 16, 24, 32, 48, 64
        core.runner.capture_decode_graphs(config.max_num_seqs, 256, emulate=True)
    if pieces:
        # prefill and mixed steps up to the step budget (512 tokens) through the pieces
        core.runner.capture_piecewise_graphs(config.max_num_batched_tokens, emulate=True)
    async with AsyncEngine(config, core=core) as engine:
        async def final(prompt, params):
            return [out async for out in engine.generate(prompt, params)][-1]

        async def aborted():
            deltas = []
            async for delta in engine.generate("Tell me a long story.", SamplingParams(
                    max_tokens=40, ignore_eos=True, output_kind="delta"), request_id="gone"):
                deltas.append(delta)
                if len(deltas) == 3:
                    engine.abort("gone")
            return deltas[-1]

        greedy = [final(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
                  for p, m in GREEDY]
        sampled = final("Name a colour:", SamplingParams(n=3, max_tokens=12, temperature=0.8,
                                                         seed=7, ignore_eos=True))
        outs = await asyncio.gather(*greedy, sampled, aborted())
        await engine.check_idle_clean()
        assert engine.stats()["num_used_blocks"] == 0
    runner = core.runner
    if pieces:
        assert runner.piecewise_steps > 0 and runner.eager_steps == 0
    # once the sampled request is done, the greedy ones' steps read back each row's argmax and
    # finite flag: computed inside the graph on graph steps, by the Rust kernel on eager ones
    assert core.plain_greedy_steps > 0, core.plain_greedy_steps
    return outs, runner.graph_steps, runner.eager_steps


async def test_engine_with_emulated_decode_graphs_matches_eager(loaded_smollm2):
    want, graph_steps, _ = await _serve(loaded_smollm2, graphs=False)
    got, graph_steps_g, eager_steps_g = await _serve(loaded_smollm2, graphs=True)
    assert graph_steps == 0 and graph_steps_g > 10 and eager_steps_g > 0
    for w, g in zip(want[:-1], got[:-1], strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert [o.text for o in g.outputs] == [o.text for o in w.outputs]
    assert len(got[len(GREEDY)].outputs) == 3
    assert got[-1].outputs[0].finish_reason == "abort" == want[-1].outputs[0].finish_reason


async def test_engine_with_emulated_piecewise_graphs_matches_eager(loaded_smollm2):
    """Decode graphs and piecewise graphs together (no step left eager), the same tokens."""
    want, _, _ = await _serve(loaded_smollm2, graphs=False)
    got, graph_steps, eager_steps = await _serve(loaded_smollm2, graphs=True, pieces=True)
    assert graph_steps > 10 and eager_steps == 0
    for w, g in zip(want[:-1], got[:-1], strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert [o.text for o in g.outputs] == [o.text for o in w.outputs]
    assert got[-1].outputs[0].finish_reason == "abort"


async def _serve_loras(loaded, loras: dict, graphs: bool):
    """Base and two adapters' requests, interleaved, in one engine (two slots)."""
    config = EngineConfig(model="smollm2", enable_lora=True, max_loras=2, **REAL_ENGINE_OPTIONS)
    core = await asyncio.to_thread(EngineCore.build, config, loaded)
    if graphs:
        core.runner.capture_decode_graphs(config.max_num_seqs, 256, emulate=True)
        core.runner.capture_piecewise_graphs(config.max_num_batched_tokens, emulate=True)
    async with AsyncEngine(config, core=core) as engine:
        async def final(prompt, lora):
            params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
            outs = [o async for o in engine.generate(prompt, params, lora_request=lora)]
            return outs[-1].outputs[0].token_ids

        runs = [(0, None), (0, "qv"), (0, "all"), (2, "all"), (2, None), (2, "qv")]
        tokens = await asyncio.gather(*(final(GREEDY[p][0], loras.get(n)) for p, n in runs))
        await engine.check_idle_clean()
        assert engine.loras.num_refs == 0
    return tokens, core.runner


async def test_lora_decode_graphs_match_eager_steps(loaded_smollm2, tmp_path):
    """The scheduler's real batches mixing base and adapter rows: with emulated decode and
    piecewise graphs the steps with adapter rows replay the LoRA ones (no step eager), and
    every request gets the tokens of the eager steps (which test_lora.py checks against
    transformers)."""
    cfg = loaded_smollm2.config
    loras = {}
    for i, (name, targets, r) in enumerate([("qv", ("q_proj", "v_proj"), 8),
                                            ("all", ATTN + MLP, 4)]):
        write_peft_adapter(str(tmp_path / name), cfg, targets=targets, r=r, alpha=2 * r,
                           seed=i + 1, b_std=0.1)
        loras[name] = LoRARequest(name, i + 1, str(tmp_path / name))
    want, eager = await _serve_loras(loaded_smollm2, loras, graphs=False)
    got, runner = await _serve_loras(loaded_smollm2, loras, graphs=True)
    assert eager.lora_graph_steps == 0 and runner.lora_graph_steps > 5
    assert runner.lora_piecewise_steps > 0 and runner.eager_steps == 0
    assert got == want
    for first in (0, 3):        # one prompt, three models: three answers
        assert len({tuple(t) for t in want[first:first + 3]}) == 3
