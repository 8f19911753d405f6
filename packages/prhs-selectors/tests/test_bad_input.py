"""Bad input raises a clear error before anything changes: slots that hold no sequence, lie
past the pool or repeat (a checked plan), a cache whose batch differs from the plan's, a query
of another dtype, a layer out of range or a sliding layer, a plan made for another state or by
another selector, and bad ``write_kv`` calls."""

from __future__ import annotations

import pytest
import torch

from prhs_core.registry import selectors

TYPES = ("full", "sliding", "full")
KW = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "num_layers": 3, "layer_types": TYPES}


@pytest.fixture
def running(make_sim, tools, case):
    """A sim of two live sequences (slots 0 and 2 of 4) after one step, its state snapshot
    and a check that nothing changed."""
    sim = make_sim([30, 17], slots=[0, 2], capacity=4, max_new_tokens=2, **KW)
    sel = tools.make_selector(case)
    state = sim.attach(sel)
    sim.select(0)
    sim.select(2)
    sim.advance()
    sim.update()
    plan = sim.plan()
    before = tools.snapshot(state)
    meta = (plan.seq_lens.clone(), plan.slots.clone())

    def unchanged() -> None:
        tools.assert_same_state(before, tools.snapshot(state))
        assert torch.equal(plan.seq_lens, meta[0]) and torch.equal(plan.slots, meta[1])

    return sim, sel, state, plan, unchanged


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ([0, 1], r"slots \[1\] hold no sequence"),
        ([0, 4], r"slots\[1\] = 4 is out of range"),
        ([0, 7], r"slots\[1\] = 7 is out of range"),
        ([-2, 0], r"slots\[0\] = -2 is out of range"),
        ([2, 2], "slots must be distinct"),
    ],
    ids=["never-created", "past-the-pool", "far-past", "below-padding", "duplicate"],
)
def test_checked_plan_rejects_bad_slots(running, slots, match) -> None:
    sim, _, state, plan, unchanged = running
    with pytest.raises(ValueError, match=match):
        plan.update(sim.seq_lens(), torch.tensor(slots))
    unchanged()
    # A released slot holds no sequence either.
    state.pool.release([2])
    with pytest.raises(ValueError, match=r"slots \[2\] hold no sequence"):
        plan.update(sim.seq_lens(), torch.tensor([0, 2]))


def test_plan_rejects_bad_shapes_and_lengths(running) -> None:
    sim, _, _, plan, unchanged = running
    with pytest.raises(ValueError, match=r"slots must have shape \[B\] = \[2\]"):
        plan.update(sim.seq_lens(), torch.tensor([0]))
    with pytest.raises(TypeError, match="seq_lens must be an integer tensor"):
        plan.update(sim.seq_lens().float(), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="seq_lens"):
        plan.update(torch.tensor([30, 0], dtype=torch.int32), torch.tensor([0, 2]))
    unchanged()


def test_select_rejects_a_cache_of_another_batch_size(make_sim, running) -> None:
    _, sel, state, plan, unchanged = running
    one = make_sim([31], max_new_tokens=2, **KW)
    with pytest.raises(ValueError, match="plan was made for batch_size=2"):
        sel.select(plan, 0, one.queries[0], one.kv(0), state)
    unchanged()


def test_select_rejects_a_query_of_another_dtype(running) -> None:
    sim, sel, state, plan, unchanged = running
    with pytest.raises(TypeError, match="cast the query to the cache dtype"):
        sel.select(plan, 0, sim.queries[0].double(), sim.kv(0), state)
    with pytest.raises(TypeError, match="query must be a floating-point tensor"):
        sel.select(plan, 0, sim.queries[0].long(), sim.kv(0), state)
    unchanged()


@pytest.mark.parametrize(
    ("layer", "error", "match"),
    [
        (3, ValueError, "layer 3 is out of range for 3 layers"),
        (-1, ValueError, "layer must be >= 0"),
        (1, ValueError, "layer 1 is a sliding-window layer"),
        (1.0, TypeError, "layer must be an int"),
    ],
    ids=["past", "negative", "sliding", "float"],
)
def test_select_rejects_a_bad_layer(running, layer, error, match) -> None:
    sim, sel, state, plan, unchanged = running
    with pytest.raises(error, match=match):
        sel.select(plan, layer, sim.queries[0], sim.kv(0), state)
    unchanged()


def test_select_rejects_a_plan_of_another_state_or_selector(tools, case, running) -> None:
    sim, sel, state, _, unchanged = running
    other_state = tools.make_selector(case).init_state(sim.spec, capacity=4, max_seq_len=64)
    foreign = sel.make_plan(other_state, batch_size=2, scaling=sim.scaling, checked=True)
    with pytest.raises(ValueError, match="plan was made for another state"):
        sel.select(foreign, 0, sim.queries[0], sim.kv(0), state)
    other = selectors.create("oracle", budget=50, n_sink=1, n_local=1)
    other.init_state(sim.spec, capacity=4, max_seq_len=64)
    theirs = other.make_plan(state, batch_size=2, scaling=sim.scaling, checked=True)
    theirs.update(sim.seq_lens(), sim.slots_tensor())
    with pytest.raises(ValueError, match="plan was made by another selector"):
        sel.select(theirs, 0, sim.queries[0], sim.kv(0), state)
    with pytest.raises(TypeError, match="plan must be a DecodePlan"):
        sel.select(object(), 0, sim.queries[0], sim.kv(0), state)
    unchanged()


def test_checked_select_rejects_lengths_that_differ_from_the_plan(running) -> None:
    sim, sel, state, plan, unchanged = running
    lens = sim.seq_lens() - 1
    with pytest.raises(ValueError, match=r"kv\.seq_lens differ from the plan's"):
        sel.select(plan, 0, sim.queries[0], sim.kv(0, lens), state)
    unchanged()


def test_write_kv_rejects_bad_calls(running) -> None:
    _, sel, state, _, unchanged = running
    loc = torch.tensor([0, 1])
    key = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        sel.write_kv(state, 3, loc, key, key)
    with pytest.raises(ValueError, match="must have n=2 rows"):
        sel.write_kv(state, 0, loc, key[:1], key)
    with pytest.raises(ValueError, match="Hkv=2"):
        sel.write_kv(state, 0, loc, torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match="locations must be an integer tensor"):
        sel.write_kv(state, 0, loc.float(), key, key)
    unchanged()


def test_select_before_init_state_is_a_clear_error(tools, case) -> None:
    sel = tools.make_selector(case)
    with pytest.raises(RuntimeError, match=r"call init_state\(...\) first"):
        sel.make_plan(None, batch_size=1, scaling=1.0)


def test_a_contiguous_cache_with_more_rows_than_the_state_is_rejected(make_sim, tools, case):
    """Side caches of a contiguous layout hold ``capacity`` rows: a wider cache would index
    past them (on a GPU, a device-side assert)."""
    sim = make_sim([30, 17, 9], slots=[0, -1, 2], capacity=3, **KW)
    sel = tools.make_selector(case)
    small = sel.init_state(sim.spec, capacity=2, max_seq_len=sim.t_cap, kv_dtype=sim.dtype)
    small.pool.create([0, 1])
    plan = sel.make_plan(small, batch_size=3, scaling=sim.scaling, checked=True)
    plan.update(sim.seq_lens(), torch.tensor([0, -1, 1]))
    if small.side is None:  # nothing indexed by batch row: any width works
        sel.select(plan, 0, sim.queries[0], sim.kv(0), small)
        return
    before = tools.snapshot(small)
    with pytest.raises(ValueError, match="the contiguous cache holds 3 rows but the state's"):
        sel.select(plan, 0, sim.queries[0], sim.kv(0), small)
    # ... and a checked host's write_kv names the location that does not exist.
    loc = sim.locations(small.row_stride)[2, :1]
    key = sim.keys[0][2, :, :1].transpose(0, 1)
    with pytest.raises(ValueError, match=r"locations\[0\] = \d+ is out of range"):
        sel.write_kv(small, 0, loc, key, key, checked=True)
    tools.assert_same_state(before, tools.snapshot(small))


def test_a_contiguous_cache_longer_than_the_state_rows_is_rejected(make_sim, tools, case):
    """A contiguous side-cache row holds ``row_stride`` positions: a longer cache would write
    its tail into the next row's locations."""
    sim = make_sim([300, 17], capacity=2, **KW)
    sel = tools.make_selector(case)
    short = sel.init_state(sim.spec, capacity=2, max_seq_len=200, kv_dtype=sim.dtype)
    short.pool.create([0, 1])
    plan = sel.make_plan(short, batch_size=2, scaling=sim.scaling)
    plan.update(sim.seq_lens(), torch.tensor([0, 1]))
    kv = sim.kv(0)
    if short.side is None or kv.max_len <= short.row_stride:
        return  # nothing indexed by position, or the cache fits
    before = tools.snapshot(short)
    with pytest.raises(ValueError, match="positions but the state's side cache rows hold 256"):
        sel.select(plan, 0, sim.queries[0], kv, short)
    tools.assert_same_state(before, tools.snapshot(short))
