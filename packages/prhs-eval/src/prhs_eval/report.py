"""Reports of evaluation runs: a terminal table, JSONL and CSV files, and a PNG plot.

Every function takes a sequence of :class:`~prhs_eval.results.RunResult` (one selector with its
options on one task) in the order the runs were made:

- :func:`format_table` renders the plain-text table the CLI prints;
- :func:`write_jsonl` writes one JSON record per run, samples included (``nan`` → ``null``);
- :func:`write_csv` writes one flat row per run (``nan`` → empty cell, options as JSON);
- :func:`figure` builds the plot (bars for one budget, curves against several) and
  :func:`plot` saves it as a PNG;
- :data:`TABLE_LEGEND` explains the table's columns;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prhs_eval.results import RunResult

__all__ = [
    "DENSE",
    "DPI",
    "LEGEND_ROW_HEIGHT",
    "PANEL_HEIGHT",
    "PANEL_WIDTH",
    "TABLE_LEGEND",
    "ZERO_BELOW",
    "figure",
    "format_table",
    "plot",
    "shared_prefill_note",
    "table_legend",
    "to_json_safe",
    "varied_options",
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


ZERO_BELOW = 1e-12
"""Magnitudes below this show as 0 in the table (float noise, e.g. dense attention's β_emp)."""


def _denoise(x: float) -> float:
    return 0.0 if abs(x) < ZERO_BELOW else x


def _fmt(spec: str) -> Callable[[float | int | None], str]:
    def fmt(x: float | int | None) -> str:
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return _MISSING
        return format(_denoise(x) if isinstance(x, float) else x, spec)

    return fmt


def _fmt_percent(x: float | None) -> str:
    return _MISSING if x is None or math.isnan(x) else f"{100.0 * _denoise(x):.1f}%"


def _has_budget(r: RunResult) -> bool:
    return r.selector != DENSE and r.budget is not None


def varied_options(results: Sequence[RunResult]) -> dict[str, tuple[str, ...]]:
    """Per selector, the options (``budget`` aside) whose values differ between its runs in
    ``results``: what a sweep (``prhs-eval compare --sweep``) varied. Selectors whose runs all
    share their options are left out.

    Returns
    -------
    dict of str to tuple of str
        ``{selector: (option, ...)}`` in the options' order.
    """
    seen: dict[str, dict[str, list[Any]]] = {}
    for r in results:
        per = seen.setdefault(r.selector, {})
        for key, value in r.options.items():
            values = per.setdefault(key, [])
            if value not in values:
                values.append(value)
    out = {}
    for name, per in seen.items():
        keys = tuple(k for k, vs in per.items() if k != "budget" and len(vs) > 1)
        if keys:
            out[name] = keys
    return out


def _set_cell(varied: Mapping[str, tuple[str, ...]]) -> Callable[[RunResult], str]:
    def cell(r: RunResult) -> str:
        keys = varied.get(r.selector, ())
        return " ".join(f"{k}={_option_text(r.options.get(k))}" for k in keys) or _MISSING

    return cell


def _set_label(varied: Mapping[str, tuple[str, ...]]) -> Callable[[RunResult], str]:
    """A run's name in a plot: its selector, and the values a sweep varied (``prhs
    use_etf=True``)."""
    cell = _set_cell(varied)

    def label(r: RunResult) -> str:
        return f"{r.selector} {cell(r)}" if r.selector in varied else r.selector

    return label


def _option_text(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def _dense_layers(r: RunResult) -> str:
    n = r.options.get("dense_layers")
    return str(n) if isinstance(n, int) and not isinstance(n, bool) else _MISSING


def _prefill(r: RunResult) -> str:
    return "shared" if r.prefill_shared else _f2(r.prefill_seconds)


def _ratio(num: float, den: float) -> float:
    if not (_finite(num) and _finite(den)) or den == 0:
        return math.nan
    return num / den


_g4 = _fmt(".4g")
_g3 = _fmt(".3g")
_f3 = _fmt(".3f")
_f1 = _fmt(".1f")
_f2 = _fmt(".2f")

# (header, right-aligned, cell)
_COLUMNS: tuple[tuple[str, bool, Callable[[RunResult], str]], ...] = (
    ("task", False, lambda r: r.task),
    ("selector", False, lambda r: r.selector),
    ("budget", True, lambda r: str(r.budget) if _has_budget(r) else _MISSING),
    ("dense L", True, _dense_layers),
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
    ("missed", True, lambda r: _fmt("d")(r.metrics.target_misses)),
    ("prefill s", True, _prefill),
    ("s/tok", True, lambda r: _g3(_ratio(r.decode_seconds, r.decode_tokens))),
)

_LEGEND: dict[str, str] = {
    "task": "the task (samples generated from the seed at the context length)",
    "selector": "the selector (sparse-attention method); dense is full attention, the reference",
    "budget": "k, KV positions a selector may read per step beyond its sink and local windows "
    "(- : no budget, dense)",
    "set": "the options a sweep varied for this row (--sweep; - : none)",
    "dense L": "leading layers the selector leaves dense, outside its budget (Quest's "
    "dense_layers; - : none)",
    "acc": "accuracy: mean task score, % (generation tasks)",
    "ppl": "perplexity of the scored tokens, decoded through the selector (perplexity tasks)",
    "δ mean": "mean dropped attention mass δ of the positions read (0 = nothing dropped)",
    "δ max": "largest δ of any decision",
    "β_emp": "mean retained-mass gap to the oracle set of the same size (0 = oracle-optimal)",
    "overlap": "mean overlap with the oracle set of the same size (1 = identical)",
    "ρ̂ %": "share of decisions that scored every key (a full retrieval), %",
    "Avg KV": "mean positions read per KV head per step",
    "KB/step": "KiB read per decode step (K/V rows + proxies, all layers)",
    "vs dense": "bytes read as % of what dense attention reads",
    "B_MI": "mean routing mutual-information loss bound",
    "ΔI_emp": "mean measured routing mutual-information loss (≤ B_MI)",
    "cert": "certificate violations: decisions where some query head's measured δ is above "
    "the certified δ̂ (- : the selector does not certify)",
    "missed": "certified retrievals where some query head's dropped mass is above the target "
    "δ_target, their top-p set cut by the cap k_max (- : the selector does not certify)",
    "prefill s": "seconds of the selector's own prefill; shared: it reused the dense prefill "
    "made once per sample (its time is reported once, under the table)",
    "s/tok": "decode seconds per decode step",
}


def table_legend() -> str:
    """What every column of :func:`format_table` means, one line per column.

    Returns
    -------
    str
        ``"Columns:"`` then one indented ``name  meaning`` line per column, ending with a
        newline; ``-`` marks a missing value, and magnitudes below 1e-12 show as 0.
    """
    headers = [h for h, _, _ in _COLUMNS]
    headers.insert(headers.index("budget") + 1, "set")
    width = max(_display_width(h) for h in headers)
    lines = ["Columns:"]
    lines += [f"  {_pad(h, width, False)}  {_LEGEND[h]}" for h in headers]
    lines.append(f"  - is a missing value; magnitudes below {ZERO_BELOW:g} show as 0.")
    return "\n".join(lines) + "\n"


TABLE_LEGEND: str = table_legend()
"""The legend of :func:`format_table` (:func:`table_legend`), e.g. for ``--help``."""


def format_table(results: Sequence[RunResult]) -> str:
    """Render results as a plain-text table for the terminal.

    One row per result, rows grouped by task (tasks in order of first appearance, runs in input
    order), under a header and a rule line. Numbers are right-aligned; missing values (``nan``,
    no certificate, no decode steps) show as ``-``.

    Values whose magnitude is below :data:`ZERO_BELOW` show as ``0``. Under the rows, the time
    of the shared dense prefill is given once per task (:func:`shared_prefill_note`); rows
    that reused it show ``shared`` in ``prefill s``. :data:`TABLE_LEGEND` explains every column.

    Columns: ``task``, ``selector`` (name), ``budget`` (``-`` for dense), ``set`` (only when a
    selector's runs differ in an option other than the budget, as in a sweep: that option's
    value, see :func:`varied_options`), ``dense L`` (Quest's dense layers),
    ``acc`` (% with one decimal), ``ppl`` (three decimals), ``δ mean``, ``δ max`` and ``β_emp``
    (four significant digits), ``overlap`` (oracle overlap), ``ρ̂ %``, ``Avg KV``, ``KB/step``
    (bytes read per decode step / 1024), ``vs dense`` (bytes read as % of dense), ``B_MI`` and
    ``ΔI_emp`` (three significant digits), ``cert`` (certificate violations), ``missed``
    (certified retrievals above their target), ``prefill s`` and ``s/tok``
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
    columns = list(_COLUMNS)
    varied = varied_options(items)
    if varied:  # a sweep: say which value each row ran with, after the budget
        at = [h for h, _, _ in columns].index("budget") + 1
        columns.insert(at, ("set", False, _set_cell(varied)))
    cells = [[cell(r) for _, _, cell in columns] for r in ordered]
    headers = [h for h, _, _ in columns]
    widths = [max(_display_width(row[i]) for row in [headers, *cells]) for i in range(len(columns))]
    sep = "  "
    if sum(widths) + len(sep) * (len(widths) - 1) > _MAX_TABLE_WIDTH:
        sep = " "

    def line(row: Sequence[str]) -> str:
        return sep.join(
            _pad(text, w, right)
            for text, w, (_, right, _) in zip(row, widths, columns, strict=True)
        ).rstrip()

    head = line(headers)
    rule = "-" * (sum(widths) + len(sep) * (len(widths) - 1))
    lines = [head, rule, *(line(row) for row in cells)]
    note = shared_prefill_note(ordered)
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def shared_prefill_note(results: Sequence[RunResult]) -> str:
    """The shared dense prefill's time, once per task: ``"shared dense prefill: passkey
    1.23 s, niah_single 1.10 s (...)"``, or ``""`` when no run reused it."""
    per_task: dict[str, float] = {}
    for r in results:
        if r.prefill_shared and r.task not in per_task:
            per_task[r.task] = r.shared_prefill_seconds
    if not per_task:
        return ""
    parts = ", ".join(f"{t} {s:.2f} s" for t, s in per_task.items())
    return (
        f"shared dense prefill: {parts} (made once per sample, reused by the rows "
        "whose prefill is 'shared')"
    )


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


def _title(items: Sequence[RunResult]) -> str:
    models = list(dict.fromkeys(r.model for r in items))
    lengths = sorted({r.context_len for r in items})
    ctx = "/".join(str(n) for n in lengths)
    return f"{', '.join(models)} — context {ctx} tokens"


def _task_metric(runs: Sequence[RunResult]) -> str:
    return "accuracy" if any(_finite(r.accuracy) for r in runs) else "perplexity"


_YLABELS = {
    "accuracy": "accuracy (%)",
    "perplexity": "perplexity",
    "beta": "β_emp (gap to oracle)",
    "bytes": "bytes read vs dense (%)",
    "rho": "ρ̂: decisions that retrieved (%)",
    "beta-rho": "β_emp against ρ̂",
}


def _y(r: RunResult, attr: str) -> float:
    if attr == "accuracy":
        return 100.0 * r.accuracy
    if attr == "perplexity":
        return r.perplexity
    if attr == "beta":
        b = r.metrics.beta_emp
        return _denoise(b) if _finite(b) else b
    if attr == "rho":
        return r.metrics.retrieval_ratio
    if r.selector == DENSE:
        return 100.0
    return 100.0 * _ratio(r.metrics.bytes_per_step, r.metrics.dense_bytes_per_step)


def _beta_scale(ax: Any, values: Sequence[float]) -> None:
    positive = [v for v in values if _finite(v) and v > 0]
    if positive and len(positive) == len([v for v in values if _finite(v)]):
        ax.set_yscale("log")
    elif positive:
        ax.set_yscale("symlog", linthresh=10.0 ** math.floor(math.log10(min(positive))))


def figure(results: Sequence[RunResult]) -> Any:
    """Build the plot of a run as a :class:`matplotlib.figure.Figure` (nothing is saved).

    With one budget (every selector but dense at the same budget): one row of bar panels,
    quality (accuracy in %, or perplexity; one panel per kind present), ``β_emp`` and bytes
    read vs dense in %, with the tasks on the x axis and one bar per selector (dense
    included: its β_emp is 0 and its bytes 100%). With several budgets: one column per task
    (titled with the task) and one row per metric (quality, ``β_emp``, bytes vs dense),
    each selector a curve against the budget and dense a dashed horizontal reference. With one
    budget and a swept option (:func:`varied_options`, a number, e.g. CIS's ``tau``): the same
    curves against that option; then, when some run retrieved on only part of its decisions
    (``0 < ρ̂ < 100``), two more rows: ``ρ̂`` against the option and ``β_emp`` against ``ρ̂``
    (the trade-off the option moves along). Each selector keeps one colour everywhere; the
    legend (below the panels) names them.
    ``β_emp`` is on a log axis when every value is positive (symlog when some are 0), and
    values below :data:`ZERO_BELOW` are 0.

    Parameters
    ----------
    results:
        The runs to draw.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (Agg canvas); ``fig.axes`` are its panels.

    Raises
    ------
    ValueError
        If ``results`` is empty.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    items = _require(results, "plot")
    groups = _group_by_task(items)
    tasks = list(groups)
    names = list(dict.fromkeys(r.selector for r in items))
    curves = [n for n in names if n != DENSE]
    colors = {n: ("black" if n == DENSE else f"C{curves.index(n) % 10}") for n in names}
    markers = {n: _MARKERS[curves.index(n) % len(_MARKERS)] for n in curves}
    budgets = sorted({r.budget for r in items if r.budget is not None and r.selector != DENSE})
    swept = _swept_key(items)
    if len(budgets) > 1:
        axis = _Axis("budget (KV positions)", lambda r: r.budget if _has_budget(r) else None,
                     budgets)  # fmt: skip
        fig, handles = _curves(items, groups, tasks, curves, colors, markers, axis)
    elif swept is not None:
        key = swept
        values = sorted({v for r in items if r.selector != DENSE
                         and _is_number(v := r.options.get(key))})  # fmt: skip
        axis = _Axis(
            key, lambda r: r.options.get(key) if r.selector != DENSE else None, values, True
        )
        fig, handles = _curves(items, groups, tasks, curves, colors, markers, axis)
    else:
        # A sweep of a non-numeric option (e.g. a switch) has no axis: one bar per setting.
        label = _set_label(varied_options(items))
        bars = list(dict.fromkeys(label(r) for r in items))
        shown = [n for n in bars if n != DENSE]
        colors = {n: ("black" if n == DENSE else f"C{shown.index(n) % 10}") for n in bars}
        fig, handles = _bars(items, groups, tasks, bars, colors, budgets, label)
    FigureCanvasAgg(fig)
    fig.suptitle(_title(items))
    if handles:
        ncols = max(1, min(_LEGEND_COLUMNS, len(handles)))
        fig.legend(
            handles=handles, loc="outside lower center", ncols=ncols, frameon=False, fontsize=9
        )
    return fig


@dataclass(frozen=True)
class _Axis:
    """The x axis of curves: its label, each run's x (``None``: not on a curve), the ticks."""

    label: str
    x: Callable[[RunResult], Any]
    ticks: Sequence[float]
    tradeoff: bool = False  # add the ρ̂ and β-against-ρ̂ rows when some run has 0 < ρ̂ < 100


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _swept_key(items: Sequence[RunResult]) -> str | None:
    """The first numeric option (budget aside) a sweep varied, or ``None``."""
    for keys in varied_options(items).values():
        for key in keys:
            values = [r.options.get(key) for r in items if key in r.options]
            if all(_is_number(v) for v in values):
                return key
    return None


def _figsize(cols: int, rows: int, entries: int) -> tuple[float, float]:
    legend_rows = math.ceil(entries / _LEGEND_COLUMNS) if entries else 0
    return PANEL_WIDTH * cols, PANEL_HEIGHT * rows + LEGEND_ROW_HEIGHT * legend_rows


def _bars(
    items: Sequence[RunResult],
    groups: Mapping[str, list[RunResult]],
    tasks: Sequence[str],
    names: Sequence[str],
    colors: Mapping[str, str],
    budgets: Sequence[int],
    label: Callable[[RunResult], str],
) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    quality = [
        m
        for m in ("accuracy", "perplexity")
        if any(_task_metric(rs) == m for rs in groups.values())
    ]
    panels = [*quality, "beta", "bytes"]
    fig = Figure(figsize=_figsize(len(panels), 1, len(names)), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    width = 0.8 / max(1, len(names))
    for ax, attr in zip(axes, panels, strict=True):
        shown = [t for t in tasks if attr not in quality or _task_metric(groups[t]) == attr]
        values: list[float] = []
        for j, name in enumerate(names):
            xs, ys = [], []
            for k, task in enumerate(shown):
                runs = [r for r in groups[task] if label(r) == name]
                y = _y(runs[0], attr) if runs else math.nan
                xs.append(k + (j - (len(names) - 1) / 2) * width)
                ys.append(y if _finite(y) else 0.0)
                values.append(y)
            ax.bar(xs, ys, width=width, color=colors[name], label=name)
        ax.set_xticks(range(len(shown)), shown)
        ax.set_xlabel("task")
        ax.set_ylabel(_YLABELS[attr])
        if attr == "beta":
            _beta_scale(ax, values)
        ax.grid(True, axis="y", which="major", alpha=0.3)
        if budgets:
            ax.set_title(f"budget {budgets[0]}")
    handles = [Patch(color=colors[n], label=n) for n in names]
    return fig, handles


def _curves(
    items: Sequence[RunResult],
    groups: Mapping[str, list[RunResult]],
    tasks: Sequence[str],
    curves: Sequence[str],
    colors: Mapping[str, str],
    markers: Mapping[str, str],
    axis: _Axis,
) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullLocator

    rows = ["quality", "beta", "bytes"]
    on_curve = [r for r in items if r.selector != DENSE and _is_number(axis.x(r))]
    if axis.tradeoff and any(0.0 < r.metrics.retrieval_ratio < 100.0 for r in on_curve):
        rows += ["rho", "beta-rho"]  # a selector that retrieves on some steps only: its trade-off
    has_dense = any(r.selector == DENSE for r in items)
    entries = len(curves) + int(has_dense)
    fig = Figure(figsize=_figsize(len(tasks), len(rows), entries), dpi=DPI, layout="constrained")
    grid = fig.subplots(len(rows), len(tasks), squeeze=False)
    ticks = list(axis.ticks)
    for col, task in enumerate(tasks):
        runs = groups[task]
        for row, what in enumerate(rows):
            ax = grid[row][col]
            attr = _task_metric(runs) if what == "quality" else what
            values: list[float] = []
            for name in curves:
                mine = [r for r in runs if r.selector == name and _is_number(axis.x(r))]
                if attr == "beta-rho":
                    pts = sorted((_y(r, "rho"), _y(r, "beta")) for r in mine)
                else:
                    pts = sorted((axis.x(r), _y(r, attr)) for r in mine)
                pts = [(x, y) for x, y in pts if _finite(x) and _finite(y)]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                values += ys
                ax.plot(xs, ys, color=colors[name], marker=markers[name], linewidth=1.5,
                        markersize=6, label=name)  # fmt: skip
            if attr in ("beta-rho", "rho"):
                ax.set_xlabel("ρ̂ (%)" if attr == "beta-rho" else axis.label)
            dense = [_y(r, attr) for r in runs if r.selector == DENSE and _finite(_y(r, attr))]
            if dense and attr not in ("rho", "beta-rho"):
                y = sum(dense) / len(dense)
                values.append(y)
                ax.axhline(y, color="black", linestyle="--", linewidth=1.2, label=DENSE)
            if attr in ("beta", "beta-rho"):
                _beta_scale(ax, values)
            if attr != "beta-rho":
                if ticks and ticks[0] > 0 and ticks[-1] >= 4 * ticks[0]:
                    ax.set_xscale("log", base=2)
                ax.set_xticks(ticks, [_option_text(t) for t in ticks])
                ax.xaxis.set_minor_locator(NullLocator())
                ax.set_xlabel(axis.label)
            ax.set_ylabel(_YLABELS[attr])
            ax.set_title(task)
            ax.grid(True, which="major", alpha=0.3)
    handles = [
        Line2D([], [], color=colors[n], marker=markers[n], linestyle="-", label=n) for n in curves
    ]
    if has_dense:
        handles.append(Line2D([], [], color="black", linestyle="--", label=DENSE))
    return fig, handles


def plot(results: Sequence[RunResult], path: PathLike) -> Path:
    """Save :func:`figure` of ``results`` as a PNG at ``path`` (parent folders are created).

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        If ``results`` is empty.
    """
    fig = figure(results)
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
