"""The ``prhs-eval`` command line.

- ``prhs-eval selectors``: every registered selector with its hyperparameters' defaults.
- ``prhs-eval tasks``: every task with its kind, description and minimum context.
- ``prhs-eval models``: the embedded models, their architecture, context limit and whether
  they are installed.
- ``prhs-eval run SELECTOR``: one selector on one or more tasks.
- ``prhs-eval calibrate --out FILE``: Double Sparsity's label channels chosen on offline text
  (:mod:`prhs_eval.calibrate`), for ``--set double_sparsity.channels=@FILE``.
- ``prhs-eval compare``: several selectors on identical inputs. With no arguments it compares
  dense, oracle, prhs, quest, h2o and streaming on SmolLM2-135M, passkey and NIAH at about
  4k tokens, a few samples each.
- ``prhs-eval table2 | table6 | table8 | fig6 | fig7``: the paper's accuracy tables and
  figures on the offline models (:mod:`prhs_eval.paper`); ``table4``: the kernel latency table
  from a kernels benchmark file; ``table5``: end-to-end decode throughput
  (:mod:`prhs_eval.throughput`). Each writes ``OUT/<name>/`` (:mod:`prhs_eval.tables`);
  ``--from-rows`` rewrites a folder from earlier rows without running anything.

Both ``run`` and ``compare`` print a table, and write ``results.jsonl``, ``results.csv`` and
``results.png`` (accuracy and δ against budget) into ``--out``. Every argument is checked, and
every selector built from its options, before the model is loaded: a mistake is one line
on stderr and exit code 2. Heavy modules (torch, the selector registry) are imported only by the
commands that need them, so ``prhs-eval --help`` answers at once.

``prhs-eval run NAME --server URL`` runs the tasks on a running SGLang server instead of an
in-process model (:mod:`prhs_eval.server`): the server serves ``--model`` with the attention it
was started with, and ``NAME`` only labels the results (it must equal the server's
``sparse_attn`` argument when the server reports one). A server runs one configuration, so
``compare --server`` is refused: start one server per selector and ``run`` against each.
``--set``, ``--device`` and ``--dtype`` choose what the in-process model does and are refused
with ``--server``. After the arguments, and before any work starts, the server is checked
(reachable, healthy, serving ``--model``, context long enough); a failure there is exit code 2
too. A server request that fails during the run is one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prhs_eval import __version__

if TYPE_CHECKING:
    from prhs_core.registry import Registry

__all__ = ["DEFAULT_COMPARE", "DEFAULT_TASKS", "build_parser", "main"]

DEFAULT_COMPARE = ("dense", "oracle", "prhs", "quest", "h2o", "streaming")
DEFAULT_TASKS = ("passkey", "niah_single")
DEFAULT_CONTEXT = 4096
DEFAULT_SAMPLES = 3
DEFAULT_OUT = "prhs-eval-results"
_DTYPES = ("float32", "bfloat16", "float16")  # prhs_eval.models.DTYPES, without importing it


class UsageError(ValueError):
    """A command-line argument that cannot work; reported before any work starts."""


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns under a header and a rule; the last column is not padded."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]

    def line(row: Sequence[str]) -> str:
        cells = [f"{c:<{w}}" for c, w in zip(row, widths, strict=False)]
        return "  ".join([*cells, row[-1]]).rstrip()

    lines = [line(head)]
    lines.append("-" * len(lines[0]))
    lines += [line(r) for r in rows]
    return "\n".join(lines) + "\n"


def _format_tasks() -> str:
    from prhs_eval.preflight import task_min_context
    from prhs_eval.tasks import TASKS

    rows = []
    for spec in TASKS.values():
        minimum = task_min_context(spec.name)
        rows.append((spec.name, spec.kind, f">= {minimum}" if minimum else "1", spec.description))
    note = (
        "\nmin context: the instructions, needle(s) and question alone, counted in words; in a "
        "model's tokens they take more.\n"
    )
    return _table(("name", "kind", "min context", "description"), rows) + note


def _format_models() -> str:
    from prhs_eval.models import DEFAULT_MODEL, EMBEDDED_MODELS, is_installed

    rows = []
    for name, source in EMBEDDED_MODELS.items():
        if is_installed(name):
            installed = "yes"
        else:
            group = "uv sync" if source.group == "models" else f"uv sync --group {source.group}"
            installed = f"no ({group})"
        limit = str(source.max_positions) if source.max_positions else "?"
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        rows.append((label, source.architecture or "?", limit, installed, source.licence))
    table = _table(("name", "architecture", "context", "installed", "licence"), rows)
    return table + "\nAlso: a local directory written by save_pretrained, or a hub id org/name.\n"


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
        default=None,
        metavar="NAME|PATH",
        help="NIAH/variable-tracking haystack: repeat, essays, or a UTF-8 text file of your own "
        "(default: the task's)",
    )
    p.add_argument(
        "--text",
        default=None,
        metavar="NAME|PATH",
        help="perplexity: the text to score, kjv (the default), essays (Paul Graham's), or a "
        "UTF-8 text file of your own",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="gsm8k / longbench_v2: the benchmark's local file (GSM8K's test.jsonl, LongBench "
        "v2's data.json)",
    )
    p.add_argument(
        "--set",
        dest="options",
        action="append",
        default=[],
        metavar="[SEL.]KEY=VALUE",
        help="selector option, e.g. budget=128 (every selector that has it) or "
        "cis.tau=0.9 (one selector); KEY=@FILE reads the value from a JSON file (e.g. a "
        "per-head tau table); repeatable",
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
    p.add_argument(
        "--device",
        default=None,
        help="where the model runs: cpu, cuda, cuda:N (default cuda when available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="parameter dtype (default bfloat16 on CUDA, float32 on CPU)",
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--overwrite", action="store_true", help="replace the results already in --out"
    )
    again.add_argument(
        "--resume", action="store_true", help="keep the results in --out and run what is missing"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="run on a running SGLang server (e.g. http://127.0.0.1:30000) serving --model, "
        "with the attention it was started with; `run` only, SELECTOR is then a label",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for the docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="prhs-eval",
        description="Evaluate prhs sparse-attention selectors on real models and tasks.",
    )
    parser.add_argument("--version", action="version", version=f"prhs-eval {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("selectors", help="list the registered selectors and their defaults")
    sub.add_parser("tasks", help="list the tasks, their kind and minimum context")
    sub.add_parser("models", help="list the embedded models and whether they are installed")
    from prhs_eval.report import TABLE_LEGEND  # light: no torch

    legend = TABLE_LEGEND
    raw = argparse.RawDescriptionHelpFormatter
    run = sub.add_parser("run", help="evaluate one selector", epilog=legend, formatter_class=raw)
    run.add_argument(
        "selector",
        help="a registered selector name (see `prhs-eval selectors`); with --server, the label "
        "of the server's attention",
    )
    _add_common(run)
    cmp_ = sub.add_parser(
        "compare",
        help="evaluate several selectors on identical inputs",
        epilog=legend,
        formatter_class=raw,
    )
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
    cmp_.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="[SEL.]KEY=V1,V2,...",
        help="run the selectors that have option KEY (or only SEL) once per value, e.g. "
        "cis.tau=0.6,0.7,0.8; the table gets a 'set' column and the plot curves against "
        "KEY; repeatable (every combination runs); with --budgets, every budget too",
    )
    _add_common(cmp_)
    cal = sub.add_parser(
        "calibrate",
        help="choose Double Sparsity's label channels on offline text (a JSON file for "
        "--set double_sparsity.channels=@FILE)",
    )
    from prhs_eval.models import DEFAULT_MODEL

    cal.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    cal.add_argument(
        "--text",
        default="kjv",
        metavar="NAME|PATH",
        help="kjv (default), essays, or a UTF-8 text file",
    )
    cal.add_argument(
        "--context-len", type=_positive_int, default=2048, help="window length (default 2048)"
    )
    cal.add_argument("--samples", type=_positive_int, default=4, help="windows (default 4)")
    cal.add_argument("--seed", type=int, default=0, help="window seed (default 0)")
    cal.add_argument(
        "--label-channels",
        type=_positive_int,
        default=None,
        help="r, label channels per KV head (default head_dim // 8)",
    )
    cal.add_argument(
        "--prompt-queries",
        type=_positive_int,
        default=256,
        help="the last queries of each window that score the channels (default 256)",
    )
    cal.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    cal.add_argument("--dtype", choices=_DTYPES, default=None, help="parameter dtype")
    cal.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    cal.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_table5(sub)
    _add_paper_tables(sub)
    t4 = sub.add_parser(
        "table4",
        help="Table IV analog: attention-operator latency from a kernels benchmark run "
        "(benchmarks/scripts/kernels.py bench on a GPU); writes OUT/table4/",
    )
    t4.add_argument("--bench", type=Path, required=True, metavar="FILE",
                    help="the bench.jsonl kernels.py bench wrote")  # fmt: skip
    t4.add_argument("--out", type=Path, default=Path("docs/results"),
                    help="root of the results folders (default docs/results)")  # fmt: skip
    return parser


def _table4(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json

    from prhs_eval.paper import table4_cells
    from prhs_eval.tables import write_table_folder

    try:
        if not args.bench.is_file():
            raise UsageError(f"--bench {str(args.bench)!r} is not a file")
        rows = [json.loads(x) for x in args.bench.read_text(encoding="utf-8").splitlines()
                if x.strip()]  # fmt: skip
        head, cells = table4_cells(rows)
        if not cells:
            raise UsageError(f"--bench {str(args.bench)!r} holds no bench rows (kernels.py bench)")
    except (UsageError, json.JSONDecodeError) as exc:
        message = " ".join(str(exc).split())
        parser.exit(2, f"prhs-eval table4: error: {message}\n")
    meta = next((r for r in rows if r.get("part") == "machine"), {})
    machine = {"gpu": meta.get("gpu"), "torch": meta.get("torch"), "triton": meta.get("triton"),
               "python": meta.get("python"), "prhs_commit": meta.get("commit"),
               "date": meta.get("date")}  # fmt: skip
    bw = next((r["TB/s"] for r in rows if r.get("op") == "copy" and "TB/s" in r), None)
    notes = (
        "Every ms is the median of `triton.testing.do_bench` over a CUDA-graph replay of one "
        "layer's op (B sequences, 32 query heads, head_dim 128, bf16). `× best dense`: the "
        "fastest dense kernel of the shape over this op; `× floor`: over the bytes it must "
        "read at the measured copy bandwidth"
        + (f" ({bw:.2f} TB/s)" if bw else "")
        + ". `cis step` / `quest step`: the whole selection and attention of a layer; a forced "
        "ρ is the share of query groups made to jump each step (so CIS retrieves)."
    )
    config = {"command": "table4", "argv": sys.argv[1:], "bench": str(args.bench)}
    folder = write_table_folder(
        args.out, "table4", title="Table IV analog: attention-operator latency", head=head,
        rows=cells, records=[r for r in rows if r.get("part") == "bench"], config=config,
        machine=machine, notes=notes,
    )  # fmt: skip
    sys.stdout.write(_table(head, cells) + f"\nwrote {folder}\n")
    return 0


_PAPER_HELP = {
    "table2": "Table II analog: dense, H2O, Quest, HShare, oracle, CIS, certified CIS",
    "table6": "Table VI analog: CIS against matched controls (HShare, DirectReuse, one tau)",
    "table8": "Table VIII analog: PrHS hyperparameters (CIS s, tau, r; PSAW phi, alpha; ETF psi)",
    "fig6": "Fig. 6 analog: accuracy, beta and oracle overlap against the budget",
    "fig7": "Fig. 7 analog: routing-MI perturbation against its certificate B_MI",
}


def _add_paper_tables(sub: Any) -> None:
    for name, text in _PAPER_HELP.items():
        p = sub.add_parser(name, help=f"{text}; writes OUT/{name}/")
        p.add_argument(
            "--models", type=_csv, default=["smollm2-135m"],
            help="embedded model names or directories (default smollm2-135m)",
        )  # fmt: skip
        p.add_argument("--tasks", type=_csv, default=None, help="override the table's tasks")
        p.add_argument("--context-len", type=_positive_int, default=2048, help="default 2048")
        p.add_argument("--samples", type=_positive_int, default=4, help="per task (default 4)")
        if name in ("fig6", "fig7"):
            p.add_argument(
                "--budgets", type=lambda s: [_positive_int(x) for x in _csv(s)], default=None,
                help="the budgets swept (default 32,64,128,256)",
            )  # fmt: skip
        else:
            p.add_argument("--budget", type=_positive_int, default=128, help="k (default 128)")
        p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
        p.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
        p.add_argument("--dtype", choices=_DTYPES, default=None, help="parameter dtype")
        p.add_argument(
            "--out", type=Path, default=Path("docs/results"),
            help=f"root of the results folders; writes OUT/{name}/ (default docs/results)",
        )  # fmt: skip
        p.add_argument("--quiet", action="store_true", help="no progress lines")
        what = "fig6's (its runs measure both) or fig7's" if name == "fig7" else f"{name}'s"
        p.add_argument(
            "--from-rows", type=lambda s: [Path(x) for x in _csv(s)], default=None,
            metavar="FILE[,FILE...]",
            help=f"run nothing: write the folder from earlier rows.jsonl files ({what}), "
            "joined (e.g. one run per model)",
        )  # fmt: skip


def _paper_table(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import dataclasses as dc
    import json

    from prhs_eval import preflight
    from prhs_eval.models import ModelNotAvailableError, check_model_name
    from prhs_eval.paper import PAPER_TABLES, fig7_cells, figure, run_paper_table, table_cells
    from prhs_eval.tables import machine_info, write_table_folder
    from prhs_eval.tasks import TASKS

    name = args.command
    table = PAPER_TABLES[name]
    budgets = getattr(args, "budgets", None)
    if budgets:
        table = dc.replace(table, budgets=tuple(budgets))  # this run's sweep, for its checks
    records: list[dict[str, Any]] = []
    from_rows = getattr(args, "from_rows", None)
    try:
        if from_rows is not None:
            need = {"model", "label", "selector", "task", "accuracy", "b_mi", "delta_i_emp"}
            for path in from_rows:
                if not path.is_file():
                    raise UsageError(f"--from-rows {str(path)!r} is not a file (a rows.jsonl)")
                for line in path.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        rec = json.loads(line)
                        if not need <= set(rec):
                            raise UsageError(
                                f"--from-rows {str(path)!r}: not the rows of a paper table "
                                f"(missing {sorted(need - set(rec))})"
                            )
                        records.append(rec)
            if not records:
                raise UsageError(f"--from-rows: {', '.join(map(str, from_rows))} hold no rows")
        else:
            tasks = tuple(args.tasks or table.tasks)
            unknown = [t for t in tasks if t not in TASKS]
            if unknown:
                raise UsageError(f"unknown task(s) {unknown}; known tasks: {', '.join(TASKS)}")
            from prhs_eval.tasks import FILE_TASKS

            files = [t for t in tasks if t in FILE_TASKS]
            if files:
                raise UsageError(
                    f"{files[0]} reads a local file, which the paper tables do not take: run it "
                    "with `prhs-eval compare --tasks ... --data PATH`"
                )
            sweep = table.budgets or (args.budget,)
            if max(sweep) >= args.context_len:
                raise UsageError(
                    f"budget {max(sweep)} >= context {args.context_len}: that is dense attention"
                )
            new_tokens = max(TASKS[t].max_new_tokens for t in tasks)
            for model in args.models:
                check_model_name(model)
                preflight.check_hub_cached(model)
                preflight.check_context(model, args.context_len, new_tokens)
            preflight.check_task_contexts(tasks, args.context_len, args.samples, args.seed)
            args.device = preflight.check_device(args.device)
        if args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out {str(args.out)!r} exists and is not a directory")
    except (UsageError, ModelNotAvailableError, preflight.PreflightError, ValueError) as exc:
        message = " ".join(str(exc).split())
        parser.exit(2, f"prhs-eval {name}: error: {message}\n")
    if from_rows is None:
        from tqdm.auto import tqdm

        bar = tqdm(disable=args.quiet, unit="run", dynamic_ncols=True, file=sys.stderr)

        def progress(msg: str) -> None:
            bar.set_postfix_str(msg, refresh=False)
            bar.update(1)

        try:
            records = run_paper_table(
                name, args.models, tasks=args.tasks, context_len=args.context_len,
                samples=args.samples, budget=getattr(args, "budget", 128), budgets=budgets,
                seed=args.seed,
                device=args.device, dtype=args.dtype, progress=progress,
            )  # fmt: skip
        finally:
            bar.close()
    head, rows = fig7_cells(records) if name == "fig7" else table_cells(name, records)
    env = records[0].get("environment", {}) if records else {}
    machine = {**machine_info(env.get("device")), **{k: v for k, v in env.items() if v}}
    config = {"command": name, "argv": sys.argv[1:], **{k: (str(v) if isinstance(v, Path) else v)
              for k, v in vars(args).items()}, "budgets": table.budgets}  # fmt: skip
    draw = None
    if name in ("fig6", "fig7"):
        draw = lambda path: figure(name, records, path)  # noqa: E731
    folder = write_table_folder(
        args.out, name, title=table.title, head=head, rows=rows, records=records, config=config,
        machine=machine, notes=table.note + _setting_note(records), figure=draw,
    )  # fmt: skip
    sys.stdout.write(_table(head, rows) + f"\nwrote {folder}\n")
    return 0


def _setting_note(records: Sequence[dict[str, Any]]) -> str:
    if not records:
        return ""
    r = records[0]
    return (
        f"\n\nSetting: context {r['context_len']} tokens, {r['num_samples']} sample(s) per task, "
        f"seed {r['seed']}; models {', '.join(dict.fromkeys(x['model'] for x in records))}; "
        "every metric measured against dense attention on the same steps."
    )


def _add_table5(sub: Any) -> None:
    t5 = sub.add_parser(
        "table5",
        help="end-to-end decode throughput (the paper's Table V): random-weight models of "
        "published shapes, a static cache, CUDA graphs; writes OUT/table5/",
        description="Decode throughput through the transformers integration: a model of each "
        "shape with random weights, a static cache of B rows of T random tokens, one decode "
        "step captured in a CUDA graph (eager off CUDA), its replays timed back to back by CUDA "
        "events over a window of 132 steps (the mean: a selector's occasional retrieval steps "
        "count as often as they run; the median step beside it); every method on the same "
        "model and cache, beside its byte floor.",
    )
    t5.add_argument(
        "--shapes", type=_csv, default=["llama2-7b", "llama3-8b"],
        help="llama2-7b (MHA), llama3-8b (GQA), tiny (tests) (default llama2-7b,llama3-8b)",
    )  # fmt: skip
    ints = lambda s: [_positive_int(x) for x in _csv(s)]  # noqa: E731
    t5.add_argument("--batches", type=ints, default=[1, 8, 16], help="default 1,8,16")
    t5.add_argument(
        "--contexts", type=ints, default=[4096, 16384, 32768], help="default 4096,16384,32768"
    )
    t5.add_argument(
        "--methods", default="sdpa,dense,quest,prhs",
        help="sdpa (transformers' attention), dense (prhs's dense kernel) or selectors, options "
        "in brackets: prhs[tau=0.5;budget=512] (default sdpa,dense,quest,prhs)",
    )  # fmt: skip
    t5.add_argument(
        "--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
        help="an option for every selector that has it (default budget=1024); repeatable",
    )  # fmt: skip
    t5.add_argument(
        "--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
        help="torch.compile the model's norms, MLPs and rotary embedding (every method alike; "
        "attention is not compiled) with BACKEND (default inductor) before the capture",
    )  # fmt: skip
    t5.add_argument(
        "--compile-scope", choices=("parts", "layers"), default="parts",
        help="with --compile: parts (the norms, MLPs and rotary embedding) or layers (each "
        "decoder layer whole, prhs's attention excluded from tracing; a graph per layer) "
        "(default parts)",
    )  # fmt: skip
    t5.add_argument(
        "--fuse", action="store_true",
        help="run each layer's q/k/v projections as one GEMM and its MLP's gate/up as another "
        "(every method alike; the weights are concatenated once, not copied twice)",
    )  # fmt: skip
    t5.add_argument(
        "--fuse-layers", action="store_true",
        help="with --gemm triton: run each Llama-family decoder layer's RMS norms, SiLU·mul "
        "and residual adds in its GEMMs' epilogues, and at decode steps its rotary embedding "
        "and KV-cache write in the q|k|v GEMM's (implies --fuse; every method alike)",
    )  # fmt: skip
    t5.add_argument(
        "--gemm", choices=("cublas", "triton"), default="cublas",
        help="the linear layers' GEMMs: cublas (F.linear) or triton (prhs_kernels.gemm's "
        "weight stream at decode sizes; every method alike) (default cublas)",
    )  # fmt: skip
    t5.add_argument("--layers", type=_positive_int, default=None, help="override the depth")
    t5.add_argument(
        "--headroom", type=_positive_int, default=160,
        help="decode positions past T the cache holds: the timed replays (default 160)",
    )  # fmt: skip
    t5.add_argument("--device", default=None, help="cuda (default when available), cuda:N, cpu")
    t5.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="default bfloat16")
    t5.add_argument("--seed", type=int, default=0, help="weights and K/V seed (default 0)")
    t5.add_argument(
        "--out", type=Path, default=Path("docs/results"),
        help="root of the results folders; writes OUT/table5/ (default docs/results)",
    )  # fmt: skip
    t5.add_argument("--quiet", action="store_true", help="no progress lines")
    t5.add_argument(
        "--from-rows", type=_csv, default=None, metavar="DIR[,DIR...]",
        help="measure nothing: join earlier table5 folders (one GPU; a later folder's point "
        "replaces an earlier one's) and write OUT/table5/ from them",
    )  # fmt: skip


def _table5(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from prhs_core.registry import UnknownSelectorError
    from prhs_eval.preflight import PreflightError, check_device
    from prhs_eval.runner import parse_option_value
    from prhs_eval.throughput import SHAPES, parse_methods

    if args.from_rows:
        return _table5_write(parser, args, None)
    try:
        unknown = [s for s in args.shapes if s not in SHAPES]
        if unknown or not args.shapes:
            raise UsageError(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
        common: dict[str, Any] = {"budget": 1024}
        for item in args.options:
            if "=" not in item or item.startswith("="):
                raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
            key, raw = item.split("=", 1)
            common[key.strip()] = parse_option_value(raw)
        methods = parse_methods(args.methods, common)
        used = {k for m in methods for k in m.options}
        unused = sorted(set(common) - used - {"budget"})
        if unused:
            raise UsageError(f"--set {unused[0]}: no method among {args.methods!r} has it")
        for m in methods:
            budget = m.options.get("budget")
            if isinstance(budget, int) and budget >= min(args.contexts):
                raise UsageError(
                    f"{m.label}: budget {budget} >= context {min(args.contexts)}: that is dense "
                    "(use longer --contexts or a smaller budget)"
                )
        if args.headroom < 16:
            raise UsageError(f"--headroom must be at least 16, got {args.headroom}")
        if args.fuse_layers and args.gemm != "triton":
            raise UsageError(
                "--fuse-layers needs --gemm triton (the norm and adds run inside prhs's GEMMs)"
            )
        device = check_device(args.device)
        if args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out {str(args.out)!r} exists and is not a directory")
    except (UsageError, UnknownSelectorError, PreflightError, TypeError, ValueError) as exc:
        message = " ".join(str(exc).split())
        parser.exit(2, f"prhs-eval table5: error: {message}\n")
    import torch

    from prhs_eval.tables import machine_info
    from prhs_eval.throughput import decode_throughput

    dtype = getattr(torch, args.dtype)
    say = None if args.quiet else (lambda m: sys.stderr.write(m + "\n"))
    points, contexts = [], []
    for shape in args.shapes:
        pts, ctx = decode_throughput(
            shape, args.batches, args.contexts, methods, device=device, dtype=dtype,
            layers=args.layers, headroom=args.headroom, seed=args.seed, compile=args.compile,
            fuse=args.fuse, compile_scope=args.compile_scope, gemm=args.gemm, progress=say,
            fuse_layers=args.fuse_layers,
        )  # fmt: skip
        points += pts
        contexts.append(ctx)
    return _table5_write(parser, args, (points, contexts, machine_info(device), methods))


def _table5_write(parser: argparse.ArgumentParser, args: argparse.Namespace, run: Any) -> int:
    from prhs_eval.tables import write_table_folder
    from prhs_eval.throughput import TABLE5_HEAD, load_points, table5_figure, table5_rows

    if run is None:
        try:
            points, contexts, machine = load_points(args.from_rows)
        except (OSError, ValueError, TypeError) as exc:
            message = " ".join(str(exc).split())
            parser.exit(2, f"prhs-eval table5: error: --from-rows: {message}\n")
        labels = list(dict.fromkeys(p.method for p in points))
    else:
        points, contexts, machine, methods = run
        labels = [m.label for m in methods]
    if not contexts:
        parser.exit(2, "prhs-eval table5: error: --from-rows: the folders record no run\n")
    rows = table5_rows(points)
    graphed = all(p.graph for p in points if not p.skipped)
    notes = (
        "Random weights and random K/V (a step reads the same bytes whatever they hold), "
        "greedy decoding, one step "
        + ("captured in a CUDA graph; `ms/step` is the mean of a window of consecutive replays "
           "(132: four whole 33-step periods of a CIS anchor's life, so its retrieval steps "
           "count as often as they run) timed by CUDA events, `median ms` that window's median "
           "step (a reuse step, for CIS); a `ms/step` marked `(median)` was timed before the "
           "window, by `triton.testing.do_bench`'s median, which leaves retrieval steps out"
           if graphed else "run eagerly and timed by the wall clock (no CUDA here: not a "
           "throughput figure)")
        + ". `· compiled`: the model's RMS norms, MLPs and rotary embedding ran through "
        "`torch.compile` (attention did not), for every method of that run; `· compiled "
        "layers`: each decoder layer did, whole (prhs's attention excluded from tracing); "
        "`· fused`: each layer's q/k/v projections ran as one GEMM and its gate/up as "
        "another, for every method of that run; `· fused layers`: that, and each layer's "
        "norms, SiLU·mul and residual adds ran in its GEMMs' epilogues; `+ rope`: the "
        "rotary embedding and the K/V cache write too, in the q|k|v GEMM's; "
        "`· triton GEMMs`: every linear layer ran "
        "prhs's decode GEMM (`prhs_kernels.gemm`) instead of cuBLAS, for every method of that "
        "run"
        + ". `sdpa`: transformers' attention over the static cache; `dense`: prhs's dense "
        "decode kernel; `× dense`: the best of the two over this row. Floor: weights + the "
        "K/V and proxies the method reads per step (its own statistics, kept in a second, "
        "untimed run of as many steps: the timed one keeps none), at the copy "
        f"bandwidth measured in the run ({contexts[0]['copy_bandwidth_GBps']:.0f} GB/s). ρ̂: "
        "the share of (row, KV head, layer) decisions that retrieved; random weights make "
        "consecutive queries unlike each other, so CIS's reuse ratio here is not a real "
        "model's."
    )  # fmt: skip
    config = {"command": "table5", "argv": sys.argv[1:], **vars(args), "out": str(args.out),
              "methods": labels, "runs": contexts}  # fmt: skip
    folder = write_table_folder(
        args.out, "table5", title="Table V analog: end-to-end decode throughput",
        head=TABLE5_HEAD, rows=rows, records=[p.as_dict() for p in points], config=config,
        machine=machine, notes=notes,
        figure=lambda path: table5_figure(points, path),
    )  # fmt: skip
    sys.stdout.write(_table(TABLE5_HEAD, rows) + f"\nwrote {folder}\n")
    return 0


def _calibrate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from prhs_eval.calibrate import calibrate_channels, write_channels
    from prhs_eval.data import DataPackageNotFoundError
    from prhs_eval.models import ModelNotAvailableError, check_model_name

    try:
        if args.prompt_queries < 2:
            raise UsageError("--prompt-queries must be at least 2")
        if args.prompt_queries > args.context_len:
            raise UsageError(
                f"--prompt-queries ({args.prompt_queries}) must not exceed --context-len "
                f"({args.context_len})"
            )
        if args.out.is_dir():
            raise UsageError(f"--out {str(args.out)!r} is a directory; name the JSON file")
        check_model_name(args.model)
        result = calibrate_channels(
            args.model, text=args.text, context_len=args.context_len, samples=args.samples,
            seed=args.seed, label_channels=args.label_channels,
            prompt_queries=args.prompt_queries, device=args.device, dtype=args.dtype,
            progress=not args.quiet,
        )  # fmt: skip
    except (
        UsageError, ModelNotAvailableError, DataPackageNotFoundError, TypeError, ValueError
    ) as exc:  # fmt: skip
        message = " ".join(str(exc).split())
        parser.exit(2, f"prhs-eval calibrate: error: {message}\n")
    path = write_channels(result, args.out)
    r, n = result["label_channels"], result["head_dim"]
    sys.stdout.write(
        f"wrote {path}: {r} of {n} channels per KV head, {result['num_layers']} layers; use "
        f"--set double_sparsity.channels=@{path}\n"
    )
    return 0


def _fields(name: str) -> set[str]:
    from prhs_core.registry import selectors

    config = selectors.get(name).config
    return {f.name for f in dataclasses.fields(config)} if config is not None else set()


def _options_of(name: str) -> str:
    fields = sorted(_fields(name))
    return f"its options: {', '.join(fields)}" if fields else f"{name} has no options"


def _load_option_file(item: str, key: str, path: str) -> Any:
    """``KEY=@FILE``: the value is the JSON in ``FILE``; a JSON object holding ``KEY`` (the
    option's name, without its selector) gives that entry, so a calibration file can carry
    its provenance beside the value."""
    from prhs_core.config import load_option_file

    try:
        return load_option_file(key.split(".", 1)[-1], path)
    except ValueError as exc:
        raise UsageError(f"--set {item!r}: {exc}") from None


def _parse_options(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--set`` items per selector. A global ``KEY=VALUE`` goes to every selector that has
    ``KEY`` (an error when none has it); ``SEL.KEY=VALUE`` to ``SEL``, which must have it."""
    from prhs_eval.runner import parse_option_value

    per: dict[str, dict[str, Any]] = {n: {} for n in names}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set expects KEY=VALUE or SELECTOR.KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        if raw.startswith("@"):
            value = _load_option_file(item, key, raw[1:])
        else:
            value = parse_option_value(raw)
        if "." in key:
            sel, field = key.split(".", 1)
            if sel not in per:
                raise UsageError(
                    f"--set {item!r}: {sel!r} is not among the selectors {list(names)}"
                )
            if field not in _fields(sel):
                raise UsageError(
                    f"--set {item!r}: selector {sel!r} has no option {field!r}, so it would be "
                    f"ignored ({_options_of(sel)})"
                )
            targets = [sel]
        else:
            field = key
            targets = [n for n in names if field in _fields(n)]
            if not targets:
                raise UsageError(
                    f"--set {item!r}: no selector among {list(names)} has the option {field!r}, "
                    f"so it would be ignored ({'; '.join(_options_of(n) for n in names)})"
                )
        for t in targets:
            per[t][field] = value
    return per


def _specs(args: argparse.Namespace) -> list[Any]:
    from prhs_core.registry import selectors
    from prhs_eval.runner import SelectorSpec

    names = [args.selector] if args.command == "run" else list(args.selectors)
    if not names:
        raise UsageError("no selectors given")
    for n in names:
        selectors.get(n)  # UnknownSelectorError lists the known names
    per = _parse_options(args.options, names)
    budgets = getattr(args, "budgets", None)
    swept = [n for n in names if "budget" in _fields(n)]
    if budgets and not swept:
        raise UsageError(
            f"--budgets: no selector among {list(names)} has a budget, so it would be ignored"
        )
    grids: dict[str, list[dict[str, Any]]] = {n: [dict(per[n])] for n in names}
    for key, values, targets in _parse_sweeps(getattr(args, "sweep", []), names):
        for t in targets:
            grids[t] = [{**opts, key: v} for opts in grids[t] for v in values]
    specs = []
    for n in names:
        for opts in grids[n]:
            if budgets and n in swept:
                specs += [SelectorSpec(n, {**opts, "budget": b}) for b in budgets]
            else:
                specs.append(SelectorSpec(n, opts))
    return specs


def _parse_sweeps(
    items: Sequence[str], names: Sequence[str]
) -> list[tuple[str, list[Any], list[str]]]:
    """``--sweep`` items as ``(key, values, selectors)``; the selectors follow ``--set``'s rule
    (``SEL.KEY``: that one, which must have ``KEY``; ``KEY``: every one that has it)."""
    from prhs_eval.runner import parse_option_value

    out: list[tuple[str, list[Any], list[str]]] = []
    seen: set[tuple[str, str]] = set()
    for item in items:
        if "=" not in item:
            raise UsageError(
                f"--sweep expects KEY=V1,V2,... or SELECTOR.KEY=V1,V2,..., got {item!r}"
            )
        key, raw = item.split("=", 1)
        values = [parse_option_value(v) for v in _csv(raw)]
        if not values:
            raise UsageError(f"--sweep {item!r}: no values after '='")
        if len(set(map(repr, values))) != len(values):
            raise UsageError(f"--sweep {item!r}: a value is given twice")
        # Which selectors: the same rule as --set, checked by the same function.
        targets = [n for n, opts in _parse_options([f"{key}={raw}"], names).items() if opts]
        field = key.split(".", 1)[1] if "." in key else key
        if field == "budget":
            raise UsageError(f"--sweep {item!r}: sweep budgets with --budgets")
        for t in targets:
            if (t, field) in seen:
                raise UsageError(f"--sweep {item!r}: {t}.{field} is swept twice")
            seen.add((t, field))
        out.append((field, values, targets))
    return out


def _check_budgets(specs: Sequence[Any], context_len: int) -> None:
    """A budget that covers the whole context reads every position: that is dense."""
    for spec in specs:
        budget = spec.config_dict().get("budget")
        if isinstance(budget, int) and budget >= context_len:
            origin = "" if "budget" in spec.options else " (its default)"
            raise UsageError(
                f"{spec.name}: budget {budget}{origin} >= context {context_len}: every "
                f"position is read; this is dense attention (use a budget below "
                f"{context_len} or the dense selector)"
            )


def _check_files(args: argparse.Namespace) -> None:
    from prhs_eval.preflight import check_text_file, check_text_long_enough
    from prhs_eval.tasks import FILE_TASKS, HAYSTACKS, check_haystack

    file_tasks = [t for t in args.tasks if t in FILE_TASKS]
    if args.data is not None:
        if not file_tasks:
            raise UsageError(f"--data is for the tasks that read a file ({', '.join(FILE_TASKS)})")
        if len(file_tasks) > 1:
            raise UsageError(
                f"--data names one file, but {file_tasks} each read their own: run them apart"
            )
        if not Path(args.data).is_file():
            raise UsageError(f"--data {args.data!r} is not a file")
    elif file_tasks:
        raise UsageError(f"{file_tasks[0]} reads the benchmark's local file: give --data PATH")

    if args.text is not None:
        from prhs_eval.tasks.perplexity import PERPLEXITY_TEXTS

        if "perplexity" not in args.tasks:
            raise UsageError("--text is for the perplexity task; add it to --tasks")
        if args.text in PERPLEXITY_TEXTS:
            text = PERPLEXITY_TEXTS[args.text]()  # its data package must be installed
        elif not Path(args.text).exists():
            raise UsageError(
                f"--text {args.text!r} does not exist, and is not a text name either "
                f"({', '.join(PERPLEXITY_TEXTS)})"
            )
        else:
            text = check_text_file(args.text, "--text")
        check_text_long_enough(
            text, args.text, context_len=args.context_len, num_samples=args.samples
        )
    if args.haystack is not None:
        if set(args.tasks) <= {"perplexity"}:
            raise UsageError("--haystack is for the passkey, NIAH and variable-tracking tasks")
        if args.haystack not in HAYSTACKS:
            if not Path(args.haystack).exists():
                raise UsageError(
                    f"--haystack {args.haystack!r} is neither a haystack name "
                    f"({', '.join(HAYSTACKS)}) nor an existing text file"
                )
            check_text_file(args.haystack, "--haystack")
        check_haystack(args.haystack)  # essays installed; a file with enough sentences


def _check_model_and_tasks(args: argparse.Namespace) -> None:
    from prhs_eval import preflight
    from prhs_eval.models import check_model_name
    from prhs_eval.tasks import TASKS

    if not args.tasks:
        raise UsageError("no tasks given")
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        raise UsageError(f"unknown task(s) {unknown}; known tasks: {', '.join(TASKS)}")
    _check_files(args)
    check_model_name(args.model)
    preflight.check_hub_cached(args.model)
    new_tokens = max(TASKS[t].max_new_tokens for t in args.tasks)
    preflight.check_context(args.model, args.context_len, new_tokens)
    preflight.check_task_contexts(args.tasks, args.context_len, args.samples, args.seed)
    if args.server is not None:
        return  # the model runs in the server: no device or dtype here
    args.device = preflight.check_device(args.device)
    if args.dtype is None:
        args.dtype = preflight.default_dtype(args.device)


def _check_server_args(args: argparse.Namespace) -> None:
    """``--server``: what cannot apply to a server, the URL and the label; no network yet."""
    from prhs_eval.server import LABEL_PATTERN, check_server_url

    if args.command == "compare":
        raise UsageError(
            "compare --server: a server runs one attention configuration, the one it was "
            "started with (--sparse-attn NAME); start one server per selector and run "
            "`prhs-eval run NAME --server URL --out DIR` against each"
        )
    if args.options:
        raise UsageError(
            f"--set {args.options[0]!r} with --server: selector options cannot be sent to a "
            "running server; start the server with them (--sparse-config)"
        )
    for flag in ("device", "dtype"):
        if getattr(args, flag) is not None:
            raise UsageError(
                f"--{flag} with --server: the model runs in the server; choose its {flag} "
                "when starting the server"
            )
    if not LABEL_PATTERN.match(args.selector):
        raise UsageError(
            f"{args.selector!r} is not a selector label: use letters, digits and _ . + - "
            "(with --server, SELECTOR only labels the results)"
        )
    check_server_url(args.server)


def _connect(args: argparse.Namespace) -> Any:
    """``--server``: reach the server, check it serves ``--model`` under the label's selector
    and with enough context; the :class:`~prhs_eval.server.ServerTarget`."""
    from prhs_eval.preflight import PreflightError, check_context
    from prhs_eval.server import check_label, connect
    from prhs_eval.tasks import TASKS

    target = connect(args.server, args.model)
    check_label(args.selector, target.info)
    limit = target.info.max_model_len
    if limit is not None:
        new_tokens = max(TASKS[t].max_new_tokens for t in args.tasks)
        try:
            check_context(args.model, args.context_len, new_tokens, known=limit)
        except PreflightError as exc:
            raise UsageError(f"{exc} (the server's context length, /v1/models)") from None
    return target


def _check_out(args: argparse.Namespace) -> None:
    from prhs_eval.results import check_out_dir

    check_out_dir(args.out, overwrite=args.overwrite, resume=args.resume)


def main(argv: Sequence[str] | None = None, registry: Registry | None = None) -> int:
    """Run the CLI; returns the process exit code (2 for bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "selectors":
        if registry is None:
            from prhs_core.registry import selectors as registry
        sys.stdout.write(_format_selectors(registry))
        return 0
    if args.command == "tasks":
        sys.stdout.write(_format_tasks())
        return 0
    if args.command == "models":
        sys.stdout.write(_format_models())
        return 0
    if args.command == "calibrate":
        return _calibrate(parser, args)
    if args.command == "table5":
        return _table5(parser, args)
    if args.command == "table4":
        return _table4(parser, args)
    if args.command in _PAPER_HELP:
        return _paper_table(parser, args)
    if args.command in ("run", "compare"):
        from prhs_core.registry import UnknownSelectorError
        from prhs_eval.data import DataPackageNotFoundError
        from prhs_eval.models import ModelNotAvailableError
        from prhs_eval.server import ServerError

        try:  # every argument and selector option is checked before any work starts
            if args.server is None:
                specs = _specs(args)
            else:
                _check_server_args(args)
                specs = []
            _check_model_and_tasks(args)
            _check_budgets(specs, args.context_len)
            _check_out(args)
            if args.server is not None:  # the network last: the arguments fail fast
                args.server_target = _connect(args)
        except (
            UsageError,
            UnknownSelectorError,
            ModelNotAvailableError,
            DataPackageNotFoundError,
            ServerError,
            TypeError,
            ValueError,
        ) as exc:
            message = " ".join(str(exc).split())
            parser.exit(2, f"prhs-eval {args.command}: error: {message}\n")
        from prhs_eval.evaluate import evaluate

        if args.server is None:
            return evaluate(args, specs)
        try:
            return evaluate(args, specs)
        except ServerError as exc:  # mid-run: the finished rows are in the log (--resume)
            message = " ".join(str(exc).split())
            sys.stderr.write(
                f"prhs-eval {args.command}: error: {message}\n(the samples finished before are "
                f"in {args.out}; --resume continues the run)\n"
            )
            return 1
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
