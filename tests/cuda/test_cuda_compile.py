"""CI compile check of the CUDA kernels, without a GPU.

Compiles every ``cuda/*.cu`` to an sm_90 object (``nvcc -c``) and ``cuda/ops.cpp`` with the host
compiler, using torch's headers and the nvcc shipped on PyPI (``nvidia-cuda-nvcc``, which must match
the installed torch's CUDA major.minor; it is in the ``test`` extra). This catches syntax, type and
template errors, and runs ptxas, so register spills are caught too — before any GPU session.

Nothing is linked or run; kernels' numerics are checked by ``pytest -m gpu`` on a GPU machine.
Skipped (with the reason) only when no nvcc can be found at all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "cuda"

sys.path.insert(0, str(ROOT / "python"))
from ferrobatch.runtime import cuda_ops  # noqa: E402  (after the path insert)


def _toolkit():
    tk = cuda_ops.find_cuda_toolkit()
    if tk is None:
        pytest.skip(
            "no nvcc found (install the test extra: nvidia-cuda-nvcc matching torch "
            f"{torch.__version__} / CUDA {torch.version.cuda}, or set CUDA_HOME)"
        )
    return tk


def _compile_one(cmd: list[str]) -> tuple[list[str], int, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    return cmd, proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile all sources once (in parallel); returns {source name: (rc, log)}."""
    if not torch.version.cuda:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build: no CUDA headers to compile against")
    tk = _toolkit()
    out = tmp_path_factory.mktemp("cuda_objs")
    cmds = {}
    for src in sorted(CUDA_DIR.glob("*.cu")):
        cmds[src.name] = cuda_ops.nvcc_compile_command(tk, src, out / (src.stem + ".o"), arch="90")
    for src in sorted(CUDA_DIR.glob("*.cpp")):
        cmds[src.name] = cuda_ops.host_compile_command(tk, src, out / (src.stem + ".o"))
    jobs = max(1, min(len(cmds), os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        results = dict(zip(cmds, pool.map(_compile_one, cmds.values())))
    return {name: (rc, log) for name, (_cmd, rc, log) in results.items()}


# The parallel nvcc run happens inside the first test that uses the fixture; on a loaded 2-core
# machine it can take several minutes, more than the suite's default per-test timeout.
pytestmark = pytest.mark.timeout(1500)


def test_sources_present():
    names = {p.name for p in CUDA_DIR.iterdir()}
    for required in ("ops.cpp", "ops.h", "common.cuh", "reshape_and_cache.cu",
                     "decode_attention.cuh", "decode_attention.cu", "decode_attention_bf16.cu",
                     "decode_attention_fp16.cu", "decode_attention_fp32.cu",
                     "prefill_attention.cu", "elementwise.cu"):
        assert required in names, f"cuda/{required} missing"


def test_nvcc_matches_torch_cuda():
    tk = _toolkit()
    assert tk.version is not None, f"could not read the version of {tk.nvcc}"
    if torch.version.cuda:
        want = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
        assert tk.version[0] == want[0], (
            f"nvcc {tk.version} vs torch CUDA {torch.version.cuda}: major versions must match")


@pytest.mark.parametrize("name", sorted(p.name for p in CUDA_DIR.glob("*.c[pu]*") if p.suffix in (".cu", ".cpp")))
def test_compiles_for_sm90(compiled, name):
    rc, log = compiled[name]
    assert rc == 0, f"compiling cuda/{name} failed:\n{log[-6000:]}"
    # ptxas -v is on: a spill to local memory is a performance bug in these kernels.
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert all(int(s) == 0 for s in spills), f"register spills in cuda/{name}:\n{log[-6000:]}"
