"""What every task shares: tokenizer adapters, the sample and template types, scoring and
argument checks."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeAlias

import numpy as np

__all__ = [
    "PromptTemplate",
    "Sample",
    "TaskSpec",
    "TemplateSet",
    "TokenizerLike",
    "check_common",
    "check_int",
    "count_tokens",
    "distinct_ints",
    "length_tolerance",
    "score",
    "task_rng",
    "token_ids",
]


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class _EncodingTokenizer(Protocol):
    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...


class _CallableTokenizer(Protocol):
    def __call__(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...


TokenizerLike: TypeAlias = _EncodingTokenizer | _CallableTokenizer
"""A tokenizer: an object with ``encode(text) -> ids`` (a transformers tokenizer, a
``tokenizers.Tokenizer``, tiktoken) or callable as ``tokenizer(text) -> {"input_ids": ids}``."""


def token_ids(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens.

    ``tokenizer.encode(text, add_special_tokens=False)`` is used when the tokenizer has
    ``encode`` (falling back to ``encode(text)`` when that keyword is not accepted), otherwise
    ``tokenizer(text, add_special_tokens=False)["input_ids"]``. A ``tokenizers.Encoding``
    result (with ``.ids``) is accepted too.

    Parameters
    ----------
    tokenizer
        The tokenizer.
    text
        The text to encode.

    Returns
    -------
    list of int
        The ids.
    """
    return [int(i) for i in _encode(tokenizer, text)]


def _encode(tokenizer: TokenizerLike, text: str) -> list[Any]:
    encode = getattr(tokenizer, "encode", None)
    fn = encode if callable(encode) else tokenizer
    if not callable(fn):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no encode() and is not callable")
    try:
        out = fn(text, add_special_tokens=False)
    except TypeError:
        out = fn(text)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    elif hasattr(out, "ids"):
        out = out.ids
    ids = list(out)
    if ids and isinstance(ids[0], list | tuple):  # a batch of one
        ids = list(ids[0])
    return ids


def count_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """Number of tokens of ``text`` without special tokens (see :func:`token_ids`).

    Tokens need not be ints: a tokenizer whose ``encode`` returns token strings works too.

    Parameters
    ----------
    tokenizer
        The tokenizer.
    text
        The text.

    Returns
    -------
    int
        The token count.
    """
    return len(_encode(tokenizer, text))


def length_tolerance(context_len: int) -> int:
    """The allowed deviation of a generation sample's length from ``context_len``.

    Parameters
    ----------
    context_len
        The requested length in tokens.

    Returns
    -------
    int
        ``max(16, ceil(0.02 * context_len))`` tokens.
    """
    return max(16, math.ceil(0.02 * context_len))


# --------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One task instance.

    Attributes
    ----------
    task
        The task's name, e.g. ``"passkey"``.
    index
        The sample's index within its generated list.
    prompt
        The full text given to the model; it ends right where the answer should start.
    answers
        Every string the completion must contain (empty for perplexity samples).
    context_tokens
        The prompt's length in tokens, measured with the generator's tokenizer without
        special tokens.
    max_new_tokens
        How many tokens to generate (0 for perplexity samples).
    meta
        Task details: seed, haystack, needle depths and texts, keys, … (read-only).
    """

    task: str
    index: int
    prompt: str
    answers: tuple[str, ...]
    context_tokens: int
    max_new_tokens: int
    meta: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "answers", tuple(self.answers))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))


@dataclass(frozen=True)
class PromptTemplate:
    """The instruction before the context and the question after it.

    The prompt is ``intro + "\\n\\n" + context + "\\n\\n" + question``; it must end where the
    answer starts. Both strings are formatted with :meth:`str.format` and the task's fields:
    ``passkey``: none; ``niah_single`` and ``niah_multikey``: ``{key}``; ``niah_multivalue``:
    ``{key}``, ``{num}`` (number of values); ``variable_tracking``: ``{value}``, ``{num}``
    (number of variables). Write ``{{`` and ``}}`` for literal braces.

    Attributes
    ----------
    intro
        Text before the context.
    question
        Text after the context; the completion continues it.
    """

    intro: str
    question: str


@dataclass(frozen=True)
class TaskSpec:
    """A registered task.

    Attributes
    ----------
    name
        The registry key.
    generator
        ``generator(tokenizer, *, context_len, num_samples, seed, ...) -> list[Sample]``.
    description
        One line.
    kind
        ``"generation"`` (score completions with :func:`score`) or ``"perplexity"`` (score the
        prompt's log-likelihood).
    max_new_tokens
        The generator's default ``max_new_tokens`` for its default parameters.
    """

    name: str
    generator: Callable[..., list[Sample]]
    description: str
    kind: Literal["generation", "perplexity"]
    max_new_tokens: int


def score(sample: Sample, completion: str) -> float:
    """RULER's string match: the fraction of ``sample.answers`` found in ``completion``; a
    public benchmark's sample (``meta["scorer"]``) is scored its own way instead (GSM8K's
    flexible extraction, CoQA's token F1 of the completion up to the next turn, LongBench v2's
    answer letter).

    Matching is case-insensitive, on whitespace-stripped strings, and by substring (an answer
    anywhere in the completion counts).

    Parameters
    ----------
    sample
        A generation sample.
    completion
        The model's output after the prompt.

    Returns
    -------
    float
        In ``[0, 1]``; 1.0 means every answer was found.

    Raises
    ------
    ValueError
        If the sample has no answers (a perplexity sample).
    """
    if not sample.answers:
        raise ValueError(
            f"sample of task {sample.task!r} has no answers to match (perplexity samples are "
            f"scored by log-likelihood, not by score())"
        )
    scorer = sample.meta.get("scorer")
    if scorer is not None:  # a public benchmark's own scoring (prhs_eval.tasks.benchmarks)
        from prhs_eval import scoring

        if scorer == "gsm8k":
            return scoring.gsm8k_flexible(completion, str(sample.meta["answer"]))
        if scorer == "coqa":
            return scoring.coqa_f1(sample.answers, scoring.coqa_answer(completion))
        if scorer == "longbench_v2":
            return float(scoring.longbench_v2_choice(completion) == sample.answers[0])
        raise ValueError(f"sample of task {sample.task!r} names an unknown scorer {scorer!r}")
    pred = completion.strip().lower()
    hits = sum(1 for a in sample.answers if a.strip().lower() in pred)
    return hits / len(sample.answers)


# --------------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateSet:
    """A task's built-in templates by name and the fields its templates may use."""

    choices: Mapping[str, PromptTemplate]
    fields: tuple[str, ...]

    def resolve(self, template: str | PromptTemplate) -> tuple[str, PromptTemplate]:
        """``(name, template)`` for a built-in name or a checked custom template
        (named ``"custom"``); ``ValueError`` for anything else."""
        if isinstance(template, str):
            if template not in self.choices:
                raise ValueError(
                    f"unknown template {template!r}; choose one of {sorted(self.choices)} or "
                    f"pass a PromptTemplate"
                )
            return template, self.choices[template]
        if not isinstance(template, PromptTemplate):
            raise ValueError(f"template must be a name or a PromptTemplate, got {template!r}")
        dummy = dict.fromkeys(self.fields, "x")
        for part in (template.intro, template.question):
            try:
                part.format(**dummy)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"bad PromptTemplate {part!r}: {exc!r}; this task's fields are "
                    f"{['{' + f + '}' for f in self.fields]}"
                ) from exc
        return "custom", template


# --------------------------------------------------------------------------------------------
# Argument checks and seeded draws
# --------------------------------------------------------------------------------------------


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int, or ``ValueError`` if it is no int (bools excluded) or too small."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_common(
    context_len: object, num_samples: object, seed: object, max_new_tokens: object
) -> None:
    """Check the arguments every generator takes (``max_new_tokens`` may be None)."""
    check_int("context_len", context_len, 1)
    check_int("num_samples", num_samples, 1)
    check_int("seed", seed, 0)
    if max_new_tokens is not None:
        check_int("max_new_tokens", max_new_tokens, 1)


def task_rng(seed: int, task: str, *extra: int) -> np.random.Generator:
    """The random stream of one sample: ``default_rng([seed, crc32(task), *extra])``."""
    return np.random.default_rng([seed, zlib.crc32(task.encode()), *extra])


def distinct_ints(rng: np.random.Generator, low: int, high: int, k: int) -> list[int]:
    """``k`` distinct ints drawn one by one from ``[low, high)``."""
    out: list[int] = []
    while len(out) < k:
        v = int(rng.integers(low, high))
        if v not in out:
            out.append(v)
    return out
