"""``dense``: no selection (``None``), every cached position read, no state."""

from __future__ import annotations

import pytest
import torch

from prhs_selectors import Dense

GEOMETRIES = [([37, 12, 1], 2, 2, 8), ([50, 29], 6, 2, 16)]


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=["Hq2-Hkv2", "Hq6-Hkv2"])
def test_dense_reads_every_position(make_sim, layout, lengths, hq, hkv, d) -> None:
    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout, max_new_tokens=2
    )
    dense = Dense()
    state = sim.attach(dense)
    assert dense.selection_width() == 0
    assert state.side is None and state.pool.field_names == ()
    for _ in range(2):
        assert sim.select(0) is None
        st = sim.plan().stats
        assert torch.equal(st.num_selected, sim.seq_lens().view(-1, 1).expand(-1, hkv))
        assert not bool(st.retrieved.any()) and not bool(st.proxy_bytes.any())
        out, _ = sim.attend(0, None)
        torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)
        sim.advance()


def test_an_unchecked_dense_step_runs_no_op(make_sim, op_log) -> None:
    """Without statistics, a layer's ``select`` issues no tensor op beyond views: no check of
    the query (nothing is skipped, so a non-finite query is not counted either)."""
    sim = make_sim([37, 12], num_q_heads=4, num_kv_heads=2, head_dim=8, num_layers=2)
    dense = Dense()
    state = sim.attach(dense, stats=False, checked=False)
    sim.queries[1][0, 1, 3] = float("nan")
    plan, kv = sim.update(dense), sim.kv(1)
    with op_log() as log:
        assert dense.select(plan, 1, sim.queries[1], kv, state) is None
    assert set(log.ops) <= {"select", "slice", "alias", "view", "detach"}, log.ops
    assert state.nonfinite_count() == 0
