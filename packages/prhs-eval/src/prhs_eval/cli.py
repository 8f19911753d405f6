"""The ``prhs-eval`` command line.

- ``prhs-eval selectors``: every registered selector with its hyperparameters' defaults.
- ``prhs-eval run SELECTOR``: one selector on one or more tasks.
- ``prhs-eval compare``: several selectors on identical inputs. With no arguments it compares
  dense, oracle, prhs, quest, h2o and streaming on SmolLM2-135M, passkey and NIAH at about
  4k tokens, a few samples each.

Both ``run`` and ``compare`` print a table, and write ``results.jsonl``, ``results.csv`` and
``results.png`` (accuracy and δ against budget) into ``--out``. Every argument is checked, and
every selector built from its options, before the model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prhs_core.registry import Registry, UnknownSelectorError, selectors
from prhs_eval import __version__

__all__ = ["DEFAULT_COMPARE", "DEFAULT_TASKS", "build_parser", "main"]

DEFAULT_COMPARE = ("dense", "oracle", "prhs", "quest", "h2o", "streaming")
DEFAULT_TASKS = ("passkey", "niah_single")
DEFAULT_CONTEXT = 4096
DEFAULT_SAMPLES = 3
DEFAULT_OUT = "prhs-eval-results"


class UsageError(ValueError):
    """A command-line argument that cannot work; reported before any work starts."""


def _format_selectors(registry: Registry) -> str:
    entries = list(registry)
    if not entries:
        return "no selectors registered (install prhs-selectors)\n"
    rows = [
        (e.name, e.summary, ", ".join(f"{k}={v!r}" for k, v in e.defaults().items()))
        for e in entries
    ]
    head = ("name", "summary", "defaults")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(2)]
    lines = [f"{head[0]:<{widths[0]}}  {head[1]:<{widths[1]}}  {head[2]}"]
    lines.append("-" * len(lines[0]))
    lines += [f"{n:<{widths[0]}}  {s:<{widths[1]}}  {d}" for n, s, d in rows]
    return "\n".join(lines) + "\n"


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    from prhs_eval.models import DEFAULT_MODEL

    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"embedded model name, local directory or hub id (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--tasks",
        type=_csv,
        default=list(DEFAULT_TASKS),
        help=f"comma-separated task names (default {','.join(DEFAULT_TASKS)})",
    )
    p.add_argument(
        "--context-len",
        type=_positive_int,
        default=DEFAULT_CONTEXT,
        help=f"prompt length in tokens (default {DEFAULT_CONTEXT})",
    )
    p.add_argument(
        "--samples",
        type=_positive_int,
        default=DEFAULT_SAMPLES,
        help=f"samples per task (default {DEFAULT_SAMPLES})",
    )
    p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    p.add_argument(
        "--haystack",
        choices=("repeat", "essays"),
        default=None,
        help="NIAH/variable-tracking haystack (default: the task's)",
    )
    p.add_argument(
        "--text",
        type=Path,
        default=None,
        metavar="PATH",
        help="perplexity: a UTF-8 text file to score instead of the KJV Bible",
    )
    p.add_argument(
        "--set",
        dest="options",
        action="append",
        default=[],
        metavar="[SEL.]KEY=VALUE",
        help="selector option, e.g. budget=128 (every selector that has it) or "
        "cis.tau=0.9 (one selector); repeatable",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help=f"directory for results.jsonl/.csv/.png (default {DEFAULT_OUT})",
    )
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="skip measuring δ, β, overlap and MI against dense attention (faster)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for the docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="prhs-eval",
        description="Evaluate prhs sparse-attention selectors on real models and tasks.",
    )
    parser.add_argument("--version", action="version", version=f"prhs-eval {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("selectors", help="list the registered selectors and their defaults")
    run = sub.add_parser("run", help="evaluate one selector")
    run.add_argument("selector", help="a registered selector name (see `prhs-eval selectors`)")
    _add_common(run)
    cmp_ = sub.add_parser("compare", help="evaluate several selectors on identical inputs")
    cmp_.add_argument(
        "--selectors",
        type=_csv,
        default=list(DEFAULT_COMPARE),
        help=f"comma-separated names (default {','.join(DEFAULT_COMPARE)})",
    )
    cmp_.add_argument(
        "--budgets",
        type=lambda s: [_positive_int(x) for x in _csv(s)],
        default=None,
        help="sweep these budgets (k) for every selector but dense",
    )
    _add_common(cmp_)
    return parser


def _fields(name: str) -> set[str]:
    config = selectors.get(name).config
    return {f.name for f in dataclasses.fields(config)} if config is not None else set()


def _parse_options(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    from prhs_eval.runner import parse_option_value

    per: dict[str, dict[str, Any]] = {n: {} for n in names}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set expects KEY=VALUE or SELECTOR.KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        value = parse_option_value(raw)
        if "." in key:
            sel, field = key.split(".", 1)
            if sel not in per:
                raise UsageError(
                    f"--set {item!r}: {sel!r} is not among the selectors {list(names)}"
                )
            targets = [sel]
        else:
            field = key
            targets = [n for n in names if field in _fields(n)]
            if not targets:
                raise UsageError(f"--set {item!r}: no selector among {list(names)} has {field!r}")
        for t in targets:
            per[t][field] = value
    return per


def _specs(args: argparse.Namespace) -> list[Any]:
    from prhs_eval.runner import SelectorSpec

    names = [args.selector] if args.command == "run" else list(args.selectors)
    if not names:
        raise UsageError("no selectors given")
    for n in names:
        selectors.get(n)  # UnknownSelectorError lists the known names
    per = _parse_options(args.options, names)
    budgets = getattr(args, "budgets", None)
    specs = []
    for n in names:
        if budgets and n != "dense":
            specs += [SelectorSpec(n, {**per[n], "budget": b}) for b in budgets]
        else:
            specs.append(SelectorSpec(n, per[n]))
    return specs


def _check_model_and_tasks(args: argparse.Namespace) -> None:
    from prhs_eval.models import check_model_name
    from prhs_eval.tasks import TASKS

    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        raise UsageError(f"unknown task(s) {unknown}; known tasks: {', '.join(TASKS)}")
    if not args.tasks:
        raise UsageError("no tasks given")
    if args.text is not None and not args.text.is_file():
        raise UsageError(f"--text {str(args.text)!r} is not a file")
    if args.text is not None and "perplexity" not in args.tasks:
        raise UsageError("--text is for the perplexity task; add it to --tasks")
    if args.haystack and set(args.tasks) <= {"perplexity"}:
        raise UsageError("--haystack is for the passkey, NIAH and variable-tracking tasks")
    check_model_name(args.model)


def main(argv: Sequence[str] | None = None, registry: Registry | None = None) -> int:
    """Run the CLI; returns the process exit code (2 for bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "selectors":
        sys.stdout.write(_format_selectors(registry if registry is not None else selectors))
        return 0
    if args.command in ("run", "compare"):
        try:  # every argument and selector option is checked before any work starts
            specs = _specs(args)
            _check_model_and_tasks(args)
        except (UsageError, UnknownSelectorError, TypeError, ValueError) as exc:
            parser.exit(2, f"prhs-eval {args.command}: error: {exc}\n")
        from prhs_eval.evaluate import evaluate

        return evaluate(args, specs)
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
