"""Result records of an evaluation run (what the CLI prints, writes and plots)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from prhs_eval.metrics import SelectionMetrics

__all__ = ["RunResult", "SampleResult"]


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
        The selector's full config (defaults included).
    budget:
        The config's ``budget`` (the x axis of plots).
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
        Wall time spent in prefill and in decode steps.
    decode_tokens:
        Decode steps run.
    """

    model: str
    selector: str
    task: str
    options: Mapping[str, Any]
    budget: int
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
        out["options"] = dict(self.options)
        return out

    def record(self) -> dict[str, Any]:
        """The full record, samples included (one JSONL line)."""
        out = self.row()
        out["samples"] = [asdict(s) for s in self.samples]
        return out
