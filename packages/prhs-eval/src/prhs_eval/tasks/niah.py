"""RULER's needle-in-a-haystack tasks: ``niah_single``, ``niah_multikey``, ``niah_multivalue``.

All three are one task with two counts: ``num_keys`` keys with ``num_values`` values each, one
needle ``"One of the special magic numbers for {key} is: {value}."`` per pair; the first key is
asked for, and every one of its values is an answer. ``niah_single`` is 1 × 1,
``niah_multikey`` is ``num_keys`` × 1 (the other keys are distractors) and ``niah_multivalue``
is 1 × ``num_values``.
"""

from __future__ import annotations

import numpy as np

from prhs_eval.tasks.base import (
    PromptTemplate,
    Sample,
    TemplateSet,
    TokenizerLike,
    check_common,
    check_int,
    distinct_ints,
)
from prhs_eval.tasks.haystack import (
    HaystackArg,
    Needle,
    NeedleTask,
    Plan,
    even_depth,
    needle_task_doc,
)

__all__ = [
    "niah_multikey",
    "niah_multikey_task",
    "niah_multivalue",
    "niah_multivalue_task",
    "niah_single",
    "niah_single_task",
    "random_keys",
]

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

_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards."
)
_Q_ONE = "What is the special magic number for {key} mentioned in the provided text?"
_Q_ALL = "What are all the special magic numbers for {key} mentioned in the provided text?"

ONE_VALUE_TEMPLATES = TemplateSet(
    {
        "completion": PromptTemplate(
            _INTRO, _Q_ONE + " The special magic number for {key} mentioned in the provided text is"
        ),
        "qa": PromptTemplate(_INTRO, "Question: " + _Q_ONE + "\nAnswer:"),
    },
    fields=("key",),
)
"""Templates of ``niah_single`` and ``niah_multikey`` (one value asked for)."""

ALL_VALUES_TEMPLATES = TemplateSet(
    {
        "completion": PromptTemplate(
            _INTRO,
            _Q_ALL + " The special magic numbers for {key} mentioned in the provided text are",
        ),
        "qa": PromptTemplate(_INTRO, "Question: " + _Q_ALL + "\nAnswer:"),
    },
    fields=("key", "num"),
)
"""Templates of ``niah_multivalue`` (every value asked for; ``{num}`` values)."""


def random_keys(rng: np.random.Generator, k: int) -> list[str]:
    """``k`` distinct adjective-noun keys such as ``"lucky-walnut"``."""
    combos = len(_ADJECTIVES) * len(_NOUNS)
    idx = distinct_ints(rng, 0, combos, k)
    return [f"{_ADJECTIVES[i // len(_NOUNS)]}-{_NOUNS[i % len(_NOUNS)]}" for i in idx]


def _niah_task(
    name: str, num_samples: int, num_keys: int, num_values: int, max_new_tokens: int
) -> NeedleTask:
    """``num_keys`` keys × ``num_values`` values; the first key's values are the answers.

    Draws, in order: the keys, ``num_keys * num_values`` distinct values (key ``k`` holds
    values ``k * num_values ...``), then the depths of every needle but the first, whose depth
    sweeps the samples evenly.
    """
    all_values = num_values > 1

    def plan(rng: np.random.Generator, i: int) -> Plan:
        keys = random_keys(rng, num_keys)
        values = [str(v) for v in distinct_ints(rng, 1_000_000, 10_000_000, num_keys * num_values)]
        depths = [even_depth(i, num_samples)]
        if len(values) > 1:
            depths += [float(d) for d in rng.random(len(values) - 1)]
        needles = tuple(
            Needle(f"One of the special magic numbers for {keys[j // num_values]} is: {v}.", d)
            for j, (v, d) in enumerate(zip(values, depths, strict=True))
        )
        fields = {"key": keys[0], "num": str(num_values)} if all_values else {"key": keys[0]}
        return Plan(
            needles,
            fields,
            tuple(values[:num_values]),
            {"keys": tuple(keys), "values": tuple(values), "query_key": keys[0]},
        )

    templates = ALL_VALUES_TEMPLATES if all_values else ONE_VALUE_TEMPLATES
    return NeedleTask(name, templates, num_samples, plan, max_new_tokens)


def niah_single_task(num_samples: int, max_new_tokens: int | None = None) -> NeedleTask:
    """The ``niah_single`` task for ``num_samples`` samples (arguments already checked)."""
    return _niah_task("niah_single", num_samples, 1, 1, max_new_tokens or 16)


def niah_multikey_task(
    num_samples: int, num_keys: int = 4, max_new_tokens: int | None = None
) -> NeedleTask:
    """The ``niah_multikey`` task; checks ``num_keys``."""
    num_keys = check_int("num_keys", num_keys, 2)
    return _niah_task("niah_multikey", num_samples, num_keys, 1, max_new_tokens or 16)


def niah_multivalue_task(
    num_samples: int, num_values: int = 4, max_new_tokens: int | None = None
) -> NeedleTask:
    """The ``niah_multivalue`` task; checks ``num_values``."""
    num_values = check_int("num_values", num_values, 2)
    budget = max_new_tokens or 12 * num_values
    return _niah_task("niah_multivalue", num_samples, 1, num_values, budget)


@needle_task_doc
def niah_single(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: HaystackArg = "repeat",
    template: str | PromptTemplate = "completion",
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER single needle: one ``"One of the special magic numbers for {key} is: {value}."``.

    The key is an adjective-noun pair from a built-in word list (e.g. ``"lucky-walnut"``), the
    value a 7-digit number; the needle sits at depth ``(i + 0.5) / num_samples``.

    Parameters
    ----------
    <common parameters>
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
    check_common(context_len, num_samples, seed, max_new_tokens)
    task = niah_single_task(num_samples, max_new_tokens)
    return task.samples(
        tokenizer, context_len=context_len, seed=seed, haystack=haystack, template=template
    )


@needle_task_doc
def niah_multikey(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: HaystackArg = "repeat",
    template: str | PromptTemplate = "completion",
    num_keys: int = 4,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER multi-key needles: ``num_keys`` needles with different keys; one is asked for.

    The queried needle sits at depth ``(i + 0.5) / num_samples``, the distractors at seeded
    uniform depths.

    Parameters
    ----------
    <common parameters>
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
    check_common(context_len, num_samples, seed, max_new_tokens)
    task = niah_multikey_task(num_samples, num_keys, max_new_tokens)
    return task.samples(
        tokenizer, context_len=context_len, seed=seed, haystack=haystack, template=template
    )


@needle_task_doc
def niah_multivalue(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: HaystackArg = "repeat",
    template: str | PromptTemplate = "completion",
    num_values: int = 4,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER multi-value needles: one key with ``num_values`` values; all are asked for.

    The first value's needle sits at depth ``(i + 0.5) / num_samples``, the others at seeded
    uniform depths. :func:`score` gives partial credit: the fraction of values recalled.

    Parameters
    ----------
    <common parameters>
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
    check_common(context_len, num_samples, seed, max_new_tokens)
    task = niah_multivalue_task(num_samples, num_values, max_new_tokens)
    return task.samples(
        tokenizer, context_len=context_len, seed=seed, haystack=haystack, template=template
    )
