"""`import ferrobatch` sets a short OpenMP spin-wait before torch loads, and never overrides the
user's own setting (checked in fresh interpreters: libgomp reads it once, at load)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = "import ferrobatch, os; print(os.environ.get('GOMP_SPINCOUNT'))"


def _probe(extra_env: dict[str, str], code: str = PROBE) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env.update(extra_env, PYTHONPATH=os.path.join(ROOT, "python"))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_import_sets_a_short_spin_when_unset():
    assert _probe({}) == "3000"


def test_user_setting_wins():
    assert _probe({"GOMP_SPINCOUNT": "7"}) == "7"


def test_not_set_once_torch_is_loaded():
    # too late for libgomp to see it, so ferrobatch leaves the environment alone
    assert _probe({}, "import torch, ferrobatch, os; print(os.environ.get('GOMP_SPINCOUNT'))") == "None"
