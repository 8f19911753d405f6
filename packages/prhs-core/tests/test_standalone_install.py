"""prhs-core installs and imports alone: torch and numpy, nothing of the heavier packages."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import prhs_core

ROOT = Path(__file__).resolve().parents[3]
NO_INDEX = ("Failed to fetch", "dns error", "error sending request", "Could not connect")
HEAVY = ("triton", "numba", "sglang", "transformers", "prhs_kernels", "prhs_selectors")

CHECK = """
import importlib.util, sys
import torch
import prhs_core
from prhs_core import theory
present = [m for m in {heavy!r} if importlib.util.find_spec(m) is not None]
assert not present, f"installed beside prhs-core: {{present}}"
logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
sel = torch.tensor([[False, True, True]])
d = theory.dropped_mass(logits, sel).item()
assert abs(d - 1 / (1 + 2.718281828459045 + 2.718281828459045 ** 2)) < 1e-12, d
print(prhs_core.__version__)
"""


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (.ci/run installs it)")
    return uv


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_importing_prhs_core_imports_nothing_heavy():
    code = "import sys, prhs_core; print(sorted(m for m in {h!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code.format(h=HEAVY)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_prhs_core_wheel_installs_and_imports_alone(tmp_path):
    uv = _uv()
    dist = tmp_path / "dist"
    subprocess.run(
        [uv, "build", "--package", "prhs-core", "--wheel", "--out-dir", str(dist)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("prhs_core-*.whl")

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in zf.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
        assert any(n.endswith("prhs_core/py.typed") for n in zf.namelist())
    assert {_dist_name(r) for r in requires} == {"torch", "numpy"}, requires

    # A fresh venv with the wheel and what it requires. torch and numpy are pinned to the
    # workspace's versions so uv takes them from its cache. torch's Linux wheels declare triton;
    # it is overridden away here to show that prhs-core neither needs nor imports it.
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    py = venv / "bin" / "python"
    pins = tmp_path / "constraints.txt"
    pins.write_text(
        f"torch=={importlib.metadata.version('torch')}\nnumpy=={importlib.metadata.version('numpy')}\n"
    )
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("triton; sys_platform == 'never'\n")
    install = subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(py), str(wheel),
         "--constraint", str(pins), "--override", str(overrides)],
        capture_output=True, text=True,
    )  # fmt: skip
    if install.returncode != 0 and any(m in install.stderr for m in NO_INDEX):
        # e.g. the GPU machine, which reaches no package index and has no uv cache
        pytest.skip(f"no package index reachable to install torch: {install.stderr[-200:]}")
    assert install.returncode == 0, install.stderr
    out = subprocess.run([str(py), "-c", CHECK.format(heavy=HEAVY)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == prhs_core.__version__
