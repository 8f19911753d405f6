"""RULER's aggregation tasks: common-word (CWE) and frequent-word (FWE) extraction."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from prhs_eval.tasks import TASKS, length_tolerance, make_samples, min_context, score
from prhs_eval.tasks.aggregation import pseudo_words


class WS:
    """Whitespace tokenizer."""

    def encode(self, text, add_special_tokens=False):
        return text.split()


def _listed(prompt: str) -> list[str]:
    return re.findall(r"\d+\. ([a-z]+)", prompt.split("\n")[1])


def _coded(prompt: str) -> list[str]:
    return [w for w in prompt.split("\n")[1].split() if w != "...."]


def test_pseudo_words_are_distinct_and_never_substrings():
    words = pseudo_words(np.random.default_rng(0), 3000)
    assert len(set(words)) == 3000
    assert {len(w) for w in words} == {6}  # equal lengths: no word inside another


@pytest.mark.parametrize("length", [1000, 4000])
def test_common_words_list_and_answers(length):
    samples = make_samples("common_words", WS(), context_len=length, num_samples=2, seed=5)
    assert samples == make_samples("common_words", WS(), context_len=length, num_samples=2,
                                   seed=5)  # fmt: skip
    assert samples[0].answers != samples[1].answers
    for s in samples:
        assert abs(s.context_tokens - length) <= length_tolerance(length)
        counts = Counter(_listed(s.prompt))
        freq = s.meta["freq_common"]
        assert freq == (30 if length == 4000 else freq) and 3 < freq <= 30
        assert sorted(w for w, c in counts.items() if c == freq) == sorted(s.answers)
        assert set(counts.values()) <= {freq, 3}
        assert len(s.answers) == 10 and s.max_new_tokens == TASKS["common_words"].max_new_tokens
        assert s.prompt.endswith("The top 10 words that appear most often in the list are:")
        # The list is shuffled: the common words do not come first.
        assert set(_listed(s.prompt)[:10]) != set(s.answers)
        assert score(s, " " + ", ".join(s.answers)) == 1.0
        assert score(s, " " + ", ".join(s.answers[:5])) == 0.5


@pytest.mark.parametrize("length", [500, 4000])
def test_frequent_words_text_and_answers(length):
    (s,) = make_samples("frequent_words", WS(), context_len=length, num_samples=1, seed=2)
    assert abs(s.context_tokens - length) <= length_tolerance(length)
    counts = Counter(_coded(s.prompt)).most_common()
    assert [w for w, _ in counts[:3]] == list(s.answers)
    assert counts[2][1] > counts[3][1]  # the third is strictly ahead: one answer
    assert " .... " in s.prompt and s.max_new_tokens == 50
    assert score(s, "tidumu " + " ".join(s.answers)) == 1.0


def test_min_context_and_errors():
    assert min_context("common_words") == min_context("common_words", tokenizer=WS()) > 80
    assert min_context("common_words", freq_common=30) > 600
    assert min_context("common_words", num_common=2, freq_common=5) < 100
    assert 100 < min_context("frequent_words") < 200
    with pytest.raises(ValueError, match="too small for common_words"):
        make_samples("common_words", WS(), context_len=60, num_samples=1, seed=0)
    with pytest.raises(ValueError, match="too small for frequent_words"):
        make_samples("frequent_words", WS(), context_len=60, num_samples=1, seed=0)
    with pytest.raises(ValueError, match="freq_common must be >= 4"):
        make_samples("common_words", WS(), context_len=2000, num_samples=1, seed=0,
                     freq_common=3)  # fmt: skip
    with pytest.raises(ValueError, match="alpha must be a number > 1"):
        make_samples("frequent_words", WS(), context_len=2000, num_samples=1, seed=0, alpha=1)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        make_samples("frequent_words", WS(), context_len=2000, num_samples=1, seed=-1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["common_words", "frequent_words"])
def test_smollm2_lengths(smol, name):
    for length in (1024, 4096):
        for s in make_samples(name, smol, context_len=length, num_samples=1, seed=1):
            assert s.context_tokens == len(smol.encode(s.prompt, add_special_tokens=False))
            assert abs(s.context_tokens - length) <= length_tolerance(length)
