"""Non-finite input is skipped, never stored: a (sequence, KV head) whose query holds a NaN or an
infinity reads only its sink and local windows, leaves its persistent state as it was, leaves
every other row alone and is counted in ``state.nonfinite``; a checked plan raises first. A
non-finite key written through ``write_kv`` is left out of the side caches and counted."""

from __future__ import annotations

import pytest
import torch

from prhs_selectors import Quest, QuestConfig
from prhs_selectors.dense import Dense

BAD_B, BAD_H, LAYER = 1, 1, 1  # the poisoned (sequence, KV head), on layer 1 of 2
KW = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "num_layers": 2, "max_new_tokens": 4}


def _bad_part(name: str, t: torch.Tensor, loc: torch.Tensor, page: int) -> tuple | None:
    """The index of the poisoned row's entries in state tensor ``name``, or ``None`` when the
    tensor holds nothing per (sequence, layer, KV head). ``page``: the side cache's."""
    kind, field = name.split(".", 1) if "." in name else ("", name)
    if kind == "pool" and t.ndim >= 3:  # [slots, L, Hkv, ...] (slot = batch row here)
        return (BAD_B, LAYER, BAD_H)
    if kind == "side" and field.startswith("h2o"):  # [locations, L, Hkv]
        return (loc[BAD_B][loc[BAD_B] >= 0], LAYER, BAD_H)
    if kind == "side" and field == "cis_page_logm":  # [pages, L, Hkv, g, 2]: the anchor's
        return (torch.unique(loc[BAD_B][loc[BAD_B] >= 0] // page), LAYER, BAD_H)
    return None


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_a_nonfinite_query_is_skipped(make_sim, tools, case, layout, value) -> None:
    sim = make_sim([37, 29, 12], layout=layout, **KW)
    twin = make_sim([37, 29, 12], layout=layout, **KW)
    sel, twin_sel = tools.make_selector(case), tools.make_selector(case)
    state = sim.attach(sel, checked=False)
    twin_state = twin.attach(twin_sel, checked=False)
    g = 2
    for step in range(3):
        for s in (sim, twin):
            s.select(0)
        if step == 2:
            # The poisoned step: layer 0 ran as usual; one query head of (BAD_B, BAD_H) on
            # layer 1 is non-finite.
            sim.queries[LAYER][BAD_B, BAD_H * g + 1, 3] = value
            before = tools.snapshot(state)
            got = sim.select(LAYER)
            want = twin.select(LAYER)
            if got is not None:
                got, want = got.indices.clone(), want.indices.clone()
            break
        for s in (sim, twin):
            s.select(LAYER)
            s.advance()
    # Dense decoding (dense, and PSAW / ETF, prefill selectors that decode dense) chooses
    # nothing, so it skips (and counts) nothing: its attention returns the non-finite output.
    want_count = 0 if isinstance(sel, Dense) else 1
    assert state.nonfinite_count() == want_count and twin_state.nonfinite_count() == 0

    # The selection: for the poisoned row, only what its selector picks without scoring (the
    # sink and local windows, H2O's recent window; all of Streaming's); the twin's for every
    # other row.
    if got is not None:
        name, fields = tools.cases[case]
        sel_ = sim.plan().selection
        n = int(sim.lengths[BAD_B])
        if name == "streaming":
            assert torch.equal(got[BAD_B, BAD_H], want[BAD_B, BAD_H])
        else:
            window = tools.window(n, fields["n_sink"], fields["n_local"])
            if name == "h2o":  # plus the n_recent positions before the local window
                end = n - fields["n_local"]
                window |= set(range(max(0, end - twin_sel.config.n_recent), end))
            assert tools.chosen(sel_, BAD_B, BAD_H) == tools.blocks_of(window, sel_.block_size)
        others = torch.ones(got.shape[:2], dtype=torch.bool)
        others[BAD_B, BAD_H] = False
        assert torch.equal(got[others], want[others])

    # The state: the poisoned row's entries as they were, every other entry as in the twin.
    after, twin_after = tools.snapshot(state), tools.snapshot(twin_state)
    loc = sim.locations(state.row_stride)
    twin_loc = twin.locations(twin_state.row_stride)
    for name in after:
        if name == "nonfinite":
            continue
        a, b, w = after[name], before[name], twin_after[name]
        if name.startswith("side.h2o") and layout == "contiguous":
            assert torch.equal(loc, twin_loc)
        part = _bad_part(name, a, loc, state.side.page_size if state.side else 1)
        if part is not None:
            assert torch.equal(a[part], b[part]), f"{name} of the skipped row changed"
            a, w = a.clone(), w.clone()
            a[part] = 0
            w[part] = 0
        assert torch.equal(a, w), f"{name} of another row differs"


def test_a_checked_plan_raises_before_anything_changes(make_sim, tools, case) -> None:
    sim = make_sim([37, 29, 12], **KW)
    state = sim.attach(tools.make_selector(case))
    sim.select(0)
    sim.select(1)
    sim.advance()
    sim.queries[0][2, 0, 5] = float("nan")
    before = tools.snapshot(state)
    buffers = [t.clone() for t in (sim.plan().selection.indices, sim.plan().selection.counts)]
    with pytest.raises(ValueError, match="non-finite"):
        sim.select(0)
    tools.assert_same_state(before, tools.snapshot(state))
    assert state.nonfinite_count() == 0
    assert torch.equal(buffers[0], sim.plan().selection.indices)
    assert torch.equal(buffers[1], sim.plan().selection.counts)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_a_nonfinite_key_is_left_out_of_quest_pages(make_sim, layout) -> None:
    sim = make_sim([37, 29], layout=layout, **KW)
    sim.keys[1][0, 1, 10, 2] = float("nan")  # a prompt key (position 10, page 2)
    n1 = int(sim.lengths[1])
    sim.keys[1][1, 0, n1, 0] = float("-inf")  # the next token of row 1
    quest = Quest(QuestConfig(budget=8, page_size=4, dense_layers=1, n_local=2))
    state = sim.attach(quest, checked=False)
    assert state.nonfinite_count() == 1
    sim.select(1)
    sim.advance()
    assert state.nonfinite_count() == 2
    side = state.side
    loc = sim.locations(state.row_stride)
    for b, n in enumerate(sim.lengths.tolist()):
        keys = sim.keys[1][b, :, :n].float()  # [Hkv, n, D]
        skipped = ~torch.isfinite(keys).all(-1).all(0)  # a whole key row is skipped
        for j in range(0, n, 4):
            page = side.pages_of(loc[b, j : j + 1])
            kmin = side["quest_kmin"][page, 0].float()[0]
            kmax = side["quest_kmax"][page, 0].float()[0]
            assert bool(torch.isfinite(kmin).all() and torch.isfinite(kmax).all()), (b, j)
            keep = ~skipped[j : j + 4]
            rows = keys[:, j : j + 4][:, keep]
            assert torch.equal(kmin, rows.amin(1)) and torch.equal(kmax, rows.amax(1)), (b, j)


def test_a_nonfinite_key_is_left_out_of_h2o_scores(make_sim, tools) -> None:
    sim = make_sim([30], layout="paged", **KW)
    sim.keys[1][0, 0, 7, 1] = float("nan")
    h2o = tools.make_selector("h2o")
    state = sim.attach(h2o, checked=False)
    assert state.nonfinite_count() == 1  # layer 1 only: layer 0's keys are finite
    loc = sim.locations(state.row_stride)[0, 7]
    assert float(state.side["h2o_mass"][loc].abs().sum()) == 0.0
    assert not bool(state.side["h2o_evicted"][loc].any())


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_a_nonfinite_key_still_resets_its_location(make_sim, tools, layout) -> None:
    """A new sequence's non-finite key lands where an old sequence's metadata is: the location
    (H2O) or page (Quest) is reset, so nothing of the old sequence survives there."""
    for case in ("h2o", "quest"):
        old = make_sim([37, 29], layout=layout, seed=1, **KW)
        sel = tools.make_selector(case)
        state = old.attach(sel)
        for _ in range(2):
            old.select(1)
            old.advance()
        old.release()
        new = make_sim([37, 29], layout=layout, seed=2, **KW)
        new.keys[1][0, :, 8] = float("nan")  # position 8: the first of a Quest page of 4
        new.attach(sel, state, checked=False)
        assert state.nonfinite_count() == 1
        loc = new.locations(state.row_stride)[0, 8]
        if case == "h2o":
            assert float(state.side["h2o_mass"][loc, 1].abs().sum()) == 0.0
            assert not bool(state.side["h2o_evicted"][loc, 1].any())
        else:
            page = state.side.pages_of(loc.view(1))
            keys = new.keys[1][0, :, 9:12].float()  # the page's finite keys
            assert torch.equal(state.side["quest_kmin"][page, 0][0].float(), keys.amin(1))
            assert torch.equal(state.side["quest_kmax"][page, 0][0].float(), keys.amax(1))


def test_checked_write_kv_raises_before_anything_changes(make_sim, tools) -> None:
    for case in ("h2o", "quest"):
        sim = make_sim([20], **KW)
        sel = tools.make_selector(case)
        state = sim.attach(sel)
        before = tools.snapshot(state)
        key = torch.randn(1, 2, 8)
        key[0, 1, 0] = float("inf")
        with pytest.raises(ValueError, match="non-finite"):
            sel.write_kv(state, 1, torch.tensor([3]), key, key, checked=True)
        tools.assert_same_state(before, tools.snapshot(state))
