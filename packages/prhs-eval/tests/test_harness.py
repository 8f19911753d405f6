"""``prhs-hf``, the lm-evaluation-harness model: a local task on the offline model, through
lm-eval's Python API and through ``prhs-lm-eval`` (lm-eval's command line)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lm_eval")

from prhs_eval.harness import MODEL_NAME, main, model_class, register

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. "
TASK = """task: prhs_local_passkey
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
"""


@pytest.fixture
def local_task(tmp_path, monkeypatch):
    """A two-document pass-key task in lm-eval's YAML, its data a local JSONL file."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "passkey.jsonl"
    with open(data, "w") as f:
        for key in (71432, 50981):
            prompt = (FILLER * 10 + f"The pass key is {key}. Remember it. {key} is the pass key. "
                      + FILLER * 10 + "What is the pass key? The pass key is")  # fmt: skip
            f.write(json.dumps({"prompt": prompt, "answer": str(key)}) + "\n")
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    return tmp_path


def test_model_args_split_between_the_selector_and_hflm():
    from prhs_eval.harness import _split_options

    sel, rest = _split_options("cis", {"budget": "64", "tau": "0.8", "dtype": "float32",
                                       "max_length": 512})  # fmt: skip
    assert sel == {"budget": 64, "tau": 0.8}
    assert rest == {"dtype": "float32", "max_length": 512}


@pytest.mark.slow
def test_prhs_hf_runs_a_local_task_and_decodes_through_the_selector(smollm2, local_task):
    import lm_eval
    from lm_eval.tasks import TaskManager

    cls = register()
    assert cls is model_class()
    from lm_eval.api.registry import get_model

    assert get_model(MODEL_NAME) is cls
    with pytest.raises(ValueError, match="budget"):  # refused before the model is touched
        cls(pretrained=smollm2.model, tokenizer=smollm2.tokenizer, selector="cis", budget=0)
    lm = cls(pretrained=smollm2.model, tokenizer=smollm2.tokenizer, selector="oracle",
             budget=32, batch_size=2, device="cpu")  # fmt: skip
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=["prhs_local_passkey"], task_manager=TaskManager(
                include_path=str(local_task)),
        )  # fmt: skip
        summary = lm.prhs_runtime.summary()
    finally:
        lm.prhs_runtime.disable()
    assert out["results"]["prhs_local_passkey"]["exact_match,first_number"] == 1.0
    assert summary["decisions"] > 0  # the generation decoded through the selector
    assert summary["avg_selected"] < 100  # of ~250 cached positions: sparse


@pytest.mark.slow
def test_prhs_lm_eval_command_line(local_task, tmp_path, capsys):
    code = main([
        "run", "--model", MODEL_NAME, "--model_args",
        "pretrained=smollm2-135m,selector=prhs,budget=32,dtype=float32",
        "--tasks", "prhs_local_passkey", "--include_path", str(local_task), "--device", "cpu",
        "--batch_size", "2", "--output_path", str(tmp_path / "out"),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "prhs_local_passkey" in printed and "exact_match" in printed
    results = [p for p in (tmp_path / "out").rglob("results_*.json")]
    assert results, os.listdir(tmp_path / "out")
    data = json.loads(results[0].read_text())
    assert data["config"]["model"] == MODEL_NAME
