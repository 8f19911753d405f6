"""The paper-table commands (table2, table4, table6, table8, fig6, fig7): their variants, their
folders, re-rendering from rows, and their argument errors."""

from __future__ import annotations

import json
import math

import pytest

from prhs_eval.cli import main
from prhs_eval.paper import PAPER_TABLES, _variants, fig7_cells, table4_cells, table_cells
from prhs_eval.runner import SelectorSpec


@pytest.mark.parametrize("name", sorted(PAPER_TABLES))
def test_every_variant_builds_and_labels_are_distinct(name):
    table = PAPER_TABLES[name]
    pairs = _variants(table, 128)
    labels = [(v.label, b) for v, b in pairs]
    assert len(set(labels)) == len(labels)
    for v, b in pairs:
        SelectorSpec(v.selector, dict(v.options))  # every option is one the selector has
        assert v.options.get("budget") == b
    if table.budgets:  # a sweep: every sparse variant at every budget, dense once
        assert sum(b is None for _, b in pairs) == 1
        assert {b for _, b in pairs if b} == set(table.budgets)


def _record(model, label, selector, task, budget=None, **kw):
    base = {"model": model, "label": label, "selector": selector, "task": task,
            "table_budget": budget, "accuracy": 1.0, "perplexity": math.nan,
            "retrieval_ratio": 20.0, "avg_kv": 100.0, "beta_emp": 0.01, "oracle_overlap": 0.9,
            "b_mi": 0.1, "delta_i_emp": 0.01, "context_len": 512, "num_samples": 1, "seed": 0,
            "environment": {"device": "cpu", "prhs_commit": "abc"}}  # fmt: skip
    return {**base, **kw}


def test_table_cells_average_over_tasks_and_leave_dense_blank():
    recs = [
        _record("m", "dense (original)", "dense", "passkey"),
        _record("m", "dense (original)", "dense", "niah_multikey", accuracy=0.0),
        _record("m", "CIS", "cis", "passkey", beta_emp=0.02),
        _record("m", "CIS", "cis", "niah_multikey", accuracy=0.5, beta_emp=0.04),
    ]
    head, rows = table_cells("table2", recs)
    assert head == ["model", "method", "ρ̂ %", "Avg KV", "β_emp", "passkey", "niah_multikey",
                    "mean acc"]  # fmt: skip
    assert rows[0] == ["m", "dense (original)", "—", "—", "—", "1.000", "0.000", "0.500"]
    assert rows[1] == ["m", "CIS", "20.0", "100", "0.0300", "1.000", "0.500", "0.750"]


def test_fig7_counts_where_the_bound_held():
    recs = [_record("m", "CIS", "cis", "passkey", 32, b_mi=0.1, delta_i_emp=0.01),
            _record("m", "CIS", "cis", "passkey", 64, b_mi=0.1, delta_i_emp=0.2)]  # fmt: skip
    _, rows = fig7_cells(recs)
    assert rows == [["m", "CIS", "2", "0.1", "0.105", "1/2"]]


def test_from_rows_rerenders_a_folder_and_joins_files(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(_record("m1", "CIS", "cis", "passkey", 32)) + "\n")
    b.write_text(json.dumps(_record("m2", "CIS", "cis", "passkey", 64)) + "\n")
    assert main(["fig6", "--from-rows", f"{a},{b}", "--out", str(tmp_path / "r")]) == 0
    folder = tmp_path / "r" / "fig6"
    assert (folder / "fig6.png").is_file()
    rows = (folder / "rows.jsonl").read_text().splitlines()
    assert len(rows) == 2
    assert "| m2 | CIS | 64 |" in (folder / "README.md").read_text()
    assert main(["fig7", "--from-rows", str(a), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "fig7" / "fig7.png").is_file()


def test_table4_renders_a_kernels_bench_file(tmp_path):
    bench = tmp_path / "bench.jsonl"
    rows = [
        {"part": "machine", "gpu": "NVIDIA H200", "torch": "2.11", "commit": "abc"},
        {"part": "bench", "op": "copy", "TB/s": 4.28},
        {"part": "bench", "B": 1, "T": 16384, "Hkv": 8, "op": "dense sdpa-cudnn", "ms": 0.0324,
         "vs_best_dense": 0.99},
        {"part": "bench", "B": 1, "T": 16384, "Hkv": 8, "op": "dense sdpa-efficient",
         "error": "RuntimeError: No available kernel."},
        {"part": "bench", "B": 16, "T": 65536, "Hkv": 8, "op": "cis step", "rho": 0.2,
         "ms": 0.4841, "vs_best_dense": 1.97, "vs_floor": 3.52, "rho_measured": 22.57},
    ]  # fmt: skip
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    head, cells = table4_cells(rows)
    assert head[3] == "op"
    assert len(cells) == 3 and cells[1][5].startswith("failed: RuntimeError")
    assert cells[2] == ["16", "65536", "8", "cis step", "0.20", "0.4841", "1.97", "3.52", "22.6"]
    assert main(["table4", "--bench", str(bench), "--out", str(tmp_path)]) == 0
    machine = json.loads((tmp_path / "table4" / "machine.json").read_text())
    assert machine["gpu"] == "NVIDIA H200" and machine["prhs_commit"] == "abc"
    assert "4.28 TB/s" in (tmp_path / "table4" / "README.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["table2", "--tasks", "mmlu"], "unknown task(s) ['mmlu']"),
        (["table2", "--tasks", "gsm8k"], "reads a local file"),
        (["table2", "--budget", "4096", "--context-len", "2048"], "budget 4096 >= context 2048"),
        (["fig6", "--budgets", "64,4096", "--context-len", "2048"], "budget 4096"),
        (["table6", "--models", "gpt-17"], "gpt-17"),
        (["table8", "--from-rows", "/nonexistent.jsonl"], "is not a file"),
        (["table4", "--bench", "/nonexistent.jsonl"], "is not a file"),
    ],
)
def test_bad_arguments_exit_2_before_any_work(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_table6_runs_on_smollm2_and_writes_its_folder(tmp_path):
    argv = ["table6", "--tasks", "passkey", "--context-len", "512", "--samples", "1",
            "--budget", "32", "--device", "cpu", "--quiet", "--out", str(tmp_path)]  # fmt: skip
    code = main(argv)
    assert code == 0
    folder = tmp_path / "table6"
    recs = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    labels = [r["label"] for r in recs]
    assert labels == [v.label for v in PAPER_TABLES["table6"].variants(32)]
    direct = recs[labels.index("DirectReuse (no dilation, no re-ranking; τ 0.8)")]
    assert direct["options"]["r"] == 0 and direct["options"]["rescore"] == 0
    assert all(r["selector"] == "dense" or r["avg_kv"] < 512 for r in recs)
    readme = (folder / "README.md").read_text()
    assert "RandomExpansion" in readme and "context 512 tokens" in readme
