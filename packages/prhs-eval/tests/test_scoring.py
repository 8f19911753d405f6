"""prhs_eval.scoring: GSM8K's strict and flexible match, CoQA's exact match and F1, and the
readers of both benchmarks' files, on fixtures written here in their formats."""

from __future__ import annotations

import json

import pytest

from prhs_eval.scoring import (
    coqa_exact_match,
    coqa_f1,
    coqa_normalize,
    gsm8k_flexible,
    gsm8k_strict,
    gsm8k_target,
    read_coqa,
    read_gsm8k,
)

ANSWER = "She pays 3 * $400 = $<<3*400=1200>>1200.\n#### 1,200"


def test_gsm8k_target_is_the_final_number():
    assert gsm8k_target(ANSWER) == "1200"
    assert gsm8k_target("x\n#### -3.5.") == "-3.5"


@pytest.mark.parametrize(
    ("completion", "strict", "flexible"),
    [
        ("3 * 400 = 1200.\n#### 1200", 1.0, 1.0),
        ("So the answer is $1,200.", 0.0, 1.0),  # no #### line: only the flexible one
        ("#### 1200\nThen 7 more.", 1.0, 0.0),  # strict takes the first ####, flexible the last
        ("#### 120", 0.0, 0.0),
        ("I do not know.", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(completion, strict, flexible):
    assert gsm8k_strict(completion, ANSWER) == strict
    assert gsm8k_flexible(completion, ANSWER) == flexible


def test_coqa_normalisation_and_scores():
    assert coqa_normalize("The  White, Cat!") == "white cat"
    assert coqa_exact_match(["a white cat"], "White cat.") == 1.0
    assert coqa_f1(["white cat"], "cat") == pytest.approx(2 / 3)
    assert coqa_f1(["white cat"], "dog") == 0.0
    # several golds: each left out in turn, the best against the others, averaged
    golds = ["white", "white cat", "a dog"]
    # leaving out "white": best of ("white cat" 1.0, "a dog" 0) = 1; out "white cat": best of
    # ("white" 2/3, "a dog" 0); out "a dog": best of (2/3, 1) = 1
    assert coqa_f1(golds, "white cat") == pytest.approx((1 + 2 / 3 + 1) / 3)
    assert coqa_exact_match(golds, "white cat") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="gold"):
        coqa_f1([], "x")
    with pytest.raises(TypeError, match="prediction"):
        coqa_f1(["x"], None)


def test_read_gsm8k(tmp_path):
    f = tmp_path / "test.jsonl"
    f.write_text(
        json.dumps({"question": "How much?", "answer": ANSWER}) + "\n\n"
        + json.dumps({"question": "And now?", "answer": "2 + 2 = 4\n#### 4"}) + "\n",
        encoding="utf-8",
    )  # fmt: skip
    probs = read_gsm8k(f)
    assert [(p.question, p.target) for p in probs] == [("How much?", "1200"), ("And now?", "4")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1"):
        read_gsm8k(bad)
    with pytest.raises(FileNotFoundError, match="GSM8K"):
        read_gsm8k(tmp_path / "missing.jsonl")


def test_read_coqa(tmp_path):
    story = {
        "id": "s1",
        "story": "Tom had a white cat. It slept all day.",
        "questions": [
            {"turn_id": 2, "input_text": "What did it do?"},
            {"turn_id": 1, "input_text": "What did Tom have?"},
        ],
        "answers": [
            {"turn_id": 1, "input_text": "a white cat"},
            {"turn_id": 2, "input_text": "slept"},
        ],
        "additional_answers": {
            "0": [
                {"turn_id": 1, "input_text": "a cat"},
                {"turn_id": 2, "input_text": "slept all day"},
            ],
        },
    }
    f = tmp_path / "coqa-dev.json"
    f.write_text(json.dumps({"version": 1.0, "data": [story]}), encoding="utf-8")
    turns = read_coqa(f)
    assert [t.question for t in turns] == ["What did Tom have?", "What did it do?"]
    assert turns[0].answers == ("a white cat", "a cat") and turns[0].history == ()
    assert turns[1].history == (("What did Tom have?", "a white cat"),)
    assert coqa_exact_match(turns[1].answers, "Slept all day.") == pytest.approx(0.5)
    del story["answers"]
    f.write_text(json.dumps({"data": [story]}), encoding="utf-8")
    with pytest.raises(ValueError, match="story 0"):
        read_coqa(f)
