"""GSM8K and LongBench v2 as compare tasks, from files the tests write in their formats."""

from __future__ import annotations

import json

import pytest

from prhs_eval.cli import main
from prhs_eval.tasks import FILE_TASKS, TASKS, make_samples, min_context, score


class WS:
    def encode(self, text, add_special_tokens=False):
        return text.split()


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "test.jsonl"
    with open(path, "w") as f:
        for i in range(12):
            q = f"Tom has {i} apples and buys {i + 2} more. " + "He counts them twice. " * (i % 3)
            f.write(
                json.dumps(
                    {
                        "question": q + "How many apples?",
                        "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}",
                    }
                )
                + "\n"
            )
    return path


@pytest.fixture
def longbench_file(tmp_path):
    items = [{"_id": f"id{i}", "domain": "d", "sub_domain": "s", "difficulty": "easy",
              "length": "short", "question": f"Which number is item {i}?", "choice_A": "1",
              "choice_B": "2", "choice_C": "3", "choice_D": "4", "answer": "ABCD"[i % 4],
              "context": " ".join(f"w{j}" for j in range(3000)) + f" END{i}"}
             for i in range(3)]  # fmt: skip
    path = tmp_path / "data.json"
    path.write_text(json.dumps(items))
    return path


@pytest.fixture
def coqa_file(tmp_path):
    stories = []
    for i in range(3):
        story = f"Story {i}. " + " ".join(f"w{j}" for j in range(400)) + f" Ann owns {i + 2} cats."
        qs = ["Who owns cats?", "How many?", "Is it a story?"]
        ans = ["Ann", f"{i + 2}", "yes"]
        stories.append({
            "id": f"s{i}", "story": story,
            "questions": [{"turn_id": t + 1, "input_text": q} for t, q in enumerate(qs)],
            "answers": [{"turn_id": t + 1, "input_text": a} for t, a in enumerate(ans)],
            "additional_answers": {"0": [{"turn_id": t + 1, "input_text": a + " indeed"}
                                         for t, a in enumerate(ans)]},
        })  # fmt: skip
    path = tmp_path / "coqa-dev-v1.0.json"
    path.write_text(json.dumps({"version": "1.0", "data": stories}))
    return path


def test_coqa_turns_in_lm_eval_layout_scored_by_f1(coqa_file):
    samples = make_samples("coqa", WS(), context_len=1000, num_samples=6, seed=0, data=coqa_file)
    assert samples == make_samples("coqa", WS(), context_len=1000, num_samples=6, seed=0,
                                   data=coqa_file)  # fmt: skip
    for s in samples:
        assert s.prompt.startswith("Story ") and s.prompt.endswith("\n\nA:")
        assert s.prompt.count("Q: ") == s.meta["turn"] and not s.meta["cut"]
        assert s.max_new_tokens == TASKS["coqa"].max_new_tokens == 32
    s = next(x for x in samples if x.meta["turn"] == 2)
    assert "Q: Who owns cats?\n\nA: Ann\n\nQ: How many?\n\nA:" in s.prompt
    n = s.answers[0]
    # Golds "2" and "2 indeed": CoQA averages, leaving each gold out in turn, the best F1
    # against the others: (F1 vs "2 indeed" = 2/3, F1 vs "2" = 1) / 2. The next turn is cut.
    assert score(s, f" {n}\n\nQ: Is it a story?") == pytest.approx(5 / 6)
    assert score(s, f" {n} indeed") == pytest.approx(5 / 6)
    assert score(s, " seven") == 0.0
    (cut,) = make_samples("coqa", WS(), context_len=200, num_samples=1, seed=0, data=coqa_file)
    assert cut.meta["cut"] and cut.context_tokens <= 200 and "cats." in cut.prompt
    with pytest.raises(ValueError, match="too small for coqa"):
        make_samples("coqa", WS(), context_len=3, num_samples=1, seed=0, data=coqa_file)
    with pytest.raises(ValueError, match="9 turns"):
        make_samples("coqa", WS(), context_len=500, num_samples=10, seed=0, data=coqa_file)


def test_gsm8k_is_many_shot_up_to_the_context(gsm8k_file):
    samples = make_samples("gsm8k", WS(), context_len=300, num_samples=3, seed=1, data=gsm8k_file)
    assert samples == make_samples("gsm8k", WS(), context_len=300, num_samples=3, seed=1,
                                   data=gsm8k_file)  # fmt: skip
    for s in samples:
        assert s.context_tokens <= 300 and s.meta["shots"] >= 3
        assert s.prompt.endswith("How many apples?\nAnswer:")
        question = s.prompt.rsplit("Question: ", 1)[1]
        assert s.prompt.count(question) == 1  # the target is not among its own shots
        assert s.prompt.count("####") == s.meta["shots"]
        assert s.max_new_tokens == TASKS["gsm8k"].max_new_tokens == 256
    s = samples[0]
    n = s.answers[0]
    assert score(s, f"So the answer is {n}.") == 1.0  # flexible: the last number
    assert score(s, f"{n} apples, or maybe {int(n) + 1}") == 0.0
    assert min_context("gsm8k") == 1  # the generator checks its own prompts
    with pytest.raises(ValueError, match="too small for gsm8k"):
        make_samples("gsm8k", WS(), context_len=5, num_samples=1, seed=0, data=gsm8k_file)
    with pytest.raises(ValueError, match="at least 13"):
        make_samples("gsm8k", WS(), context_len=300, num_samples=12, seed=0, data=gsm8k_file)
    with pytest.raises(ValueError, match="give its path"):
        make_samples("gsm8k", WS(), context_len=300, num_samples=1, seed=0)


def test_longbench_v2_cuts_contexts_in_the_middle(longbench_file):
    samples = make_samples("longbench_v2", WS(), context_len=1000, num_samples=3, seed=0,
                           data=longbench_file)  # fmt: skip
    for s in samples:
        assert 990 <= s.context_tokens <= 1000 and s.meta["cut"]
        assert "<text>\nw0 w1 " in s.prompt and " END" in s.prompt  # both ends kept
        assert " w1500 " not in s.prompt  # the middle is gone
        letter = s.answers[0]
        assert score(s, f"The correct answer is ({letter})") == 1.0
        assert score(s, "The correct answer is (E)") == 0.0
    (whole,) = make_samples("longbench_v2", WS(), context_len=5000, num_samples=1, seed=0,
                            data=longbench_file)  # fmt: skip
    assert not whole.meta["cut"]
    with pytest.raises(ValueError, match="too small for longbench_v2"):
        make_samples("longbench_v2", WS(), context_len=20, num_samples=1, seed=0,
                     data=longbench_file)  # fmt: skip
    with pytest.raises(ValueError, match="does not exist"):
        make_samples("longbench_v2", WS(), context_len=2000, num_samples=1, seed=0,
                     data="/nonexistent.json")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "gsm8k"], "give --data PATH"),
        (["--tasks", "passkey", "--data", "{g}"], "--data is for the tasks that read a file"),
        (["--tasks", "gsm8k,longbench_v2", "--data", "{g}"], "each read their own"),
        (["--tasks", "gsm8k", "--data", "/nonexistent.jsonl"], "is not a file"),
    ],
)
def test_compare_data_errors(gsm8k_file, tmp_path, capsys, argv, message):
    argv = [a.format(g=gsm8k_file) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv, "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert set(FILE_TASKS) == {"gsm8k", "coqa", "longbench_v2"}


@pytest.mark.slow
def test_compare_runs_gsm8k_on_smollm2(smollm2, gsm8k_file):
    from prhs_eval.runner import SelectorSpec, compare

    results = compare(
        smollm2, [SelectorSpec("dense"), SelectorSpec("oracle", {"budget": 32})], ["gsm8k"],
        context_len=400, num_samples=1, seed=0,
        task_options={"data": str(gsm8k_file), "max_new_tokens": 12},
    )  # fmt: skip
    dense, oracle = results
    assert dense.task == "gsm8k" and dense.samples[0].context_tokens > 300
    assert 0.0 <= dense.accuracy <= 1.0
    assert oracle.metrics.avg_kv < 100  # the selector read a fraction of ~400 positions
