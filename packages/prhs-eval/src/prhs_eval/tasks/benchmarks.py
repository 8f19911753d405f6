"""Public benchmarks as ``compare`` tasks, from local files (``--data PATH``).

``gsm8k``
    A GSM8K test problem after as many solved problems of the same file (their worked answers
    ending in ``#### N``) as fill ``context_len`` tokens: many-shot, so the prompt is long and a
    selector has something to choose from. Scored by GSM8K's flexible extraction (the
    completion's last number); ``meta["strict"]`` the strict match.
``coqa``
    A CoQA turn: its story, the conversation before it and its question, in
    lm-evaluation-harness's layout (the story, then ``Q: ...`` / ``A: ...`` lines); the story is
    cut in the middle if the prompt would not fit ``context_len``. Scored by CoQA's token F1
    against the turn's gold answers, on the completion up to the next turn
    (:func:`prhs_eval.scoring.coqa_answer`); :func:`prhs_eval.scoring.coqa_exact_match` is the
    benchmark's other metric.
``longbench_v2``
    A LongBench v2 question in the benchmark's zero-shot prompt, its context cut in the middle
    (as the benchmark's own script does) to fit ``context_len`` tokens. Scored by the letter the
    completion gives.

Samples are drawn by a seeded permutation of the file's items; the files are read by
:mod:`prhs_eval.scoring` (the same formats). A sample's scorer is named in ``meta["scorer"]``
and applied by :func:`prhs_eval.tasks.score`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

from prhs_eval.tasks.base import (
    Sample,
    TokenizerLike,
    check_common,
    count_tokens,
    task_rng,
)

__all__ = ["coqa", "gsm8k", "longbench_v2"]


def _check_data(task: str, data: object) -> str:
    if data is None:
        raise ValueError(f"{task} reads a local file: give its path (data=..., --data PATH)")
    if not isinstance(data, str | os.PathLike):
        raise ValueError(f"{task}: data must be a path, got {data!r}")
    if not os.path.isfile(data):
        raise ValueError(f"{task}: data file {str(data)!r} does not exist")
    return str(data)


def _gsm8k_block(question: str, answer: str | None) -> str:
    return f"Question: {question}\nAnswer:" + (f" {answer}\n\n" if answer is not None else "")


def gsm8k(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    data: str | os.PathLike[str] | None = None,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """Many-shot GSM8K from ``data`` (its ``test.jsonl``); ``max_new_tokens`` default 256."""
    from prhs_eval.scoring import read_gsm8k

    check_common(context_len, num_samples, seed, max_new_tokens)
    problems = read_gsm8k(_check_data("gsm8k", data))
    if len(problems) < num_samples + 1:
        raise ValueError(
            f"gsm8k: {len(problems)} problems in {str(data)!r}; {num_samples} samples need at "
            f"least {num_samples + 1} (each one's shots come from the others)"
        )
    order = task_rng(seed, "gsm8k").permutation(len(problems))
    out = []
    for i in range(num_samples):
        target = problems[int(order[i])]
        question = _gsm8k_block(target.question, None)
        shots: list[str] = []
        used = count_tokens(tokenizer, question)
        if used > context_len:
            raise ValueError(
                f"context_len={context_len} is too small for gsm8k: sample {i}'s question alone "
                f"takes {used} tokens"
            )
        for j in order[num_samples:]:
            p = problems[int(j)]
            block = _gsm8k_block(p.question, p.answer)
            n = count_tokens(tokenizer, block)
            if used + n > context_len:
                continue  # a shorter one may still fit
            shots.append(block)
            used += n
        prompt = "".join(shots) + question
        out.append(Sample("gsm8k", i, prompt, (target.target,), count_tokens(tokenizer, prompt),
                          max_new_tokens or 256,
                          {"seed": seed, "scorer": "gsm8k", "answer": target.answer,
                           "shots": len(shots)}))  # fmt: skip
    return out


def coqa_prompt(story: str, history: tuple[tuple[str, str], ...], question: str) -> str:
    """lm-evaluation-harness's CoQA layout: the story, each earlier turn, then the question."""
    turns = "".join(f"Q: {q}\n\nA: {a}\n\n" for q, a in history)
    return f"{story}\n\n{turns}Q: {question}\n\nA:"


def coqa(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    data: str | os.PathLike[str] | None = None,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """CoQA turns from ``data`` (``coqa-dev-v1.0.json``), stories cut in the middle to fit;
    ``max_new_tokens`` default 32 (CoQA's answers are short spans)."""
    from prhs_eval.scoring import read_coqa

    check_common(context_len, num_samples, seed, max_new_tokens)
    turns = read_coqa(_check_data("coqa", data))
    if len(turns) < num_samples:
        raise ValueError(f"coqa: {len(turns)} turns in {str(data)!r}, {num_samples} samples asked")
    order = task_rng(seed, "coqa").permutation(len(turns))
    out = []
    for i in range(num_samples):
        turn = turns[int(order[i])]
        bare = count_tokens(tokenizer, coqa_prompt("", turn.history, turn.question))
        room = context_len - bare
        if room < 2:
            raise ValueError(
                f"context_len={context_len} is too small for coqa: sample {i}'s conversation "
                f"without its story takes {bare} tokens"
            )
        make = partial(coqa_prompt, history=turn.history, question=turn.question)
        story, prompt = _fit(tokenizer, turn.story, make, room, context_len)
        out.append(Sample("coqa", i, prompt, turn.answers, count_tokens(tokenizer, prompt),
                          max_new_tokens or 32,
                          {"seed": seed, "scorer": "coqa", "story_id": turn.story_id,
                           "turn": len(turn.history) + 1, "cut": story != turn.story}))  # fmt: skip
    return out


def longbench_v2(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    data: str | os.PathLike[str] | None = None,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """LongBench v2 from ``data`` (its ``data.json``), contexts cut in the middle to fit;
    ``max_new_tokens`` default 32 (the answer sentence, no chain of thought)."""
    from prhs_eval.scoring import longbench_v2_prompt, read_longbench_v2

    check_common(context_len, num_samples, seed, max_new_tokens)
    items = read_longbench_v2(_check_data("longbench_v2", data))
    if len(items) < num_samples:
        raise ValueError(
            f"longbench_v2: {len(items)} items in {str(data)!r}, {num_samples} samples asked"
        )
    order = task_rng(seed, "longbench_v2").permutation(len(items))
    out = []
    for i in range(num_samples):
        item = items[int(order[i])]
        bare = count_tokens(tokenizer, longbench_v2_prompt(_with_context(item, "")))
        room = context_len - bare
        if room < 2:
            raise ValueError(
                f"context_len={context_len} is too small for longbench_v2: sample {i}'s prompt "
                f"without its context takes {bare} tokens"
            )
        context, prompt = _fit(
            tokenizer, item.context, lambda x, it=item: longbench_v2_prompt(_with_context(it, x)),
            room, context_len,
        )  # fmt: skip
        out.append(Sample("longbench_v2", i, prompt, (item.answer,),
                          count_tokens(tokenizer, prompt), max_new_tokens or 32,
                          {"seed": seed, "scorer": "longbench_v2", "id": item.id,
                           "difficulty": item.difficulty, "length": item.length,
                           "cut": context != item.context}))  # fmt: skip
    return out


def _fit(
    tokenizer: TokenizerLike,
    text: str,
    make_prompt: Callable[[str], str],
    room: int,
    context_len: int,
) -> tuple[str, str]:
    """``(text', prompt)``: ``text`` cut in the middle to ``room`` tokens, shortened further
    while ``make_prompt(text')`` exceeds ``context_len`` (a cut can merge tokens across its
    seam)."""
    cut = _cut_middle(tokenizer, text, room)
    prompt = make_prompt(cut)
    while count_tokens(tokenizer, prompt) > context_len and room > 2:
        room -= max(1, room // 100)
        cut = _cut_middle(tokenizer, text, room)
        prompt = make_prompt(cut)
    return cut, prompt


def _with_context(item, context: str):
    from dataclasses import replace

    return replace(item, context=context)


def _cut_middle(tokenizer: TokenizerLike, text: str, max_tokens: int) -> str:
    """``text`` with its middle removed so it keeps at most ``max_tokens`` tokens (half from
    each end), as LongBench v2's script truncates; unchanged when it fits."""
    from prhs_eval.tasks.base import _encode

    ids = _encode(tokenizer, text)
    if len(ids) <= max_tokens:
        return text
    decode = getattr(tokenizer, "decode", None)
    if decode is None:  # a tokenizer of whitespace words: cut words
        words = text.split()
        half = max_tokens // 2
        return " ".join(words[:half] + words[len(words) - (max_tokens - half) :])
    half = max_tokens // 2
    head = decode(ids[:half], skip_special_tokens=True)
    tail = decode(ids[len(ids) - (max_tokens - half) :], skip_special_tokens=True)
    return head + tail
