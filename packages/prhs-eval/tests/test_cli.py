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


# ---------------------------------------------------------------------------------------------
# run / compare
# ---------------------------------------------------------------------------------------------
BAD_ARGS = {
    "unknown-selector": (["run", "cys"], "unknown selector 'cys'"),
    "budget-zero": (["run", "cis", "--set", "budget=0"], "budget must be >= 1"),
    "bad-option": (["run", "oracle", "--set", "oracle.tau=0.5"], "no option"),
    "option-nobody-has": (
        ["compare", "--selectors", "dense,oracle", "--set", "tau=0.5"],
        "no selector",
    ),
    "unknown-task": (["compare", "--tasks", "passkey,gsm9k"], "unknown task"),
    "unknown-model": (["run", "dense", "--model", "no-such-model"], "unknown model"),
    "set-syntax": (["run", "cis", "--set", "budget"], "KEY=VALUE"),
    "set-file-missing": (["run", "cis", "--set", "tau=@/no/such.json"], "cannot read"),
    "set-file-not-json": (["run", "cis", "--set", f"tau=@{__file__}"], "is not JSON"),
    "budgets": (["compare", "--budgets", "32,-1"], "positive integer"),
    "context": (["run", "cis", "--context-len", "0"], "positive integer"),
    "text-missing": (
        ["run", "cis", "--tasks", "perplexity", "--text", "/no/such.txt"],
        "does not exist",
    ),
    "text-without-perplexity": (["run", "cis", "--text", __file__], "perplexity task"),
    "haystack-for-perplexity": (
        ["run", "cis", "--tasks", "perplexity", "--haystack", "essays"],
        "--haystack is for",
    ),
}


@pytest.mark.parametrize("name", list(BAD_ARGS))
def test_bad_arguments_fail_before_the_model_loads(name, monkeypatch, capsys):
    import prhs_eval.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(prhs_eval.models, "load_model", no_load)
    argv, message = BAD_ARGS[name]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_set_reads_a_value_from_a_json_file(tmp_path):
    """``KEY=@FILE``: a bare JSON value, or the entry named KEY of a JSON object (a calibration
    file with its provenance); an object without it is an error."""
    from prhs_eval.cli import UsageError, _parse_options

    table = [[0.7, 0.9], [0.8, 0.8]]
    bare = tmp_path / "bare.json"
    bare.write_text("[[0.7, 0.9], [0.8, 0.8]]")
    wrapped = tmp_path / "calib.json"
    wrapped.write_text('{"model": "m", "tau": [[0.7, 0.9], [0.8, 0.8]]}')
    assert _parse_options([f"tau=@{bare}"], ["cis", "dense"])["cis"] == {"tau": table}
    assert _parse_options([f"cis.tau=@{wrapped}"], ["cis"])["cis"] == {"tau": table}
    other = tmp_path / "other.json"
    other.write_text('{"budget": 3}')
    with pytest.raises(UsageError, match="without 'tau'"):
        _parse_options([f"cis.tau=@{other}"], ["cis"])


@pytest.mark.slow
def test_compare_end_to_end_on_smollm2(smollm2, tmp_path, monkeypatch, capsys):
    import csv
    import json
    from pathlib import Path

    cache_root = Path(smollm2.source_path).parent
    monkeypatch.setenv("PRHS_CACHE_DIR", str(cache_root))
    out = tmp_path / "res"
    code = main(
        [
            "compare",
            "--selectors",
            "dense,oracle,streaming",
            "--tasks",
            "passkey",
            "--context-len",
            "300",
            "--samples",
            "1",
            "--set",
            "budget=16",
            "--set",
            "oracle.block_size=1",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    for name in ("dense", "oracle", "streaming"):
        assert name in text
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["selector"] for r in rows] == ["dense", "oracle", "streaming"]
    records = [json.loads(line) for line in open(out / "results.jsonl")]
    assert records[0]["delta_mean"] == 0.0  # dense drops nothing
    assert records[2]["delta_mean"] > 0  # streaming at budget 16 does
    assert records[1]["options"]["budget"] == 16
    assert all(len(r["samples"]) == 1 for r in records)
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
