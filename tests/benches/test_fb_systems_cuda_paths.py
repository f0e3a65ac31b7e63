"""What the throughput bench reports about a CUDA engine's optional paths (FlashAttention prefill,
fused elementwise kernels, rotary with the K/V write), read from the engine's runner; checked here on stand-in objects."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))

from fb_systems import FerrobatchRunner  # noqa: E402


def _runner(backend_name, flash_prefill=True, verdicts=None, fused=False, whole=True,
            rotary_write=True, fused_reduce=True):
    from ferrobatch.model.llama import RMSNorm
    from ferrobatch.runtime.cuda_elementwise import CudaRMSNorm

    norm = RMSNorm(8, 1e-5)
    model = nn.Sequential(CudaRMSNorm(norm) if fused else norm)
    backend = SimpleNamespace(name=backend_name, flash_prefill=flash_prefill,
                              flash_whole_steps=whole, _flash_verdicts=verdicts or {},
                              rotary_with_kv_write=rotary_write, fused_reduce=fused_reduce)
    fb = object.__new__(FerrobatchRunner)
    fb.engine = SimpleNamespace(_core=SimpleNamespace(
        runner=SimpleNamespace(attn_backend=backend, model=model)))
    return fb


@pytest.mark.parametrize("flash,verdicts,want", [
    (True, {("bf16",): True}, "on"), (True, {("bf16",): False}, "check failed"),
    (True, {}, "on, not used yet"), (False, {}, "off")])
def test_cuda_paths_report_flash_and_fused_ops(flash, verdicts, want):
    paths = _runner("cuda", flash, verdicts, fused=True)._cuda_paths()
    assert paths == {"flash_prefill": want, "flash_whole_steps": "on", "fused_elementwise": "on",
                     "rotary_with_kv_write": "on", "decode_fused_reduce": "on"}
    assert _runner("cuda", flash, verdicts)._cuda_paths()["fused_elementwise"] == "off"
    assert _runner("cuda", flash, verdicts, whole=False)._cuda_paths()["flash_whole_steps"] \
        == "off"
    assert _runner("cuda", flash, verdicts, rotary_write=False)._cuda_paths()[
        "rotary_with_kv_write"] == "off"
    assert _runner("cuda", flash, verdicts, fused_reduce=False)._cuda_paths()[
        "decode_fused_reduce"] == "off"


def test_no_cuda_paths_off_the_cuda_backend():
    assert _runner("cpu")._cuda_paths() == {}
    assert _runner("torch")._cuda_paths() == {}
