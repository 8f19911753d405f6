"""The ``perplexity`` task: contiguous windows of exactly ``context_len`` tokens."""

from __future__ import annotations

import bisect
import math
import os
import re

import numpy as np

from prhs_eval import data
from prhs_eval.tasks.base import Sample, TokenizerLike, check_common, count_tokens, task_rng

__all__ = ["PERPLEXITY_TEXTS", "perplexity_text"]

#: The texts ``perplexity_text`` knows by name (each loaded from its data package).
PERPLEXITY_TEXTS = {"kjv": data.kjv_text, "essays": data.essays_text}


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
    passage per line), Paul Graham's essays (``"essays"``: the 49 files in name order, a blank
    line between them) or a UTF-8 text file. The text is cut into equal regions of about
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
        ``"kjv"`` (default), ``"essays"`` or the path of a UTF-8 text file.

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
    check_common(context_len, num_samples, seed, None)
    if isinstance(source, str) and source in PERPLEXITY_TEXTS:
        text, source_name = PERPLEXITY_TEXTS[source](), source
    elif isinstance(source, str | os.PathLike):
        text, source_name = data.read_text_file(source), os.fspath(source)
    else:
        raise ValueError(
            f"source must be one of {sorted(PERPLEXITY_TEXTS)} or a path to a text file, got "
            f"{source!r}"
        )

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
        rng = task_rng(seed, "perplexity_text", int(margin * 100))
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
