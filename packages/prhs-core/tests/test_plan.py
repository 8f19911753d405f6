"""DecodePlan: static buffers made once, ``update`` copies a step's metadata into them (padded
rows to the scratch slot), checked mode validates on the host, and a failed update changes
nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from prhs_core import DecodePlan, Selection, SelectorState, SequenceStatePool, SideCache, StepStats

I32 = torch.int32
CAP = 5


def make_state(device: str = "cpu") -> SelectorState:
    pool = SequenceStatePool(CAP, device=device)
    pool.add_field("anchor", (2,), torch.float32)
    side = SideCache(64, 4, device=device)
    side.add_page_field("bounds", (2, 3))
    return SelectorState(pool, side, row_stride=16, kv_page_size=4)


def make_plan(state: SelectorState, **kwargs: Any) -> DecodePlan:
    args: dict[str, Any] = {
        "batch_size": 3,
        "num_kv_heads": 2,
        "num_layers": 4,
        "width": 6,
        "block_size": 2,
        "scaling": 0.125,
        **kwargs,
    }
    return DecodePlan(state, **args)


def buffers(plan: DecodePlan) -> list[torch.Tensor]:
    """Every tensor a captured graph would hold a pointer to."""
    out = [plan.seq_lens, plan.slots, plan.selection.indices, plan.selection.counts]
    if plan.stats is not None:
        out += [plan.stats.retrieved, plan.stats.num_selected, plan.stats.proxy_bytes]
        out += [plan.stats.delta_hat] if plan.stats.delta_hat is not None else []
    if plan.totals is not None:
        out.append(plan.totals)
    return out


def snapshot(plan: DecodePlan) -> dict[str, Any]:
    return {
        "buffers": [t.clone() for t in buffers(plan)],
        "ids": [id(t) for t in buffers(plan)],
        "seeding": plan.seeding,
        "active": plan.state.pool.active_slots,
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["ids"] == b["ids"] and a["seeding"] == b["seeding"] and a["active"] == b["active"]
    for x, y in zip(a["buffers"], b["buffers"], strict=True):
        assert torch.equal(x, y)


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stats", "certified"), [(False, False), (True, False), (True, True)],
    ids=["no-stats", "stats", "certified"],
)  # fmt: skip
def test_buffers_have_static_shapes_and_dtypes(stats: bool, certified: bool) -> None:
    state = make_state()
    plan = make_plan(state, stats=stats, certified=certified)
    assert plan.state is state and plan.batch_size == 3 and plan.num_kv_heads == 2
    assert plan.num_layers == 4 and plan.scaling == 0.125 and plan.checked is False
    assert plan.seq_lens.dtype == I32 and plan.seq_lens.tolist() == [1, 1, 1]
    assert plan.slots.dtype == torch.int64 and plan.slots.tolist() == [CAP] * 3  # scratch
    sel = plan.selection
    assert isinstance(sel, Selection) and sel.width == 6 and sel.block_size == 2
    assert sel.indices.shape == (3, 2, 6) and sel.counts.shape == (3, 2)
    assert not sel.counts.any()
    assert plan.seeding is True  # before any update, every row may be new
    if stats:
        assert isinstance(plan.stats, StepStats) and plan.stats is sel.stats
        assert plan.stats.retrieved.shape == (3, 2)
        assert (plan.stats.delta_hat is not None) is certified
        assert plan.totals is not None and plan.totals.shape == (4, 4)
        assert plan.totals.dtype == torch.float64 and not plan.totals.any()
    else:
        assert plan.stats is None and plan.totals is None and plan.summary() == {}


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be >= 1"),
        ({"num_layers": 0}, ValueError, "num_layers must be >= 1"),
        ({"width": -1}, ValueError, "width must be >= 0, got -1"),
        ({"block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int, got float"),
        ({"scaling": 0.0}, ValueError, "scaling must be a positive finite float, got 0.0"),
        ({"scaling": -0.5}, ValueError, "scaling must be a positive finite float, got -0.5"),
        ({"scaling": math.nan}, ValueError, "scaling must be a positive finite float, got nan"),
        ({"scaling": math.inf}, ValueError, "scaling must be a positive finite float, got inf"),
        ({"scaling": True}, TypeError, "scaling must be a float, got bool"),
        ({"scaling": torch.tensor(0.5)}, TypeError, "scaling must be a float, got Tensor"),
    ],
    ids=[
        "B0",
        "Hkv0",
        "layers0",
        "width-neg",
        "block0",
        "B-float",
        "scaling-zero",
        "scaling-neg",
        "scaling-nan",
        "scaling-inf",
        "scaling-bool",
        "scaling-tensor",
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        make_plan(make_state(), **kwargs)


def test_constructor_rejects_a_state_that_is_not_a_selector_state() -> None:
    with pytest.raises(TypeError, match="state must be a SelectorState, got SequenceStatePool"):
        make_plan(SequenceStatePool(2))  # type: ignore[arg-type]


def test_an_int_scaling_is_stored_as_a_float() -> None:
    plan = make_plan(make_state(), scaling=1)
    assert plan.scaling == 1.0 and isinstance(plan.scaling, float)


# -- update ---------------------------------------------------------------------------------


@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize(
    ("lens_dtype", "slots_dtype"),
    [(I32, torch.int64), (torch.int64, I32), (I32, I32)],
    ids=["lens32-slots64", "lens64-slots32", "both32"],
)
def test_update_copies_into_the_same_buffers(
    checked: bool, lens_dtype: torch.dtype, slots_dtype: torch.dtype
) -> None:
    state = make_state()
    state.pool.create([0, 2, 4])
    plan = make_plan(state, stats=True, certified=True, checked=checked)
    ids = [id(t) for t in buffers(plan)]
    ptrs = [t.data_ptr() for t in buffers(plan)]
    steps = [
        ([7, 3, 12], [4, -1, 0]),  # a padded row in the middle
        ([8, 1, 13], [4, 2, 0]),
        ([9, 2, 1], [-1, -1, 2]),  # two padded rows: -1 is not a duplicate slot
    ]
    for lens, slots in steps:
        seq_lens = torch.tensor(lens, dtype=lens_dtype)
        slot_t = torch.tensor(slots, dtype=slots_dtype)
        plan.update(seq_lens, slot_t)
        assert plan.seq_lens.tolist() == lens and plan.seq_lens.dtype == I32
        assert plan.slots.tolist() == [s if s >= 0 else CAP for s in slots]
        assert plan.slots.dtype == torch.int64
        # Static: the very same tensors (a CUDA graph holds their addresses), same shapes.
        assert [id(t) for t in buffers(plan)] == ids
        assert [t.data_ptr() for t in buffers(plan)] == ptrs
        assert plan.selection.indices.shape == (3, 2, 6)
        # Copies, not views: the host may reuse its tensors after update.
        seq_lens.fill_(99)
        slot_t.fill_(1)
        assert plan.seq_lens.tolist() == lens
        assert plan.slots.tolist() == [s if s >= 0 else CAP for s in slots]


def test_unchecked_update_reads_no_values() -> None:
    # Unchecked is the graph path: it must not inspect values (a slot never created, a length
    # of 0), only copy them.
    plan = make_plan(make_state())
    plan.update(torch.tensor([0, 5, 2], dtype=I32), torch.tensor([3, 3, -7]))
    assert plan.seq_lens.tolist() == [0, 5, 2] and plan.slots.tolist() == [3, 3, CAP]


def test_seeding_follows_pool_creations() -> None:
    state = make_state()
    plan = make_plan(state)
    lens, slots = torch.tensor([4, 4, 4], dtype=I32), torch.tensor([0, 1, -1])
    state.pool.create([0, 1])
    plan.update(lens, slots)
    assert plan.seeding is True  # rows 0 and 1 are at their first step
    plan.update(lens, slots)
    assert plan.seeding is False
    state.pool.release([1])
    plan.update(lens, torch.tensor([0, -1, -1]))
    assert plan.seeding is False  # a release seeds nothing
    state.pool.create([3])
    plan.update(lens, torch.tensor([0, 3, -1]))
    assert plan.seeding is True


@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize(
    ("lens", "slots", "error", "fragment"),
    [
        (
            torch.tensor([4, 4], dtype=I32),
            torch.tensor([0, 1, 2]),
            ValueError,
            r"seq_lens must have shape \[B\] = \[3\], got \[2\]",
        ),
        (
            torch.tensor([4, 4, 4], dtype=I32),
            torch.tensor([0, 1]),
            ValueError,
            r"slots must have shape \[B\] = \[3\], got \[2\]",
        ),
        (
            torch.tensor([4.0, 4.0, 4.0]),
            torch.tensor([0, 1, 2]),
            TypeError,
            "seq_lens must be an integer tensor",
        ),
        (
            torch.tensor([4, 4, 4], dtype=I32),
            torch.tensor([0.0, 1.0, 2.0]),
            TypeError,
            "slots must be an integer tensor",
        ),
        (
            torch.tensor([[4, 4, 4]], dtype=I32),
            torch.tensor([0, 1, 2]),
            ValueError,
            "seq_lens must have 1 dimensions",
        ),
        (
            torch.tensor([4, 4, 4], dtype=I32),
            torch.tensor([[0, 1, 2]]),
            ValueError,
            "slots must have 1 dimensions",
        ),
        (
            torch.tensor([4, 4, 4], dtype=I32),
            torch.tensor([True, False, True]),
            TypeError,
            "slots must be an integer tensor",
        ),
    ],
    ids=["lens-B2", "slots-B2", "lens-float", "slots-float", "lens-2d", "slots-2d", "slots-bool"],
)
def test_update_rejects_bad_shapes_and_changes_nothing(
    checked: bool, lens: torch.Tensor, slots: torch.Tensor, error: type, fragment: str
) -> None:
    state = make_state()
    state.pool.create([0, 1, 2])
    plan = make_plan(state, stats=True, checked=checked)
    plan.update(torch.tensor([3, 5, 7], dtype=I32), torch.tensor([2, 0, 1]))
    state.pool.create([3])  # a pending creation the failed update must not consume
    before = snapshot(plan)
    with pytest.raises(error, match=fragment):
        plan.update(lens, slots)
    assert_same(before, snapshot(plan))
    plan.update(torch.tensor([4, 6, 8], dtype=I32), torch.tensor([2, 0, 3]))
    assert plan.seeding is True


@pytest.mark.parametrize(
    ("lens", "slots", "fragment"),
    [
        ([4, 4, 4], [0, 3, -1], r"slots \[3\] hold no sequence: create them before decoding"),
        ([4, 4, 4], [0, 2, 4], r"slots \[4\] hold no sequence"),  # released before the call
        ([4, 4, 4], [0, 1, 0], r"slots must be distinct, got \[0, 1, 0\]"),
        ([4, 4, 4], [1, 1, -1], r"slots must be distinct, got \[1, 1\]"),
        (
            [4, 0, 4],
            [0, 1, 2],
            r"seq_lens\[1\] = 0 is out of range: a decode step caches >= 1 token",
        ),
        ([-3, 4, 4], [0, 1, 2], r"seq_lens\[0\] = -3 is out of range"),
        (
            [4, 4, 4],
            [0, 1, CAP],
            rf"slots\[2\] = {CAP} is out of range: "
            rf"state slots \(-1: padded row\) \(\[-1, {CAP - 1}\]\)",
        ),
        ([4, 4, 4], [0, -2, 1], r"slots\[1\] = -2 is out of range"),
    ],
    ids=[
        "never-created",
        "released",
        "duplicate",
        "duplicate-with-padding",
        "len0",
        "len-neg",
        "slot=scratch",
        "slot-below-minus-one",
    ],
)
def test_checked_update_rejects_bad_values_and_changes_nothing(
    lens: list[int], slots: list[int], fragment: str
) -> None:
    state = make_state()
    state.pool.create([0, 1, 2, 4])
    state.pool.release([4])
    plan = make_plan(state, stats=True, checked=True)
    plan.update(torch.tensor([3, 5, 7], dtype=I32), torch.tensor([2, 0, 1]))
    state.pool.release([2])
    state.pool.create([2])  # a pending creation: the flag is up
    before = snapshot(plan)
    with pytest.raises(ValueError, match=fragment):
        plan.update(torch.tensor(lens, dtype=I32), torch.tensor(slots))
    assert_same(before, snapshot(plan))
    assert state.pool.take_created() is True  # the failed update did not consume it


# -- summary --------------------------------------------------------------------------------


def test_summary_of_the_running_totals() -> None:
    plan = make_plan(make_state(), stats=True)
    empty = plan.summary()
    assert empty["decisions"] == 0 and math.isnan(empty["retrieval_ratio"])
    assert math.isnan(empty["avg_selected"])
    # decisions, retrievals, selected positions, proxy bytes -- per layer.
    plan.totals.copy_(torch.tensor([[6, 3, 60, 100], [6, 0, 30, 0], [0, 0, 0, 0], [8, 1, 10, 5]]))
    s = plan.summary()
    assert (s["decisions"], s["retrievals"], s["selected"], s["proxy_bytes"]) == (20, 4, 100, 105)
    assert s["retrieval_ratio"] == pytest.approx(20.0)
    assert s["avg_selected"] == pytest.approx(5.0)


# -- the meta device ------------------------------------------------------------------------


def test_plan_and_update_on_the_meta_device() -> None:
    state = make_state("meta")
    assert state.device.type == "meta"
    plan = make_plan(state, stats=True, certified=True)
    assert all(t.device.type == "meta" for t in buffers(plan))
    ids = [id(t) for t in buffers(plan)]
    state.pool.create([0, 1])
    plan.update(
        torch.empty(3, dtype=I32, device="meta"), torch.empty(3, dtype=torch.int64, device="meta")
    )
    assert [id(t) for t in buffers(plan)] == ids
    assert plan.seq_lens.shape == (3,) and plan.slots.shape == (3,)
    assert plan.selection.indices.shape == (3, 2, 6) and plan.totals.shape == (4, 4)
    assert plan.seeding is True
    with pytest.raises(ValueError, match=r"slots must have shape \[B\] = \[3\], got \[4\]"):
        plan.update(
            torch.empty(3, dtype=I32, device="meta"),
            torch.empty(4, dtype=torch.int64, device="meta"),
        )


def test_seeding_is_exact_for_host_slots() -> None:
    """With slots on the CPU, a plan seeds only when one of its own rows is new, and a new
    sequence left out of a step is still seeded when it first decodes."""
    state = make_state()
    state.pool.create([0, 1])
    plan = make_plan(state)
    plan.update(torch.tensor([3, 3, 3], dtype=I32), torch.tensor([0, 1, -1]))
    assert plan.seeding is True
    plan.update(torch.tensor([4, 4, 4], dtype=I32), torch.tensor([0, 1, -1]))
    assert plan.seeding is False
    state.pool.create([3])
    plan.update(torch.tensor([5, 5, 5], dtype=I32), torch.tensor([0, 1, -1]))  # 3 not here
    assert plan.seeding is False
    plan.update(torch.tensor([6, 6, 6], dtype=I32), torch.tensor([0, 3, 1]))
    assert plan.seeding is True
    state.pool.create([2])
    state.pool.release([2])  # created and ended without a step: nothing to seed
    plan.update(torch.tensor([7, 7, 7], dtype=I32), torch.tensor([0, 3, 1]))
    assert plan.seeding is False
