"""The ``prhs-eval`` command line.

``prhs-eval selectors`` lists every registered selector with its hyperparameters' defaults.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prhs_core.registry import Registry, selectors
from prhs_eval import __version__

__all__ = ["build_parser", "main"]


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for the docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="prhs-eval",
        description="Evaluate prhs sparse-attention selectors on real models and tasks.",
    )
    parser.add_argument("--version", action="version", version=f"prhs-eval {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("selectors", help="list the registered selectors and their defaults")
    return parser


def main(argv: Sequence[str] | None = None, registry: Registry | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "selectors":
        sys.stdout.write(_format_selectors(registry if registry is not None else selectors))
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
