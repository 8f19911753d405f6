"""The docs' "Write your own selector" guide: its example file (docs/examples/own_selector.py)
is imported, registered and run exactly as the guide says, and checked against ``oracle``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import prhs_eval
from prhs_core import AttentionSpec, ContiguousKV, selectors
from prhs_eval.runner import SelectorSpec
from prhs_kernels import sparse_decode_attention

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "own_selector.py"
B, HQ, HKV, D, T = 2, 8, 2, 64, 300
LENS = [300, 211]


@pytest.fixture
def guide():
    """The example module, imported from its file (which registers ``topdims``)."""
    assert EXAMPLE.is_file(), f"{EXAMPLE} is missing (the guide literalincludes it)"
    spec = importlib.util.spec_from_file_location("prhs_guide_own_selector", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        if "topdims" in selectors:
            selectors.unregister("topdims")


def _inputs(seed: int = 0, planted: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, HKV, T, D, generator=g)
    v = torch.randn(B, HKV, T, D, generator=g)
    q = torch.randn(B, HQ, D, generator=g)
    if planted:  # queries with 4 large dimensions, and keys that are large there too
        q[..., :4] = 4.0
        k[:, :, planted, :4] = 4.0
    kv = ContiguousKV(k, v, torch.tensor(LENS, dtype=torch.int32))
    return q, kv


def _select(name: str, q: torch.Tensor, kv: ContiguousKV, **options):
    """One decode step of layer 0 through the named selector, as the guide runs it."""
    sel = selectors.create(name, **options)
    spec = AttentionSpec(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    state = sel.init_state(spec, capacity=B, max_seq_len=T, kv_dtype=kv.dtype)
    state.pool.create(list(range(B)))
    plan = sel.make_plan(state, batch_size=B, scaling=D**-0.5, stats=True, checked=True)
    plan.update(kv.seq_lens, torch.arange(B))
    selection = sel.select(plan, 0, q, kv, state)
    assert selection is not None
    return selection, plan


def test_guide_selector_registers_with_its_config(guide):
    assert "topdims" in selectors
    entry = selectors.get("topdims")
    assert entry.config is guide.TopDimsConfig
    assert entry.defaults()["rank"] == 16 and entry.defaults()["budget"] == 64
    sel = selectors.create("topdims", budget=32, rank=8)
    assert isinstance(sel, guide.TopDims) and sel.config.rank == 8
    with pytest.raises(ValueError, match="rank"):
        selectors.create("topdims", rank=0)
    with pytest.raises(TypeError, match="no option"):
        selectors.create("topdims", tau=0.5)
    # What prhs-eval compare builds from --selectors topdims --set topdims.rank=8:
    assert SelectorSpec("topdims", {"rank": 8}).config_dict()["rank"] == 8


@pytest.mark.parametrize("budget", [8, 40])
def test_guide_selector_with_every_dimension_is_oracle(guide, budget):
    q, kv = _inputs()
    ours, _ = _select("topdims", q, kv, budget=budget, rank=D)
    ref, _ = _select("oracle", q, kv, budget=budget)
    assert torch.equal(ours.to_mask(kv.seq_lens, T), ref.to_mask(kv.seq_lens, T))


def test_guide_selector_with_the_full_budget_is_dense(guide):
    q, kv = _inputs(seed=1)
    ours, plan = _select("topdims", q, kv, budget=T, rank=4)
    assert torch.equal(ours.counts, kv.seq_lens.view(-1, 1).expand(B, HKV))
    out, _ = sparse_decode_attention(q, kv, ours, plan.scaling)
    dense, _ = sparse_decode_attention(q, kv, None, plan.scaling)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)


def test_guide_selector_finds_planted_keys_with_few_dimensions(guide):
    planted = [40, 90, 150, 199]
    q, kv = _inputs(seed=2, planted=planted)
    ours, plan = _select("topdims", q, kv, budget=8, rank=8, n_sink=2, n_local=8)
    mask = ours.to_mask(kv.seq_lens, T)
    assert mask[:, :, planted].all()  # the strong keys are read
    assert int(ours.counts.max()) <= guide.TopDims(guide.TopDimsConfig(budget=8)).selection_width()
    # It reads far fewer positions than dense, and its statistics say so.
    stats = plan.stats
    assert stats is not None and not bool(stats.retrieved.any())
    assert torch.equal(stats.num_selected, ours.counts)
    assert bool((stats.proxy_bytes > 0).all())
    summary = plan.summary()
    assert summary["retrieval_ratio"] == 0.0 and summary["avg_selected"] == 2 + 8 + 8


def test_guide_selector_runs_in_a_model(guide, make_tiny):
    model = make_tiny("llama")
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def generate():
        with torch.no_grad():
            return model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)

    dense = generate()
    with prhs_eval.enable(model, "topdims", budget=10_000, rank=2):
        assert torch.equal(generate(), dense)  # the full budget reads everything
    with prhs_eval.enable(model, "topdims", budget=2, n_sink=1, n_local=2, rank=4) as runtime:
        runtime.add_observer(lambda step, sel: None)  # statistics on
        generate()
        assert runtime.summary()["avg_selected"] == 1 + 2 + 2
