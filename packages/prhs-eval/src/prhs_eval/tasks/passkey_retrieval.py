"""The ``passkey`` task: a 5-digit pass key hidden in filler text."""

from __future__ import annotations

import numpy as np

from prhs_eval.tasks.base import (
    PromptTemplate,
    Sample,
    TemplateSet,
    TokenizerLike,
    check_common,
)
from prhs_eval.tasks.haystack import (
    HaystackArg,
    Needle,
    NeedleTask,
    Plan,
    even_depth,
    needle_task_doc,
)

__all__ = ["passkey", "passkey_task"]

_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
TEMPLATES = TemplateSet(
    {
        "completion": PromptTemplate(_INTRO, "What is the pass key? The pass key is"),
        "qa": PromptTemplate(_INTRO, "Question: What is the pass key?\nAnswer:"),
    },
    fields=(),
)


def passkey_task(num_samples: int, max_new_tokens: int | None = None) -> NeedleTask:
    """The ``passkey`` task for ``num_samples`` samples (arguments already checked)."""

    def plan(rng: np.random.Generator, i: int) -> Plan:
        key = str(int(rng.integers(10_000, 100_000)))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        return Plan((Needle(needle, even_depth(i, num_samples)),), {}, (key,), {"passkey": key})

    return NeedleTask("passkey", TEMPLATES, num_samples, plan, max_new_tokens or 8)


@needle_task_doc
def passkey(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: HaystackArg = "repeat",
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
    <common parameters>
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
    check_common(context_len, num_samples, seed, max_new_tokens)
    task = passkey_task(num_samples, max_new_tokens)
    return task.samples(
        tokenizer, context_len=context_len, seed=seed, haystack=haystack, template=template
    )
