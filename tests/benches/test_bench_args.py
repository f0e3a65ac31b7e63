"""Every bench refuses a bad command line with one line naming the option (argparse's exit code 2),
before it loads any model, never with a traceback or a silently different run.

The invocations run as subprocesses, all at once (a few at a time): most take well under a second,
the ones that import torch first a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_URL = "http://127.0.0.1:8340"      # never contacted: every case fails before

# (script, arguments, what the last line of stderr must name)
CASES = [
    ("serving.py", ["--base-url", BASE_URL, "--doors", "http,nosuch"], "'nosuch'"),
    ("serving.py", ["--servers", "ferrobatch", "--doors", "smoke"], "--doors"),
    ("serving.py", ["--base-url", BASE_URL, "--doors", "http,tcp"], "--doors tcp"),
    ("serving.py", ["--servers", "ferrobatch,nosuch"], "--servers"),
    ("serving.py", ["--base-url", BASE_URL, "--max-num-seqs", "8"], "--max-num-seqs"),
    ("serving.py", ["--servers", "hf", "--num-prompts", "0"], "--num-prompts"),
    ("serving.py", ["--servers", "hf", "--num-prompts", "-1"], "--num-prompts"),
    ("serving.py", ["--servers", "hf", "--request-rates", "-1"], "--request-rates"),
    ("serving.py", ["--servers", "hf", "--request-rates", "1,abc"], "--request-rates"),
    ("throughput.py", ["--num-requests", "-3"], "--num-requests"),
    ("kquant_gguf.py", ["{tmp}/k.gguf", "--hidden", "1000"], "--hidden 1000"),
    ("q8g16_minimums.py", ["{tmp}/none.gguf"], "no such file"),
    ("q8g16_minimums.py", ["{tmp}/none.gguf", "--rows", "1,x"], "--rows"),
    ("half_panels.py", ["--rows", "1,x"], "--rows"),
    ("half_panels.py", ["--hf-dir", "{tmp}/notjson.json"], "not a directory"),
    ("gemma3.py", ["--hf-dir", "{tmp}/notjson.json"], "not a directory"),
    ("gemma3.py", ["--contexts", "0"], "--contexts"),
    ("gemma3.py", ["--shape", "huge"], "--shape"),
    ("kquant_gguf.py", ["{tmp}/k.gguf", "--layers", "0"], "--layers"),
    ("kquant_gguf.py", ["{tmp}/k.gguf", "--heads", "3"], "--heads 3"),
    ("load_memory.py", ["/nonexistent/model.gguf"], "no such model"),
    ("throughput.py", ["--workload", "smoke", "--num-requests", "1000"], "--num-requests"),
    ("throughput.py", ["--replot", "/nonexistent.json"], "--replot"),
    ("throughput.py", ["--replot", "{tmp}/serving.json"], "not a throughput result"),
    ("throughput.py", ["--systems", "ferrobatch@abc"], "ferrobatch@abc"),
    ("throughput.py", ["--systems", "ferrobatch@-1"], "ferrobatch@-1"),
    ("throughput.py", ["--systems", "nosuch"], "--systems"),
    ("throughput.py", ["--systems", "ferrobatch,ferrobatch-torchops"], "ferrobatch-torchops"),
    ("engine_overhead.py", ["--running", "-4"], "--running"),
    ("engine_overhead.py", ["--running", "abc"], "--running"),
    ("engine_overhead.py", ["--systems", "nosuch"], "--systems"),
    ("engine_overhead.py", ["--l1", "8", "--l2", "8"], "--l2"),
    ("speculative.py", ["--workloads", "nosuch"], "copy, edit, open"),
    ("speculative.py", ["--rounds", "-1"], "--rounds"),
    ("speculative.py", ["--drafts", "abc"], "--drafts"),
    ("speculative.py", ["--drafts", "3/0/16/often"], "--drafts"),
    ("speculative.py", ["--drafts", "17"], "num_speculative_tokens"),
    ("speculative.py", ["--concurrency", "0"], "--concurrency"),
    ("speculative.py", ["--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    ("guided.py", ["--requests", "-2"], "--requests"),
    ("guided.py", ["--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    ("scheduler_overhead.py", ["--cycles", "-1"], "--cycles"),
    ("scheduler_overhead.py", ["--running", "-5"], "--running"),
    ("scheduler_overhead.py", ["--running", "0"], "--running"),
    ("single_stream.py", ["--lengths", "-5"], "--lengths"),
    ("single_stream.py", ["--lengths", "abc"], "--lengths"),
    ("prefill_latency.py", ["--paths", "fused", "--lengths", "-1"], "--lengths"),
    ("prefill_latency.py", ["--paths", "nosuch"], "--paths"),
    ("report.py", ["{tmp}/notjson.json"], "notjson.json"),
    ("prefill_attention_cuda.py", ["--shapes", "llama3-8b,nosuch"], "--shapes"),
    ("prefill_attention_cuda.py", ["--reps", "0"], "--reps"),
    # these import torch before parsing their arguments (a few seconds each)
    ("model_forward.py", ["--iters", "-1"], "--iters"),
    ("model_forward.py", ["--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    ("step_breakdown.py", ["--rows", "-1"], "--rows"),
    ("cpu_kernels.py", ["--repeats", "-1", "--only", "linear"], "--repeats"),
    ("cpu_kernels.py", ["--block-rows", "-2", "--only", "blocks"], "--block-rows"),
    ("cpu_kernels.py", ["--block-rows", "abc"], "--block-rows"),
]


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case run once, a few at a time: index -> (return code, stderr)."""
    tmp = tmp_path_factory.mktemp("bench_args")
    (tmp / "notjson.json").write_text("not json\n")
    (tmp / "serving.json").write_text('{"workload": {"name": "smoke"}, "results": [{"request_rate": 1}]}')
    env = _env()

    def run(case):
        script, args, _ = case
        proc = subprocess.run(
            [sys.executable, str(REPO / "benches" / script), *(a.format(tmp=tmp) for a in args)],
            check=False, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        return proc.returncode, proc.stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(enumerate(pool.map(run, CASES)))


@pytest.mark.parametrize("i", range(len(CASES)),
                         ids=[f"{s.removesuffix('.py')}:{' '.join(a)}" for s, a, _ in CASES])
def test_bad_arguments_fail_fast_in_one_line(runs: dict, i: int) -> None:
    script, args, names = CASES[i]
    rc, stderr = runs[i]
    assert rc == 2, (rc, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: "), last
    assert names in last, last
