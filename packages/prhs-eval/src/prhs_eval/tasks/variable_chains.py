"""The ``variable_tracking`` task: RULER's chains of variable assignments."""

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
from prhs_eval.tasks.haystack import HaystackArg, Needle, NeedleTask, Plan, needle_task_doc

__all__ = ["random_names", "variable_tracking", "variable_tracking_task"]

_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_Q = "Question: Find all variables that are assigned the value {value} in the text above."
TEMPLATES = TemplateSet(
    {
        "completion": PromptTemplate(
            _INTRO,
            _Q + " Answer: According to the chain(s) of variable assignment in the text "
            "above, {num} variables are assigned the value {value}, they are:",
        ),
        "qa": PromptTemplate(_INTRO, _Q + "\nAnswer:"),
    },
    fields=("value", "num"),
)


def random_names(rng: np.random.Generator, k: int) -> list[str]:
    """``k`` distinct names of 5 capital letters (never ``"VAR"``)."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out: list[str] = []
    while len(out) < k:
        name = "".join(letters[int(c)] for c in rng.integers(0, 26, size=5))
        if name not in out and name != "VAR":
            out.append(name)
    return out


def variable_tracking_task(
    num_samples: int, num_chains: int = 1, num_hops: int = 4, max_new_tokens: int | None = None
) -> NeedleTask:
    """The ``variable_tracking`` task; checks ``num_chains`` and ``num_hops``."""
    num_chains = check_int("num_chains", num_chains, 1)
    num_hops = check_int("num_hops", num_hops, 1)

    def plan(rng: np.random.Generator, i: int) -> Plan:
        names = random_names(rng, num_chains * (num_hops + 1))
        values = distinct_ints(rng, 10_000, 100_000, num_chains)
        chains = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(num_chains)]
        needles: list[Needle] = []
        for chain, value in zip(chains, values, strict=True):
            depths = sorted(float(d) for d in rng.random(num_hops + 1))
            texts = [f"VAR {chain[0]} = {value}."] + [
                f"VAR {chain[h]} = VAR {chain[h - 1]}." for h in range(1, num_hops + 1)
            ]
            needles += [Needle(t, d) for t, d in zip(texts, depths, strict=True)]
        return Plan(
            tuple(needles),
            {"value": str(values[0]), "num": str(num_hops + 1)},
            tuple(chains[0]),
            {
                "chains": tuple(tuple(c) for c in chains),
                "chain_values": tuple(map(str, values)),
                "query_value": str(values[0]),
            },
        )

    budget = max_new_tokens or 6 * (num_hops + 1) + 2
    return NeedleTask("variable_tracking", TEMPLATES, num_samples, plan, budget)


@needle_task_doc
def variable_tracking(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    haystack: HaystackArg = "repeat",
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
    <common parameters>
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
    check_common(context_len, num_samples, seed, max_new_tokens)
    task = variable_tracking_task(num_samples, num_chains, num_hops, max_new_tokens)
    return task.samples(
        tokenizer, context_len=context_len, seed=seed, haystack=haystack, template=template
    )
