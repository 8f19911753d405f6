from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from prhs_core.registry import Registry
from prhs_eval import __version__
from prhs_eval.cli import main


@dataclasses.dataclass(frozen=True)
class _Cfg:
    budget: int = 64
    tau: float = 0.8


def test_selectors_lists_names_summaries_and_defaults(capsys):
    reg: Registry = Registry("selector")
    reg.register("zeta", lambda c: c, config=_Cfg, summary="last one")
    reg.register("alpha", lambda: None, summary="no config")
    assert main(["selectors"], registry=reg) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "summary", "defaults"]
    rows = [line for line in out[2:] if line.strip()]
    assert [r.split()[0] for r in rows] == ["alpha", "zeta"]
    assert "last one" in rows[1] and "budget=64, tau=0.8" in rows[1]


def test_selectors_on_empty_registry_says_what_to_install(capsys):
    assert main(["selectors"], registry=Registry("selector")) == 0
    assert "install prhs-selectors" in capsys.readouterr().out


def test_console_help_and_version_run():
    out = subprocess.run(
        [sys.executable, "-m", "prhs_eval", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "selectors" in out and "usage: prhs-eval" in out
    ver = subprocess.run(
        [sys.executable, "-m", "prhs_eval", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert ver.strip() == f"prhs-eval {__version__}"


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
