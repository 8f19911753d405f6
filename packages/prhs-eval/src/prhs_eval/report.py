"""Reports of evaluation runs: a terminal table, JSONL and CSV files, and a PNG plot.

Every function takes a sequence of :class:`~prhs_eval.results.RunResult` (one selector with its
options on one task) in the order the runs were made:

- :func:`format_table` renders the plain-text table the CLI prints;
- :func:`write_jsonl` writes one JSON record per run, samples included (``nan`` → ``null``);
- :func:`write_csv` writes one flat row per run (``nan`` → empty cell, options as JSON);
- :func:`plot` draws accuracy (or perplexity) and mean ``δ`` against the budget;
- :func:`write_all` writes all three files into one folder.

Plots are rendered with the Agg canvas on a bare :class:`matplotlib.figure.Figure`, so no
window is ever opened and pyplot's global state is left alone.
"""

from __future__ import annotations

import csv
import json
import math
import os
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prhs_eval.results import RunResult

__all__ = [
    "DENSE",
    "DPI",
    "LEGEND_ROW_HEIGHT",
    "PANEL_HEIGHT",
    "PANEL_WIDTH",
    "format_table",
    "plot",
    "to_json_safe",
    "write_all",
    "write_csv",
    "write_jsonl",
]

DENSE = "dense"
"""Selector name of dense attention, whose budget is irrelevant (a reference, not a curve)."""

DPI = 120
"""Resolution of :func:`plot` (dots per inch)."""

PANEL_WIDTH = 6.0
"""Width of one plot panel in inches."""

PANEL_HEIGHT = 4.5
"""Height of the plot (panels, axis labels and title) in inches, legend excluded."""

LEGEND_ROW_HEIGHT = 0.25
"""Height added below the panels per legend row, in inches."""

_LEGEND_COLUMNS = 6
_MAX_TABLE_WIDTH = 150
_MISSING = "-"

PathLike = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------
# helpers


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _finite(x: float | int | None) -> bool:
    return x is not None and _is_number(x) and math.isfinite(x)


def _require(results: Sequence[RunResult], what: str) -> list[RunResult]:
    items = list(results)
    if not items:
        raise ValueError(f"{what}: no results to report (got an empty sequence)")
    return items


def _group_by_task(results: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    """Results grouped by task, tasks in order of first appearance, runs in input order."""
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(r.task, []).append(r)
    return groups


def to_json_safe(value: Any) -> Any:
    """Convert ``value`` recursively into something :func:`json.dumps` writes as strict JSON.

    Parameters
    ----------
    value:
        Any nesting of mappings, sequences and scalars.

    Returns
    -------
    Any
        The same structure with mappings as ``dict`` (keys as ``str``), tuples, lists and sets
        as ``list``, non-finite floats (``nan``, ``±inf``) as ``None`` and objects JSON does not
        know (dtypes, devices, paths, ...) as their ``str``.
    """
    if value is None or isinstance(value, bool | str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_json_safe(v) for v in value]
    item = getattr(value, "item", None)  # NumPy / torch scalars
    if callable(item):
        try:
            return to_json_safe(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


# --------------------------------------------------------------------------------------------
# table


def _display_width(text: str) -> int:
    """Terminal columns taken by ``text`` (combining marks take none, wide characters two)."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def _pad(text: str, width: int, right: bool) -> str:
    fill = " " * max(0, width - _display_width(text))
    return fill + text if right else text + fill


def _fmt(spec: str) -> Callable[[float | int | None], str]:
    def fmt(x: float | int | None) -> str:
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return _MISSING
        return format(x, spec)

    return fmt


def _fmt_percent(x: float | None) -> str:
    return _MISSING if x is None or math.isnan(x) else f"{100.0 * x:.1f}%"


def _ratio(num: float, den: float) -> float:
    if not (_finite(num) and _finite(den)) or den == 0:
        return math.nan
    return num / den


_g4 = _fmt(".4g")
_g3 = _fmt(".3g")
_f3 = _fmt(".3f")
_f1 = _fmt(".1f")

# (header, right-aligned, cell)
_COLUMNS: tuple[tuple[str, bool, Callable[[RunResult], str]], ...] = (
    ("task", False, lambda r: r.task),
    ("selector", False, lambda r: r.selector),
    ("budget", True, lambda r: _MISSING if r.selector == DENSE else str(r.budget)),
    ("acc", True, lambda r: _fmt_percent(r.accuracy)),
    ("ppl", True, lambda r: _f3(r.perplexity)),
    ("δ mean", True, lambda r: _g4(r.metrics.delta_mean)),
    ("δ max", True, lambda r: _g4(r.metrics.delta_max)),
    ("β_emp", True, lambda r: _g4(r.metrics.beta_emp)),
    ("overlap", True, lambda r: _f3(r.metrics.oracle_overlap)),
    ("ρ̂ %", True, lambda r: _f1(r.metrics.retrieval_ratio)),
    ("Avg KV", True, lambda r: _f1(r.metrics.avg_kv)),
    ("KB/step", True, lambda r: _f1(r.metrics.bytes_per_step / 1024.0)),
    (
        "vs dense",
        True,
        lambda r: _fmt_percent(_ratio(r.metrics.bytes_per_step, r.metrics.dense_bytes_per_step)),
    ),
    ("B_MI", True, lambda r: _g3(r.metrics.b_mi)),
    ("ΔI_emp", True, lambda r: _g3(r.metrics.delta_i_emp)),
    ("cert", True, lambda r: _fmt("d")(r.metrics.certificate_violations)),
    ("s/tok", True, lambda r: _g3(_ratio(r.decode_seconds, r.decode_tokens))),
)


def format_table(results: Sequence[RunResult]) -> str:
    """Render results as a plain-text table for the terminal.

    One row per result, rows grouped by task (tasks in order of first appearance, runs in input
    order), under a header and a rule line. Numbers are right-aligned; missing values (``nan``,
    no certificate, no decode steps) show as ``-``.

    Columns: ``task``, ``selector`` (name), ``budget`` (``-`` for dense),
    ``acc`` (% with one decimal), ``ppl`` (three decimals), ``δ mean``, ``δ max`` and ``β_emp``
    (four significant digits), ``overlap`` (oracle overlap), ``ρ̂ %``, ``Avg KV``, ``KB/step``
    (bytes read per decode step / 1024), ``vs dense`` (bytes read as % of dense), ``B_MI`` and
    ``ΔI_emp`` (three significant digits), ``cert`` (certificate violations) and ``s/tok``
    (decode seconds per decode step).

    Parameters
    ----------
    results:
        The runs to show.

    Returns
    -------
    str
        The table, lines joined by ``\\n``, ending with a newline.

    Raises
    ------
    ValueError
        If ``results`` is empty.
    """
    items = _require(results, "format_table")
    ordered = [r for group in _group_by_task(items).values() for r in group]
    cells = [[cell(r) for _, _, cell in _COLUMNS] for r in ordered]
    headers = [h for h, _, _ in _COLUMNS]
    widths = [
        max(_display_width(row[i]) for row in [headers, *cells]) for i in range(len(_COLUMNS))
    ]
    sep = "  "
    if sum(widths) + len(sep) * (len(widths) - 1) > _MAX_TABLE_WIDTH:
        sep = " "

    def line(row: Sequence[str]) -> str:
        return sep.join(
            _pad(text, w, right)
            for text, w, (_, right, _) in zip(row, widths, _COLUMNS, strict=True)
        ).rstrip()

    head = line(headers)
    rule = "-" * (sum(widths) + len(sep) * (len(widths) - 1))
    return "\n".join([head, rule, *(line(row) for row in cells)]) + "\n"


# --------------------------------------------------------------------------------------------
# files


def write_jsonl(results: Sequence[RunResult], path: PathLike) -> Path:
    """Write one JSON line per run (:meth:`RunResult.record`, samples included).

    Non-finite floats are written as ``null`` (strict JSON, never the token ``NaN``); parent
    folders are created.

    Parameters
    ----------
    results:
        The runs to write (an empty sequence writes an empty file).
    path:
        The ``.jsonl`` file to (over)write.

    Returns
    -------
    Path
        ``path``.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in results:
            record = to_json_safe(r.record())
            f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
    return out


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return "" if math.isnan(value) else repr(value)
    if isinstance(value, Mapping):
        return json.dumps(to_json_safe(value), separators=(",", ":"), allow_nan=False)
    return value


def write_csv(results: Sequence[RunResult], path: PathLike) -> Path:
    """Write one CSV row per run (:meth:`RunResult.row`).

    Columns follow the key order of :meth:`RunResult.row`; ``options`` is a compact JSON string;
    ``nan`` and ``None`` are empty cells. Parent folders are created.

    Parameters
    ----------
    results:
        The runs to write (an empty sequence writes an empty file).
    path:
        The ``.csv`` file to (over)write.

    Returns
    -------
    Path
        ``path``.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [r.row() for r in results]
    with out.open("w", encoding="utf-8", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            for row in rows:
                writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    return out


# --------------------------------------------------------------------------------------------
# plot


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_LINESTYLES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def _title(items: Sequence[RunResult]) -> str:
    models = list(dict.fromkeys(r.model for r in items))
    lengths = sorted({r.context_len for r in items})
    ctx = "/".join(str(n) for n in lengths)
    return f"{', '.join(models)} — context {ctx} tokens"


def _value_panels(groups: Mapping[str, list[RunResult]]) -> list[tuple[str, str]]:
    """``(attribute, y label)`` of the quality panels: accuracy and/or perplexity."""
    has_acc = any(_finite(r.accuracy) for rs in groups.values() for r in rs)
    has_ppl = any(
        not any(_finite(r.accuracy) for r in rs) and any(_finite(r.perplexity) for r in rs)
        for rs in groups.values()
    )
    panels = []
    if has_acc or not has_ppl:
        panels.append(("accuracy", "accuracy (%)"))
    if has_ppl:
        panels.append(("perplexity", "perplexity"))
    return panels


def _task_metric(runs: Sequence[RunResult]) -> str:
    return "accuracy" if any(_finite(r.accuracy) for r in runs) else "perplexity"


def _y(r: RunResult, attr: str) -> float:
    if attr == "accuracy":
        return 100.0 * r.accuracy
    if attr == "perplexity":
        return r.perplexity
    return r.metrics.delta_mean


def plot(results: Sequence[RunResult], path: PathLike) -> Path:
    """Draw quality and mean ``δ`` against the budget into a PNG.

    Panels, side by side: accuracy in % (tasks with an accuracy), perplexity (tasks without
    one; a third panel only when both kinds of task are present) and mean dropped mass ``δ``
    (log axis when every plotted ``δ`` is positive, else symlog). Each selector gets a
    colour and marker, each task a line style; a selector with one budget shows as points.
    Dense attention, whose budget is irrelevant, is a dashed black horizontal reference in
    the quality panels (it has ``δ = 0`` and is left out of the ``δ`` panel). The title names
    the model(s) and context length(s); the legend sits below the panels.

    The image is ``PANEL_WIDTH × DPI`` pixels wide per panel and
    ``(PANEL_HEIGHT + LEGEND_ROW_HEIGHT × legend rows) × DPI`` pixels high, with up to six
    legend entries per row (selectors, then tasks when there are several).

    Parameters
    ----------
    results:
        The runs to draw.
    path:
        The ``.png`` file to (over)write; parent folders are created.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        If ``results`` is empty.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullLocator

    items = _require(results, "plot")
    groups = _group_by_task(items)
    tasks = list(groups)
    multi_task = len(tasks) > 1
    labels = list(dict.fromkeys(r.selector for r in items if r.selector != DENSE))
    has_dense = any(r.selector == DENSE for r in items)
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    markers = {label: _MARKERS[i % len(_MARKERS)] for i, label in enumerate(labels)}
    styles = {task: _LINESTYLES[i % len(_LINESTYLES)] for i, task in enumerate(tasks)}

    handles: list[Line2D] = [
        Line2D([], [], color=colors[lb], marker=markers[lb], linestyle="-", label=lb)
        for lb in labels
    ]
    if has_dense:
        handles.append(Line2D([], [], color="black", linestyle="--", label="dense (any budget)"))
    if multi_task:
        handles += [
            Line2D([], [], color="0.35", linestyle=styles[t], label=f"task: {t}") for t in tasks
        ]
    ncols = max(1, min(_LEGEND_COLUMNS, len(handles)))
    legend_rows = math.ceil(len(handles) / ncols) if handles else 0

    panels = [*_value_panels(groups), ("delta", "mean δ (dropped mass)")]
    fig = Figure(
        figsize=(PANEL_WIDTH * len(panels), PANEL_HEIGHT + LEGEND_ROW_HEIGHT * legend_rows),
        dpi=DPI,
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    budgets = sorted({r.budget for r in items if r.selector != DENSE})

    for ax, (attr, ylabel) in zip(axes, panels, strict=True):
        deltas: list[float] = []
        dense_tasks: dict[float, list[str]] = {}
        for task, runs in groups.items():
            if attr != "delta" and _task_metric(runs) != attr:
                continue
            for label in labels:
                pts = sorted(
                    (r.budget, _y(r, attr))
                    for r in runs
                    if r.selector == label and _finite(_y(r, attr))
                )
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                if attr == "delta":
                    deltas += ys
                ax.plot(
                    xs,
                    ys,
                    color=colors[label],
                    marker=markers[label],
                    linestyle=styles[task],
                    linewidth=1.5,
                    markersize=6,
                )
            dense = [_y(r, attr) for r in runs if r.selector == DENSE and _finite(_y(r, attr))]
            if attr != "delta" and dense:
                y = sum(dense) / len(dense)
                ax.axhline(y, color="black", linestyle="--", linewidth=1.2, alpha=0.8, zorder=1)
                dense_tasks.setdefault(round(y, 9), []).append(task)
        if multi_task:
            # One label per reference line: tasks whose dense values coincide share it.
            for y, names in dense_tasks.items():
                ax.annotate(
                    f"dense: {', '.join(names)}",
                    xy=(0.01, y),
                    xycoords=("axes fraction", "data"),
                    xytext=(0, 2),
                    textcoords="offset points",
                    fontsize=7,
                    color="0.25",
                    va="bottom",
                    ha="left",
                )
        if attr == "delta":
            if deltas and all(d > 0 for d in deltas):
                ax.set_yscale("log")
            elif deltas:
                positive = [d for d in deltas if d > 0]
                # Linear below the decade under the smallest positive δ, log above it.
                floor = min(positive) if positive else 1e-6
                ax.set_yscale("symlog", linthresh=10.0 ** math.floor(math.log10(floor)))
        if budgets:
            if budgets[0] > 0 and budgets[-1] >= 4 * budgets[0]:
                ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.xaxis.set_minor_locator(NullLocator())
            if len(budgets) == 1:
                b = budgets[0]
                ax.set_xlim(*((b * 0.5, b * 1.5) if b > 0 else (-1, 1)))
        ax.set_xlabel("budget (KV positions)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)

    fig.suptitle(_title(items))
    if handles:
        fig.legend(
            handles=handles, loc="outside lower center", ncols=ncols, frameon=False, fontsize=9
        )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, format="png")
    return out


def write_all(results: Sequence[RunResult], out_dir: PathLike) -> dict[str, Path]:
    """Write ``results.jsonl``, ``results.csv`` and ``results.png`` into ``out_dir``.

    Parameters
    ----------
    results:
        The runs to write.
    out_dir:
        The folder (created if missing).

    Returns
    -------
    dict of str to Path
        ``{"jsonl": ..., "csv": ..., "png": ...}``.

    Raises
    ------
    ValueError
        If ``results`` is empty.
    """
    items = _require(results, "write_all")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "jsonl": write_jsonl(items, folder / "results.jsonl"),
        "csv": write_csv(items, folder / "results.csv"),
        "png": plot(items, folder / "results.png"),
    }
