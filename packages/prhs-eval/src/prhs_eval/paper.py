"""The paper's accuracy tables and figures, on the offline models and tasks.

Each analog is a fixed set of *variants* (a label, a selector, its options) run by
:func:`prhs_eval.runner.compare` on identical samples of every task, one model after another,
then written by :func:`prhs_eval.tables.write_table_folder`:

- ``table2`` (Table II): dense, H2O, Quest, HShare, oracle, CIS and certified CIS at one budget;
- ``table6`` (Table VI, panel A): CIS against budget- and retrieval-matched controls (HShare,
  DirectReuse: the anchor's list reused as it is, RandomExpansion: as many extra blocks as the
  dilation, drawn at random, the dilation alone, CIS with one global threshold, CIS
  calibrated on each prompt);
- ``table8`` (Table VIII): PrHS's hyperparameters swept one at a time (CIS ``s``, ``τ``, ``r``;
  PSAW ``φ``, ``α``; ETF ``ψ``), with a perplexity task beside the retrieval ones;
- ``fig6`` (Fig. 6/12): accuracy, ``β_emp`` and oracle overlap against the budget, for CIS,
  HShare, Quest and oracle;
- ``fig7`` (Fig. 7): the measured routing-MI perturbation ``ΔI_emp`` against its bound ``B_MI``,
  and the accuracy lost against ``ΔI_emp``, over fig6's runs (or its own).

The paper's tasks (GSM8K, CoQA, LongBench v2) cannot be reached offline: these run the offline
retrieval tasks (pass key and NIAH; multi-key NIAH and variable tracking in the figures) and
KJV perplexity (ppl: the last 64 tokens of each window scored through decode); the readers
and scorers for the public benchmarks are in :mod:`prhs_eval.scoring`. Accuracy is the task's
score, every number is sparse against dense on the same (dequantized) model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PAPER_TABLES", "PaperTable", "Variant", "run_paper_table"]

RETRIEVAL_TASKS = ("passkey", "niah_multikey", "variable_tracking")
#: The tables' default: two retrieval tasks the small offline models solve densely at 2k, and
#: perplexity, the most sensitive to what a selection drops.
TABLE_TASKS = ("passkey", "niah_single", "perplexity")


@dataclass(frozen=True)
class Variant:
    """One row: ``label`` (what the table prints), a registered ``selector`` and options."""

    label: str
    selector: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PaperTable:
    """A paper analog: its variants at a budget, default tasks, and how its folder looks."""

    name: str
    title: str
    variants: Callable[[int], list[Variant]]
    tasks: tuple[str, ...]
    budgets: tuple[int, ...] | None = None  # a sweep over budgets (figures): every variant
    note: str = ""


def _table2(k: int) -> list[Variant]:
    return [
        Variant("dense (original)", "dense"),
        Variant("H2O", "h2o", {"budget": k}),
        Variant("Quest", "quest", {"budget": k}),
        Variant("HShare", "hshare", {"budget": k}),
        Variant("oracle top-k", "oracle", {"budget": k}),
        Variant("CIS", "cis", {"budget": k}),
        Variant("CIS certified (δ ≤ 0.05)", "cis", {"budget": k, "delta_max": 0.05}),
    ]


def _table6(k: int) -> list[Variant]:
    return [
        Variant("dense (original)", "dense"),
        Variant("HShare-matched", "hshare", {"budget": k}),
        Variant("DirectReuse (no dilation, no re-ranking; τ 0.8)", "cis",
                {"budget": k, "tau": 0.8, "r": 0, "rescore": 0}),
        Variant("RandomExpansion (random extras, no re-ranking; τ 0.8)", "cis",
                {"budget": k, "tau": 0.8, "expansion": "random", "rescore": 0}),
        Variant("CIS dilation, no re-ranking (τ 0.8)", "cis",
                {"budget": k, "tau": 0.8, "rescore": 0}),
        Variant("CIS, global-frozen τ 0.8", "cis", {"budget": k, "tau": 0.8}),
        Variant("CIS, τ calibrated per prompt", "cis", {"budget": k}),
    ]  # fmt: skip


def _table8(k: int) -> list[Variant]:
    rows = [Variant("dense (original)", "dense")]
    for s, tau, r in ((1, "auto", 1), (1, 0.8, 1), (8, 0.7, 1), (8, 0.8, 2), (16, 0.8, 1)):
        rows.append(
            Variant(f"CIS s={s} τ={tau} r={r}", "cis", {"budget": k, "block_size": s, "tau": tau,
                                                       "r": r})
        )  # fmt: skip
    for phi, alpha in ((0.5, 1.0), (0.7, 1.0), (0.5, 2.0)):
        opts = {"budget": k, "use_psaw": True, "phi": phi, "alpha": alpha}
        rows.append(Variant(f"CPE +PSAW φ={phi} α={alpha}", "prhs", opts))
    for psi in (0.5, 0.7):
        rows.append(
            Variant(f"CPE +ETF ψ={psi}", "prhs", {"budget": k, "use_etf": True, "psi": psi})
        )
    return rows


def _fig6(k: int) -> list[Variant]:
    return [
        Variant("dense (original)", "dense"),
        Variant("oracle top-k", "oracle", {"budget": k}),
        Variant("CIS", "cis", {"budget": k}),
        Variant("HShare", "hshare", {"budget": k}),
        Variant("Quest", "quest", {"budget": k}),
    ]


PAPER_TABLES: dict[str, PaperTable] = {
    "table2": PaperTable(
        "table2",
        "Table II analog: methods at one budget",
        _table2,
        TABLE_TASKS,
        note="Accuracy per task (mean score of its samples), ρ̂ = the share of (step, layer, KV "
        "head) decisions that scored every key, Avg KV = positions read per KV head and step, "
        "β_emp = mean retained-mass gap to the oracle of the same size; ppl: KJV windows, the last "
        "64 tokens of each scored through decode.",
    ),
    "table6": PaperTable(
        "table6",
        "Table VI analog (panel A): CIS against matched controls",
        _table6,
        TABLE_TASKS,
        note="DirectReuse reuses the anchor's list as it is: no dilation (r=0) and no "
        "re-ranking (rescore=0). RandomExpansion adds as many blocks as the dilation does, drawn "
        "uniformly from the context (expansion='random'). The next row is CIS's dilation with "
        "the same rule, so the three differ only in what a reuse adds; the last two re-rank "
        "the anchor's pool at each reuse (rescore, the default).",
    ),
    "table8": PaperTable(
        "table8",
        "Table VIII analog: PrHS hyperparameters",
        _table8,
        TABLE_TASKS,
        note="ppl: KJV windows scored through decode (the last 64 tokens of each window). PSAW "
        "and ETF change the prefill; CIS the decode.",
    ),
    "fig6": PaperTable(
        "fig6",
        "Fig. 6 analog: accuracy and selection quality against the budget",
        _fig6,
        RETRIEVAL_TASKS,
        budgets=(32, 64, 128, 256),
    ),
    "fig7": PaperTable(
        "fig7",
        "Fig. 7 analog: routing-MI perturbation against its certificate",
        _fig6,
        RETRIEVAL_TASKS,
        budgets=(32, 64, 128, 256),
        note="Each point: one (model, method, budget, task). ΔI_emp: the measured change of the "
        "routing mutual information; B_MI: the bound the theory gives from the dropped mass. "
        "A bound holds where the point is under y = x.",
    ),
}


def _variants(table: PaperTable, budget: int) -> list[tuple[Variant, int | None]]:
    if table.budgets is None:
        return [(v, budget if "budget" in v.options else None) for v in table.variants(budget)]
    out: list[tuple[Variant, int | None]] = []
    seen_dense = False
    for b in table.budgets:
        for v in table.variants(b):
            if "budget" not in v.options:
                if seen_dense:
                    continue
                seen_dense = True
                out.append((v, None))
            else:
                out.append((v, b))
    return out


def run_paper_table(
    name: str,
    models: Sequence[str],
    *,
    tasks: Sequence[str] | None = None,
    context_len: int = 2048,
    samples: int = 4,
    budget: int = 128,
    budgets: Sequence[int] | None = None,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run one analog on every model; one record per (model, variant, task): the
    :meth:`~prhs_eval.results.RunResult.row` plus ``label``. ``budgets`` replaces a figure's
    sweep (``budget`` is the tables' one budget)."""
    from dataclasses import replace

    from prhs_eval.models import load_model
    from prhs_eval.runner import SelectorSpec, compare

    table = PAPER_TABLES[name]
    if budgets and table.budgets is not None:
        table = replace(table, budgets=tuple(budgets))
    tasks = tuple(tasks or table.tasks)
    pairs = _variants(table, budget)
    specs = [SelectorSpec(v.selector, dict(v.options)) for v, _ in pairs]
    records: list[dict[str, Any]] = []
    for model in models:
        kw = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        loaded = load_model(model, **kw)
        results = compare(
            loaded, specs, tasks, context_len=context_len, num_samples=samples, seed=seed,
            progress=progress, measure=True,
        )  # fmt: skip
        for i, res in enumerate(results):
            v, b = pairs[i % len(pairs)]
            rec = res.row()
            rec["label"] = v.label
            rec["table_budget"] = b
            records.append(rec)
        del loaded
    return records


# -- presentation ------------------------------------------------------------------------------


def _num(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return format(x, spec)


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _selection_cells(recs: Sequence[Mapping[str, Any]]) -> list[str]:
    sparse = [r for r in recs if r["selector"] != "dense"]
    if not sparse:
        return ["—", "—", "—"]
    return [
        _num(_mean([r["retrieval_ratio"] for r in sparse]), ".1f"),
        _num(_mean([r["avg_kv"] for r in sparse]), ".0f"),
        _num(_mean([r["beta_emp"] for r in sparse]), ".4f"),
    ]


def _score(rec: Mapping[str, Any]) -> float:
    return rec["perplexity"] if rec["task"] == "perplexity" else rec["accuracy"]


def table_cells(
    name: str, records: Sequence[Mapping[str, Any]]
) -> tuple[list[str], list[list[str]]]:
    """(head, rows) of an analog's Markdown table from its records."""
    table = PAPER_TABLES[name]
    models = list(dict.fromkeys(r["model"] for r in records))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    labels = list(dict.fromkeys((r["label"], r.get("table_budget")) for r in records))
    task_head = [("ppl" if t == "perplexity" else t) for t in tasks]
    if table.budgets is None:
        head = ["model", "method", "ρ̂ %", "Avg KV", "β_emp", *task_head, "mean acc"]
    else:
        head = ["model", "method", "budget", "ρ̂ %", "Avg KV", "β_emp", "overlap", *task_head,
                "mean acc"]  # fmt: skip
    rows = []
    for model in models:
        for label, b in labels:
            recs = [r for r in records if r["model"] == model and r["label"] == label
                    and r.get("table_budget") == b]  # fmt: skip
            if not recs:
                continue
            cells = [model, label]
            if table.budgets is not None:
                cells.append("—" if b is None else str(b))
            cells += _selection_cells(recs)
            if table.budgets is not None:
                sparse = [r for r in recs if r["selector"] != "dense"]
                cells.append(_num(_mean([r["oracle_overlap"] for r in sparse]), ".3f")
                             if sparse else "—")  # fmt: skip
            by_task = {r["task"]: r for r in recs}
            for t in tasks:
                r = by_task.get(t)
                cells.append("—" if r is None else _num(_score(r), ".2f" if t == "perplexity"
                                                                else ".3f"))  # fmt: skip
            cells.append(_num(_mean([r["accuracy"] for r in recs if r["task"] != "perplexity"]),
                              ".3f"))  # fmt: skip
            rows.append(cells)
    return head, rows


def figure(name: str, records: Sequence[Mapping[str, Any]], path: Any) -> None:
    """fig6: accuracy, β_emp and overlap against the budget; fig7: ΔI_emp against B_MI, and
    accuracy lost against ΔI_emp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    sparse = [r for r in records if r["selector"] != "dense" and r["task"] != "perplexity"]
    if name == "fig6":
        fig, axes = plt.subplots(len(models), 3, figsize=(13, 3.4 * len(models)), squeeze=False)
        for row, model in zip(axes, models, strict=True):
            dense = _mean([r["accuracy"] for r in records
                           if r["model"] == model and r["selector"] == "dense"])  # fmt: skip
            for label in dict.fromkeys(r["label"] for r in sparse if r["model"] == model):
                mine = [r for r in sparse if r["model"] == model and r["label"] == label]
                budgets = sorted({r["table_budget"] for r in mine})
                for ax, key in zip(row, ("accuracy", "beta_emp", "oracle_overlap"), strict=True):
                    ys = [_mean([r[key] for r in mine if r["table_budget"] == b]) for b in budgets]
                    ax.plot(budgets, ys, marker="o", label=label)
            if math.isfinite(dense):
                row[0].axhline(dense, color="gray", ls="--", label="dense")
            for ax, title in zip(row, ("accuracy (mean over tasks)", "β_emp", "oracle overlap"),
                                 strict=True):  # fmt: skip
                ax.set_xscale("log", base=2)
                ax.set_xlabel("budget k")
                ax.set_title(f"{model}: {title}", fontsize=9)
            row[0].legend(fontsize=7)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        dense_acc = {
            (r["model"], r["task"]): r["accuracy"] for r in records if r["selector"] == "dense"
        }
        markers = "osD^v<>"
        for mi, model in enumerate(models):
            for label in dict.fromkeys(r["label"] for r in sparse if r["model"] == model):
                ok = [r for r in sparse if math.isfinite(r["b_mi"] + r["delta_i_emp"])]
                mine = [r for r in ok if r["model"] == model and r["label"] == label]
                name = label if len(models) == 1 else f"{model}: {label}"
                marker = markers[mi % len(markers)]
                axes[0].scatter([r["b_mi"] for r in mine], [r["delta_i_emp"] for r in mine],
                                s=16, marker=marker, label=name)  # fmt: skip
                drops = [dense_acc.get((model, r["task"]), math.nan) - r["accuracy"] for r in mine]
                axes[1].scatter([r["delta_i_emp"] for r in mine], drops, s=16, marker=marker,
                                label=name)  # fmt: skip
        lo = min(
            [r["b_mi"] for r in sparse if math.isfinite(r["b_mi"]) and r["b_mi"] > 0] or [1e-4]
        )
        hi = max([r["b_mi"] for r in sparse if math.isfinite(r["b_mi"])] or [1.0])
        axes[0].plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        axes[0].set_xscale("log")
        axes[0].set_yscale("log")
        axes[0].set_xlabel("B_MI (certificate)")
        axes[0].set_ylabel("ΔI_emp (measured)")
        axes[1].set_xscale("log")
        axes[1].set_xlabel("ΔI_emp")
        axes[1].set_ylabel("dense − sparse accuracy")
        for ax in axes:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig7_cells(records: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """fig7's table: per (model, method), ΔI_emp and B_MI averaged over budgets and tasks, and
    in how many of its points the bound held."""
    head = ["model", "method", "points", "mean B_MI", "mean ΔI_emp", "bound held"]
    rows = []
    sparse = [r for r in records if r["selector"] != "dense" and r["task"] != "perplexity"]
    for model in dict.fromkeys(r["model"] for r in sparse):
        for label in dict.fromkeys(r["label"] for r in sparse if r["model"] == model):
            mine = [r for r in sparse if r["model"] == model and r["label"] == label
                    and math.isfinite(r["b_mi"]) and math.isfinite(r["delta_i_emp"])]  # fmt: skip
            held = sum(r["delta_i_emp"] <= r["b_mi"] for r in mine)
            b_mi = _num(_mean([r["b_mi"] for r in mine]), ".4g")
            d_i = _num(_mean([r["delta_i_emp"] for r in mine]), ".4g")
            rows.append([model, label, str(len(mine)), b_mi, d_i, f"{held}/{len(mine)}"])
    return head, rows


TABLE4_HEAD = ["B", "T", "Hkv", "op", "forced ρ", "ms", "× best dense", "× floor", "ρ̂ % measured"]


def table4_cells(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Table IV's cells from the ``bench`` rows ``benchmarks/scripts/kernels.py bench`` writes
    (an op that failed on a shape keeps its row, with its error)."""
    out = []
    for r in rows:
        if r.get("part") != "bench" or "B" not in r:
            continue
        base = [str(r["B"]), str(r["T"]), str(r.get("Hkv", "—")), str(r["op"]),
                _num(r.get("rho"), ".2f")]  # fmt: skip
        if "ms" not in r:
            error = " ".join(str(r.get("error", "no time recorded")).split())[:80]
            out.append([*base, f"failed: {error}", "—", "—", "—"])
            continue
        out.append([
            *base, _num(r["ms"], ".4f"), _num(r.get("vs_best_dense"), ".2f"),
            _num(r.get("vs_floor"), ".2f"), _num(r.get("rho_measured"), ".1f"),
        ])  # fmt: skip
    return list(TABLE4_HEAD), out
