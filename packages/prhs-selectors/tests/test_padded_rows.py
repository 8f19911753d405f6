"""Padded batch rows (slot ``-1``, as SGLang pads CUDA-graph batches) use the state's scratch
slot, and the live rows' results are exactly those of a batch without the padded row."""

from __future__ import annotations

import pytest
import torch

KW = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "num_layers": 2, "max_new_tokens": 3}


def _run(sim, sel, live: list[int]) -> tuple[list, object]:
    state = None
    if getattr(sel.config, "key_codes", False):
        # Key codes (CIS's default scorer) are taken around a centre that the first write fixes
        # unless one is pinned before it; a padded row's prompt keys would move the former, so
        # both states pin the same centre (as a host that wants batch invariance does).
        state = sim.init_state(sel)
        gen = torch.Generator().manual_seed(11)
        d = KW["head_dim"]
        sel.set_key_center(state, torch.randn(2, 2, d, generator=gen) * 0.3)
    state = sim.attach(sel, state)
    got = []
    for _ in range(3):
        for layer in range(2):
            s = sim.select(layer)
            out, lse = sim.attend(layer, s)
            st = sim.plan().stats
            row = [out[live], lse[live], st.retrieved[live], st.num_selected[live]]
            row += [st.proxy_bytes[live]]
            if st.delta_hat is not None:
                row.append(st.delta_hat[live])
            if s is not None:
                row += [s.indices[live], s.counts[live]]
            got.append([t.clone() for t in row])
        sim.advance()
    return got, state


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_padded_rows_leave_live_rows_alone(make_sim, tools, case, layout) -> None:
    # Row 1 is padding; rows 0 and 2 are the same sequences as rows 0 and 1 of `plain`, in
    # slots 0 and 2 (a contiguous host's slot is its batch row).
    kw = {"layout": layout, "capacity": 3, **KW}
    padded = make_sim([40, 23, 30], slots=[0, -1, 2], row_ids=[0, 99, 1], **kw)
    plain = make_sim([40, 30], slots=[0, 2], row_ids=[0, 1], **kw)
    got, state = _run(padded, tools.make_selector(case), [0, 2])
    want, plain_state = _run(plain, tools.make_selector(case), [0, 1])
    plan = padded.plan()
    assert plan.slots.tolist() == [0, state.pool.scratch_slot, 2]
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    # The live sequences' per-request state is the same; totals count live rows only.
    for name in state.pool.field_names:
        assert torch.equal(state.pool[name][[0, 2]], plain_state.pool[name][[0, 2]]), name
    assert plan.summary() == plain.plan().summary()
