"""RULER's aggregation tasks: common-word and frequent-word extraction.

Neither hides a needle in a haystack: the whole context is the list to count, so a selector is
tested on attention spread over many positions rather than concentrated on a few.

``common_words`` (RULER's CWE)
    A numbered list of words, ``num_common`` of them repeated ``freq_common`` times each and
    as many others as fill the context ``freq_uncommon`` times each, shuffled; the answer is
    the ``num_common`` common ones.
``frequent_words`` (RULER's FWE)
    A "coded text" of words drawn from a Zipf distribution (exponent ``alpha``) over a seeded
    vocabulary, with ``....`` separators; the answer is its three most frequent words.

The words are three seeded consonant-vowel syllables (no word list is downloaded), distinct
within a sample and all six letters long, so none is a substring of another and a completion's
match is unambiguous. Scoring is
RULER's (:func:`prhs_eval.tasks.score`): the fraction of the answer words the completion
holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from prhs_eval.tasks.base import (
    Sample,
    TokenizerLike,
    check_common,
    check_int,
    count_tokens,
    length_tolerance,
    task_rng,
)

__all__ = ["common_words", "common_words_min_context", "frequent_words",
           "frequent_words_min_context", "pseudo_words"]  # fmt: skip

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")

CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
CWE_QUESTION = (
    "Question: What are the {num} most common words in the above list? Answer: The top {num} "
    "words that appear most often in the list are:"
)
FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words."
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
    "three most frequently appeared words in the above coded text? Answer: According to the "
    "coded text above, the three most frequently appeared words are:"
)


def pseudo_words(rng: np.random.Generator, k: int) -> list[str]:
    """``k`` distinct lower-case words of three consonant-vowel syllables. All have six
    letters, so none is a substring of another: a completion's match is unambiguous."""
    if k > (len(_ONSETS) * len(_VOWELS)) ** 3:
        raise ValueError(f"cannot make {k} distinct words of three syllables")
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < k:
        w = "".join(_ONSETS[int(rng.integers(len(_ONSETS)))] + _VOWELS[int(rng.integers(5))]
                    for _ in range(3))  # fmt: skip
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _fit(build: Callable[[int], str], tokenizer: TokenizerLike, lo: int, hi: int,
         context_len: int) -> tuple[str, int]:  # fmt: skip
    """The text of the largest ``n`` in ``[lo, hi]`` whose tokens fit ``context_len``."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, build(mid)) <= context_len:
            lo = mid
        else:
            hi = mid - 1
    text = build(lo)
    return text, count_tokens(tokenizer, text)


def _check_fits(task: str, tokens: int, context_len: int, minimum: int) -> None:
    if tokens > context_len:
        raise ValueError(
            f"context_len={context_len} is too small for {task}: its instructions, question and "
            f"smallest list alone take {minimum} tokens"
        )
    if context_len - tokens > length_tolerance(context_len):
        raise ValueError(  # pragma: no cover - one word is far below the tolerance
            f"{task}: could not fill {context_len} tokens (got {tokens})"
        )


def _cwe_prompt(words: list[str], num: int) -> str:
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    return f"{CWE_INTRO}\n{listing}\n{CWE_QUESTION.format(num=num)}"


def common_words_min_context(
    tokenizer: TokenizerLike,
    *,
    num_common: int = 10,
    freq_common: int | None = None,
    freq_uncommon: int = 3,
) -> int:
    """Tokens of the instructions, question and the common words alone (no other word), at
    ``freq_common`` (default: the least the task allows, ``freq_uncommon + 1``)."""
    if freq_common is None:
        freq_common = freq_uncommon + 1
    rng = task_rng(0, "common_words")
    words = pseudo_words(rng, num_common)
    return count_tokens(tokenizer, _cwe_prompt(words * freq_common, num_common))


def common_words(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    num_common: int = 10,
    freq_common: int | None = None,
    freq_uncommon: int = 3,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER's common-word extraction (see the module docs); ``max_new_tokens`` default 120.

    ``freq_common``: how often each common word is listed; by default RULER's 30, or less
    where 30 would take more than half the context (the most that leaves the other half to
    the uncommon words), at least ``freq_uncommon + 1``.
    """
    check_common(context_len, num_samples, seed, max_new_tokens)
    check_int("num_common", num_common, 1)
    check_int("freq_uncommon", freq_uncommon, 1)
    if freq_common is None:
        lo, hi = freq_uncommon + 1, max(30, freq_uncommon + 1)
        while lo < hi:  # the largest frequency whose common words fit half the context
            mid = (lo + hi + 1) // 2
            fits = common_words_min_context(tokenizer, num_common=num_common, freq_common=mid)
            lo, hi = (mid, hi) if fits <= context_len // 2 else (lo, mid - 1)
        freq_common = lo
    check_int("freq_common", freq_common, freq_uncommon + 1)
    out = []
    for i in range(num_samples):
        rng = task_rng(seed, "common_words", i)
        # Enough distinct words for any context: at least one token per listed word.
        pool = pseudo_words(rng, num_common + context_len // max(freq_uncommon, 1) + 1)
        common, others = pool[:num_common], pool[num_common:]
        order = rng.permutation(num_common * freq_common + len(others) * freq_uncommon)

        def build(n: int, common=common, others=others, order=order) -> str:
            words = common * freq_common + others[:n] * freq_uncommon
            keep = order[order < len(words)]  # one seeded shuffle for every n
            return _cwe_prompt([words[j] for j in keep], num_common)

        prompt, tokens = _fit(build, tokenizer, 0, len(others), context_len)
        _check_fits("common_words", tokens, context_len, tokens)
        out.append(Sample("common_words", i, prompt, tuple(common), tokens,
                          max_new_tokens or 120,
                          {"seed": seed, "common": tuple(common), "freq_common": freq_common,
                           "freq_uncommon": freq_uncommon}))  # fmt: skip
    return out


def _fwe_prompt(words: list[str]) -> str:
    chunks = [" ".join(words[j : j + 20]) for j in range(0, len(words), 20)]
    return f"{FWE_INTRO}\n{' .... '.join(chunks)}\n{FWE_QUESTION}"


def frequent_words_min_context(tokenizer: TokenizerLike, *, min_words: int = 64) -> int:
    """Tokens of the instructions, question and the shortest text (``min_words`` words)."""
    rng = task_rng(0, "frequent_words")
    return count_tokens(tokenizer, _fwe_prompt(pseudo_words(rng, 1) * min_words))


def frequent_words(
    tokenizer: TokenizerLike,
    *,
    context_len: int,
    num_samples: int,
    seed: int,
    alpha: float = 2.0,
    vocab_size: int = 800,
    max_new_tokens: int | None = None,
) -> list[Sample]:
    """RULER's frequent-word extraction (see the module docs); ``max_new_tokens`` default 50."""
    check_common(context_len, num_samples, seed, max_new_tokens)
    check_int("vocab_size", vocab_size, 4)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 1.0:
        raise ValueError(f"alpha must be a number > 1 (a Zipf exponent), got {alpha!r}")
    out = []
    for i in range(num_samples):
        rng = task_rng(seed, "frequent_words", i)
        vocab = pseudo_words(rng, vocab_size)
        p = 1.0 / np.arange(1, vocab_size + 1) ** float(alpha)
        draws = rng.choice(vocab_size, size=context_len + 64, p=p / p.sum())

        def build(n: int, draws=draws, vocab=vocab) -> str:
            return _fwe_prompt([vocab[j] for j in _untied(draws[:n])])

        prompt, tokens = _fit(build, tokenizer, 64, len(draws), context_len)
        _check_fits("frequent_words", tokens, context_len, tokens)
        words = [w for w in prompt.split("\n")[1].split() if w != "...."]
        top = [w for w, _ in Counter(words).most_common(3)]
        out.append(Sample("frequent_words", i, prompt, tuple(top), tokens,
                          max_new_tokens or 50,
                          {"seed": seed, "alpha": float(alpha), "vocab_size": vocab_size,
                           "words": len(words)}))  # fmt: skip
    return out


def _untied(draws: np.ndarray) -> list[int]:
    """``draws`` with the third most frequent word made strictly more frequent than the fourth
    (one of the fourth's occurrences becomes the third's), so the answer is unique."""
    seq = [int(x) for x in draws]
    counts = Counter(seq).most_common(4)
    while len(counts) == 4 and counts[2][1] == counts[3][1]:
        fourth, third = counts[3][0], counts[2][0]
        seq[seq.index(fourth)] = third
        counts = Counter(seq).most_common(4)
    return seq
