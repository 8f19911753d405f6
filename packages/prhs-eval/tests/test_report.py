"""Tests of the run reports (prhs_eval.report): table, JSONL, CSV and PNG plot.

Results are built by hand with made-up metrics; nothing here loads a model.
"""

from __future__ import annotations

import csv
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
        _run("quest", "niah", 256, accuracy=0.8766, certificate_violations=3),
        _run("streaming", "ppl_kjv", 128, perplexity=12.34567, delta_mean=1.234567e-5),
        _run("dense", "niah", 0, accuracy=1.0, delta_mean=0.0, decode_tokens=0),
    ]
    text = report.format_table(results)
    (head, rule), rows = _table_rows(text)
    for name in ("task", "selector", "budget", "acc", "ppl", "δ mean", "δ max", "β_emp",
                 "overlap", "ρ̂ %", "Avg KV", "KB/step", "vs dense", "B_MI", "ΔI_emp", "cert",
                 "s/tok"):  # fmt: skip
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
    assert quest.split()[-2] == "3"  # cert
    assert " 256 " in quest  # budget

    assert " 12.346 " in streaming  # perplexity, three decimals
    assert " 1.235e-05 " in streaming
    assert streaming.split()[3] == "-"  # acc is nan
    assert quest.split()[4] == "-"  # ppl is nan
    assert streaming.split()[-2] == "-"  # no certificate
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


def _png_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` in pixels, read with matplotlib's PNG reader."""
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    return width, height


def _expected_size(panels: int, legend_rows: int) -> tuple[int, int]:
    return (
        round(report.PANEL_WIDTH * panels * report.DPI),
        round((report.PANEL_HEIGHT + report.LEGEND_ROW_HEIGHT * legend_rows) * report.DPI),
    )


def test_plot_accuracy_sweep(tmp_path: Path) -> None:
    results = [r for r in sweep() if r.task == "niah"]  # 3 selectors + dense, one task
    path = report.plot(results, tmp_path / "plots" / "niah.png")
    assert path == tmp_path / "plots" / "niah.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert _png_size(path) == _expected_size(panels=2, legend_rows=1) == (1440, 570)


def test_plot_mixed_tasks_adds_perplexity_panel(tmp_path: Path) -> None:
    # 3 selectors + dense + 2 tasks = 6 legend entries: one row; accuracy, perplexity, δ panels.
    path = report.plot(sweep(), tmp_path / "mixed.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert _png_size(path) == _expected_size(panels=3, legend_rows=1)


def test_plot_perplexity_only_single_budget(tmp_path: Path) -> None:
    results = [
        _run("quest", "ppl_kjv", 128, perplexity=10.5, delta_mean=0.02),
        _run("h2o", "ppl_kjv", 128, perplexity=14.0, delta_mean=0.0),  # δ = 0: symlog
        _run("dense", "ppl_kjv", 0, perplexity=10.0, delta_mean=0.0),
    ]
    path = report.plot(results, tmp_path / "ppl.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert _png_size(path) == _expected_size(panels=2, legend_rows=1)


def test_plot_many_legend_entries_grow_the_figure(tmp_path: Path) -> None:
    results = [_run(f"sel{i}", "niah", 64 * (j + 1), accuracy=0.1 * i, delta_mean=0.01 * (i + 1))
               for i in range(8) for j in range(2)]  # fmt: skip
    path = report.plot(results, tmp_path / "many.png")
    assert _png_size(path) == _expected_size(panels=2, legend_rows=2)


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
