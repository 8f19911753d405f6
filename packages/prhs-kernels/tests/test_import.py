"""Importing prhs_kernels stays light: heavy dependencies load only when their code path runs."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("triton", "numba")


def test_import_loads_no_heavy_dependency():
    code = f"import sys, prhs_kernels; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
