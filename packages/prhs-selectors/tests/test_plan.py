"""What a plan promises a host: static shapes (a step writes into the same buffers every time,
so it can be captured in a CUDA graph and replayed) and statistics whose running summary agrees
with the per-step ones."""

from __future__ import annotations

import math

import pytest
import torch


def test_shapes_and_buffers_are_static_over_steps(make_sim, tools, case) -> None:
    sim = make_sim(
        [45, 20, 2], num_q_heads=4, num_kv_heads=2, head_dim=8, num_layers=2, max_new_tokens=10
    )
    sel = tools.make_selector(case)
    sim.attach(sel, checked=False)
    plan = sim.plan()
    buffers = [plan.selection.indices, plan.selection.counts, plan.seq_lens, plan.slots]
    buffers += [plan.stats.retrieved, plan.stats.num_selected, plan.stats.proxy_bytes]
    shapes = [t.shape for t in buffers]
    ptrs = [t.data_ptr() for t in buffers]
    assert shapes[0] == (3, 2, sel.selection_width())
    for _ in range(10):
        for layer in range(2):
            s = sim.select(layer)
            if s is not None:
                assert s is plan.selection
                assert s.indices is buffers[0] and s.counts is buffers[1]
            out, lse = sim.attend(layer, s)
            assert out.shape == (3, 4, 8) and lse.shape == (3, 4)
        assert [t.shape for t in buffers] == shapes
        assert [t.data_ptr() for t in buffers] == ptrs
        assert plan.selection.indices.data_ptr() == ptrs[0]
        sim.advance()


@pytest.mark.parametrize("slots", [[0, 1, 2], [0, -1, 2]], ids=["full", "padded"])
def test_summary_agrees_with_the_step_stats(make_sim, tools, case, slots) -> None:
    sim = make_sim(
        [45, 20, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_layers=2,
        max_new_tokens=4,
        slots=slots,
    )
    sim.attach(tools.make_selector(case))
    plan = sim.plan()
    assert sim.plan().summary()["decisions"] == 0
    live = torch.tensor([s >= 0 for s in slots])
    decisions = retrievals = selected = proxy = 0.0
    for _ in range(4):
        for layer in range(2):
            sim.select(layer)
            st = plan.stats
            decisions += float(live.sum()) * 2
            retrievals += float(st.retrieved[live].sum())
            selected += float(st.num_selected[live].double().sum())
            proxy += float(st.proxy_bytes[live].sum())
            assert bool((st.num_selected <= sim.seq_lens().view(-1, 1)).all())
        sim.advance()
    summary = plan.summary()
    assert summary["decisions"] == decisions == 4 * 2 * float(live.sum()) * 2
    assert summary["retrievals"] == retrievals
    assert math.isclose(summary["retrieval_ratio"], 100 * retrievals / decisions)
    assert math.isclose(summary["avg_selected"], selected / decisions)
    assert math.isclose(summary["proxy_bytes"], proxy)
    assert plan.totals.shape == (2, 4)


def test_no_stats_no_totals(make_sim, tools, case) -> None:
    sim = make_sim([20], num_q_heads=2, num_kv_heads=1, head_dim=8)
    sim.attach(tools.make_selector(case), stats=False)
    sim.select(0)
    plan = sim.plan()
    assert plan.stats is None and plan.totals is None and plan.summary() == {}
