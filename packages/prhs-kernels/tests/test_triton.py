"""Runs ``interpreted/`` (the Triton kernels against their references under Triton's CPU
interpreter) in a pytest process of its own started with ``TRITON_INTERPRET=1``: Triton reads
that variable when it is imported, and in this process it may already be imported without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PRHS_KERNELS", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(HERE / "interpreted"),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE.parents[2])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
