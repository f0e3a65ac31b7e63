"""Loader and typed wrappers for ferrobatch's CUDA kernels (``torch.ops.ferrobatch.*``).

The kernels are compiled on first use with ``torch.utils.cpp_extension.load`` from the sources that
ship inside the package (``ferrobatch/_cuda_src`` in a wheel, ``<repo>/cuda`` in a source checkout),
for the device's own architecture (``-arch=sm_90`` on Hopper), with ``-O3 --use_fast_math``. The
build is cached under ``~/.cache/ferrobatch/torch_extensions/<torch>-<cuda>-sm<arch>-<hash>``
(override with ``FERROBATCH_CACHE_DIR``), keyed by a hash of the sources, so later processes only
load the shared library.

All wrappers are thin: they allocate only outputs/workspaces the caller did not pass (and callers
that capture CUDA graphs pass them all), never synchronize, and run on the current stream.

The same module also builds the nvcc command lines that the CI compile check
(``tests/cuda/test_cuda_compile.py``) runs without a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The decode kernels are compiled one dtype per file so that the build runs them in parallel.
SOURCE_FILES = ("ops.cpp", "reshape_and_cache.cu", "decode_attention.cu", "decode_attention_bf16.cu",
                "decode_attention_fp16.cu", "decode_attention_fp32.cu", "prefill_attention.cu",
                "elementwise.cu")
HEADER_FILES = ("ops.h", "common.cuh", "decode_attention.cuh")
EXTENSION_NAME = "ferrobatch_cuda_ops"
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_GQA_RATIO = 8


# --------------------------------------------------------------------------------------------
# Locating sources and the CUDA toolkit
# --------------------------------------------------------------------------------------------

def cuda_source_dir() -> Path:
    """Directory holding the kernel sources: in the installed package, else the repo's ``cuda/``."""
    here = Path(__file__).resolve()
    candidates = [here.parent.parent / "_cuda_src",  # wheel layout (see pyproject [tool.maturin])
                  here.parents[3] / "cuda"]           # source checkout: <repo>/python/ferrobatch/runtime
    for cand in candidates:
        if all((cand / f).is_file() for f in SOURCE_FILES + HEADER_FILES):
            return cand
    raise FileNotFoundError(
        "ferrobatch CUDA sources not found (looked in " + ", ".join(map(str, candidates)) + ")")


@dataclass(frozen=True)
class CudaToolkit:
    """An nvcc plus the include directories that hold the CUDA runtime headers."""

    home: Path
    nvcc: Path
    version: tuple[int, int] | None
    include_dirs: tuple[Path, ...] = field(default_factory=tuple)


def _nvcc_version(nvcc: Path) -> tuple[int, int] | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _pip_cuda_homes() -> list[Path]:
    """CUDA roots installed from PyPI: ``nvidia/cu13`` (CUDA 13 wheels) or ``nvidia/cuda_nvcc``."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    homes = []
    for base in spec.submodule_search_locations:
        for sub in ("cu13", "cu12", "cuda_nvcc"):
            homes.append(Path(base) / sub)
    return homes


def find_cuda_toolkit() -> CudaToolkit | None:
    """First usable nvcc: $CUDA_HOME/$CUDA_PATH, torch's CUDA_HOME, the PyPI nvcc, PATH, /usr/local/cuda."""
    homes: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            homes.append(Path(os.environ[var]))
    try:
        from torch.utils import cpp_extension
        if cpp_extension.CUDA_HOME:
            homes.append(Path(cpp_extension.CUDA_HOME))
    except Exception as exc:  # noqa: BLE001 - torch builds without cpp_extension support
        logger.debug("torch.utils.cpp_extension unavailable: %s", exc)
    homes += _pip_cuda_homes()
    which = shutil.which("nvcc")
    if which:
        homes.append(Path(which).resolve().parent.parent)
    homes.append(Path("/usr/local/cuda"))
    seen = set()
    for home in homes:
        nvcc = home / "bin" / "nvcc"
        if home in seen or not nvcc.is_file() or not os.access(nvcc, os.X_OK):
            continue
        seen.add(home)
        includes = [home / "include"]
        if home.parent.name == "nvidia":  # PyPI layout: runtime headers may sit in sibling packages
            includes += [home.parent / "cuda_runtime" / "include", home.parent / "cu13" / "include"]
        includes = [d for d in dict.fromkeys(includes) if d.is_dir()]
        if not any((d / "cuda_runtime.h").is_file() for d in includes):
            continue
        return CudaToolkit(home=home, nvcc=nvcc, version=_nvcc_version(nvcc),
                           include_dirs=tuple(includes))
    return None


# --------------------------------------------------------------------------------------------
# Compiler flags (shared by the JIT build and the CI compile check)
# --------------------------------------------------------------------------------------------

def nvcc_flags(arch: str) -> list[str]:
    """Our flags on top of torch's: one real architecture (sm_90 on Hopper), fast math, ptxas report.

    ``arch`` is a compute capability without the dot (``"90"``). We compile machine code for exactly
    that architecture: an unnamed target would embed older SASS + PTX and use no Hopper features.
    """
    return [
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-O3",
        "--use_fast_math",
        "-lineinfo",
        "-Xptxas=-v",
        "--expt-relaxed-constexpr",
        "-DFERROBATCH_CUDA_ARCH=" + arch,
    ]


def _torch_include_dirs() -> list[str]:
    from torch.utils import cpp_extension
    root = Path(torch.__file__).resolve().parent / "include"
    dirs = [root, root / "torch" / "csrc" / "api" / "include"]
    return [str(d) for d in dirs if d.is_dir()] or list(cpp_extension.include_paths())


def _cxx_std() -> str:
    """C++ standard torch's headers need (ATen refuses C++17 from torch 2.10 on)."""
    hdr = Path(torch.__file__).resolve().parent / "include" / "ATen" / "ATen.h"
    try:
        if "C++20" in hdr.read_text(errors="ignore")[:2000]:
            return "c++20"
    except OSError:
        pass
    return "c++17"


def _torch_nvcc_common_flags() -> list[str]:
    from torch.utils import cpp_extension
    return [f for f in getattr(cpp_extension, "COMMON_NVCC_FLAGS", []) if f]


def nvcc_compile_command(tk: CudaToolkit, src: Path, obj: Path, arch: str = "90") -> list[str]:
    """``nvcc -c`` of one .cu with torch's headers (what the JIT build does, minus linking)."""
    import sysconfig
    cmd = [str(tk.nvcc), "-c", str(src), "-o", str(obj), f"-std={_cxx_std()}",
           "-Xcompiler", "-fPIC", "-DTORCH_EXTENSION_NAME=" + EXTENSION_NAME,
           "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch.compiled_with_cxx11_abi()))]
    cmd += _torch_nvcc_common_flags() + nvcc_flags(arch)
    for inc in [*_torch_include_dirs(), *map(str, tk.include_dirs), sysconfig.get_paths()["include"]]:
        cmd += ["-I", inc]
    return cmd


def host_compile_command(tk: CudaToolkit, src: Path, obj: Path) -> list[str]:
    """Host compiler ``-c`` of one .cpp (op registration) with torch's and CUDA's headers."""
    import sysconfig
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    cmd = [cxx, "-c", str(src), "-o", str(obj), f"-std={_cxx_std()}", "-O2", "-fPIC",
           "-DTORCH_EXTENSION_NAME=" + EXTENSION_NAME,
           "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch.compiled_with_cxx11_abi()))]
    for inc in [*_torch_include_dirs(), *map(str, tk.include_dirs), sysconfig.get_paths()["include"]]:
        cmd += ["-I", inc]
    return cmd


# --------------------------------------------------------------------------------------------
# JIT build + load
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[str, str] = {}  # arch -> shared library path


def _sources_digest(src_dir: Path) -> str:
    h = hashlib.sha256()
    for name in SOURCE_FILES + HEADER_FILES:
        h.update(name.encode())
        h.update((src_dir / name).read_bytes())
    return h.hexdigest()[:12]


def build_dir_for(arch: str, src_dir: Path) -> Path:
    root = Path(os.environ.get("FERROBATCH_CACHE_DIR", Path.home() / ".cache" / "ferrobatch"))
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{arch}-{_sources_digest(src_dir)}"
    return root / "torch_extensions" / tag


def device_arch(device: torch.device | int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def ops_loaded() -> bool:
    """Whether ``torch.ops.ferrobatch`` ops are registered in this process."""
    try:
        return hasattr(torch.ops.ferrobatch, "paged_decode_attention")
    except (AttributeError, RuntimeError):
        return False


def load_ops(device: torch.device | int | None = None, verbose: bool = False) -> str:
    """Compiles (first time) and loads the kernels for ``device``'s architecture; returns the .so path.

    Raises RuntimeError with the reason when CUDA, nvcc or the sources are missing or the build fails.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available in this torch build / on this machine")
    return build_and_load(device_arch(device), verbose=verbose)


def _cudart_link_flags(tk: CudaToolkit, build_dir: Path) -> list[str]:
    """Link flags for a PyPI-layout toolkit (``lib/`` with only ``libcudart.so.<major>``, no
    ``lib64/``): torch links ``-L$CUDA_HOME/lib64 -lcudart``, so point -L at a folder holding an
    unversioned ``libcudart.so`` link. System toolkits need nothing."""
    if (tk.home / "lib64" / "libcudart.so").exists():
        return []
    candidates = sorted((tk.home / "lib").glob("libcudart.so*"))
    if not candidates:
        return []
    link_dir = build_dir / "cudart_link"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / "libcudart.so"
    if not link.exists():
        link.symlink_to(candidates[-1])
    return [f"-L{link_dir}", f"-Wl,-rpath,{candidates[-1].parent}"]


class BuildProgress:
    """Logs, every ``interval_s`` while the JIT build runs, how many of its object files exist
    (ninja writes each when its compile finishes), so a first start is visibly not hung."""

    def __init__(self, build_dir: Path, num_objects: int, interval_s: float = 20.0) -> None:
        self.build_dir, self.num_objects, self.interval_s = build_dir, num_objects, interval_s
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cuda-build-progress", daemon=True)
        self._thread.start()

    def message(self) -> str:
        done = sum(1 for _ in self.build_dir.glob("*.o"))
        return (f"compiling CUDA kernels: {min(done, self.num_objects)}/{self.num_objects} files "
                f"done, {time.monotonic() - self.t0:.0f} s")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            logger.warning(self.message())

    def stop(self, ok: bool = True) -> None:
        self._stop.set()
        self._thread.join()
        logger.info("%s (%s)", self.message(), "finished" if ok else "failed")


def _put_ninja_on_path() -> None:
    """torch's JIT build runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) installs the
    binary next to the interpreter, or under the install target's bin/ with ``pip --target``,
    neither always on PATH. Prepend its directory when PATH has no ninja."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return     # torch's own error says to install it
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_and_load(arch: str, verbose: bool = False) -> str:
    """Builds the extension for compute capability ``arch`` (e.g. ``"90"``) and loads it into this
    process (registering ``torch.ops.ferrobatch.*``). Needs nvcc and ninja, not a GPU."""
    with _lock:
        if arch in _loaded:
            return _loaded[arch]
        if _loaded:  # one process, one library: the ops are registered once
            return next(iter(_loaded.values()))
        from torch.utils import cpp_extension
        tk = find_cuda_toolkit()
        if tk is None:
            raise RuntimeError(
                "nvcc not found: set CUDA_HOME to a CUDA toolkit, or `pip install nvidia-cuda-nvcc` "
                f"matching torch's CUDA {torch.version.cuda}")
        _put_ninja_on_path()
        # torch reads CUDA_HOME at import; point it at the toolkit we found.
        cpp_extension.CUDA_HOME = str(tk.home)
        os.environ.setdefault("CUDA_HOME", str(tk.home))
        src_dir = cuda_source_dir()
        build_dir = build_dir_for(arch, src_dir)
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch adds its own -gencode flags from TORCH_CUDA_ARCH_LIST (default: all visible archs);
        # pin it so only our single target is built.
        saved_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{arch[:-1]}.{arch[-1]}"
        logger.info("building ferrobatch CUDA ops for sm_%s with %s (CUDA %s) in %s",
                    arch, tk.nvcc, tk.version, build_dir)
        first_build = not (build_dir / f"{EXTENSION_NAME}.so").exists()
        if first_build:
            logger.warning("compiling ferrobatch's CUDA kernels for sm_%s: first use only, a few "
                           "minutes (%d files in parallel); cached in %s", arch, len(SOURCE_FILES),
                           build_dir)
        progress = BuildProgress(build_dir, len(SOURCE_FILES)) if first_build else None
        built = False
        try:
            path = cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(src_dir / f) for f in SOURCE_FILES],
                extra_cflags=["-O3"],
                extra_cuda_cflags=[f for f in nvcc_flags(arch) if not f.startswith("-gencode")],
                extra_include_paths=[str(src_dir), *map(str, tk.include_dirs)],
                extra_ldflags=_cudart_link_flags(tk, build_dir),
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
            built = True
        except Exception as exc:
            raise RuntimeError(f"building ferrobatch CUDA ops failed: {exc}") from exc
        finally:
            if progress is not None:
                progress.stop(ok=built)
            if saved_arch_list is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch_list
        path = str(path) if path is not None else str(build_dir / f"{EXTENSION_NAME}.so")
        if not ops_loaded():
            torch.ops.load_library(path)
        _loaded[arch] = path
        return path


# --------------------------------------------------------------------------------------------
# Typed wrappers
# --------------------------------------------------------------------------------------------

def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Writes ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` (-1 = skip)."""
    torch.ops.ferrobatch.reshape_and_cache(key, value, kv_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` of ``x [..., H]`` in one kernel."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.ferrobatch.rms_norm(out.view(-1, x.shape[-1]), x.reshape(-1, x.shape[-1]), weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + delta`` rounded to the dtype, in one kernel
    (``x``, ``delta`` ``[..., H]``)."""
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.ferrobatch.add_rms_norm(out.view(-1, hidden), total.view(-1, hidden),
                                      x.reshape(-1, hidden), delta.reshape(-1, hidden), weight,
                                      eps)
    return total, out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` of ``x [..., 2I]`` in one kernel."""
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    torch.ops.ferrobatch.silu_and_mul(out.view(-1, inter), x.reshape(-1, x.shape[-1]))
    return out


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place by ``cos`` / ``sin`` ``[T, D]``."""
    torch.ops.ferrobatch.rotary_inplace(q, k, cos, sin)


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``rotary_inplace(q, k, cos, sin)`` then ``reshape_and_cache(k, v, kv_cache, slot_mapping)``
    in one kernel (one dtype for q, k, v, cos, sin and the cache; slot -1 skips a row)."""
    torch.ops.ferrobatch.rotary_and_cache(q, k, v, cos, sin, kv_cache, slot_mapping)


def num_sms(device: torch.device | int | None = None) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Mirror of the kernel's per-sequence partition (decode_chunk() in cuda/decode_attention.cuh).
DECODE_MIN_CHUNK = 128
DECODE_CHUNK_ALIGN = 64


def decode_chunk(seq_len: int, num_splits: int) -> int:
    """Tokens per KV split for a sequence of ``seq_len`` (same formula as the kernel)."""
    c = max(-(-max(seq_len, 1) // num_splits), DECODE_MIN_CHUNK)
    return -(-c // DECODE_CHUNK_ALIGN) * DECODE_CHUNK_ALIGN


# Per-CTA fixed cost of the decode kernel in token-equivalents (loading the queries, walking the
# block table, writing the partial outputs): fitted to a split-count sweep on the H200
# (benches/results/gpu-2026-12-04/decode_splits_sweep.json, 40 shapes x 10 split counts).
DECODE_CTA_OVERHEAD_TOKENS = 256


@functools.lru_cache(maxsize=4096)
def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int,
                      max_splits: int = 32, ctas_per_sm: int = 3) -> int:
    """KV splits per sequence for the decode kernel (1 = no split, no reduce pass).

    Models the kernel as ``ceil(ctas / slots)`` waves of CTAs that each stream one chunk plus a
    fixed per-CTA cost (``DECODE_CTA_OVERHEAD_TOKENS``), with ``slots = sm_count * ctas_per_sm``
    resident CTAs (3 per SM at the GP=4 kernels' 168 registers), and picks the split count with
    the least ``waves * (chunk + overhead)`` (+ 3 % and a little for the partial-output round trip
    and the reduce launch of a split). This fills the GPU at small batch and avoids splitting a
    batch that already fills it: on the H200 sweep its choice is within 2 % of the best measured
    split count on every shape (the model without the per-CTA cost chose up to 32 splits at batch
    128-256 and lost up to 37 %). Pure function of host ints, so a CUDA-graph capture can fix it
    per batch bucket from an upper bound of ``max_seq_len``; the kernel re-derives each sequence's
    actual chunks on the device. Memoized: an eager step asks once per layer (~20 us of Python
    a call, ~0.5 ms per 30-layer mixed step otherwise).
    """
    work_items = max(1, batch * num_kv_heads)
    slots = max(1, sm_count * ctas_per_sm)
    seq_len = max(1, max_seq_len)
    best, best_cost = 1, None
    for splits in range(1, max(1, max_splits) + 1):
        chunk = decode_chunk(seq_len, splits)
        used = -(-seq_len // chunk)
        if used < splits:  # the partition would leave splits empty: same as a smaller count
            continue
        waves = -(-(work_items * used) // slots)
        cost = waves * (chunk + DECODE_CTA_OVERHEAD_TOKENS)
        if splits > 1:
            cost = cost * 1.03 + 32
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


@dataclass
class DecodeWorkspace:
    """Split-KV workspace: fp32 partial outputs ``[B, Hq, S, D]`` and log2-sum-exps ``[B, Hq, S]``,
    and the fused reduce's arrival counters (int32 ``[B * Hq]``, zero; each launch leaves them
    zero)."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    split_counters: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> DecodeWorkspace:
        return cls(torch.empty(max_batch, num_heads, max_splits, head_dim, dtype=torch.float32,
                               device=device),
                   torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=device),
                   torch.zeros(max_batch * num_heads, dtype=torch.int32, device=device))

    @property
    def max_splits(self) -> int:
        return int(self.partial_out.shape[2])

    def fits(self, batch: int, num_heads: int, head_dim: int) -> bool:
        return (self.partial_out.shape[0] >= batch and self.partial_out.shape[1] == num_heads
                and self.partial_out.shape[3] == head_dim)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, num_splits: int,
                           workspace: DecodeWorkspace | None = None,
                           out: torch.Tensor | None = None,
                           fused_reduce: bool = False) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` (one token per sequence) over the paged cache.
    With ``num_splits > 1`` the splits are combined by a reduce pass (a second kernel) or, with
    ``fused_reduce``, by the last split to finish (the workspace's ``split_counters``)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    counters = None
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(q.shape[0], q.shape[1], q.shape[2], num_splits,
                                                 q.device)
        po, pl = workspace.partial_out, workspace.partial_lse
        counters = workspace.split_counters if fused_reduce else None
    else:
        # unused in direct mode (two tensors: the op's schema marks both as mutated)
        po, pl = out.new_empty(0, dtype=torch.float32), out.new_empty(0, dtype=torch.float32)
    torch.ops.ferrobatch.paged_decode_attention(out, q, kv_cache, block_tables, seq_lens, po, pl,
                                                float(scale), int(num_splits), counters)
    return out


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                            max_query_len: int, *, out: torch.Tensor | None = None,
                            seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the flat ``q [T, Hq, D]`` (variable-length chunks) over the paged cache.

    ``seq_ids`` (int32, optional) restricts the work to those sequences: only their rows of ``out``
    are written (``max_query_len`` is then the max over them)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.ferrobatch.paged_prefill_attention(out, q, kv_cache, block_tables, seq_lens,
                                                 query_start_loc, float(scale), int(max_query_len),
                                                 seq_ids)
    return out


def _main(argv: list[str] | None = None) -> int:
    """``python -m ferrobatch.runtime.cuda_ops [--build]``: print toolchain info; build the ops."""
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="compile and load the ops now")
    parser.add_argument("--arch", default=None,
                        help="build for this compute capability (e.g. 90) without needing a GPU")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    print("sources", cuda_source_dir())
    print("toolkit", find_cuda_toolkit())
    if args.build:
        path = (build_and_load(args.arch, verbose=args.verbose) if args.arch
                else load_ops(verbose=args.verbose))
        print("loaded", path)
        print("ops", [n for n in ("reshape_and_cache", "paged_decode_attention",
                                  "paged_prefill_attention") if hasattr(torch.ops.ferrobatch, n)])
    return 0


if __name__ == "__main__":
    sys.exit(_main())
