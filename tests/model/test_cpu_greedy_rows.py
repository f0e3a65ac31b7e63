"""The CPU read of a greedy step's logits (``_scheduler.greedy_rows_f32``, ``cpu_greedy.rs``):
each row's first argmax and an exact finite flag in one pass, as torch computes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrobatch._scheduler import greedy_rows_f32


def _rows(logits: torch.Tensor, threads: int) -> np.ndarray:
    out = np.full((logits.shape[0], 2), -7, np.int64)
    greedy_rows_f32(logits.numpy(), out, threads)
    return out


@pytest.mark.parametrize("vocab", [1, 7, 97, 1000, 49152])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_rows_first_argmax_and_whether_it_is_finite(vocab, threads):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1] = 0.25                                   # every value tied: the first index
    x[2, vocab // 3] = x[2, (2 * vocab) // 3] = 40.0    # a tie for the maximum
    x[3, vocab // 2] = float("nan")
    x[4, vocab - 1] = float("inf")
    x[5, 0] = float("-inf")
    x[6] = 1e38                                   # finite, though the row's sum overflows
    x[7, vocab - 1] = 1e38                        # the maximum in the last column
    rows = _rows(x, threads)
    assert rows[:, 1].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    finite = rows[:, 1] == 1
    assert np.array_equal(rows[finite, 0], x[torch.from_numpy(finite)].argmax(-1).numpy())
    assert rows[1, 0] == 0 and rows[2, 0] == vocab // 3 and rows[7, 0] == vocab - 1


def test_a_single_row_split_over_threads_keeps_the_lower_of_two_equal_maxima():
    # two threads split SmolLM2's 49,152 logits at 24,576
    for a, b in [(100, 30000), (24575, 24576), (0, 49151)]:
        x = torch.full((1, 49152), -2.0)
        x[0, a] = x[0, b] = 3.0
        assert _rows(x, 2).tolist() == [[a, 1]]


def test_bad_arrays_are_errors_not_crashes():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="out has shape"):
        greedy_rows_f32(x.numpy(), np.zeros((3, 2), np.int64), 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        greedy_rows_f32(x.numpy()[:, ::2], np.zeros((4, 2), np.int64), 1)
    with pytest.raises(TypeError):
        greedy_rows_f32(x.double().numpy(), np.zeros((4, 2), np.int64), 1)
    with pytest.raises(ValueError, match="empty"):
        greedy_rows_f32(np.zeros((4, 0), np.float32), np.zeros((4, 2), np.int64), 1)
    out = np.zeros((0, 2), np.int64)
    greedy_rows_f32(np.zeros((0, 5), np.float32), out, 2)     # no rows: nothing to do


def test_the_cpu_runner_reads_eager_steps_through_it(loaded_smollm2):
    from ferrobatch.runtime.model_runner import ModelRunner
    from ferrobatch.runtime.sampler import greedy_rows

    runner = ModelRunner(loaded_smollm2, num_blocks=16, block_size=16)
    assert runner.rust_linears
    logits = torch.randn(3, loaded_smollm2.config.vocab_size)
    logits[1, 17] = float("nan")
    got = runner.greedy_rows(logits)
    assert got.dtype == torch.int64 and got[:, 1].tolist() == [1, 0, 1]
    want = greedy_rows(logits)
    assert torch.equal(got[[0, 2], 0], want[[0, 2], 0])
    assert runner.greedy_rows(logits.double()) is None      # not float32: the general path
