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
    assert set(FILE_TASKS) == {"gsm8k", "longbench_v2"}


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
