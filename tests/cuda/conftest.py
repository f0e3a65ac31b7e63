"""The ``backend`` fixture of the CUDA glue tests: a CudaPagedBackend on the CPU whose ops are
``cuda_glue.FakeOps`` (the constructor needs a GPU; the glue does not)."""

from __future__ import annotations

import pytest
import torch
from cuda_glue import BLOCK_SIZE, FakeOps

from ferrobatch.runtime import cuda_ops
from ferrobatch.runtime.attention.cuda import CudaPagedBackend


@pytest.fixture
def backend(monkeypatch):
    fake = FakeOps()
    for name in ("reshape_and_cache", "paged_decode_attention", "paged_prefill_attention"):
        monkeypatch.setattr(cuda_ops, name, getattr(fake, name))
    be = object.__new__(CudaPagedBackend)
    be.block_size, be.max_splits, be.device, be.sm_count = BLOCK_SIZE, 32, torch.device("cpu"), 132
    be._workspaces, be._graph_workspaces_fixed, be._retired_workspaces = {}, False, []
    be.flash_prefill, be._flash_verdicts = False, {}   # on in test_flash_prefill_cpu.py
    be.flash_whole_steps, be._whole_step_verdicts = True, {}
    be.fused_reduce = False
    be.fake = fake
    return be
