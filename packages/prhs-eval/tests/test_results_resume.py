"""Results that survive: the output folder check, the per-sample log, and a resumed compare
that reports what an uninterrupted one does (tiny random model, byte tokenizer, fake clock)."""

from __future__ import annotations

import itertools
import json
import types
from pathlib import Path

import pytest
import torch

from prhs_eval import report, results, runner
from prhs_eval.metrics import MeterSums
from prhs_eval.results import (
    LOG_NAME,
    OutputDirError,
    OutputExistsError,
    ResumeMismatchError,
    SampleLog,
    check_out_dir,
    prepare_out_dir,
)
from prhs_eval.runner import SelectorSpec, compare


class ByteTokenizer:
    """One token per byte (ids < 120), enough for the task generators and the runner."""

    eos_token_id = 127

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % 120 for b in text.encode()]

    def __call__(self, text: str, return_tensors: str | None = None, add_special_tokens=True):
        return types.SimpleNamespace(input_ids=torch.tensor([self.encode(text)]))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i + 32 for i in ids).decode("latin-1")


# --------------------------------------------------------------------------------------------
# the output folder


def test_check_out_dir_refuses_to_overwrite_silently(tmp_path: Path) -> None:
    check_out_dir(tmp_path / "new", overwrite=False, resume=False)  # missing: fine
    check_out_dir(tmp_path, overwrite=False, resume=False)  # empty: fine
    (tmp_path / "notes.txt").write_text("mine")
    check_out_dir(tmp_path, overwrite=False, resume=False)  # no results in it: fine
    (tmp_path / "results.jsonl").write_text("{}\n")
    with pytest.raises(OutputExistsError, match=r"--resume .*--overwrite .*--out") as err:
        check_out_dir(tmp_path, overwrite=False, resume=False)
    assert isinstance(err.value, ValueError)
    assert "results.jsonl" in str(err.value) and "\n" not in str(err.value)
    check_out_dir(tmp_path, overwrite=True, resume=False)
    assert (tmp_path / "results.jsonl").exists()  # no side effects
    with pytest.raises(OutputDirError, match=f"no {LOG_NAME} to resume"):
        check_out_dir(tmp_path, overwrite=False, resume=True)
    (tmp_path / LOG_NAME).write_text("")
    check_out_dir(tmp_path, overwrite=False, resume=True)
    with pytest.raises(OutputDirError, match="exclude"):
        check_out_dir(tmp_path, overwrite=True, resume=True)
    with pytest.raises(OutputDirError, match="not a folder"):
        check_out_dir(tmp_path / "notes.txt", overwrite=False, resume=False)


def test_prepare_out_dir_overwrite_removes_only_result_files(tmp_path: Path) -> None:
    for name in results.RESULT_FILES:
        (tmp_path / name).write_text("old\n")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        prepare_out_dir(tmp_path, overwrite=False, resume=False)
    log = prepare_out_dir(tmp_path, overwrite=True, resume=False)
    assert len(log) == 0 and log.path == tmp_path / LOG_NAME
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_sample_log_drops_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / LOG_NAME
    row = {"version": results.ROW_VERSION, "selector": "dense", "options": {}, "task": "t",
           "index": 0}  # fmt: skip
    path.write_text(json.dumps(row) + "\n" + '{"version": 1, "sel')
    log = SampleLog(path, read=True)
    assert len(log) == log.loaded == 1
    assert path.read_text() == json.dumps(row) + "\n"  # the next append starts a clean line
    path.write_text("not json\n" + json.dumps(row) + "\n")
    with pytest.raises(OutputDirError, match="not a JSON line"):
        SampleLog(path, read=True)


def test_meter_sums_add_up_and_round_trip() -> None:
    a = MeterSums(decisions=4, sums={"delta": 0.4, "beta": 0.04}, delta_max=0.3, steps=2,
                  bytes_total=100.0, dense_bytes_total=400.0, mi_count=2, b_mi_sum=1.0)  # fmt: skip
    b = MeterSums(decisions=6, sums={"delta": 0.6, "beta": 0.06, "retrieved": 3.0},
                  delta_max=0.5, violations=1, steps=3, bytes_total=50.0,
                  dense_bytes_total=600.0, mi_count=2, b_mi_sum=3.0)  # fmt: skip
    m = MeterSums.combine([a, b]).metrics()
    assert (m.decisions, m.delta_mean, m.delta_max) == (10, 0.1, 0.5)
    assert m.retrieval_ratio == pytest.approx(30.0)
    assert m.bytes_per_step == 30.0 and m.dense_bytes_per_step == 200.0
    assert m.b_mi == 1.0 and m.certificate_violations == 1
    assert MeterSums.combine([a]).metrics().certificate_violations is None
    assert MeterSums.from_dict(json.loads(json.dumps(b.as_dict()))) == b


def test_resolved_options_record_what_was_used() -> None:
    cis = SelectorSpec("cis", {"budget": 16, "delta_max": 0.1}).resolved_options(4)
    assert (cis["delta_target"], cis["k_max"]) == (0.05, 64)
    assert (cis["certificate"], cis["certificate_page"]) == ("page", 16)
    glob = SelectorSpec("cis", {"delta_max": 0.1, "certificate": "global"}).resolved_options(4)
    assert (glob["certificate"], glob["certificate_page"]) == ("global", None)
    plain = SelectorSpec("cis", {"budget": 16}).resolved_options(4)
    assert plain["delta_target"] is None  # not certified: not used at all
    assert SelectorSpec("prhs").resolved_options(6)["start_layer"] == 3
    assert SelectorSpec("quest").resolved_options(4)["dense_layers"] == 2


# --------------------------------------------------------------------------------------------
# an interrupted compare, resumed


class Interrupted(Exception):
    pass


@pytest.fixture
def tiny(make_tiny):
    return types.SimpleNamespace(
        model=make_tiny("llama"), tokenizer=ByteTokenizer(), name="tiny", revision="r1"
    )


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every perf_counter() call advances by 0.25 s: timings depend on the work done only."""
    ticks = itertools.count()
    monkeypatch.setattr(runner.time, "perf_counter", lambda: 0.25 * next(ticks))


SPECS = [SelectorSpec("dense"), SelectorSpec("quest", {"budget": 16, "page_size": 8})]
ARGS = dict(context_len=260, num_samples=2, seed=1)


def _records(res) -> list[str]:
    return [json.dumps(report.to_json_safe(r.record()), sort_keys=True) for r in res]


def test_interrupted_compare_resumes_without_rerunning_rows(tiny, fake_clock, tmp_path):
    full = compare(tiny, SPECS, ["passkey"], log=prepare_out_dir(tmp_path / "a",
                   overwrite=False, resume=False), **ARGS)  # fmt: skip
    assert len((tmp_path / "a" / LOG_NAME).read_text().splitlines()) == 4

    out = tmp_path / "b"
    seen: list[str] = []

    def stop_after_three(msg: str) -> None:
        seen.append(msg)
        if len(seen) == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        compare(tiny, SPECS, ["passkey"], progress=stop_after_three,
                log=prepare_out_dir(out, overwrite=False, resume=False), **ARGS)  # fmt: skip
    logged = [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]
    assert [(r["selector"], r["index"]) for r in logged] == [("dense", 0), ("quest", 0),
                                                             ("dense", 1)]  # fmt: skip
    with pytest.raises(OutputExistsError):  # the interrupted run's rows are not overwritten
        check_out_dir(out, overwrite=False, resume=False)

    resumed_msgs: list[str] = []
    log = prepare_out_dir(out, overwrite=False, resume=True)
    assert log.loaded == 3
    resumed = compare(tiny, SPECS, ["passkey"], progress=resumed_msgs.append, log=log, **ARGS)
    assert [m for m in resumed_msgs if not m.endswith("(logged)")] == ["passkey #1 quest"]
    assert len([m for m in resumed_msgs if m.endswith("(logged)")]) == 3
    assert len((out / LOG_NAME).read_text().splitlines()) == 4

    assert _records(resumed) == _records(full)
    assert report.format_table(resumed) == report.format_table(full)
    env = resumed[0].environment
    assert env["model_revision"] == "r1" and env["device"] == "cpu"
    assert env["dtype"] == "float32" and env["torch"] == torch.__version__
    assert {"platform", "python", "transformers", "cpu", "gpu", "prhs_commit"} <= set(env)
    assert resumed[1].options["dense_layers"] == 2 and resumed[1].budget == 16
    assert resumed[0].budget is None  # dense has no budget
    # Shared prefill: one per sample, reported apart from the selectors' own prefill.
    assert all(r.prefill_shared and r.prefill_seconds == 0.0 for r in resumed)
    assert resumed[0].shared_prefill_seconds == 2 * 0.25

    with pytest.raises(ResumeMismatchError, match="context_len"):
        compare(tiny, SPECS, ["passkey"], log=prepare_out_dir(out, overwrite=False,
                resume=True), **{**ARGS, "context_len": 280})  # fmt: skip


# --------------------------------------------------------------------------------------------
# evaluate (the CLI's run step)


def test_evaluate_logs_refuses_to_overwrite_and_resumes(tiny, tmp_path, monkeypatch, capsys):
    import argparse

    from prhs_eval import models
    from prhs_eval.evaluate import evaluate

    calls: list[tuple[str, dict]] = []

    def fake_load(name, **kwargs):
        calls.append((name, kwargs))
        return tiny

    monkeypatch.setattr(models, "load_model", fake_load)
    args = argparse.Namespace(
        model="tiny", tasks=["passkey"], context_len=260, samples=1, seed=0, haystack=None,
        text=None, out=tmp_path / "out", no_measure=True, quiet=True, device="cpu", dtype=None,
    )  # fmt: skip
    specs = [SelectorSpec("dense"), SelectorSpec("streaming", {"budget": 16})]
    assert evaluate(args, specs) == 0
    assert calls == [("tiny", {"device": "cpu"})]  # only the options that were set
    first = capsys.readouterr().out
    assert report.TABLE_LEGEND in first
    assert len((tmp_path / "out" / LOG_NAME).read_text().splitlines()) == 2
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(results.RESULT_FILES)

    with pytest.raises(OutputExistsError):
        evaluate(args, specs)
    assert len(calls) == 1  # refused before loading the model

    args.resume = True
    assert evaluate(args, specs) == 0
    again = capsys.readouterr().out
    assert "resumed: 2 row(s)" in again
    table = first.split("\n\n", 1)[1]
    assert again.split("\n\n", 2)[2].startswith(table.split(report.TABLE_LEGEND)[0])
    assert len((tmp_path / "out" / LOG_NAME).read_text().splitlines()) == 2  # nothing rerun


def test_a_selector_that_calibrates_on_the_prompt_prefills_for_itself(tiny, monkeypatch):
    """CIS's ``tau="auto"`` observes the prompt's queries at prefill: it must not be handed the
    dense prefill made before it was attached (its calibration would silently not happen)."""
    from prhs_selectors.cis import CIS

    seen = []
    observe = CIS.observe_prompt

    def counting(self, *args, **kwargs):
        seen.append(self.config.tau)
        return observe(self, *args, **kwargs)

    monkeypatch.setattr(CIS, "observe_prompt", counting)
    specs = [
        SelectorSpec("dense"),
        SelectorSpec("cis", {"budget": 16}),  # tau="auto", the default
        SelectorSpec("cis", {"budget": 16, "tau": 0.72}),
        SelectorSpec("prhs", {"budget": 16}),
    ]
    res = compare(tiny, specs, ["passkey"], context_len=260, num_samples=1, seed=1)
    shared = {(r.selector, r.options.get("tau")): r.prefill_shared for r in res}
    assert shared == {
        ("dense", None): True,
        ("cis", "auto"): False,
        ("cis", 0.72): True,
        ("prhs", "auto"): False,
    }
    assert seen and set(seen) == {"auto"}  # every full layer of the two auto runs observed
