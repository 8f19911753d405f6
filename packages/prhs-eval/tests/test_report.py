"""Tests of the run reports (prhs_eval.report): table, JSONL, CSV and PNG plot.

Results are built by hand with made-up metrics; nothing here loads a model.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from prhs_eval import report
from prhs_eval.metrics import SelectionMetrics
from prhs_eval.results import RunResult, SampleResult

NAN = math.nan
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _metrics(**overrides: Any) -> SelectionMetrics:
    base: dict[str, Any] = dict(
        decisions=120,
        delta_mean=0.0123,
        delta_max=0.0891,
        beta_emp=1.2e-05,
        oracle_overlap=0.8766,
        top_mass_recall=0.93,
        retrieval_ratio=12.5,
        avg_kv=256.0,
        bytes_per_step=2048.0 * 1024,
        dense_bytes_per_step=8192.0 * 1024,
        b_mi=0.0456,
        delta_i_emp=0.00789,
        certificate_violations=None,
    )
    base.update(overrides)
    return SelectionMetrics(**base)


def _run(
    selector: str,
    task: str,
    budget: int,
    *,
    accuracy: float = NAN,
    perplexity: float = NAN,
    model: str = "smollm2-135m",
    context_len: int = 4096,
    samples: tuple[SampleResult, ...] = (),
    options: dict[str, Any] | None = None,
    decode_seconds: float = 1.5,
    decode_tokens: int = 100,
    **metrics: Any,
) -> RunResult:
    return RunResult(
        model=model,
        selector=selector,
        task=task,
        options={"budget": budget, **(options or {})},
        budget=budget,
        context_len=context_len,
        num_samples=max(1, len(samples)),
        seed=0,
        accuracy=accuracy,
        perplexity=perplexity,
        metrics=_metrics(**metrics),
        samples=samples,
        prefill_seconds=0.25,
        decode_seconds=decode_seconds,
        decode_tokens=decode_tokens,
    )


def _sample(task: str, index: int, score: float, nll: float = NAN) -> SampleResult:
    return SampleResult(
        task=task,
        index=index,
        context_tokens=4000,
        completion="the magic number is 42",
        answers=("42",),
        score=score,
        nll=nll,
        scored_tokens=0 if math.isnan(nll) else 64,
    )


def sweep() -> list[RunResult]:
    """Two tasks (one generation, one perplexity), three selectors over budgets, dense."""
    out: list[RunResult] = []
    for task, gen in (("niah", True), ("ppl_kjv", False)):
        for selector, scale in (("quest", 1.0), ("cis", 0.4), ("h2o", 3.0)):
            for i, budget in enumerate((64, 128, 256, 512)):
                delta = scale * 0.08 / (i + 1) ** 1.5
                out.append(
                    _run(
                        selector,
                        task,
                        budget,
                        accuracy=min(1.0, 0.4 + 0.15 * i / scale**0.5) if gen else NAN,
                        perplexity=NAN if gen else 9.0 + 3.0 * delta,
                        delta_mean=delta,
                        delta_max=3 * delta,
                        avg_kv=float(budget),
                        bytes_per_step=budget * 1024.0,
                        certificate_violations=0 if selector == "cis" else None,
                        samples=(_sample(task, 0, 1.0 if gen else NAN),),
                    )
                )
        out.append(
            _run(
                "dense",
                task,
                0,
                accuracy=0.95 if gen else NAN,
                perplexity=NAN if gen else 9.0,
                delta_mean=0.0,
                delta_max=0.0,
                beta_emp=0.0,
                oracle_overlap=1.0,
                bytes_per_step=8192.0 * 1024,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# table


def _table_rows(text: str) -> tuple[list[str], list[str]]:
    lines = text.rstrip("\n").split("\n")
    return lines[:2], lines[2:]


def test_table_cells_and_missing_values() -> None:
    results = [
        _run("quest", "niah", 256, accuracy=0.8766, certificate_violations=3, target_misses=2),
        _run("streaming", "ppl_kjv", 128, perplexity=12.34567, delta_mean=1.234567e-5),
        _run("dense", "niah", 0, accuracy=1.0, delta_mean=0.0, decode_tokens=0),
    ]
    text = report.format_table(results)
    (head, rule), rows = _table_rows(text)
    for name in ("task", "selector", "budget", "acc", "ppl", "δ mean", "δ max", "β_emp",
                 "overlap", "ρ̂ %", "Avg KV", "KB/step", "vs dense", "B_MI", "ΔI_emp", "cert",
                 "missed", "prefill s", "s/tok", "dense L"):  # fmt: skip
        assert name in head
    assert set(rule) == {"-"}
    assert len(rows) == 3
    quest, dense, streaming = rows  # grouped by task: both "niah" rows come first
    assert quest.startswith("niah") and "quest" in quest
    assert dense.startswith("niah") and "dense" in dense
    assert streaming.startswith("ppl_kjv") and "streaming" in streaming

    assert " 87.7% " in quest  # accuracy, one decimal
    assert " 0.0123 " in quest  # δ mean, four significant digits
    assert " 1.2e-05 " in quest  # β_emp
    assert " 0.0891 " in quest  # δ max
    assert " 0.877 " in quest  # overlap
    assert " 12.5 " in quest  # ρ̂ %
    assert " 2048.0 " in quest  # KB/step
    assert " 25.0% " in quest  # vs dense
    assert " 0.015" in quest  # s/tok = 1.5 / 100
    assert quest.split()[-4] == "3"  # cert
    assert quest.split()[-3] == "2"  # missed
    assert quest.split()[-2] == "0.25"  # own prefill seconds
    assert " 256 " in quest  # budget

    assert " 12.346 " in streaming  # perplexity, three decimals
    assert " 1.235e-05 " in streaming
    assert streaming.split()[4] == "-"  # acc is nan
    assert quest.split()[5] == "-"  # ppl is nan
    assert streaming.split()[-3] == "-"  # no certificate
    assert dense.split()[2] == "-"  # dense budget is irrelevant
    assert dense.split()[-1] == "-"  # no decode steps


def test_table_alignment_and_width() -> None:
    text = report.format_table(sweep())
    (head, rule), rows = _table_rows(text)
    assert len(rows) == len(sweep())
    assert len(rule) <= 150
    # Every row ends at the rule's end: numbers are right-aligned to a common edge.
    width = report._display_width
    assert {width(row) for row in rows} == {len(rule)}
    assert width(head) == len(rule)
    # Each column's right edge in the header matches the rows' (ρ̂ has a combining mark).
    edge = head.index("ρ̂ %") + width("ρ̂ %") - 1  # display column of "%" (ASCII before it)
    for row in rows:
        assert row[edge] != " " and row[edge + 1] == " "


def test_table_groups_tasks_in_first_appearance_order() -> None:
    results = [
        _run("quest", "b_task", 64, accuracy=0.5),
        _run("quest", "a_task", 64, accuracy=0.5),
        _run("cis", "b_task", 64, accuracy=0.5),
        _run("cis", "a_task", 64, accuracy=0.5),
    ]
    _, rows = _table_rows(report.format_table(results))
    assert [(r.split()[0], r.split()[1]) for r in rows] == [
        ("b_task", "quest"), ("b_task", "cis"), ("a_task", "quest"), ("a_task", "cis"),
    ]  # fmt: skip


def test_table_rejects_empty_input() -> None:
    with pytest.raises(ValueError, match="no results"):
        report.format_table([])


# --------------------------------------------------------------------------------------------
# files


def test_jsonl_round_trip(tmp_path: Path) -> None:
    results = [
        _run("cis", "niah", 128, accuracy=0.5, options={"eps": 0.01, "levels": (2, 4)},
             samples=(_sample("niah", 0, 1.0), _sample("niah", 1, 0.0)),
             certificate_violations=2),
        _run("quest", "ppl_kjv", 64, perplexity=11.5, samples=(_sample("ppl_kjv", 0, NAN, 2.4),),
             b_mi=math.inf),
    ]  # fmt: skip
    path = report.write_jsonl(results, tmp_path / "deep" / "dir" / "r.jsonl")
    text = path.read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    records = [json.loads(line) for line in text.splitlines()]
    assert len(records) == 2
    first, second = records
    assert first["selector"] == "cis" and first["task"] == "niah"
    assert first["accuracy"] == 0.5 and first["perplexity"] is None
    assert first["options"] == {"budget": 128, "eps": 0.01, "levels": [2, 4]}
    assert first["certificate_violations"] == 2
    assert first["delta_mean"] == 0.0123
    assert [s["index"] for s in first["samples"]] == [0, 1]
    assert first["samples"][0]["answers"] == ["42"] and first["samples"][0]["nll"] is None
    assert second["accuracy"] is None and second["perplexity"] == 11.5
    assert second["certificate_violations"] is None
    assert second["b_mi"] is None  # inf is not valid JSON either
    assert second["samples"][0]["score"] is None and second["samples"][0]["nll"] == 2.4
    assert list(first) == [*results[0].row(), "samples"]


def test_to_json_safe_nested() -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    value = {"a": [1.0, NAN, (math.inf, {"b": -math.inf})], 3: Odd(), "t": True, "n": None}
    assert report.to_json_safe(value) == {
        "a": [1.0, None, [None, {"b": None}]], "3": "odd", "t": True, "n": None,
    }  # fmt: skip


def test_csv_header_and_values(tmp_path: Path) -> None:
    results = [
        _run("cis", "niah", 128, accuracy=0.5, options={"eps": 0.01, "name": "x, y"},
             certificate_violations=0),
        _run("quest", "ppl_kjv", 64, perplexity=11.5),
    ]  # fmt: skip
    path = report.write_csv(results, tmp_path / "sub" / "r.csv")
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        assert reader.fieldnames == list(results[0].row())
    assert len(rows) == 2
    first, second = rows
    assert first["selector"] == "cis" and first["budget"] == "128"
    assert first["accuracy"] == "0.5" and first["perplexity"] == ""
    assert first["certificate_violations"] == "0"
    assert first["delta_mean"] == "0.0123" and first["beta_emp"] == "1.2e-05"
    assert first["options"] == '{"budget":128,"eps":0.01,"name":"x, y"}'
    assert json.loads(first["options"]) == dict(results[0].options)
    assert second["accuracy"] == "" and second["perplexity"] == "11.5"
    assert second["certificate_violations"] == ""
    assert float(second["decode_seconds"]) == 1.5 and second["decode_tokens"] == "100"


# --------------------------------------------------------------------------------------------
# plot


def _legend_labels(fig: Any) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_plot_several_budgets_draws_curves_per_task() -> None:
    fig = report.figure(sweep())  # 2 tasks, 3 selectors over 4 budgets, dense
    axes = fig.axes
    assert len(axes) == 3 * 2  # rows: quality, β_emp, bytes; one column per task
    assert [ax.get_title() for ax in axes] == ["niah", "ppl_kjv"] * 3
    ylabels = [ax.get_ylabel() for ax in axes]
    assert ylabels[:2] == ["accuracy (%)", "perplexity"]
    assert ylabels[2:4] == ["β_emp (gap to oracle)"] * 2
    assert ylabels[4:] == ["bytes read vs dense (%)"] * 2
    assert {ax.get_xlabel() for ax in axes} == {"budget (KV positions)"}
    for ax in axes:
        curves = [ln for ln in ax.get_lines() if ln.get_label() != "dense"]
        assert [ln.get_label() for ln in curves] == ["quest", "cis", "h2o"]
        assert all(len(ln.get_xdata()) == 4 for ln in curves)
        assert [ln.get_label() for ln in ax.get_lines()].count("dense") == 1
    niah_acc = axes[0]
    quest = next(ln for ln in niah_acc.get_lines() if ln.get_label() == "quest")
    assert list(quest.get_xdata()) == [64, 128, 256, 512]
    assert quest.get_ydata()[0] == pytest.approx(40.0)  # accuracy in %
    assert _legend_labels(fig) == ["quest", "cis", "h2o", "dense"]


def test_plot_one_budget_draws_bars_per_selector_and_task() -> None:
    results = [
        _run("dense", "niah", 0, accuracy=1.0, beta_emp=9e-17, bytes_per_step=8192.0 * 1024),
        _run("quest", "niah", 128, accuracy=0.5, beta_emp=0.01, bytes_per_step=2048.0 * 1024),
        _run("cis", "niah", 128, accuracy=0.75, beta_emp=0.002, bytes_per_step=1024.0 * 1024),
        _run("dense", "passkey", 0, accuracy=1.0, beta_emp=0.0),
        _run("quest", "passkey", 128, accuracy=0.25, beta_emp=0.02),
        _run("cis", "passkey", 128, accuracy=1.0, beta_emp=0.001),
    ]
    fig = report.figure(results)
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == [
        "accuracy (%)", "β_emp (gap to oracle)", "bytes read vs dense (%)",
    ]  # fmt: skip
    for ax in axes:
        assert len(ax.patches) == 3 * 2  # one bar per selector and task
        assert [t.get_text() for t in ax.get_xticklabels()] == ["niah", "passkey"]
        assert ax.get_title() == "budget 128"
    acc = [round(p.get_height(), 6) for p in axes[0].patches]
    assert acc == [100.0, 100.0, 50.0, 25.0, 75.0, 100.0]  # dense, quest, cis; per task
    beta = [p.get_height() for p in axes[1].patches]
    assert beta[0] == 0.0  # float noise of dense shows as 0
    vs_dense = [round(p.get_height(), 6) for p in axes[2].patches]
    assert vs_dense[:6:2] == [100.0, 25.0, 12.5]  # niah: dense, quest, cis
    assert _legend_labels(fig) == ["dense", "quest", "cis"]


def test_plot_mixed_kinds_one_budget_has_accuracy_and_perplexity_panels() -> None:
    results = [
        _run("quest", "ppl_kjv", 128, perplexity=10.5),
        _run("quest", "niah", 128, accuracy=0.5),
        _run("dense", "ppl_kjv", 0, perplexity=10.0),
    ]
    axes = report.figure(results).axes
    assert [ax.get_ylabel() for ax in axes][:2] == ["accuracy (%)", "perplexity"]
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["niah"]
    assert [t.get_text() for t in axes[1].get_xticklabels()] == ["ppl_kjv"]


def test_plot_saves_the_figure(tmp_path: Path) -> None:
    path = report.plot(sweep(), tmp_path / "plots" / "all.png")
    assert path == tmp_path / "plots" / "all.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_all_nan_still_draws(tmp_path: Path) -> None:
    results = [_run("quest", "niah", 64, delta_mean=NAN, delta_max=NAN)]
    path = report.plot(results, tmp_path / "nan.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_rejects_empty_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no results"):
        report.plot([], tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_write_all(tmp_path: Path) -> None:
    paths = report.write_all(sweep(), tmp_path / "out")
    assert paths == {
        "jsonl": tmp_path / "out" / "results.jsonl",
        "csv": tmp_path / "out" / "results.csv",
        "png": tmp_path / "out" / "results.png",
    }
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    assert len(paths["jsonl"].read_text(encoding="utf-8").splitlines()) == len(sweep())
    with pytest.raises(ValueError, match="no results"):
        report.write_all([], tmp_path / "none")


# --------------------------------------------------------------------------------------------
# legend and consistent figures


def test_table_legend_explains_every_column() -> None:
    legend = report.TABLE_LEGEND
    assert legend == report.table_legend()
    head = report.format_table(sweep()).splitlines()[0]
    lines = legend.splitlines()
    for name, _, _ in report._COLUMNS:
        assert name in head
        assert any(line.strip().startswith(name + " ") for line in lines), name


def test_table_shows_float_noise_as_zero_and_dense_budget_as_missing() -> None:
    results = [
        _run("dense", "niah", 0, accuracy=1.0, beta_emp=9e-17, delta_mean=-3e-18),
        dataclasses.replace(_run("dense", "niah", 0, beta_emp=9e-17), budget=None),
    ]
    _, rows = _table_rows(report.format_table(results))
    for row in rows:
        cells = row.split()
        assert cells[2] == "-"  # budget, whether stored as 0 or None
        assert "9e-17" not in row and "e-18" not in row
    assert rows[0].split()[8] == "0"  # β_emp
    assert rows[0].split()[6] == "0"  # δ mean


def test_files_leave_a_missing_budget_blank(tmp_path: Path) -> None:
    dense = dataclasses.replace(_run("dense", "niah", 0, accuracy=1.0), budget=None)
    rows = list(csv.DictReader(report.write_csv([dense], tmp_path / "r.csv").open()))
    assert rows[0]["budget"] == ""
    record = json.loads(report.write_jsonl([dense], tmp_path / "r.jsonl").read_text())
    assert record["budget"] is None


def test_table_reports_quest_dense_layers_apart_from_budget() -> None:
    quest = _run("quest", "niah", 128, accuracy=0.5, options={"dense_layers": 2})
    cis = _run("cis", "niah", 128, accuracy=0.5)
    _, rows = _table_rows(report.format_table([quest, cis]))
    assert rows[0].split()[2:4] == ["128", "2"]
    assert rows[1].split()[2:4] == ["128", "-"]


def test_shared_prefill_is_reported_once() -> None:
    shared = [
        dataclasses.replace(
            _run(sel, "niah", 64, accuracy=0.5),
            prefill_seconds=0.0,
            prefill_shared=True,
            shared_prefill_seconds=1.75,
        )
        for sel in ("dense", "quest")
    ]
    own = _run("prhs", "niah", 64, accuracy=0.5)  # prefill_seconds 0.25, its own
    text = report.format_table([*shared, own])
    _, rows = _table_rows(text.split("\n\n")[0])
    assert [r.split()[-2] for r in rows] == ["shared", "shared", "0.25"]
    assert text.count("1.75") == 1
    assert "shared dense prefill: niah 1.75 s" in text
    no_shared = report.format_table([own])
    assert "shared dense prefill" not in no_shared


def _tau_sweep() -> list[RunResult]:
    """CIS over three cosine thresholds at one budget, beside dense and the oracle."""
    out = [
        _run("dense", "ppl_kjv", 0, perplexity=9.0, beta_emp=0.0, retrieval_ratio=NAN),
        _run("oracle", "ppl_kjv", 512, perplexity=9.1, beta_emp=0.0003, retrieval_ratio=100.0),
    ]
    for tau, rho, beta in ((0.6, 12.0, 0.04), (0.7, 24.0, 0.02), (0.8, 48.0, 0.008)):
        out.append(
            _run("cis", "ppl_kjv", 512, perplexity=9.0 + 10 * beta, beta_emp=beta,
                 retrieval_ratio=rho, options={"tau": tau, "block_size": 1})
        )  # fmt: skip
    return out


def test_varied_options_names_what_a_sweep_changed() -> None:
    assert report.varied_options(_tau_sweep()) == {"cis": ("tau",)}
    assert report.varied_options(sweep()) == {}  # budgets alone are not a 'set'


def test_table_of_a_sweep_says_each_rows_value() -> None:
    text = report.format_table(_tau_sweep())
    head, _, *rows = text.splitlines()
    assert head.split()[:4] == ["task", "selector", "budget", "set"]
    cells = [r.split() for r in rows[:5]]
    assert [c[3] for c in cells] == ["-", "-", "tau=0.6", "tau=0.7", "tau=0.8"]
    assert "set" not in report.format_table(sweep()).splitlines()[0].split()
    assert "  set " in report.TABLE_LEGEND


def test_plot_of_a_sweep_draws_curves_against_the_option_and_the_beta_rho_tradeoff() -> None:
    fig = report.figure(_tau_sweep())
    axes = fig.axes
    ylabels = [ax.get_ylabel() for ax in axes]
    assert ylabels == [
        "perplexity", "β_emp (gap to oracle)", "bytes read vs dense (%)",
        "ρ̂: decisions that retrieved (%)", "β_emp against ρ̂",
    ]  # fmt: skip
    assert [ax.get_xlabel() for ax in axes] == ["tau"] * 4 + ["ρ̂ (%)"]
    cis = next(ln for ln in axes[0].get_lines() if ln.get_label() == "cis")
    assert list(cis.get_xdata()) == [0.6, 0.7, 0.8]
    assert list(cis.get_ydata()) == pytest.approx([9.4, 9.2, 9.08])
    tradeoff = next(ln for ln in axes[4].get_lines() if ln.get_label() == "cis")
    assert list(tradeoff.get_xdata()) == [12.0, 24.0, 48.0]
    assert list(tradeoff.get_ydata()) == pytest.approx([0.04, 0.02, 0.008])
    # dense is the dashed reference of the quality panel; the oracle has no tau: no curve
    assert [ln.get_label() for ln in axes[0].get_lines()] == ["cis", "dense"]


def test_plot_of_a_switch_sweep_draws_one_bar_per_setting() -> None:
    results = [
        _run("dense", "ppl_kjv", 0, perplexity=9.0, beta_emp=0.0),
        _run("prhs", "ppl_kjv", 512, perplexity=9.2, options={"use_etf": False}),
        _run("prhs", "ppl_kjv", 512, perplexity=9.5, options={"use_etf": True}),
    ]
    fig = report.figure(results)
    assert _legend_labels(fig) == ["dense", "prhs use_etf=False", "prhs use_etf=True"]
    assert [round(p.get_height(), 6) for p in fig.axes[0].patches] == [9.0, 9.2, 9.5]
