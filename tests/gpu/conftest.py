"""GPU test fixtures: skip the whole directory without CUDA; build/load the kernels once.

Run with ``pytest -m gpu`` (the default addopts deselect ``gpu``). A machine with CUDA but a broken
kernel build *fails* here (the error is the compiler's), it does not skip.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # paged_utils

torch = pytest.importorskip("torch")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def cuda_ops():
    """The loaded op wrappers module (JIT-builds the kernels on first use)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ferrobatch.runtime import cuda_ops as ops

    ops.load_ops()
    return ops


@pytest.fixture(autouse=True)
def _strict_fp32():
    """No TF32 in the references (their error must stay far below the kernels' tolerances)."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
