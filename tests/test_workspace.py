"""The workspace's shape: versions, typed packages, sibling pins and the one-way import graph.

core <- kernels <- selectors <- {sglang, eval}: a package may import only the packages below
it, and each import of a sibling must be backed by a declared dependency.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["prhs-core", "prhs-kernels", "prhs-selectors", "prhs-sglang", "prhs-eval"]
ALLOWED = {
    "prhs_core": set(),
    "prhs_kernels": {"prhs_core"},
    "prhs_selectors": {"prhs_core", "prhs_kernels"},
    "prhs_sglang": {"prhs_core", "prhs_kernels", "prhs_selectors"},
    "prhs_eval": {"prhs_core", "prhs_kernels", "prhs_selectors"},
}
# Heavy third-party modules a package may import at all (anything not listed is allowed).
HEAVY = {"triton", "numba", "sglang", "transformers", "gguf"}
HEAVY_ALLOWED = {
    "prhs_core": set(),
    "prhs_kernels": {"triton", "numba"},
    "prhs_selectors": set(),
    "prhs_sglang": {"sglang"},
    "prhs_eval": {"transformers", "gguf"},
}


def _pyproject(pkg: str) -> dict:
    return tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())


def _module(pkg: str) -> str:
    return pkg.replace("-", "_")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _requirement_names(pkg: str) -> set[str]:
    deps = _pyproject(pkg)["project"]["dependencies"]
    return {re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0] for d in deps}


def test_members_are_exactly_the_five_packages():
    found = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    assert found == sorted(PACKAGES)
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "project" not in root, "the root is a virtual workspace, not a package"
    assert set(root["tool"]["uv"]["sources"]) == set(PACKAGES)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_layout_version_and_typing(pkg):
    meta = _pyproject(pkg)["project"]
    mod = ROOT / "packages" / pkg / "src" / _module(pkg)
    assert (mod / "py.typed").is_file()
    assert (ROOT / "packages" / pkg / "tests").is_dir()
    init = (mod / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"', init, re.M)
    assert version and version.group(1) == meta["version"], "__version__ != pyproject version"
    assert meta["requires-python"] == ">=3.11"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_sibling_dependencies_have_floor_and_cap(pkg):
    for dep in _pyproject(pkg)["project"]["dependencies"]:
        name = re.split(r"[\s;<>=!~\[]", dep, maxsplit=1)[0]
        if name.startswith("prhs-"):
            assert "==" not in dep
            assert re.fullmatch(rf"{name}>=\d+\.\d+,<\d+\.\d+", dep), dep


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_point_one_way(pkg):
    mod = _module(pkg)
    declared = {d.replace("-", "_") for d in _requirement_names(pkg)}
    for path in (ROOT / "packages" / pkg / "src").rglob("*.py"):
        names = _imports(path)
        siblings = {n for n in names if n.startswith("prhs_") and n != mod}
        assert siblings <= ALLOWED[mod], f"{path} imports {siblings - ALLOWED[mod]}"
        # a sibling used directly must be a declared dependency, not a transitive accident
        assert siblings <= declared, f"{path} imports undeclared {siblings - declared}"
        heavy = (names & HEAVY) - HEAVY_ALLOWED[mod]
        assert not heavy, f"{path} imports {heavy}, which {pkg} must not need"
