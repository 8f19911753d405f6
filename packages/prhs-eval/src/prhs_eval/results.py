"""Result records of an evaluation run (what the CLI prints, writes and plots), and the output
folder that keeps them.

A run's output folder (``--out``) holds, besides ``results.jsonl``/``.csv``/``.png`` written at
the end, the log :data:`LOG_NAME`: one JSON line per finished (selector, task, sample), appended
(and synced to disk) as soon as it finishes. An interrupted run therefore keeps what it measured,
and ``--resume`` skips the rows already logged. A row holds everything the run's figures are
computed from (the sample's result, times, and the :class:`~prhs_eval.metrics.MeterSums` of its
measurements), so :func:`aggregate` rebuilds the :class:`RunResult` of an uninterrupted run
exactly. Every row also records the options as used (resolved defaults), the model revision, the
prhs git commit and the machine (:func:`environment`; a ``--server`` run records the SGLang
server instead: its URL, version, model path and arguments).

- :func:`check_out_dir` checks, without side effects, that a run may write into a folder (the CLI
  calls it before loading the model);
- :func:`prepare_out_dir` does the same and then clears (``overwrite``) or reads (``resume``)
  the folder, returning the :class:`SampleLog` the runner appends to.

Importing this module is cheap (no torch).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prhs_eval.metrics import MeterSums, SelectionMetrics

__all__ = [
    "LOG_NAME",
    "RESULT_FILES",
    "ROW_VERSION",
    "RUN_FIELDS",
    "OutputDirError",
    "OutputExistsError",
    "ResumeMismatchError",
    "RunResult",
    "SampleLog",
    "SampleResult",
    "aggregate",
    "check_out_dir",
    "environment",
    "git_commit",
    "host_environment",
    "make_row",
    "prepare_out_dir",
    "row_key",
    "row_meter",
    "row_sample",
]

LOG_NAME = "samples.jsonl"
"""The per-sample log in the output folder: one JSON line per finished (selector, task, sample)."""

RESULT_FILES = ("results.jsonl", "results.csv", "results.png", LOG_NAME)
"""Files of the output folder that hold a run's results (what ``--overwrite`` replaces)."""

ROW_VERSION = 1
"""Version of the log rows' layout (``"version"`` of each row)."""


@dataclass(frozen=True)
class SampleResult:
    """One sample of one run.

    Attributes
    ----------
    task, index:
        Which sample.
    context_tokens:
        Prompt length in tokens.
    completion:
        What the model generated (empty for perplexity).
    answers:
        The expected answer strings.
    score:
        Task score in ``[0, 1]`` (fraction of answers found); ``nan`` for perplexity.
    nll:
        Mean negative log-likelihood per scored token (perplexity tasks), else ``nan``.
    scored_tokens:
        Tokens the NLL is averaged over (0 for generation tasks).
    """

    task: str
    index: int
    context_tokens: int
    completion: str
    answers: tuple[str, ...]
    score: float
    nll: float = math.nan
    scored_tokens: int = 0


@dataclass(frozen=True)
class RunResult:
    """One selector (with its options) on one task.

    Attributes
    ----------
    model, selector, task:
        Names.
    options:
        The selector's full config as used: defaults included and resolved (certified CIS's
        ``delta_target``/``k_max``, a ``start_layer`` of ``None``: the values used).
    budget:
        The config's ``budget`` (the x axis of plots); ``None`` for a selector without one
        (dense).
    context_len, num_samples, seed:
        The task's generation parameters.
    accuracy:
        Mean sample score (generation tasks), else ``nan``.
    perplexity:
        ``exp`` of the token-weighted mean NLL (perplexity tasks), else ``nan``.
    metrics:
        Selection metrics measured against dense attention on the same steps.
    samples:
        Per-sample results.
    prefill_seconds, decode_seconds:
        Wall time spent in the selector's own prefill and in decode steps. A selector that
        reused the shared dense prefill has ``prefill_seconds == 0``.
    decode_tokens:
        Decode steps run.
    prefill_shared:
        Whether every sample reused the shared dense prefill (made once per sample for all the
        selectors that leave prefill dense) instead of prefilling for itself.
    shared_prefill_seconds:
        Wall time of the task's shared dense prefills (one per sample), the same for every run
        of the task that reused them: count it once per task, not per run (0 when unused).
    environment:
        Where and with what it ran (:func:`environment`): model revision, prhs commit, machine,
        library versions, device and dtype.
    """

    model: str
    selector: str
    task: str
    options: Mapping[str, Any]
    budget: int | None
    context_len: int
    num_samples: int
    seed: int
    accuracy: float
    perplexity: float
    metrics: SelectionMetrics
    samples: tuple[SampleResult, ...] = field(default_factory=tuple)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    prefill_shared: bool = False
    shared_prefill_seconds: float = 0.0
    environment: Mapping[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """A flat record (one CSV row / JSONL line without the samples)."""
        out: dict[str, Any] = {
            "model": self.model,
            "selector": self.selector,
            "task": self.task,
            "budget": self.budget,
            "context_len": self.context_len,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "accuracy": self.accuracy,
            "perplexity": self.perplexity,
        }
        out.update(self.metrics.as_dict())
        out["prefill_seconds"] = self.prefill_seconds
        out["decode_seconds"] = self.decode_seconds
        out["decode_tokens"] = self.decode_tokens
        out["prefill_shared"] = self.prefill_shared
        out["shared_prefill_seconds"] = self.shared_prefill_seconds
        out["options"] = dict(self.options)
        out["environment"] = dict(self.environment)
        return out

    def record(self) -> dict[str, Any]:
        """The full record, samples included (one JSONL line)."""
        out = self.row()
        out["samples"] = [asdict(s) for s in self.samples]
        return out


# --------------------------------------------------------------------------------------------
# the output folder


class OutputDirError(ValueError):
    """An output folder a run cannot use as asked (reported before any work starts)."""


class OutputExistsError(OutputDirError):
    """The output folder already holds results and neither ``--resume`` nor ``--overwrite``
    was given."""


class ResumeMismatchError(OutputDirError):
    """The log being resumed was written by a run with other settings."""


def _found_results(out: Path) -> list[str]:
    return [name for name in RESULT_FILES if (out / name).exists()]


def check_out_dir(out: Path, *, overwrite: bool, resume: bool) -> None:
    """Check that a run may write its results into ``out``; no side effects.

    Parameters
    ----------
    out:
        The output folder (``--out``); it need not exist.
    overwrite:
        Replace results already there (``--overwrite``).
    resume:
        Continue the run logged there (``--resume``); on a folder without results the run just
        starts.

    Raises
    ------
    OutputDirError
        ``out`` is a file, both flags are set, or ``resume`` is asked for a folder whose
        results have no :data:`LOG_NAME` to resume from.
    OutputExistsError
        ``out`` already holds results and neither flag is set.
    """
    out = Path(out)
    if overwrite and resume:
        raise OutputDirError("--resume and --overwrite exclude each other; pass one of them")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} is a file, not a folder; choose another --out")
    found = _found_results(out) if out.is_dir() else []
    if not found or overwrite:
        return
    if resume:
        if LOG_NAME not in found:
            raise OutputDirError(
                f"{out} holds results ({', '.join(found)}) but no {LOG_NAME} to resume from; "
                "pass --overwrite to replace them, or choose another --out"
            )
        return
    raise OutputExistsError(
        f"{out} already holds results ({', '.join(found)}); pass --resume to continue it, "
        "--overwrite to replace it, or choose another --out"
    )


def prepare_out_dir(out: Path, *, overwrite: bool, resume: bool) -> SampleLog:
    """:func:`check_out_dir`, then make the folder ready and open its log.

    ``overwrite`` deletes the result files (:data:`RESULT_FILES`, nothing else) of an earlier
    run; ``resume`` reads the rows already logged (a last line cut short by an interruption is
    dropped from the file). The folder is created when missing.

    Returns
    -------
    SampleLog
        The log to append to, with the rows already there (none unless ``resume``).
    """
    out = Path(out)
    check_out_dir(out, overwrite=overwrite, resume=resume)
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for name in RESULT_FILES:
            path = out / name
            if path.is_file():
                path.unlink()
    return SampleLog(out / LOG_NAME, read=resume)


# --------------------------------------------------------------------------------------------
# per-sample rows


def _enc_float(x: float | None) -> float | str | None:
    """A float for strict JSON: ``nan`` → ``None``, ``±inf`` → ``"inf"``/``"-inf"``."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _dec_float(x: Any) -> float:
    """Inverse of :func:`_enc_float` (``None`` → ``nan``)."""
    if x is None:
        return math.nan
    return float(x)  # float("inf") / float("-inf") read the strings back


def _json_ready(value: Any) -> Any:
    if value is None or isinstance(value, bool | str | int):
        return value
    if isinstance(value, float):
        return _enc_float(value)
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_ready(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _json_ready(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def _canonical(value: Any) -> str:
    return json.dumps(_json_ready(value), sort_keys=True, separators=(",", ":"))


def row_key(selector: str, options: Mapping[str, Any], task: str, index: int) -> str:
    """The identity of a log row: the selector with its resolved options, the task, the
    sample index."""
    return _canonical([selector, dict(options), task, int(index)])


RUN_FIELDS = ("model", "model_revision", "context_len", "seed", "score_tokens", "task_options",
              "measure", "server")  # fmt: skip
"""Row fields that must match for a log to be resumed by a run. ``server`` is the SGLang
server's URL of a ``--server`` run, ``None`` in-process (a row logged before the field existed
reads as ``None``)."""


def make_row(
    *,
    run: Mapping[str, Any],
    selector: str,
    options: Mapping[str, Any],
    sample: SampleResult,
    prompt_sha256: str,
    prefill_seconds: float,
    prefill_shared: bool,
    shared_prefill_seconds: float,
    decode_seconds: float,
    decode_tokens: int,
    meter: MeterSums,
    environment: Mapping[str, Any],
) -> dict[str, Any]:
    """One log row (JSON-ready). ``run`` holds the :data:`RUN_FIELDS` of the run."""
    missing = [k for k in RUN_FIELDS if k not in run]
    if missing:
        raise ValueError(f"make_row: run lacks {missing}")
    row: dict[str, Any] = {"version": ROW_VERSION}
    row.update({k: _json_ready(run[k]) for k in RUN_FIELDS})
    row.update(
        selector=selector,
        options=_json_ready(dict(options)),
        task=sample.task,
        index=sample.index,
        prompt_sha256=prompt_sha256,
        sample=_json_ready(asdict(sample)),
        prefill_seconds=_enc_float(prefill_seconds),
        prefill_shared=bool(prefill_shared),
        shared_prefill_seconds=_enc_float(shared_prefill_seconds),
        decode_seconds=_enc_float(decode_seconds),
        decode_tokens=int(decode_tokens),
        meter=_json_ready(meter.as_dict()),
        environment=_json_ready(dict(environment)),
        finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    return row


def row_sample(row: Mapping[str, Any]) -> SampleResult:
    """The :class:`SampleResult` of a log row."""
    s = row["sample"]
    return SampleResult(
        task=s["task"],
        index=int(s["index"]),
        context_tokens=int(s["context_tokens"]),
        completion=s["completion"],
        answers=tuple(s["answers"]),
        score=_dec_float(s["score"]),
        nll=_dec_float(s["nll"]),
        scored_tokens=int(s["scored_tokens"]),
    )


def row_meter(row: Mapping[str, Any]) -> MeterSums:
    """The :class:`~prhs_eval.metrics.MeterSums` of a log row."""
    from prhs_eval.metrics import MeterSums

    m = dict(row["meter"])
    for k in ("delta_max", "bytes_total", "dense_bytes_total", "delta_i_sum", "b_mi_sum"):
        m[k] = _dec_float(m[k])
    m["sums"] = {k: _dec_float(v) for k, v in m["sums"].items()}
    return MeterSums.from_dict(m)


def _merge_environments(envs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One environment for rows from one or several sessions: a value the rows disagree on
    becomes the list of their distinct values, in order."""
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for e in envs for k in e))
    for k in keys:
        values: list[Any] = []
        for e in envs:
            v = e.get(k)
            if v not in values:
                values.append(v)
        out[k] = values[0] if len(values) == 1 else values
    return out


def aggregate(rows: Sequence[Mapping[str, Any]], *, kind: str | None = None) -> RunResult:
    """The :class:`RunResult` of one (selector with options, task) from its log rows.

    Parameters
    ----------
    rows:
        The rows of every sample of the run, in sample order; they share selector, options,
        task and the run fields.
    kind:
        ``"perplexity"`` or ``"generation"``; by default perplexity when a sample scored tokens.

    Raises
    ------
    ValueError
        No rows, or rows of different runs.
    """
    from prhs_eval.metrics import MeterSums

    if not rows:
        raise ValueError("aggregate: no rows")
    first = rows[0]
    ident = (first["selector"], _canonical(first["options"]), first["task"])
    for r in rows[1:]:
        if (r["selector"], _canonical(r["options"]), r["task"]) != ident:
            raise ValueError("aggregate: rows of different selectors or tasks")
    samples = tuple(row_sample(r) for r in rows)
    if kind is None:
        kind = "perplexity" if any(s.scored_tokens for s in samples) else "generation"
    if kind == "perplexity":
        tok = sum(s.scored_tokens for s in samples)
        total = sum(s.nll * s.scored_tokens for s in samples)
        ppl = math.exp(total / tok) if tok else math.nan
        accuracy = math.nan
    else:
        ppl = math.nan
        accuracy = sum(s.score for s in samples) / len(samples)
    options = dict(first["options"])
    budget = options.get("budget")
    return RunResult(
        model=first["model"],
        selector=first["selector"],
        task=first["task"],
        options=options,
        budget=int(budget) if isinstance(budget, int) and not isinstance(budget, bool) else None,
        context_len=int(first["context_len"]),
        num_samples=len(samples),
        seed=int(first["seed"]),
        accuracy=accuracy,
        perplexity=ppl,
        metrics=MeterSums.combine(row_meter(r) for r in rows).metrics(),
        samples=samples,
        prefill_seconds=math.fsum(_dec_float(r["prefill_seconds"]) for r in rows),
        decode_seconds=math.fsum(_dec_float(r["decode_seconds"]) for r in rows),
        decode_tokens=sum(int(r["decode_tokens"]) for r in rows),
        prefill_shared=all(bool(r["prefill_shared"]) for r in rows),
        shared_prefill_seconds=math.fsum(
            _dec_float(r["shared_prefill_seconds"]) for r in rows if r["prefill_shared"]
        ),
        environment=_merge_environments([r.get("environment") or {} for r in rows]),
    )


class SampleLog:
    """The per-sample log of an output folder (:data:`LOG_NAME`), append-only.

    Parameters
    ----------
    path:
        The ``.jsonl`` file; ``None`` keeps the rows in memory only.
    read:
        Load the rows already in the file (resume). A last line cut short by an interruption
        is cut from the file; any other unreadable line raises :class:`OutputDirError`.
    """

    def __init__(self, path: Path | None, *, read: bool = False) -> None:
        self.path = None if path is None else Path(path)
        self._rows: dict[str, dict[str, Any]] = {}
        if self.path is not None and read and self.path.is_file():
            for row in self._read(self.path):
                key = row_key(row["selector"], row["options"], row["task"], row["index"])
                self._rows[key] = row
        self.loaded = len(self._rows)
        """Rows read from the file when opened."""

    @staticmethod
    def _read(path: Path) -> Iterator[dict[str, Any]]:
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # an interrupted write: drop the partial line
            with path.open("r+b") as f:
                f.truncate(end)
        for n, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise OutputDirError(
                    f"{path}:{n} is not a JSON line ({exc}); cannot resume "
                    "from it: pass --overwrite or choose another --out"
                ) from exc
            if not isinstance(row, dict) or row.get("version") != ROW_VERSION:
                raise OutputDirError(
                    f"{path}:{n} is not a row of this prhs-eval version; "
                    "pass --overwrite or choose another --out"
                )
            yield row

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._rows.values())

    def get(self, key: str) -> dict[str, Any] | None:
        """The row of ``key`` (:func:`row_key`), or ``None``."""
        return self._rows.get(key)

    def check_run(self, run: Mapping[str, Any], keys: Iterable[str] | None = None) -> None:
        """Raise :class:`ResumeMismatchError` when a logged row was written with other run
        settings than ``run`` (:data:`RUN_FIELDS`); only the rows of ``keys`` when given."""
        rows = (
            self._rows.values()
            if keys is None
            else (self._rows[k] for k in keys if k in self._rows)
        )
        want = {k: _json_ready(run[k]) for k in RUN_FIELDS}
        for row in rows:
            for k in RUN_FIELDS:
                if _canonical(row.get(k)) != _canonical(want[k]):
                    where = self.path if self.path is not None else "the log"
                    raise ResumeMismatchError(
                        f"{where} was written with {k}={row.get(k)!r}, this run has "
                        f"{k}={want[k]!r}; pass --overwrite to replace it, or choose another --out"
                    )

    def append(self, row: Mapping[str, Any]) -> None:
        """Add a row, and write it to the file at once (flushed and synced)."""
        key = row_key(row["selector"], row["options"], row["task"], row["index"])
        self._rows[key] = dict(row)
        if self.path is None:
            return
        line = json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# provenance


@functools.cache
def git_commit(where: str | None = None) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding ``where`` (default: this package), or
    ``None`` when it is not in a git checkout (an installed wheel) or git is missing.

    ``PRHS_COMMIT`` in the environment wins: a copy of a working tree sent to another machine
    keeps git metadata that no longer names what it holds."""
    sent = os.environ.get("PRHS_COMMIT", "").strip()
    if sent:
        return sent
    folder = where if where is not None else str(Path(__file__).resolve().parent)
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_environment() -> dict[str, Any]:
    """The machine a run is started from: ``prhs_commit`` (:func:`git_commit`), ``prhs_eval``
    (version), ``platform``, ``python`` and ``cpu``."""
    from prhs_eval import __version__

    return {
        "prhs_commit": git_commit(),
        "prhs_eval": __version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
    }


def environment(model: Any, *, revision: str | None = None) -> dict[str, Any]:
    """Where and with what a run runs: recorded in every row and result.

    Parameters
    ----------
    model:
        The ``torch.nn.Module`` run (its first parameter gives device and dtype).
    revision:
        The model's revision (``LoadedModel.revision``), when known.

    Returns
    -------
    dict
        ``model_revision``, ``prhs_commit`` (:func:`git_commit`), ``prhs_eval`` (version),
        ``platform``, ``python``, ``torch``, ``transformers``, ``cpu``, ``gpu`` (name, or
        ``None`` off CUDA), ``device`` and ``dtype``.
    """
    import torch

    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency
        tf_version = None
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    gpu = None
    if device.type == "cuda":
        try:
            gpu = torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError):  # pragma: no cover
            gpu = None
    return {
        "model_revision": revision,
        **host_environment(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "gpu": gpu,
        "device": str(device),
        "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
    }
