"""Keeps the benchmark harness from rotting: the offline throughput bench on the `smoke` workload
(4 short requests, a two-layer random model) through all four systems, in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHES = REPO / "benches"

pytest.importorskip("transformers")


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    return env


def _bench(script: str, *args: str, json_out: Path, timeout: int = 240) -> tuple[dict, str]:
    """Runs ``benches/<script> *args --json json_out`` in a subprocess; a non-zero exit fails
    the test with the tail of its output. Returns the JSON it wrote and its stdout."""
    proc = subprocess.run([sys.executable, str(BENCHES / script), *args, "--json", str(json_out)],
                          check=False, capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(json_out.read_text()), proc.stdout


def test_throughput_smoke(tmp_path: Path) -> None:
    data, stdout = _bench(
        "throughput.py", "--workload", "smoke", "--systems",
        "ferrobatch,ferrobatch-static,ferrobatch-eager,ferrobatch-nodraft,ferrobatch-kv8,"
        "ferrobatch-kvi8,hf-static,hf-continuous",
        "--plot", str(tmp_path / "occ.png"), "--no-progress", "--threads", "1",
        "--kv-cache-gb", "0.01", json_out=tmp_path / "smoke.json")
    rows = {r["system"]: r for r in data["results"]}
    assert set(rows) == {"ferrobatch", "ferrobatch-static", "ferrobatch-eager",
                         "ferrobatch-nodraft", "ferrobatch-kv8", "ferrobatch-kvi8", "hf-static",
                         "hf-continuous"}
    assert rows["ferrobatch-kv8"]["params"]["kv_cache_dtype"] == "fp8"
    assert rows["ferrobatch-kvi8"]["params"]["kv_cache_dtype"] == "int8"
    assert rows["ferrobatch"]["params"]["kv_cache_gb"] == 0.01
    assert data["workload"]["kv_cache_gb"] == 0.01
    assert rows["ferrobatch"]["decode_graph_steps"] == 0      # no CUDA graphs on the CPU
    assert rows["ferrobatch"]["piecewise_graph_steps"] == 0
    assert rows["ferrobatch-eager"]["params"]["cuda_graphs"] is False
    assert rows["ferrobatch-nodraft"]["params"]["num_speculative_tokens"] == 0
    assert rows["ferrobatch-nodraft"]["drafted_tokens"] == 0
    assert rows["ferrobatch"]["drafted_tokens"] >= rows["ferrobatch"]["accepted_drafts"]
    want = data["workload"]["output_tokens"]
    for r in rows.values():
        assert r["output_tokens"] == want
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
    # static batching decodes every batch to its longest request: waste is counted, not output
    assert rows["hf-static"]["generated_tokens"] >= want
    assert "ratio of output_tokens_per_s" in stdout
    (ablation,) = data["ablation"]            # ferrobatch and ferrobatch-static at one cap
    assert ablation["cap"] == rows["ferrobatch"]["batch_cap"]
    assert ablation["measured"] == pytest.approx(rows["ferrobatch"]["output_tokens_per_s"]
                                                 / rows["ferrobatch-static"]["output_tokens_per_s"])
    assert ablation["step_bound"] == pytest.approx(
        rows["ferrobatch-static"]["ideal_decode_steps"] / rows["ferrobatch"]["ideal_decode_steps"])


def test_serving_metrics_follow_vllm_definitions() -> None:
    sys.path.insert(0, str(BENCHES))
    try:
        from serving import ReqResult, metrics
    finally:
        sys.path.remove(str(BENCHES))
    rs = [ReqResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                    itl=[0.1] * 4),
          ReqResult(ok=True, prompt_len=10, output_tokens=1, ttft=0.2, latency=0.2),
          ReqResult(ok=False, error="HTTP 500")]
    m = metrics(rs, duration=2.0, rate=1.0, max_inflight=2)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 6 and m["output_throughput"] == 3.0
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)   # (0.5 - 0.1) / (5 - 1), ms
    assert m["ttft_ms"]["median"] == pytest.approx(150.0)


def test_serving_runs_never_share_a_prompt_block() -> None:
    # a server's prefix cache must not answer one run (rate, door) from another run's blocks
    sys.path.insert(0, str(BENCHES))
    try:
        from workloads import WORKLOADS, build_requests, fresh_prompts
    finally:
        sys.path.remove(str(BENCHES))
    w = WORKLOADS["cpu-serve"]
    base = build_requests(w)
    runs = [fresh_prompts(base, w, k) for k in range(6)]
    assert runs[0] == base
    first_blocks = [{r.prompt_ids[:16] for r in run} for run in runs]
    for i in range(6):
        for j in range(i + 1, 6):
            assert not first_blocks[i] & first_blocks[j]
    for run in runs[1:]:
        assert [(len(r.prompt_ids), r.output_len) for r in run] == \
            [(len(r.prompt_ids), r.output_len) for r in base]
        assert all(100 <= t < w.vocab_size for r in run for t in r.prompt_ids)


def test_engine_overhead_smoke(tmp_path: Path) -> None:
    data, _ = _bench(
        "engine_overhead.py", "--running", "4",
        "--systems", "ferrobatch-stub,ferrobatch-stub-stream,ferrobatch-1layer,hf-cb-1layer",
        "--l1", "2", "--l2", "6",
        "--repeat", "2", "--threads", "1",
        json_out=tmp_path / "overhead.json")
    rows = {r["system"]: r for r in data["results"]}
    assert set(rows) == {"ferrobatch-stub", "ferrobatch-stub-stream", "ferrobatch-1layer",
                         "hf-cb-1layer"}
    for r in rows.values():
        assert len(r["t_short_all_s"]) == len(r["t_long_all_s"]) == 2
        assert r["running"] == 4 and r["t_short_s"] > 0 and r["t_long_s"] > 0
        # the per-step figure is a difference of two short runs (4 steps apart here): on a busy
        # machine noise can exceed it, so the smoke run checks it is a number, not its sign
        assert math.isfinite(r["us_per_step"])
        assert (r["steps_per_s"] is None) == (r["us_per_step"] <= 0)
    assert rows["ferrobatch-stub"]["core_timed_steps"] > 0


def test_speculative_bench_smoke(tmp_path: Path) -> None:
    """The speculative-decoding bench on the real SmolLM2, shortened: it exits non-zero when a
    drafting engine's greedy tokens differ from the plain engine's."""
    data, _ = _bench(
        "speculative.py", "--rounds", "1", "--max-tokens", "12",
        "--drafts", "3,3/0/16/fixed", "--concurrency", "1", "--workloads", "copy",
        json_out=tmp_path / "spec.json", timeout=300)
    rows = {r["setting"]: r for r in data["results"]}
    assert set(rows) == {"0", "3", "3/0/16/fixed"}
    assert rows["0"]["drafted"] == 0 and rows["3"]["drafted"] > 0
    assert rows["3/0/16/fixed"]["drafted"] > 0
    assert all(r["identical_to_off"] for r in rows.values())


def test_single_stream_bench_smoke(tmp_path: Path) -> None:
    """The single-stream decode bench on the real SmolLM2, shortened: one length, a few tokens."""
    data, _ = _bench(
        "single_stream.py", "--lengths", "40", "--tokens", "4",
        "--repeat", "1",
        json_out=tmp_path / "single.json", timeout=300)
    (row,) = data["results"]
    assert row["prompt_tokens"] == 40 and len(row["samples_ms"]) == 1
    assert row["ms_per_token"] > 0
    assert row["ms_per_token"] == pytest.approx(row["samples_ms"][0], abs=0.01)


def test_sampler_bench_smoke(tmp_path: Path) -> None:
    """The sampler bench on the real SmolLM2, shortened: both draws timed on captured logits,
    their tokens compared, the engine run both ways."""
    data, out = _bench("sampler.py", "--rows", "1,2", "--repeats", "1", "--requests", "2",
                       "--tokens", "3", "--rounds", "1", json_out=tmp_path / "sampler.json",
                       timeout=300)
    alone = data["sampler_alone"]
    assert {r["rows"] for r in alone} == {1, 2} and len(alone) == 2 * 9
    assert all(r["torch_ms"] > 0 and r["rust_ms"] > 0 and 0 <= r["same_token_fraction"] <= 1
               for r in alone)
    assert [r["sampler"] for r in data["engine"]] == ["torch", "rust"] * 2
    assert all(r["output_tokens"] == 2 * 3 for r in data["engine"])
    assert len(data["engine_ratios"]) == 2
    assert "out tok/s" in out


def test_step_breakdown_smoke(tmp_path: Path) -> None:
    # every part of the step took time, they fit within the step, the ceilings were measured
    data, _ = _bench(
        "step_breakdown.py", "--rows", "1,2", "--context", "40",
        "--repeats", "2",
        json_out=tmp_path / "breakdown.json")
    assert data["gemm_gflops"] > 0 and data["read_gb_per_s"] > 0
    assert data["kv_cache_dtype"] == "float32"      # the model's, without --kv-cache-dtype
    assert [r["rows"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        parts = [r[f"{p}_ms"] for p in ("linears", "attention", "other", "lm_head")]
        assert all(p > 0 for p in parts), r
        # the decoder's phases are timed inside the step they are part of (with 2 repeats the
        # medians are means, so the per-sample bound holds for them too); the ratios against
        # the untimed step are the bench's to report, not a unit test's on a noisy machine
        inside = r["linears_ms"] + r["attention_ms"] + r["other_ms"]
        assert inside <= r["step_timed_ms"] * (1 + 1e-9), r
        assert r["kv_mb"] == pytest.approx(2 * r["rows"] * 40 * 3 * 64 * 4 * 30 / 2**20)


def test_build_ab_smoke(tmp_path: Path) -> None:
    # the same build as both arms (a copy of it, so the OS loads it twice): the base build's
    # decoder layers must load, run, and give this build's logits bit for bit
    import shutil

    from ferrobatch import _scheduler

    base = tmp_path / "base" / Path(_scheduler.__file__).name
    base.parent.mkdir()
    shutil.copy(_scheduler.__file__, base)
    data, _ = _bench(
        "build_ab.py", "--base-so", str(base), "--mode", "step",
        "--rows", "1,2", "--context", "40", "--rounds", "2", "--num-blocks", "64",
        json_out=tmp_path / "ab.json")
    assert [r["rows"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert r["base_ms"] > 0 and r["this_ms"] > 0, r
        assert r["logits_max_rel_diff"] == 0.0 and r["same_argmax"], r
    # --control: the same runs against a second copy of this build, and the ratio of the two
    data, _ = _bench(
        "build_ab.py", "--base-so", str(base), "--mode", "step", "--control",
        "--rows", "1", "--context", "40", "--rounds", "2", "--num-blocks", "64",
        json_out=tmp_path / "ab_control.json")
    [r] = data["results"]
    assert r["control_speedup"] > 0 and r["logits_max_rel_diff"] == 0.0, r
    assert r["net_speedup"] == pytest.approx(r["speedup"] / r["control_speedup"]), r
    # over an int8 cache; and the attention kernel alone over each cache dtype
    data, _ = _bench(
        "build_ab.py", "--base-so", str(base), "--mode", "step", "--kv-cache-dtype", "int8",
        "--rows", "2", "--context", "40", "--rounds", "2", "--num-blocks", "64",
        json_out=tmp_path / "ab_int8.json")
    [r] = data["results"]
    assert r["kv_cache_dtype"] == "int8" and r["logits_max_rel_diff"] == 0.0, r
    data, _ = _bench(
        "build_ab.py", "--base-so", str(base), "--mode", "attention", "--rows", "3",
        "--contexts", "40", "--rounds", "2", json_out=tmp_path / "ab_attention.json")
    assert [r["kv_dtype"] for r in data["results"]] == ["float32", "float16", "fp8", "int8"]
    for r in data["results"]:
        assert r["base_ms"] > 0 and r["this_ms"] > 0 and r["out_max_abs_diff"] == 0.0, r


def test_one_row_linear_smoke(tmp_path: Path) -> None:
    # a copy of this build as the base: both settings time both arms, the outputs agree bit
    # for bit, and the per-weight figures follow from the times
    import shutil

    from ferrobatch import _scheduler

    base = tmp_path / "base" / Path(_scheduler.__file__).name
    base.parent.mkdir()
    shutil.copy(_scheduler.__file__, base)
    data, _ = _bench("one_row_linear.py", "--base-so", str(base), "--threads", "1",
                     "--rows", "1,2", "--rounds", "1", json_out=tmp_path / "one_row.json")
    assert [(r["rows"], r["setting"]) for r in data["results"]] == [
        (1, "in L2"), (1, "from DRAM"), (2, "in L2"), (2, "from DRAM")]
    for r in data["results"]:
        assert r["base_ms"] > 0 and r["this_ms"] > 0 and r["out_max_rel_diff"] == 0.0, r
        ratio = r["base_ps_per_weight_thread"] / r["this_ps_per_weight_thread"]
        assert ratio == pytest.approx(r["speedup"]), r


def test_q8g16_minimums_smoke(tmp_path: Path) -> None:
    # a small Q4_K_M-mix GGUF: its Q6_K layers (the output, every other v / down) packed with
    # and without minimums give the same outputs (the bench checks it) and both are timed
    gguf = tmp_path / "q4km.gguf"
    subprocess.run([sys.executable, str(BENCHES / "kquant_gguf.py"), str(gguf), "--hidden",
                    "256", "--intermediate", "512", "--layers", "2"], check=True, cwd=REPO,
                   env=_env(), capture_output=True, timeout=240)
    data, _ = _bench("q8g16_minimums.py", str(gguf), "--rows", "1,3", "--threads", "1",
                     "--rounds", "1", json_out=tmp_path / "q8g16.json")
    assert "lm_head" in data["layers"] and len(data["layers"]) >= 2
    assert data["mib"]["q8_s16"] == pytest.approx(data["mib"]["q8_g16"] * 640 / 768)
    assert [r["rows"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["with_minimums_ms"] > 0 and r["without_ms"] > 0, r
        assert r["speedup"] == pytest.approx(r["with_minimums_ms"] / r["without_ms"]), r


def test_half_panels_smoke(tmp_path: Path) -> None:
    # SmolLM2 saved in bfloat16: its linears as float32 and 16-bit panels give the same outputs
    # and the same greedy tokens (the bench checks both) and both are timed
    data, _ = _bench("half_panels.py", "--hf-dir", str(tmp_path / "bf16"), "--rows", "1,3",
                     "--rounds", "1", "--threads", "1", "--tokens", "2", "--repeat", "1",
                     json_out=tmp_path / "half.json", timeout=400)
    assert data["mib"]["bf16"] == pytest.approx(data["mib"]["float32"] / 2)
    assert [r["rows"] for r in data["layers"]] == [1, 3]
    for r in data["layers"]:
        assert r["speedup"] == pytest.approx(r["float32_ms"] / r["bf16_ms"]), r
    decode = data["decode"]
    assert decode["speedup"] == pytest.approx(decode["float32_ms_per_token"]
                                              / decode["bf16_ms_per_token"])


def test_gemma3_smoke(tmp_path: Path) -> None:
    # a tiny Gemma 3 saved in bfloat16: ferrobatch and transformers decode the same tokens, past
    # the window of 16, and both are timed
    data, _ = _bench("gemma3.py", "--shape", "tiny", "--hf-dir", str(tmp_path / "gemma3"),
                     "--contexts", "40", "--tokens", "4", "--repeat", "1", "--threads", "1",
                     json_out=tmp_path / "gemma3.json", timeout=400)
    (row,) = data["results"]
    assert row["context"] == 40 and row["same_tokens"] == "2/2", row
    assert row["speedup"] == pytest.approx(row["transformers_ms_per_token"]
                                           / row["ferrobatch_ms_per_token"])


def test_step_phases_smoke(tmp_path: Path) -> None:
    # the smoke workload on the CPU: every step was scheduled, run eagerly, sampled and updated
    # once (greedy rows and nothing else: their tokens read back in one pass, no sampler), the
    # phases add up within the run's wall time
    data, _ = _bench(
        "step_phases.py", "--workload", "smoke",
        json_out=tmp_path / "phases.json")
    phases = {p["phase"]: p for p in data["phases"]}
    steps = data["num_steps"]
    assert steps > 1 and data["output_tokens"] > 0
    for name in ("schedule", "model: eager", "greedy read-back", "update"):
        assert phases[name]["calls"] == steps and phases[name]["seconds"] > 0, phases[name]
    assert phases["sample"]["calls"] == phases["finite check"]["calls"] == 0
    assert phases["model: decode graph"]["calls"] == 0        # no CUDA graphs on the CPU
    assert phases["model: piecewise"]["calls"] == 0
    assert sum(p["seconds"] for p in data["phases"]) <= data["wall_s"] * (1 + 1e-9)


def test_gpu_kernel_profile_smoke(tmp_path: Path) -> None:
    # on the CPU: the steps are built and timed, and the profile lists aten ops with shares
    # that add up (the CUDA path's kernel records need the H200: benches/gpu_check.sh `profile`)
    data, _ = _bench(
        "gpu_kernel_profile.py", "--device", "cpu",
        "--context", "16", "--decode", "2", "--mixed", "1:9", "--iters", "1",
        json_out=tmp_path / "profile.json")
    steps = {r["step"]: r for r in data["results"]}
    assert set(steps) == {"decode B=2 ctx=16", "mixed 1 decode + 9-token prompt"}
    assert steps["decode B=2 ctx=16"]["num_tokens"] == 2
    assert steps["mixed 1 decode + 9-token prompt"]["num_tokens"] == 10
    for r in data["results"]:
        assert r["step_ms"] > 0 and r["top"], r
        assert sum(k["share"] for k in r["top"]) <= 1 + 1e-9
        assert all(k["calls"] >= 1 and k["us"] > 0 for k in r["top"])


def test_device_idle_smoke(tmp_path: Path) -> None:
    # the engine takes every greedy step's tokens from the emulated device's read-back (which
    # waits for the step): no launch comes before the previous step is done, so no gap is
    # negative, and each step lasts at least the device time
    data, _ = _bench(
        "device_idle.py", "--running", "4", "--tokens", "24",
        "--repeat", "1", "--device-ms", "1",
        json_out=tmp_path / "idle.json")
    rows = data["results"]
    assert {r["system"] for r in rows} == {"current", "switch-100us"}
    for r in rows:
        assert r["steps"] >= 10 and r["idle_us"] >= 0 and r["step_us"] >= 1000, r
        assert r["wakeup_us"] >= 0 and r["idle_us"] <= r["idle_p90_us"] + 1e-6


def test_embeddings_bench_smoke(tmp_path: Path) -> None:
    data, stdout = _bench(
        "embeddings.py", "--num", "3", "--min-len", "4",
        "--max-len", "20", "--repeat", "1", "--hf-batch", "2",
        json_out=tmp_path / "emb.json")
    assert [r["system"] for r in data["results"]] == ["ferrobatch", "hf"]
    assert all(r["embeddings_per_s"] > 0 for r in data["results"])
    assert data["max_abs_diff"] < 1e-4          # the same model's vectors, two ways
    assert "emb/s" in stdout


def test_lora_bench_smoke(tmp_path: Path) -> None:
    data, stdout = _bench(
        "lora.py", "--num", "3", "--max-tokens", "4",
        "--adapters", "2", "--rank", "4", "--rounds", "1",
        json_out=tmp_path / "lora.json")
    assert [r["system"] for r in data["results"]] == ["base", "lora-1", "lora-2",
                                                       "base-layered", "lora-2-layered"]
    assert all(r["output_tokens_per_s"] > 0 for r in data["results"])
    assert data["results"][0]["vs_base"] == 1.0 and "vs base" in stdout


def test_weight_update_bench_smoke(tmp_path: Path) -> None:
    data, stdout = _bench("weight_update.py", "--repeats", "1",
                          json_out=tmp_path / "weights.json")
    names = [r["update"] for r in data["results"]]
    assert names[0].startswith("all tensors, first") and names[-1].startswith("from disk")
    assert [r["tensors"] for r in data["results"]] == [272, 272, 9, 1, 272]
    assert all(r["best_ms"] > 0 for r in data["results"]) and data["decode_step_ms"] > 0
    assert "decode steps" in stdout
