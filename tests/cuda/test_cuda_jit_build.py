"""The full JIT path without a GPU: torch.utils.cpp_extension.load compiles, links and loads the
kernels for sm_90 and registers the ops with their schemas. Slow (minutes of nvcc): ``-m slow``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

SCHEMAS = {
    "reshape_and_cache": "ferrobatch::reshape_and_cache(Tensor key, Tensor value, "
                         "Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
    "paged_decode_attention": "ferrobatch::paged_decode_attention(Tensor(a!) out, Tensor q, "
                              "Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
                              "Tensor(b!) partial_out, Tensor(c!) partial_lse, float scale, "
                              "int num_splits, Tensor(d!)? split_counters=None) -> ()",
    "paged_prefill_attention": "ferrobatch::paged_prefill_attention(Tensor(a!) out, Tensor q, "
                               "Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
                               "Tensor query_start_loc, float scale, int max_query_len, "
                               "Tensor? seq_ids=None) -> ()",
    "rms_norm": "ferrobatch::rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()",
    "add_rms_norm": "ferrobatch::add_rms_norm(Tensor(a!) out, Tensor(b!) sum, Tensor x, "
                    "Tensor delta, Tensor weight, float eps) -> ()",
    "silu_and_mul": "ferrobatch::silu_and_mul(Tensor(a!) out, Tensor x) -> ()",
    "rotary_inplace": "ferrobatch::rotary_inplace(Tensor(a!) q, Tensor(b!) k, Tensor cos, "
                      "Tensor sin) -> ()",
    "rotary_and_cache": "ferrobatch::rotary_and_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, "
                        "Tensor cos, Tensor sin, Tensor(c!) kv_cache, Tensor slot_mapping) -> ()",
}


def test_jit_build_and_load_for_sm90(tmp_path):
    from ferrobatch.runtime import cuda_ops

    if not torch.version.cuda:
        pytest.skip("CPU-only torch build")
    if cuda_ops.find_cuda_toolkit() is None:
        pytest.skip("no nvcc")
    if shutil.which("ninja") is None:
        pytest.skip("torch.utils.cpp_extension.load needs ninja on PATH")
    code = (
        "import torch; from ferrobatch.runtime import cuda_ops as o; o.build_and_load('90'); "
        "print('\\n'.join(str(getattr(torch.ops.ferrobatch, n).default._schema) for n in "
        f"{list(SCHEMAS)!r}))"
    )
    env = {"FERROBATCH_CACHE_DIR": str(tmp_path), "MAX_JOBS": "2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, **env}, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-len(SCHEMAS):] == list(SCHEMAS.values())
