"""benches/prefill_attention_cuda.py without a GPU: its steps and FLOP count, and a clean exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))

import prefill_attention_cuda as bench  # noqa: E402


@pytest.mark.parametrize("tokens", [8192, 300, 2])
def test_steps_fit_the_budget_and_have_prefill_rows(tokens):
    rng = np.random.default_rng(0)
    lens, qlens = bench.step_lengths("fresh", tokens, 64, rng)
    assert lens == qlens and 0 < sum(qlens) <= max(tokens, 2) and min(qlens) >= 2
    lens, qlens = bench.step_lengths("mixed", tokens, 64, rng)
    assert qlens[:64] == [1] * 64 and all(q >= 2 for q in qlens[64:]) and len(qlens) > 64
    assert all(L >= q for L, q in zip(lens, qlens))
    assert bench.step_lengths("chunk", tokens, 64, rng) == ([8192], [2048])
    lens, qlens = bench.step_lengths("small", tokens, 64, rng)
    assert sum(q for q in qlens if q > 1) == 128 and all(L >= q for L, q in zip(lens, qlens))


def test_causal_flops_counts_the_keys_each_query_sees():
    # a fresh prompt of 3 tokens sees 1 + 2 + 3 keys; a chunk of 2 after 4 tokens sees 5 + 6
    flops = bench.causal_flops([3, 6, 9], [3, 2, 1], [0, 1], num_heads=2, head_dim=8)
    assert flops == 4 * 8 * 2 * (6 + 11)


def test_without_cuda_it_exits_with_a_message():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = subprocess.run([sys.executable, str(REPO / "benches/prefill_attention_cuda.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a CUDA device" in r.stderr
