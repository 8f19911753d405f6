"""compare(): identical inputs across selectors, perplexity through decode, option parsing."""

from __future__ import annotations

import math

import pytest

from prhs_eval.runner import SelectorSpec, compare, parse_option_value


def test_parse_option_value():
    assert parse_option_value("128") == 128
    assert parse_option_value("0.8") == 0.8
    assert parse_option_value("None") is None
    assert parse_option_value("true") is True
    assert parse_option_value("kjv") == "kjv"


def test_selector_spec_validates_on_creation():
    with pytest.raises(ValueError, match="budget"):
        SelectorSpec("cis", {"budget": -3})
    assert SelectorSpec("cis", {"budget": 32}).config_dict()["budget"] == 32


def test_compare_rejects_unknown_tasks_and_options_before_work(smollm2):
    with pytest.raises(ValueError, match="unknown task"):
        compare(smollm2, [SelectorSpec("dense")], ["mmlu"], context_len=100, num_samples=1)
    with pytest.raises(ValueError, match="gsm8k reads a local file"):
        compare(smollm2, [SelectorSpec("dense")], ["gsm8k"], context_len=100, num_samples=1)
    with pytest.raises(ValueError, match="takes the option"):
        compare(
            smollm2,
            [SelectorSpec("dense")],
            ["passkey"],
            context_len=100,
            num_samples=1,
            task_options={"source": "x.txt"},
        )


@pytest.mark.slow
def test_perplexity_full_budget_oracle_equals_dense_and_prefill_selectors_differ(smollm2, tmp_path):
    specs = [
        SelectorSpec("dense"),
        SelectorSpec("oracle", {"budget": 512, "block_size": 1}),  # >= every position
        SelectorSpec("streaming", {"budget": 4}),
        SelectorSpec("prhs", {"budget": 512, "block_size": 1, "start_layer": 10, "use_etf": True}),
    ]
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    res = compare(
        smollm2,
        specs,
        ["perplexity", "passkey"],
        context_len=256,
        num_samples=1,
        seed=3,
        score_tokens=12,
        task_options={"source": str(text)},  # taken by perplexity only
    )
    assert [r.task for r in res] == ["perplexity"] * 4 + ["passkey"] * 4
    res = res[:4]
    ppl = {r.selector: r.perplexity for r in res}
    assert all(math.isfinite(v) for v in ppl.values())
    assert ppl["dense"] < 3  # the repetitive text was scored, not the default Bible
    assert ppl["oracle"] == pytest.approx(ppl["dense"], rel=1e-4)
    assert ppl["streaming"] != pytest.approx(ppl["dense"], rel=1e-3)
    # prhs's CIS reads everything here, so only its PSAW/ETF prefill can move the perplexity.
    assert ppl["prhs"] != pytest.approx(ppl["dense"], rel=1e-4)
    assert all(r.decode_tokens == 11 and r.samples[0].scored_tokens == 12 for r in res)
    assert math.isnan(res[0].accuracy)
