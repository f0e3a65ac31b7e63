"""EngineCore's plain-greedy read-back (``EngineCore._plain_greedy``): a greedy step with
nothing else to compute takes its tokens from ``ModelRunner.greedy_rows`` in one transfer, and
anything else (a non-finite row, a sampled or penalised row, a runner without the method) goes
the general way, where a non-finite row fails its request."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from step_builder import sampling_arrays  # noqa: E402

from ferrobatch.engine.core import EngineCore  # noqa: E402
from ferrobatch.runtime.sampler import RequestExtras, Sampler, greedy_rows  # noqa: E402


class _Runner:
    def __init__(self, rows):
        self.rows, self.calls = rows, 0

    def greedy_rows(self, logits):
        self.calls += 1
        return self.rows if self.rows is not None else None


def _core(runner):
    core = EngineCore.__new__(EngineCore)       # only what _plain_greedy reads
    core.runner, core.sampler, core.plain_greedy_steps = runner, Sampler(64, [3], "cpu"), 0
    return core


def test_finite_plain_greedy_rows_are_the_step_tokens():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    core = _core(_Runner(greedy_rows(logits)))
    got = core._plain_greedy(SimpleNamespace(**sampling_arrays(5)), {}, logits)
    assert got.dtype == np.int32 and got.tolist() == logits.argmax(-1).tolist()
    assert core.plain_greedy_steps == 1


def test_a_non_finite_row_or_a_missing_read_back_takes_the_general_path():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[1, 4] = float("nan")
    batch = SimpleNamespace(**sampling_arrays(3))
    assert _core(_Runner(greedy_rows(logits)))._plain_greedy(batch, {}, logits) is None
    assert _core(_Runner(None))._plain_greedy(batch, {}, logits) is None
    assert _core(SimpleNamespace())._plain_greedy(batch, {}, logits) is None


def test_steps_that_are_not_plain_greedy_never_ask_the_runner():
    logits = torch.randn(2, 64)
    runner = _Runner(greedy_rows(logits))
    core = _core(runner)
    assert core._plain_greedy(SimpleNamespace(**sampling_arrays(2, temperature=[0, 1])), {},
                              logits) is None
    assert core._plain_greedy(SimpleNamespace(**sampling_arrays(2)),
                              {0: RequestExtras(logprobs=2)}, logits) is None
    assert runner.calls == 0 and core.plain_greedy_steps == 0
