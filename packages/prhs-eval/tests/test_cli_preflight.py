"""The CLI's checks before the model loads: every mistake is one line on stderr and exit code 2,
and no weights are read. Also the ``tasks`` and ``models`` commands, ``--device``/``--dtype``,
``--overwrite``/``--resume`` and a help that does not import torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prhs_eval.cli import main


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything loads weights (or starts the evaluation)."""
    import prhs_eval.evaluate
    import prhs_eval.models

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were loaded before the arguments were checked")

    for name in ("load_model", "_from_pretrained", "_load_from_gguf", "_convert"):
        monkeypatch.setattr(prhs_eval.models, name, forbidden)
    monkeypatch.setattr(prhs_eval.evaluate, "evaluate", forbidden)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Replace the evaluation (model load included) by a recorder of (args, specs)."""
    import prhs_eval.evaluate
    import prhs_eval.models

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were loaded by the CLI itself")

    monkeypatch.setattr(prhs_eval.models, "load_model", forbidden)
    calls: list[tuple[Any, Any]] = []

    def fake_evaluate(args: Any, specs: Any) -> int:
        calls.append((args, specs))
        return 0

    monkeypatch.setattr(prhs_eval.evaluate, "evaluate", fake_evaluate)
    return calls


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *messages: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # one line
    for message in messages:
        assert message in err, err
    return err


def _out(tmp_path: Path) -> list[str]:
    return ["--out", str(tmp_path / "results")]


# ---------------------------------------------------------------------------------------------
# --text and --haystack files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"  \n\t\n", "is empty"),
        (b"caf\xe9 latin-1 \xff\xfe", "is not UTF-8"),
        (b"In the beginning God created the heaven and the earth.\n", "is too short"),
    ],
    ids=["empty", "whitespace", "not-utf8", "too-short"],
)
def test_bad_text_file_fails_before_load(
    content: bytes, message: str, tmp_path: Path, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mine.txt"
    path.write_bytes(content)
    argv = ["run", "dense", "--tasks", "perplexity", "--text", str(path), *_out(tmp_path)]
    err = _fails(argv, capsys, "--text", message)
    assert str(path) in err


def test_missing_text_file(
    tmp_path: Path, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "dense", "--tasks", "perplexity", "--text", str(tmp_path / "nope.txt")]
    _fails(argv, capsys, "does not exist")


def test_text_long_enough_is_accepted(tmp_path: Path, captured: list[Any], cpu_only: None) -> None:
    path = tmp_path / "long.txt"
    path.write_text("word " * 2000, encoding="utf-8")
    argv = ["run", "dense", "--tasks", "perplexity", "--text", str(path), "--context-len", "512"]
    assert main([*argv, "--samples", "2", *_out(tmp_path)]) == 0
    assert captured[0][0].text == str(path)


@pytest.mark.parametrize("name", ["kjv", "essays"])
def test_text_by_name(name: str, tmp_path: Path, captured: list[Any], cpu_only: None) -> None:
    argv = ["run", "dense", "--tasks", "perplexity", "--text", name, "--samples", "8"]
    assert main([*argv, *_out(tmp_path)]) == 0
    assert captured[0][0].text == name  # the evaluation passes it on as the task's source


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is empty"), (b"\xff\xfe\x00bad", "is not UTF-8")],
    ids=["empty", "not-utf8"],
)
def test_bad_haystack_file_fails_before_load(
    content: bytes, message: str, tmp_path: Path, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "hay.txt"
    path.write_bytes(content)
    _fails(
        ["run", "dense", "--haystack", str(path), *_out(tmp_path)], capsys, "--haystack", message
    )


def test_haystack_file_with_too_few_sentences(
    tmp_path: Path, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "hay.txt"
    path.write_text("Only one sentence here.", encoding="utf-8")
    _fails(["run", "dense", "--haystack", str(path), *_out(tmp_path)], capsys, "too short")


def test_haystack_neither_name_nor_file(
    tmp_path: Path, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails(["run", "dense", "--haystack", "novels"], capsys, "'novels'", "repeat, essays")


def test_haystack_accepts_names_and_text_files(
    tmp_path: Path, captured: list[Any], cpu_only: None
) -> None:
    path = tmp_path / "hay.txt"
    path.write_text("My own haystack. " * 100, encoding="utf-8")
    assert main(["run", "dense", "--haystack", str(path), *_out(tmp_path)]) == 0
    assert main(["run", "dense", "--haystack", "essays", *_out(tmp_path)]) == 0
    assert [args.haystack for args, _ in captured] == [str(path), "essays"]


# ---------------------------------------------------------------------------------------------
# Model: context limit, offline hub cache, missing packages
# ---------------------------------------------------------------------------------------------


def test_context_longer_than_embedded_model(
    no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails(
        ["run", "dense", "--context-len", "8192"],
        capsys,
        "8192",
        "'smollm2-135m' supports (8192)",
        "--context-len 8175 or less",
    )


def test_context_limit_from_local_config(
    tmp_path: Path, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 512}})
    )
    argv = ["run", "dense", "--model", str(model), "--context-len", "1000"]
    _fails(argv, capsys, "supports (512)")


def _hub_cache(tmp_path: Path, repo_id: str, config: dict[str, Any]) -> Path:
    cache = tmp_path / "hf-hub"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abc")
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "snapshots" / "0123abc" / "config.json").write_text(json.dumps(config))
    return cache


def test_offline_hub_id_not_cached(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_load: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fails(
        ["run", "dense", "--model", "SomeOrg/some-model"],
        capsys,
        "'SomeOrg/some-model' is not in the local Hugging Face cache",
        "offline",
        "hf download SomeOrg/some-model",
    )
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "true")
    _fails(["run", "dense", "--model", "SomeOrg/some-model"], capsys, "local Hugging Face cache")


def test_offline_hub_id_cached_uses_cached_config(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    captured: list[Any],
    cpu_only: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = _hub_cache(tmp_path, "SomeOrg/some-model", {"max_position_embeddings": 2048})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["run", "dense", "--model", "SomeOrg/some-model", *_out(tmp_path)]
    assert main([*base, "--context-len", "1024"]) == 0
    _fails([*base, "--context-len", "4096"], capsys, "supports (2048)")


def test_online_hub_id_is_not_checked_against_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, captured: list[Any], cpu_only: None
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert main(["run", "dense", "--model", "SomeOrg/some-model", *_out(tmp_path)]) == 0


def test_missing_model_package_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: (
            None if name.startswith("qwen") or "pandas_sns" in name else real(name, *a, **k)
        ),
    )
    _fails(
        ["run", "dense", "--model", "qwen2.5-0.5b"], capsys, "not installed", "uv sync --group qwen"
    )


# ---------------------------------------------------------------------------------------------
# Selector options and budgets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "messages"),
    [
        (["run", "dense", "--set", "budget=5"], ["'budget'", "dense has no options"]),
        (["run", "dense", "--set", "dense.budget=5"], ["'dense' has no option 'budget'"]),
        (["run", "psaw", "--set", "budget=8"], ["'budget'", "alpha, n_sink, phi, start_layer"]),
        (["run", "psaw", "--set", "psaw.budget=8"], ["'psaw' has no option 'budget'"]),
        (
            ["compare", "--selectors", "dense,psaw", "--budgets", "8,16"],
            ["--budgets", "no selector"],
        ),
    ],
    ids=["dense-global", "dense-scoped", "psaw-global", "psaw-scoped", "budgets-sweep"],
)
def test_option_the_selector_ignores(
    argv: list[str], messages: list[str], no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails(argv, capsys, "ignored", *messages)


def test_global_option_goes_to_the_selectors_that_have_it(
    tmp_path: Path, captured: list[Any], cpu_only: None
) -> None:
    argv = ["compare", "--selectors", "dense,psaw,streaming", "--set", "budget=16"]
    assert main([*argv, "--budgets", "32,64", *_out(tmp_path)]) == 0
    specs = captured[0][1]
    assert [(s.name, s.options) for s in specs] == [
        ("dense", {}),
        ("psaw", {}),
        ("streaming", {"budget": 32}),
        ("streaming", {"budget": 64}),
    ]


def test_sweep_runs_each_value_of_an_option_for_the_selectors_that_have_it(
    tmp_path: Path, captured: list[Any], cpu_only: None
) -> None:
    argv = ["compare", "--selectors", "dense,cis,prhs", "--set", "budget=512"]
    sweep = ["--sweep", "cis.tau=0.6,0.7", "--sweep", "block_size=1,8"]
    assert main([*argv, *sweep, *_out(tmp_path)]) == 0
    specs = captured[0][1]
    assert [(s.name, s.options) for s in specs] == [
        ("dense", {}),
        ("cis", {"budget": 512, "tau": 0.6, "block_size": 1}),
        ("cis", {"budget": 512, "tau": 0.6, "block_size": 8}),
        ("cis", {"budget": 512, "tau": 0.7, "block_size": 1}),
        ("cis", {"budget": 512, "tau": 0.7, "block_size": 8}),
        ("prhs", {"budget": 512, "block_size": 1}),
        ("prhs", {"budget": 512, "block_size": 8}),
    ]
    captured.clear()
    assert main(["compare", "--selectors", "cis", "--sweep", "n_den=2,3", "--budgets", "64,128",
                 *_out(tmp_path), "--overwrite"]) == 0  # fmt: skip
    assert [s.options for s in captured[0][1]] == [
        {"n_den": 2, "budget": 64}, {"n_den": 2, "budget": 128},
        {"n_den": 3, "budget": 64}, {"n_den": 3, "budget": 128},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("sweep", "messages"),
    [
        ("tau", ["--sweep expects KEY=V1,V2"]),
        ("cis.tau=", ["no values"]),
        ("cis.tau=0.7,0.7", ["given twice"]),
        ("cis.nope=1,2", ["'cis' has no option 'nope'"]),
        ("phi=0.5,0.6", ["no selector among", "'phi'"]),
        ("budget=64,128", ["--budgets"]),
        ("cis.tau=0.7,1.5", ["tau"]),
    ],
    ids=["no-equals", "no-values", "twice", "unknown", "nobody-has-it", "budget", "bad-value"],
)
def test_bad_sweep_fails_before_any_work(
    sweep: str, messages: list[str], no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails(["compare", "--selectors", "dense,cis", "--sweep", sweep], capsys, *messages)


def test_an_option_swept_twice_fails(no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--selectors", "cis", "--sweep", "tau=0.6,0.7", "--sweep", "cis.tau=0.8,0.9"]
    _fails(argv, capsys, "cis.tau is swept twice")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "streaming", "--set", "budget=8192"], "budget 8192 >= context 4096"),
        (["run", "streaming", "--set", "budget=4096"], "budget 4096 >= context 4096"),
        (["compare", "--selectors", "dense,oracle", "--budgets", "64,5000"], "budget 5000"),
        (["run", "streaming", "--context-len", "60"], "budget 64 (its default) >= context 60"),
    ],
)
def test_budget_covering_the_context_is_dense(
    argv: list[str], message: str, no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails(argv, capsys, message, "every position is read; this is dense attention")


def test_context_too_small_for_a_task(no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    from prhs_eval.preflight import task_min_context

    minimum = task_min_context("niah_multikey")
    assert minimum is not None and minimum > 20
    argv = ["run", "dense", "--tasks", "passkey,niah_multikey", "--context-len", str(minimum - 1)]
    _fails(argv, capsys, "too small for niah_multikey", f"at least {minimum} tokens")


# ---------------------------------------------------------------------------------------------
# --device, --dtype
# ---------------------------------------------------------------------------------------------


def test_device_and_dtype_defaults_on_cpu(
    tmp_path: Path, captured: list[Any], cpu_only: None
) -> None:
    assert main(["run", "dense", *_out(tmp_path)]) == 0
    args = captured[0][0]
    assert (args.device, args.dtype) == ("cpu", "float32")


def test_device_and_dtype_defaults_on_cuda(
    tmp_path: Path, captured: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["run", "dense", *_out(tmp_path)]) == 0
    assert main(["run", "dense", "--device", "cuda:1", "--dtype", "float16", *_out(tmp_path)]) == 0
    assert [(a.device, a.dtype) for a, _ in captured] == [
        ("cuda", "bfloat16"),
        ("cuda:1", "float16"),
    ]


@pytest.mark.parametrize(
    ("device", "cuda", "message"),
    [
        ("cuda", False, "CUDA is not available"),
        ("cuda:2", True, "there are 1 CUDA device"),
        ("toaster", False, "is not a device"),
    ],
)
def test_bad_device(
    device: str,
    cuda: bool,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    no_load: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _fails(["run", "dense", "--device", device], capsys, "--device", message)


def test_bad_dtype(no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "dense", "--dtype", "float8"])
    assert exc.value.code == 2
    assert "float32" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# --overwrite / --resume
# ---------------------------------------------------------------------------------------------


def test_overwrite_and_resume_exclude_each_other(
    no_load: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--overwrite", "--resume"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], (False, False)), (["--overwrite"], (True, False)), (["--resume"], (False, True))],
)
def test_out_dir_check_gets_the_flags(
    flags: list[str],
    expected: tuple[bool, bool],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    captured: list[Any],
    cpu_only: None,
) -> None:
    import prhs_eval.results

    seen: list[tuple[Path, bool, bool]] = []

    def fake(out: Path, *, overwrite: bool, resume: bool) -> None:
        seen.append((out, overwrite, resume))

    monkeypatch.setattr(prhs_eval.results, "check_out_dir", fake)
    assert main(["run", "dense", *flags, *_out(tmp_path)]) == 0
    assert seen == [(tmp_path / "results", *expected)]


def test_out_dir_with_results_fails_before_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_load: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import prhs_eval.results

    class Occupied(ValueError):
        pass

    def refuse(out: Path, *, overwrite: bool, resume: bool) -> None:
        if not (overwrite or resume):
            raise Occupied(f"{out} already holds results: pass --overwrite or --resume")

    monkeypatch.setattr(prhs_eval.results, "check_out_dir", refuse)
    _fails(["run", "dense", *_out(tmp_path)], capsys, "already holds results", "--overwrite")


def test_real_out_dir_check_refuses_existing_results(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    captured: list[Any],
    cpu_only: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.jsonl").write_text("{}\n")
    argv = ["run", "dense", "--out", str(out)]
    import prhs_eval.models

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr(prhs_eval.models, "_from_pretrained", forbidden)
    _fails(argv, capsys, "already holds results", "--overwrite")
    assert captured == []
    assert main([*argv, "--overwrite"]) == 0
    assert len(captured) == 1


# ---------------------------------------------------------------------------------------------
# tasks, models, help
# ---------------------------------------------------------------------------------------------


def test_tasks_lists_every_task_with_kind_and_min_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from prhs_eval.preflight import task_min_context
    from prhs_eval.tasks import TASKS

    assert main(["tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["name", "kind"] and "min context" in lines[0]
    rows = {line.split()[0]: line for line in lines[2 : 2 + len(TASKS)]}
    assert set(rows) == set(TASKS)
    for name, spec in TASKS.items():
        assert spec.kind in rows[name] and spec.description in rows[name]
    assert f">= {task_min_context('passkey')}" in rows["passkey"]


def test_models_lists_embedded_models(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import prhs_eval.models

    monkeypatch.setattr(prhs_eval.models, "is_installed", lambda name: name == "smollm2-135m")
    assert main(["models"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:] if line}
    assert "llama" in rows["smollm2-135m"] and "8192" in rows["smollm2-135m"]
    assert "yes" in rows["smollm2-135m"] and "(default)" in rows["smollm2-135m"]
    assert "gemma3_text" in rows["gemma3-270m"] and "32768" in rows["gemma3-270m"]
    assert "no (uv sync --group gemma)" in rows["gemma3-270m"]
    assert "qwen2" in rows["qwen2.5-0.5b"] and "no (uv sync --group qwen)" in rows["qwen2.5-0.5b"]


_NO_TORCH = """
import sys
from prhs_eval.cli import main
try:
    main({argv!r})
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
heavy = sorted(m for m in ("torch", "transformers", "prhs_core.registry") if m in sys.modules)
assert not heavy, heavy
"""


@pytest.mark.parametrize(
    "argv", [["--help"], ["compare", "--help"], ["run", "--help"], ["--version"]]
)
def test_help_does_not_import_torch(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.format(argv=argv)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: prhs-eval" in proc.stdout or "prhs-eval" in proc.stdout


def test_package_names_resolve_lazily() -> None:
    import prhs_eval
    from prhs_eval import integration

    # The subprocess tests above show `import prhs_eval` leaves torch alone; the names still work.
    assert prhs_eval.enable is integration.enable
    assert prhs_eval.PrhsRuntime is integration.PrhsRuntime
    assert prhs_eval.UnsupportedModelError is integration.UnsupportedModelError
    assert {"enable", "PrhsRuntime", "UnsupportedModelError"} <= set(dir(prhs_eval))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = prhs_eval.nothing  # type: ignore[attr-defined]
