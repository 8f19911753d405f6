"""The work behind ``prhs-eval run`` and ``prhs-eval compare``, after the CLI has checked every
argument: load the model (or, with ``--server``, the tokenizer of the server's model), run,
report, write the results."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["evaluate"]


def evaluate(args: argparse.Namespace, specs: Sequence[Any]) -> int:
    """Load the model, run every (task, selector, sample), print the table, write the files;
    ``args`` and ``specs`` were checked by :mod:`prhs_eval.cli` before.

    The output folder ``args.out`` is checked and prepared first
    (:func:`prhs_eval.results.prepare_out_dir`: ``args.overwrite`` / ``args.resume``), each
    finished row is logged there as it finishes, and with ``args.resume`` the rows already
    logged are not run again. ``args.device`` / ``args.dtype`` go to the model loader when set.

    With ``args.server_target`` (a :class:`~prhs_eval.server.ServerTarget` the CLI checked),
    no model is loaded: the tasks run on that SGLang server
    (:func:`~prhs_eval.runner.run_on_server`) with ``args.selector`` as the label, and
    ``specs`` is not used.

    Raises
    ------
    prhs_eval.server.ServerError
        The server failed a request; the rows finished before are in the output folder's log.
    """
    from tqdm.auto import tqdm

    from prhs_eval.models import load_model
    from prhs_eval.report import TABLE_LEGEND, format_table, write_all
    from prhs_eval.results import prepare_out_dir
    from prhs_eval.runner import compare

    t0 = time.perf_counter()
    # Before the model loads: an earlier run's results are never overwritten silently.
    log = prepare_out_dir(
        Path(args.out),
        overwrite=bool(getattr(args, "overwrite", False)),
        resume=bool(getattr(args, "resume", False)),
    )
    target = getattr(args, "server_target", None)
    if target is not None:
        from prhs_eval.runner import run_on_server
        from prhs_eval.server import ServerSession

        session = ServerSession(target)
        runs = len(args.tasks) * args.samples
        version = target.info.version or "(version not reported)"
        model = f"{target.model} on SGLang {version} at {target.info.url}"
    else:
        load_kwargs = {
            k: v for k in ("device", "dtype") if (v := getattr(args, k, None)) is not None
        }
        loaded = load_model(args.model, **load_kwargs)
        runs = len(specs) * len(args.tasks) * args.samples
        model = loaded.name
    bar = tqdm(total=runs, disable=args.quiet, unit="run", dynamic_ncols=True, file=sys.stderr)

    def progress(msg: str) -> None:
        bar.set_postfix_str(msg, refresh=False)
        bar.update(1)

    task_options: dict[str, Any] = {}
    if args.haystack:
        task_options["haystack"] = args.haystack
    if args.text is not None:
        task_options["source"] = str(args.text)
    if getattr(args, "data", None) is not None:
        task_options["data"] = str(args.data)
    common: dict[str, Any] = dict(
        context_len=args.context_len,
        num_samples=args.samples,
        seed=args.seed,
        task_options=task_options,
        progress=progress,
        log=log,
    )
    try:
        if target is not None:
            results = run_on_server(session, args.selector, args.tasks, **common)
        else:
            results = compare(loaded, specs, args.tasks, measure=not args.no_measure, **common)
    finally:
        bar.close()
    sys.stdout.write(
        f"model {model} · context {args.context_len} tokens · "
        f"{args.samples} sample(s)/task · seed {args.seed} · "
        f"{time.perf_counter() - t0:.0f} s\n\n"
    )
    if target is not None:
        note = (
            f"selector {args.selector!r} labels the server's attention; a server reports no "
            "selection statistics: δ, β, overlap, ρ̂, Avg KV and bytes read are left empty; "
            "prefill s / s/tok are timed here, to the first streamed token and after it"
        )
        if "perplexity" in args.tasks:
            note += "; ppl is from the prompt logprobs of the server's prefill, not decode steps"
        sys.stdout.write(note + "\n\n")
    if log.loaded:
        sys.stdout.write(f"resumed: {log.loaded} row(s) taken from {log.path}\n\n")
    sys.stdout.write(format_table(results) + "\n" + TABLE_LEGEND + "\n")
    paths = write_all(results, args.out)
    sys.stdout.write("\n" + "\n".join(f"wrote {p}" for p in paths.values()) + "\n")
    return 0
