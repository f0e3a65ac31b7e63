"""`ferrobatch serve` with optional injected faults, for the process-level tests.

FB_FAULT_AT_EXECUTE=N: the model runner's N-th forward raises (engine-fatal).
FB_TINY=1: serve the 4-layer truncation of the model (harness.truncated_model), for speed. The fault wraps
the runner EngineCore.build creates (a real seam); the CLI itself runs unchanged."""

from __future__ import annotations

import os
import sys

from faults import RunnerProxy

from ferrobatch.cli import main
from ferrobatch.engine import core as core_mod

_build = core_mod.EngineCore.build.__func__


def _faulty_build(cls, config, loaded=None):
    if loaded is None and os.environ.get("FB_TINY"):
        import torch
        from harness import truncated_model

        from ferrobatch.model.loader import load_model
        loaded = truncated_model(load_model(config.model, device="cpu", dtype=torch.float32))
    core = _build(cls, config, loaded)
    at = os.environ.get("FB_FAULT_AT_EXECUTE")
    if at:
        core.runner = RunnerProxy(core.runner)
        core.runner.arm(int(at), RuntimeError("injected forward failure"))
    return core


core_mod.EngineCore.build = classmethod(_faulty_build)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
