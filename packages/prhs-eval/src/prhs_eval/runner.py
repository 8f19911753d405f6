"""Run selectors on a model and tasks, on identical inputs, and measure them.

For each sample the prompt is prefilled once with the model's own (dense) attention; every
selector whose prefill is dense then decodes from a copy of that cache, so they all see exactly
the same prompt state. Selectors that change prefill (PSAW, ETF, CPE) prefill for themselves.
Decoding is greedy. Every decode step is also measured against dense attention
(:class:`~prhs_eval.metrics.SelectionMeter`).

Perplexity samples: the first ``context_len − score_tokens`` tokens are prefilled, the last
``score_tokens`` are teacher-forced one decode step at a time through the selector, and their
mean negative log-likelihood is reported.

Every finished (selector, task, sample) becomes a row of a :class:`~prhs_eval.results.SampleLog`
(appended to the output folder's log as it finishes, when the log has a file); rows already in
the log are not run again (``--resume``), and every :class:`~prhs_eval.results.RunResult` is
aggregated from the rows (:func:`~prhs_eval.results.aggregate`), so a resumed run reports what
an uninterrupted one would.

:func:`run_on_server` runs the same tasks, samples and scoring on a running SGLang server
(:mod:`prhs_eval.server`) instead of an in-process model: the server's own attention (a
sparse one when it was started with one), greedy and streamed, one label for the results.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from prhs_core.protocols import PrefillPlanner, PromptObserver
from prhs_core.registry import selectors
from prhs_eval.integration import PrhsRuntime, attention_spec, enable
from prhs_eval.metrics import MeterSums, SelectionMeter
from prhs_eval.models import LoadedModel
from prhs_eval.results import (
    ResumeMismatchError,
    RunResult,
    SampleLog,
    SampleResult,
    aggregate,
    environment,
    make_row,
    row_key,
)
from prhs_eval.tasks import TASKS, Sample, make_samples, score

if TYPE_CHECKING:
    from prhs_eval.server import ServerSession

__all__ = ["SelectorSpec", "compare", "parse_option_value", "run_on_server"]

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class SelectorSpec:
    """A selector by name with option values; validated (and its config built) on creation."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options))
        self.build()  # unknown name or bad option: raise now, before any work

    def build(self) -> Any:
        """A fresh selector instance."""
        return selectors.create(self.name, **self.options)

    def config_dict(self) -> dict[str, Any]:
        """The full config, defaults included."""
        return asdict(self.build().config)

    def resolved_options(self, num_layers: int) -> dict[str, Any]:
        """The full config as used on a model of ``num_layers`` layers: defaults included and
        options left to ``None`` replaced by what they resolve to (certified CIS's
        ``delta_target``, ``k_max``, ``certificate`` and ``certificate_page``, a ``start_layer``
        of ``None``: ``num_layers // 2``)."""
        config = self.build().config
        out = asdict(config)
        if getattr(config, "certified", False):
            out["delta_target"] = config.retrieval_target
            out["k_max"] = config.retrieval_cap
            if "certificate" in out:
                out["certificate"] = "page" if config.page_certified else "global"
                out["certificate_page"] = config.page_size if config.page_certified else None
        if "start_layer" in out and out["start_layer"] is None:
            from prhs_selectors.prefill import resolve_start_layer

            out["start_layer"] = resolve_start_layer(None, num_layers)
        return out


def parse_option_value(text: str) -> Any:
    """``"128"`` -> 128, ``"0.8"`` -> 0.8, ``"none"`` -> None, ``"true"`` -> True, else the text."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _task_parameters(task: str) -> set[str]:
    return set(inspect.signature(TASKS[task].generator).parameters)


def _needs_own_prefill(selector: Any, num_layers: int, prompt_len: int) -> bool:
    """Whether ``selector`` must prefill the prompt itself rather than share the dense prefill:
    its prefill plan changes the cache (PSAW's windows, ETF's frozen rows), or it observes the
    prompt's queries (CIS's ``tau="auto"`` calibrates on them, which a shared prefill made
    before the selector was attached would skip)."""
    if isinstance(selector, PromptObserver) and selector.prompt_queries() > 0:
        return True
    if not isinstance(selector, PrefillPlanner):
        return False
    for layer in range(num_layers):
        plan = selector.plan_prefill(layer, num_layers)
        start, end = plan.frozen_rows(prompt_len)
        if plan.window_fraction > 0.0 or end > start:
            return True
    return False


@dataclass
class _Prefill:
    cache: Any
    logits: torch.Tensor  # [1, V] of the last prompt position
    seconds: float


class _Session:
    """One loaded model; prefill and greedy decode with or without a runtime."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tok = loaded.tokenizer
        self.device = next(self.model.parameters()).device
        self.eos = set()
        for tid in (
            self.tok.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(tid, int):
                self.eos.add(tid)
            elif isinstance(tid, list):
                self.eos.update(int(t) for t in tid)

    def encode(self, text: str) -> torch.Tensor:
        ids = self.tok(text, return_tensors="pt", add_special_tokens=True).input_ids
        return ids.to(self.device)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> _Prefill:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        t0 = time.perf_counter()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return _Prefill(cache, out.logits[:, -1].float(), time.perf_counter() - t0)

    @torch.no_grad()
    def step(self, token: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    def greedy(self, pre: _Prefill, max_new_tokens: int) -> tuple[str, int, float]:
        """Greedy completion from a prefilled cache: ``(text, steps, seconds)``."""
        tokens: list[int] = []
        logits = pre.logits
        t0 = time.perf_counter()
        steps = 0
        for _ in range(max_new_tokens):
            nxt = int(logits.argmax(-1))
            if nxt in self.eos:
                break
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            logits = self.step(torch.tensor([nxt], device=self.device), pre.cache)
            steps += 1
        return self.tok.decode(tokens, skip_special_tokens=True), steps, time.perf_counter() - t0

    def teacher_forced_nll(self, pre: _Prefill, targets: torch.Tensor) -> tuple[float, float]:
        """Mean NLL of ``targets`` ``[n]`` decoded one step at a time: ``(nll, seconds)``."""
        logits = pre.logits
        total = 0.0
        t0 = time.perf_counter()
        for i, tgt in enumerate(targets.tolist()):
            total -= float(torch.log_softmax(logits, -1)[0, tgt])
            if i + 1 < len(targets):
                logits = self.step(targets[i : i + 1], pre.cache)
        return total / max(1, len(targets)), time.perf_counter() - t0


def compare(
    loaded: LoadedModel,
    specs: Sequence[SelectorSpec],
    tasks: Sequence[str],
    *,
    context_len: int,
    num_samples: int,
    seed: int = 0,
    score_tokens: int = 64,
    task_options: Mapping[str, Any] | None = None,
    progress: ProgressFn | None = None,
    measure: bool = True,
    log: SampleLog | None = None,
) -> list[RunResult]:
    """Run every selector of ``specs`` on every task, on identical samples.

    Parameters
    ----------
    loaded:
        The model (:func:`prhs_eval.models.load_model`).
    specs:
        Selectors with their options.
    tasks:
        Names from :data:`prhs_eval.tasks.TASKS`.
    context_len, num_samples, seed:
        Task generation parameters.
    score_tokens:
        Perplexity tasks: the number of final tokens scored through decode.
    task_options:
        Extra keyword arguments for the task generators (``haystack="essays"``,
        ``source="path/to/text.txt"``); each goes to the tasks that take it.
    progress:
        Called with a short message after each (sample, selector), also for the rows taken
        from ``log`` (their message ends with ``(logged)``).
    measure:
        Measure selection metrics against dense attention (slower).
    log:
        The per-sample log (:func:`prhs_eval.results.prepare_out_dir`): each finished row is
        appended to it, and rows it already holds are taken from it instead of being run.
        ``None``: an in-memory log.

    Raises
    ------
    ResumeMismatchError
        ``log`` holds rows of a run with other settings (model, revision, context length,
        seed, score tokens, task options, measuring) or of other prompts.

    Returns
    -------
    list of RunResult
        One per (task, selector), in task-major order.
    """
    if not specs:
        raise ValueError("compare needs at least one selector")
    options = _check_tasks(tasks, score_tokens, task_options)
    spec_model = attention_spec(loaded.model.config)
    revision = getattr(loaded, "revision", None)
    run = {
        "model": loaded.name,
        "model_revision": revision,
        "context_len": context_len,
        "seed": seed,
        "score_tokens": score_tokens,
        "task_options": options,
        "measure": measure,
        "server": None,
    }
    if log is None:
        log = SampleLog(None)
    log.check_run(run)
    session = _Session(loaded)
    ctx = _RunContext(
        session=session,
        num_layers=spec_model.num_layers,
        run=run,
        env=environment(loaded.model, revision=revision),
        log=log,
        progress=progress,
        measure=measure,
        score_tokens=score_tokens,
    )
    results: list[RunResult] = []
    for task in tasks:
        own = {k: v for k, v in options.items() if k in _task_parameters(task)}
        samples = make_samples(
            task,
            loaded.tokenizer,
            context_len=context_len,
            num_samples=num_samples,
            seed=seed,
            **own,
        )
        results.extend(_run_task(ctx, specs, task, samples))
    return results


def _check_tasks(
    tasks: Sequence[str], score_tokens: int, task_options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Check the task names, ``score_tokens`` and that every task option has a taker."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known tasks: {', '.join(TASKS)}")
    if score_tokens < 1:
        raise ValueError(f"score_tokens must be >= 1, got {score_tokens}")
    options = dict(task_options or {})
    unused = set(options) - {p for t in tasks for p in _task_parameters(t)}
    if unused:
        raise ValueError(f"no task among {list(tasks)} takes the option(s) {sorted(unused)}")
    return options


@dataclass
class _RunContext:
    session: _Session
    num_layers: int
    run: dict[str, Any]
    env: dict[str, Any]
    log: SampleLog
    progress: ProgressFn | None
    measure: bool
    score_tokens: int


def _prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def _run_task(
    ctx: _RunContext, specs: Sequence[SelectorSpec], task: str, samples: Iterable[Sample]
) -> list[RunResult]:
    kind = TASKS[task].kind
    session = ctx.session
    resolved = [spec.resolved_options(ctx.num_layers) for spec in specs]
    rows: list[list[dict[str, Any]]] = [[] for _ in specs]
    for sample in samples:
        digest = _prompt_digest(sample.prompt)
        keys = [
            row_key(s.name, o, task, sample.index) for s, o in zip(specs, resolved, strict=True)
        ]
        names = [s.name for s in specs]
        todo = _take_logged(ctx.log, keys, names, rows, sample, digest, ctx.progress)
        if not todo:
            continue
        ids = session.encode(sample.prompt)
        targets = None
        if kind == "perplexity":
            n = min(ctx.score_tokens, ids.shape[1] - 1)
            ids, targets = ids[:, :-n], ids[0, -n:]
        shared: _Prefill | None = None
        for i in todo:
            spec = specs[i]
            selector = spec.build()
            own_prefill = _needs_own_prefill(selector, ctx.num_layers, ids.shape[1])
            if not own_prefill and shared is None:
                shared = session.prefill(ids)
            runtime: PrhsRuntime = enable(session.model, selector)
            meter = SelectionMeter()
            if ctx.measure:
                runtime.add_observer(meter)
            try:
                if own_prefill:
                    pre = session.prefill(ids)
                else:
                    assert shared is not None
                    pre = _Prefill(copy.deepcopy(shared.cache), shared.logits, shared.seconds)
                if targets is None:
                    text, steps, secs = session.greedy(pre, sample.max_new_tokens)
                    result = SampleResult(
                        task,
                        sample.index,
                        sample.context_tokens,
                        text,
                        sample.answers,
                        score(sample, text),
                    )
                else:
                    nll, secs = session.teacher_forced_nll(pre, targets)
                    steps = len(targets) - 1
                    result = SampleResult(
                        task,
                        sample.index,
                        sample.context_tokens,
                        "",
                        (),
                        float("nan"),
                        nll,
                        len(targets),
                    )
            finally:
                runtime.disable()
            row = make_row(
                run=ctx.run,
                selector=spec.name,
                options=resolved[i],
                sample=result,
                prompt_sha256=digest,
                prefill_seconds=pre.seconds if own_prefill else 0.0,
                prefill_shared=not own_prefill,
                shared_prefill_seconds=0.0 if own_prefill else pre.seconds,
                decode_seconds=secs,
                decode_tokens=steps,
                meter=meter.sums(),
                environment=ctx.env,
            )
            ctx.log.append(row)
            rows[i].append(row)
            if ctx.progress is not None:
                ctx.progress(f"{task} #{sample.index} {spec.name}")
    return [aggregate(r, kind=kind) for r in rows if r]


def _take_logged(
    log: SampleLog,
    keys: Sequence[str],
    names: Sequence[str],
    rows: list[list[dict[str, Any]]],
    sample: Sample,
    digest: str,
    progress: ProgressFn | None,
) -> list[int]:
    """Append the rows ``log`` already holds for ``sample`` to ``rows``; the indices of
    ``keys`` still to run."""
    todo = []
    for i, key in enumerate(keys):
        row = log.get(key)
        if row is None:
            todo.append(i)
            continue
        if row.get("prompt_sha256") != digest:
            raise ResumeMismatchError(
                f"the logged {sample.task} sample #{sample.index} had another prompt than this "
                "run's (task data changed?); pass --overwrite or choose another --out"
            )
        rows[i].append(row)
        if progress is not None:
            progress(f"{sample.task} #{sample.index} {names[i]} (logged)")
    return todo


def run_on_server(
    session: ServerSession,
    label: str,
    tasks: Sequence[str],
    *,
    context_len: int,
    num_samples: int,
    seed: int = 0,
    score_tokens: int = 64,
    task_options: Mapping[str, Any] | None = None,
    progress: ProgressFn | None = None,
    log: SampleLog | None = None,
) -> list[RunResult]:
    """Run the tasks on an SGLang server (:class:`~prhs_eval.server.ServerSession`): the same
    samples, prompts and scoring as :func:`compare`, the model and its attention in the server.

    The server runs one attention configuration, the one it was started with; ``label`` names
    it in the results (the ``selector`` of every row; its ``options`` are empty, the server's
    sparse-attention arguments are in the environment). Generation is greedy and streamed;
    perplexity uses the prompt logprobs of one request per sample (the server's prefill of the
    scored tokens, where :func:`compare` decodes them step by step). Nothing is measured
    against dense attention: the selection metrics of the rows are empty (``nan``).

    Parameters
    ----------
    session:
        The server and the tokenizer of its model.
    label:
        The selector name recorded.
    tasks, context_len, num_samples, seed, score_tokens, task_options, progress, log:
        As for :func:`compare`.

    Raises
    ------
    ResumeMismatchError
        ``log`` holds rows of a run with other settings (another server URL among them).
    prhs_eval.server.ServerError
        The server failed a request; the rows finished before are in ``log``.

    Returns
    -------
    list of RunResult
        One per task.
    """
    options = _check_tasks(tasks, score_tokens, task_options)
    run = {
        "model": session.name,
        "model_revision": session.target.revision,
        "context_len": context_len,
        "seed": seed,
        "score_tokens": score_tokens,
        "task_options": options,
        "measure": False,
        "server": session.info.url,
    }
    if log is None:
        log = SampleLog(None)
    log.check_run(run)
    env = session.environment()
    results: list[RunResult] = []
    for task in tasks:
        own = {k: v for k, v in options.items() if k in _task_parameters(task)}
        samples = make_samples(
            task,
            session.tokenizer,
            context_len=context_len,
            num_samples=num_samples,
            seed=seed,
            **own,
        )
        rows: list[list[dict[str, Any]]] = [[]]
        for sample in samples:
            digest = _prompt_digest(sample.prompt)
            key = row_key(label, {}, task, sample.index)
            if not _take_logged(log, [key], [label], rows, sample, digest, progress):
                continue
            ids = session.encode(sample.prompt)
            if TASKS[task].kind == "perplexity":
                n = min(score_tokens, len(ids) - 1)
                nll, seconds = session.nll(ids[:-n], ids[-n:])
                result = SampleResult(
                    task, sample.index, sample.context_tokens, "", (), float("nan"), nll, n
                )
                prefill, decode, steps = seconds, 0.0, 0
            else:
                gen = session.greedy(ids, sample.max_new_tokens)
                result = SampleResult(
                    task,
                    sample.index,
                    sample.context_tokens,
                    gen.text,
                    sample.answers,
                    score(sample, gen.text),
                )
                prefill, decode, steps = gen.prefill_seconds, gen.decode_seconds, gen.decode_steps
            row = make_row(
                run=run,
                selector=label,
                options={},
                sample=result,
                prompt_sha256=digest,
                prefill_seconds=prefill,
                prefill_shared=False,
                shared_prefill_seconds=0.0,
                decode_seconds=decode,
                decode_tokens=steps,
                meter=MeterSums(),
                environment=env,
            )
            log.append(row)
            rows[0].append(row)
            if progress is not None:
                progress(f"{task} #{sample.index} {label}")
        results.append(aggregate(rows[0], kind=TASKS[task].kind))
    return results
