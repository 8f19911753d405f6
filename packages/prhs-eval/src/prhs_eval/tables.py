"""The paper-table commands' output folders: ``<out>/<name>/``.

Every table command (``prhs-eval table5`` ...) writes one folder holding

- ``README.md``: the title, the table in Markdown, notes, the figure, and where it ran;
- ``table.rst``: the same table as reStructuredText (the docs include it);
- ``rows.jsonl``: one JSON object per measured point, every number unrounded;
- ``config.json``: the command's arguments and the run's fixed context (shapes, bandwidth ...);
- ``machine.json``: the prhs commit, package versions, CPU and GPU;
- ``<name>.png`` where the paper has a figure.

A folder is replaced whole: what a previous run left there is removed first, so a folder never
mixes two runs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TABLE_NAMES", "machine_info", "markdown_table", "rst_table", "write_table_folder"]

#: The paper analogs a command writes (``docs/results/<name>/``).
TABLE_NAMES = ("table2", "table4", "table5", "table6", "table8", "fig6", "fig7")


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` in cells escaped)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    out = [line(head), "|" + "|".join("---" for _ in head) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out) + "\n"


def rst_table(head: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> str:
    """A reStructuredText ``list-table``."""
    out = [f".. list-table:: {title}".rstrip(), "   :header-rows: 1", ""]
    for r in [head, *rows]:
        cells = [str(c) if str(c) else " " for c in r]
        out.append(f"   * - {cells[0]}")
        out += [f"     - {c}" for c in cells[1:]]
    return "\n".join(out) + "\n"


def machine_info(device: Any = None) -> dict[str, Any]:
    """Where a table ran: :func:`prhs_eval.results.host_environment` plus torch, transformers,
    Triton (when importable) and the GPU's name on CUDA."""
    import torch
    import transformers

    from prhs_eval.results import host_environment

    info: dict[str, Any] = {**host_environment(), "torch": torch.__version__}
    info["transformers"] = transformers.__version__
    try:  # its version only: prhs-eval never imports Triton itself
        from importlib.metadata import PackageNotFoundError, version

        info["triton"] = version("triton")
    except PackageNotFoundError:
        info["triton"] = None
    dev = torch.device(device) if device is not None else torch.device("cpu")
    info["device"] = str(dev)
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
    return info


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def write_table_folder(
    root: str | Path,
    name: str,
    *,
    title: str,
    head: Sequence[str],
    rows: Sequence[Sequence[str]],
    records: Sequence[Mapping[str, Any]],
    config: Mapping[str, Any],
    machine: Mapping[str, Any],
    notes: str = "",
    figure: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``root/name/`` (replacing it); returns the folder.

    ``figure(path)`` draws the PNG at ``path`` when given.
    """
    if name not in TABLE_NAMES:
        raise ValueError(f"unknown table {name!r}; known: {', '.join(TABLE_NAMES)}")
    if not rows:
        raise ValueError(f"{name}: no rows to write")
    width = len(head)
    bad = [i for i, r in enumerate(rows) if len(r) != width]
    if bad:
        raise ValueError(f"{name}: rows {bad} do not have the header's {width} cells")
    folder = Path(root) / name
    if folder.exists():
        if not folder.is_dir():
            raise ValueError(f"{folder} exists and is not a directory")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    png = None
    if figure is not None:
        png = folder / f"{name}.png"
        figure(png)
    commit = machine.get("prhs_commit") or "unknown"
    where = ", ".join(
        f"{k} {machine[k]}"
        for k in ("gpu", "cpu", "torch", "triton", "transformers", "python")
        if machine.get(k)
    )
    parts = [f"# {title}", "", markdown_table(head, rows)]
    if notes:
        parts += [notes.strip(), ""]
    if png is not None:
        parts += [f"![{name}]({png.name})", ""]
    parts += [f"prhs commit `{commit}`; {where}.", "",
              "Every number unrounded: `rows.jsonl`; the command's arguments: `config.json`; "
              "the machine: `machine.json`.", ""]  # fmt: skip
    (folder / "README.md").write_text("\n".join(parts), encoding="utf-8")
    rst = rst_table(head, rows)
    if notes:
        rst += "\n" + notes.strip().replace("`", "``").replace("````", "``") + "\n"
    if png is not None:
        # An absolute path: Sphinx reads it from the docs' root, wherever it is included.
        rst += f"\n.. image:: /results/{name}/{png.name}\n   :width: 100%\n"
    rst += f"\nprhs commit ``{commit}``; {where}.\n"
    (folder / "table.rst").write_text(rst, encoding="utf-8")
    with open(folder / "rows.jsonl", "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(dict(rec), default=_json_default, sort_keys=True) + "\n")
    for fname, data in (("config.json", config), ("machine.json", machine)):
        text = json.dumps(dict(data), default=_json_default, indent=2, sort_keys=True)
        (folder / fname).write_text(text + "\n", encoding="utf-8")
    return folder
