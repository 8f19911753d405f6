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


# ---------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["calibrate", "--out", "x.json", "--prompt-queries", "1"], "at least 2"),
        (
            ["calibrate", "--out", "x.json", "--context-len", "64", "--prompt-queries", "128"],
            "must not exceed --context-len",
        ),
        (["calibrate", "--out", "x.json", "--model", "no-such-model"], "unknown model"),
        (["calibrate", "--out", "."], "is a directory"),
    ],
)
def test_calibrate_checks_its_arguments_before_the_model_loads(argv, message, monkeypatch, capsys):
    import prhs_eval.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(prhs_eval.models, "load_model", no_load)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_writes_a_table_that_double_sparsity_runs_on(
    smollm2, tmp_path, monkeypatch, capsys
):
    """``calibrate`` on SmolLM2: a label table of the documented format (labels = the top
    scores of each head), which ``compare`` then runs Double Sparsity and HShare on."""
    import json
    from pathlib import Path

    import torch

    monkeypatch.setenv("PRHS_CACHE_DIR", str(Path(smollm2.source_path).parent))
    path = tmp_path / "ds.json"
    argv = ["calibrate", "--context-len", "160", "--samples", "2", "--prompt-queries", "16"]
    assert main([*argv, "--out", str(path), "--quiet"]) == 0
    assert "double_sparsity.channels=@" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["format"] == "prhs-double-sparsity-channels/1"
    assert (data["num_layers"], data["num_kv_heads"], data["head_dim"]) == (30, 3, 64)
    assert data["label_channels"] == 8 and data["samples"] == 2
    for row, scores in zip(data["channels"], data["scores"], strict=True):
        for labels, s in zip(row, scores, strict=True):
            want = torch.tensor(s).topk(8).indices.sort().values.tolist()
            assert labels == want
    out = tmp_path / "res"
    code = main(
        [
            "compare", "--selectors", "dense,double_sparsity,hshare", "--tasks", "passkey",
            "--context-len", "300", "--samples", "1", "--set", "budget=16",
            "--set", f"channels=@{path}", "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in open(out / "results.jsonl")]
    assert [r["selector"] for r in records] == ["dense", "double_sparsity", "hshare"]
    assert records[1]["options"]["channels"][0][0] == data["channels"][0][0]
    assert records[1]["retrieval_ratio"] == 0 and records[1]["bytes_per_step"] > 0
