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


# --------------------------------------------------------------------------------------------
# LongBench v2, RULER QA, WikiText, the hub path

from prhs_eval import scoring as sc  # noqa: E402

LB = {"_id": "66f36490", "domain": "Single-Document QA", "sub_domain": "Financial",
      "difficulty": "easy", "length": "short", "question": "Which year?", "choice_A": "1999",
      "choice_B": "2001", "choice_C": "2003", "choice_D": "2005", "answer": "C",
      "context": "In 2003 the firm was founded."}  # fmt: skip


def test_longbench_v2_reads_both_layouts_prompts_and_scores(tmp_path):
    import json as _json

    lst, jl = tmp_path / "data.json", tmp_path / "data.jsonl"
    lst.write_text(_json.dumps([LB, {**LB, "_id": "x2", "answer": "A"}]))
    jl.write_text(_json.dumps(LB) + "\n\n" + _json.dumps({**LB, "_id": "x2"}) + "\n")
    a, b = sc.read_longbench_v2(lst), sc.read_longbench_v2(jl)
    assert [i.id for i in a] == [i.id for i in b] == ["66f36490", "x2"]
    item = a[0]
    assert item.choices == ("1999", "2001", "2003", "2005") and item.answer == "C"
    prompt = sc.longbench_v2_prompt(item)
    assert "<text>\nIn 2003 the firm was founded.\n</text>" in prompt
    assert "(C) 2003" in prompt and prompt.endswith('"The correct answer is (insert answer here)".')
    assert sc.longbench_v2_choice("Thinking... The correct answer is (C).") == "C"
    assert sc.longbench_v2_choice("**The correct answer is B**") == "B"
    assert sc.longbench_v2_choice("I think C") is None
    assert sc.longbench_v2_score("The correct answer is (C)", item) == 1.0
    assert sc.longbench_v2_score("The correct answer is (A)", item) == 0.0
    bad = tmp_path / "bad.json"
    bad.write_text(_json.dumps([{**LB, "answer": "E"}]))
    with pytest.raises(ValueError, match="one of A, B, C, D"):
        sc.read_longbench_v2(bad)
    bad.write_text(_json.dumps([{"_id": 1}]))
    with pytest.raises(ValueError, match="item 0: expected an object with '_id'"):
        sc.read_longbench_v2(bad)


SQUAD = {"version": "v2.0", "data": [{"title": "T", "paragraphs": [
    {"context": "Paris is the capital of France.", "qas": [
        {"id": "q1", "question": "What is the capital of France?",
         "answers": [{"text": "Paris", "answer_start": 0}, {"text": "Paris", "answer_start": 0}]},
        {"id": "q2", "question": "Unanswerable?", "answers": [], "is_impossible": True}]},
    {"context": "Berlin is in Germany.", "qas": []},
    {"context": "Rome is in Italy.", "qas": []}]}]}  # fmt: skip

HOTPOT = [{"_id": "h1", "question": "Which city?", "answer": "Lyon",
           "context": [["Lyon", ["Lyon is a city.", " It is in France."]],
                       ["Nice", ["Nice is by the sea."]]],
           "supporting_facts": [["Lyon", 0], ["Lyon", 1]]}]  # fmt: skip


def test_ruler_qa_readers_prompt_and_score(tmp_path):
    import json as _json

    sq = tmp_path / "squad.json"
    sq.write_text(_json.dumps(SQUAD))
    items, pool = sc.read_squad(sq)
    assert [i.id for i in items] == ["q1"]  # the unanswerable one is left out
    assert items[0].answers == ("Paris",) and len(pool) == 3
    hp = tmp_path / "hotpot.json"
    hp.write_text(_json.dumps(HOTPOT))
    h_items, h_pool = sc.read_hotpotqa(hp)
    assert h_items[0].golds == ("Lyon\nLyon is a city. It is in France.",)
    assert len(h_pool) == 2
    full = sc.ruler_qa_prompt(items[0], pool, max_tokens=10_000, seed=1)
    assert full.count("Document ") == 3 and "Paris is the capital" in full
    assert full.endswith("Question: What is the capital of France? Answer:")
    short = sc.ruler_qa_prompt(items[0], pool, max_tokens=len(full.split()) - 3, seed=1)
    assert short.count("Document ") == 2 and "Paris is the capital" in short  # gold kept
    assert sc.ruler_qa_prompt(items[0], pool, max_tokens=10_000, seed=1) == full  # seeded
    with pytest.raises(ValueError, match="too small"):
        sc.ruler_qa_prompt(items[0], pool, max_tokens=5)
    assert sc.ruler_qa_score(" paris.", ("Paris",)) == 1.0
    assert sc.ruler_qa_score("Lyon", ("Paris", "City of Light")) == 0.0
    with pytest.raises(ValueError, match="expected a JSON list"):
        sc.read_hotpotqa(sq)


def test_wikitext_and_the_hub_path(tmp_path, monkeypatch):
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(" = Robert Boulter = \n\n Robert Boulter is an English actor . \n")
    assert sc.load_benchmark("wikitext2", raw).startswith(" = Robert Boulter")
    (tmp_path / "empty.raw").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        sc.read_wikitext(tmp_path / "empty.raw")
    with pytest.raises(ValueError, match="unknown benchmark"):
        sc.load_benchmark("mmlu")

    datasets = pytest.importorskip("datasets")
    calls = []

    def fake(repo, config, split):
        calls.append((repo, config, split))
        if repo == "openai/gsm8k":
            return [{"question": "1+1?", "answer": "1+1=2\n#### 2"}]
        if repo == "stanfordnlp/coqa":
            return [{"story": "S", "questions": ["a?", "b?"],
                     "answers": {"input_text": ["x", "y"], "answer_start": [0, 0]}}]  # fmt: skip
        if repo == "THUDM/LongBench-v2":
            return [LB]
        return [{"text": " = A = \n"}, {"text": " B .\n"}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    (p,) = sc.load_benchmark("gsm8k")
    assert p.target == "2"
    turns = sc.load_benchmark("coqa")
    assert [t.question for t in turns] == ["a?", "b?"] and turns[1].history == (("a?", "x"),)
    assert sc.load_benchmark("longbench_v2")[0].answer == "C"
    assert sc.load_benchmark("wikitext2") == " = A = \n B .\n"
    assert calls[0] == ("openai/gsm8k", "main", "test")

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(OSError, match="pass the path of a local copy"):
        sc.load_benchmark("gsm8k")
