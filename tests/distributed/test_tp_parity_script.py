"""benchmarks/tp_parity.py's dry run on the CPU: two gloo ranks against one on a tiny random
model agree exactly (the script the multi-GPU run uses, exercised end to end)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tp_parity_dry_run() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tp_parity.py"), "--model", "random:tiny",
         "--dtype", "float32", "--device", "cpu", "--num-prompts", "3", "--input-len", "12",
         "--output-len", "8", "--kv-cache-memory", "32MiB"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=True).stdout
    assert "identical greedy tokens: 24/24 (100.0%)" in out, out
    assert "top-1 agreement 100.00%" in out, out
