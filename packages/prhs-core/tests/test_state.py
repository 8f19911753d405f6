"""SequenceStatePool (create/release lifecycle, scratch slot, take_created), SideCache (scratch
rows, page fields) and SelectorState; a failed call changes nothing."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from prhs_core import SelectorState, SequenceStatePool, SideCache

CAP = 6


def snapshot(pool: SequenceStatePool) -> dict[str, Any]:
    return {
        "active": pool.active_slots,
        "names": pool.field_names,
        "fields": {n: pool[n].clone() for n in pool.field_names},
        "rows": pool.rows,
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["active"] == b["active"]
    assert a["names"] == b["names"]
    assert a["rows"] == b["rows"]
    for n in a["fields"]:
        assert torch.equal(a["fields"][n], b["fields"][n]), n


@pytest.fixture
def pool() -> SequenceStatePool:
    p = SequenceStatePool(CAP)
    p.add_field("anchor", (2, 3), torch.float32, fill=-1.0)
    p.add_field("count", (), torch.int64, fill=7)
    p.add_field("flag", (4,), torch.bool, fill=True)
    return p


# -- SequenceStatePool ----------------------------------------------------------------------


def test_fields_have_a_row_per_slot_plus_scratch(pool: SequenceStatePool) -> None:
    assert pool.capacity == CAP and pool.rows == CAP + 1 and pool.scratch_slot == CAP
    assert pool["anchor"].shape == (CAP + 1, 2, 3)
    assert pool["count"].shape == (CAP + 1,) and pool["count"].dtype == torch.int64
    assert bool((pool["count"] == 7).all()) and bool(pool["flag"].all())
    assert pool.device == torch.device("cpu")
    assert pool.active_slots == () and pool.num_active == 0


def test_lifecycle_create_and_release(pool: SequenceStatePool) -> None:
    pool.create([4, 1])
    assert pool.active_slots == (1, 4) and pool.num_active == 2
    assert pool.is_active(1) and pool.is_active(4) and not pool.is_active(0)
    pool.create(torch.tensor([0, 5], dtype=torch.int32))
    pool.create(torch.tensor([2]))  # int64 tensors too
    assert pool.active_slots == (0, 1, 2, 4, 5)
    pool.release([1])
    pool.release(torch.tensor([5, 0], dtype=torch.int32))
    assert pool.active_slots == (2, 4) and not pool.is_active(1)
    pool.create([1])  # a released slot is free again
    assert pool.active_slots == (1, 2, 4)


def test_scratch_slot_is_never_active(pool: SequenceStatePool) -> None:
    pool.create(list(range(CAP)))  # every request slot
    assert pool.scratch_slot not in pool.active_slots
    assert not pool.is_active(pool.scratch_slot)
    for op in (pool.create, pool.release):
        with pytest.raises(ValueError, match=rf"slots must lie in \[0, {CAP}\) .*got \[{CAP}\]"):
            op([pool.scratch_slot])
    pool.release_all()
    assert pool.active_slots == ()


def test_slot_reuse_resets_only_that_slots_fields(pool: SequenceStatePool) -> None:
    pool.create([1, 2])
    pool["anchor"][[1, 2]] = torch.arange(12, dtype=torch.float32).view(2, 2, 3)
    pool["count"][[1, 2]] = torch.tensor([100, 200])
    pool["flag"][1] = False
    pool["count"][pool.scratch_slot] = -9  # padded rows wrote here
    pool.release([1])
    assert int(pool["count"][1]) == 100  # release resets nothing: create does
    pool.create([1])
    assert torch.equal(pool["anchor"][1], torch.full((2, 3), -1.0))
    assert int(pool["count"][1]) == 7
    assert bool(pool["flag"][1].all())
    # Slot 2 and the scratch row lived through the reuse of slot 1 untouched.
    assert torch.equal(pool["anchor"][2], torch.arange(6, 12, dtype=torch.float32).view(2, 3))
    assert int(pool["count"][2]) == 200
    assert int(pool["count"][pool.scratch_slot]) == -9


def test_take_created_reports_each_creation_once(pool: SequenceStatePool) -> None:
    assert pool.take_created() is False  # a new pool has created nothing
    pool.create([3])
    assert pool.take_created() is True
    assert pool.take_created() is False  # taken
    pool.create([0])
    pool.create([1])
    assert pool.take_created() is True and pool.take_created() is False  # two creates: once
    pool.release([0])
    pool.release_all()
    pool.create([])
    assert pool.take_created() is False  # release and empty creates create nothing
    with pytest.raises(ValueError):
        pool.create([CAP])
    assert pool.take_created() is False  # nor does a failed create


def test_add_field_returns_the_pool_tensor_filled_for_every_row(pool: SequenceStatePool) -> None:
    pool.create([0])
    t = pool.add_field("score", (5,), torch.float16, fill=0.5)
    assert t is pool["score"]
    assert t.shape == (CAP + 1, 5) and t.dtype == torch.float16
    assert bool((t == 0.5).all())
    assert "score" in pool and "nope" not in pool
    assert pool.field_names == ("anchor", "count", "flag", "score")
    t[0] = 2.0  # a write through the returned tensor is what the pool holds
    assert bool((pool["score"][0] == 2.0).all())


def test_release_all_frees_every_slot(pool: SequenceStatePool) -> None:
    pool.create([0, 3, 5])
    pool.release_all()
    assert pool.active_slots == ()
    pool.create([0, 3, 5])  # every slot is free again
    assert pool.active_slots == (0, 3, 5)
    pool.release_all()
    pool.release_all()  # nothing live: a no-op
    assert pool.active_slots == ()


def test_empty_slot_lists_change_nothing(pool: SequenceStatePool) -> None:
    pool.create([2])
    pool.take_created()
    before = snapshot(pool)
    pool.create([])
    pool.create(torch.zeros(0, dtype=torch.long))
    pool.release([])
    assert_same(before, snapshot(pool))
    assert pool.take_created() is False


def test_queries_outside_the_pool(pool: SequenceStatePool) -> None:
    assert not pool.is_active(CAP) and not pool.is_active(-1) and not pool.is_active(100)
    with pytest.raises(TypeError, match="slot must be an int, got bool"):
        pool.is_active(True)
    with pytest.raises(KeyError, match=r"no field 'nope'; fields: \['anchor', 'count', 'flag'\]"):
        pool["nope"]


@pytest.mark.parametrize(
    ("capacity", "error", "fragment"),
    [
        (0, ValueError, "capacity must be >= 1, got 0"),
        (True, TypeError, "capacity must be an int, got bool"),
        (2.0, TypeError, "capacity must be an int"),
    ],
    ids=["zero", "bool", "float"],
)
def test_capacity_must_be_a_positive_int(capacity: object, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        SequenceStatePool(capacity)  # type: ignore[arg-type]


# The pool before each bad call: slots 1 and 4 live, fields written, the created flag taken.
BAD_CALLS = [
    ("create", [1], ValueError, r"create: slots \[1\] are in use; release them first"),
    ("create", [0, 4], ValueError, r"create: slots \[4\] are in use"),
    (
        "create",
        [6],
        ValueError,
        r"create: slots must lie in \[0, 6\) \(the pool's capacity\), got \[6\]",
    ),
    ("create", [0, -1], ValueError, r"create: slots must lie in \[0, 6\) .*got \[-1\]"),
    ("create", [0, 2, 0], ValueError, r"create: slots must be distinct, got \[0, 2, 0\]"),
    ("create", [0, True], TypeError, "create: slot must be an int, got bool"),
    ("create", [0, 2.0], TypeError, "create: slot must be an int, got float"),
    ("create", torch.tensor([[0, 2]]), ValueError, "create: slots must be a 1-D integer tensor"),
    ("create", torch.tensor([0.0]), ValueError, "create: slots must be a 1-D integer tensor"),
    ("create", torch.tensor([True]), ValueError, "create: slots must be a 1-D integer tensor"),
    ("create", torch.tensor([0, 3, 0]), ValueError, "create: slots must be distinct"),
    ("release", [0], ValueError, r"release: slots \[0\] hold no sequence"),
    ("release", [1, 3], ValueError, r"release: slots \[3\] hold no sequence"),
    ("release", [4, 4], ValueError, "release: slots must be distinct"),
    ("release", [-6], ValueError, r"release: slots must lie in \[0, 6\)"),
    (
        "release",
        torch.tensor([1, 9]),
        ValueError,
        r"release: slots must lie in \[0, 6\) .*got \[9\]",
    ),
]


@pytest.mark.parametrize(
    ("op", "slots", "error", "fragment"),
    BAD_CALLS,
    ids=[
        "create-busy",
        "create-some-busy",
        "create-scratch",
        "create-neg",
        "create-dup",
        "create-bool",
        "create-float",
        "create-2d-tensor",
        "create-float-tensor",
        "create-bool-tensor",
        "create-dup-tensor",
        "release-idle",
        "release-some-idle",
        "release-dup",
        "release-neg",
        "release-out-of-range-tensor",
    ],
)
def test_bad_calls_raise_and_change_nothing(
    pool: SequenceStatePool, op: str, slots: object, error: type, fragment: str
) -> None:
    pool.create([1, 4])
    pool["anchor"][1] = 5.0
    pool["count"][4] = 42
    pool.take_created()
    before = snapshot(pool)
    with pytest.raises(error, match=fragment):
        getattr(pool, op)(slots)
    assert_same(before, snapshot(pool))
    assert pool.take_created() is False


@pytest.mark.parametrize(
    ("name", "shape", "kwargs", "error", "fragment"),
    [
        ("anchor", (1,), {}, ValueError, "field 'anchor' already exists"),
        ("1abc", (1,), {}, ValueError, "field name must be an identifier, got '1abc'"),
        ("a-b", (1,), {}, ValueError, "field name must be an identifier, got 'a-b'"),
        ("", (1,), {}, ValueError, "field name must be an identifier, got ''"),
        (3, (1,), {}, ValueError, "field name must be an identifier, got 3"),
        ("neg", (2, -1), {}, ValueError, r"shape\[1\] of field 'neg' must be >= 0, got -1"),
        ("flt", (2.0,), {}, TypeError, r"shape\[0\] of field 'flt' must be an int"),
        ("dt", (2,), {"dtype": "float32"}, TypeError, "dtype must be a torch.dtype, got str"),
        ("fill", (2,), {"fill": "x"}, TypeError, "fill_value"),
    ],
    ids=[
        "duplicate",
        "digit-first",
        "dash",
        "empty",
        "not-str",
        "neg-dim",
        "float-dim",
        "dtype-str",
        "bad-fill",
    ],
)
def test_bad_add_field_raises_and_changes_nothing(
    pool: SequenceStatePool, name: object, shape: tuple, kwargs: dict, error: type, fragment: str
) -> None:
    pool.create([2])
    before = snapshot(pool)
    with pytest.raises(error, match=fragment):
        pool.add_field(name, shape, **kwargs)  # type: ignore[arg-type]
    assert_same(before, snapshot(pool))
    pool.create([3])  # the pool still works: every declared field has a tensor
    assert pool.active_slots == (2, 3)


@pytest.mark.parametrize("seed", range(4), ids=[f"seed{s}" for s in range(4)])
def test_random_operations_match_a_python_model(seed: int) -> None:
    rng = random.Random(seed)
    pool = SequenceStatePool(CAP)
    x = pool.add_field("x", (2,), torch.int32, fill=-3)
    live: set[int] = set()
    written: dict[int, int] = {}  # slot -> value the "selector" wrote
    for _ in range(80):
        op = rng.choice(["create", "release"])
        slots = rng.sample(range(CAP), rng.randint(1, 3))
        before = snapshot(pool)
        busy = [s for s in slots if s in live]
        if (op == "create" and not busy) or (op == "release" and len(busy) == len(slots)):
            getattr(pool, op)(slots)
            if op == "create":
                live.update(slots)
                assert pool.take_created() is True
                assert bool((x[slots] == -3).all())  # fresh state
                for s in slots:
                    written[s] = rng.randint(0, 9)
                    x[s] = written[s]
            else:
                live.difference_update(slots)
        else:
            with pytest.raises(ValueError, match=f"{op}: slots"):
                getattr(pool, op)(slots)
            assert_same(before, snapshot(pool))
            assert pool.take_created() is False
        assert pool.active_slots == tuple(sorted(live))
        for s in live:  # live state survives everyone else's lifecycle
            assert x[s].tolist() == [written[s]] * 2


def test_nbytes_from_shapes_on_the_meta_device() -> None:
    pool = SequenceStatePool(5, device="meta")
    pool.add_field("q", (4, 8), torch.bfloat16)  # 64 bytes a row
    pool.add_field("n", (3,), torch.int64)  # 24 bytes a row
    assert pool["q"].device.type == "meta" and pool.device == torch.device("meta")
    assert pool.nbytes() == 6 * (64 + 24)
    assert pool.nbytes_per_request() == 64 + 24
    pool.create([0, 4])  # host bookkeeping works without device values
    assert pool.active_slots == (0, 4) and pool.take_created() is True
    pool.release([4])
    assert pool.active_slots == (0,)


# -- SideCache ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "page", "pages"), [(10, 1, 10), (10, 4, 3), (12, 4, 3), (5, 8, 1)],
    ids=["N10-p1", "N10-p4", "N12-p4", "N5-p8"],
)  # fmt: skip
def test_side_cache_rows_and_page_rows(n: int, page: int, pages: int) -> None:
    side = SideCache(n, page)
    assert side.num_locations == n and side.page_size == page and side.num_pages == pages
    assert side.scratch_location == n and side.scratch_page == pages
    tok = side.add_field("score", (2,), torch.float32, fill=1.5)
    pg = side.add_page_field("bounds", (2, 3), torch.float16, fill=-2)
    assert tok.shape == (n + 1, 2) and pg.shape == (pages + 1, 2, 3)
    assert pg.dtype == torch.float16 and bool((pg == -2).all()) and bool((tok == 1.5).all())
    # A token field declared after a page field still has a row per location.
    assert side.add_field("later", ()).shape == (n + 1,)
    assert side.nbytes() == (n + 1) * 2 * 4 + (pages + 1) * 6 * 2 + (n + 1) * 4
    assert side.field_names == ("score", "bounds", "later")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("page", [1, 3, 4], ids=lambda p: f"page{p}")
def test_rows_of_and_pages_of_send_minus_one_to_scratch(page: int, dtype: torch.dtype) -> None:
    side = SideCache(10, page)
    loc = torch.tensor([0, 9, -1, 3, 4, -1, 7], dtype=dtype)
    rows, pages = side.rows_of(loc), side.pages_of(loc)
    assert rows.dtype == torch.int64 and pages.dtype == torch.int64
    assert rows.tolist() == [x if x >= 0 else 10 for x in loc.tolist()]
    assert pages.tolist() == [x // page if x >= 0 else side.num_pages for x in loc.tolist()]
    assert loc.dtype == dtype  # the input is not converted in place


def test_writes_through_rows_of_touch_only_the_listed_rows_and_scratch() -> None:
    side = SideCache(6, 2)
    score = side.add_field("score", ())
    bound = side.add_page_field("bound", (), fill=-1.0)
    loc = torch.tensor([4, -1, 1, -1])
    score[side.rows_of(loc)] = torch.tensor([1.0, 2.0, 3.0, 2.0])
    bound[side.pages_of(loc)] = torch.tensor([5.0, 6.0, 7.0, 6.0])
    assert score.tolist() == [0, 3, 0, 0, 1, 0, 2]  # row 6 is scratch
    assert bound.tolist() == [7, -1, 5, 6]  # page row 3 is scratch


@pytest.mark.parametrize(
    ("args", "error", "fragment"),
    [
        ((0,), ValueError, "num_locations must be >= 1, got 0"),
        ((4, 0), ValueError, "page_size must be >= 1, got 0"),
        ((True,), TypeError, "num_locations must be an int, got bool"),
        ((4, 2.0), TypeError, "page_size must be an int, got float"),
    ],
    ids=["N0", "page0", "N-bool", "page-float"],
)
def test_side_cache_rejects_bad_sizes(args: tuple, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        SideCache(*args)


@pytest.mark.parametrize(
    ("method", "name", "shape", "fragment"),
    [
        ("add_page_field", "score", (1,), "field 'score' already exists"),
        ("add_field", "bounds", (1,), "field 'bounds' already exists"),
        ("add_page_field", "neg", (-1,), r"shape\[0\] of field 'neg' must be >= 0"),
    ],
    ids=["page-dup-of-token", "token-dup-of-page", "page-neg-dim"],
)
def test_bad_side_fields_change_nothing(
    method: str, name: str, shape: tuple, fragment: str
) -> None:
    side = SideCache(10, 4)
    side.add_field("score", ())
    side.add_page_field("bounds", (2,))
    before = (side.field_names, side.nbytes(), side.rows)
    with pytest.raises(ValueError, match=fragment):
        getattr(side, method)(name, shape)
    assert (side.field_names, side.nbytes(), side.rows) == before
    assert side.add_field("after", ()).shape == (11,)  # rows restored after a failed page field


# -- SelectorState --------------------------------------------------------------------------


def test_selector_state_defaults_and_sizes() -> None:
    pool = SequenceStatePool(3)
    pool.add_field("a", (4,), torch.float32)  # 16 bytes a row
    side = SideCache(8, 4)
    side.add_field("s", (), torch.float64)  # 9 rows of 8 bytes
    state = SelectorState(pool, side, row_stride=4)
    assert state.kv_page_size == 1 and state.device == torch.device("cpu")
    assert state.nonfinite.shape == (1,) and state.nonfinite.dtype == torch.int64
    assert state.nonfinite_count() == 0
    state.nonfinite.add_(3)
    assert state.nonfinite_count() == 3
    assert state.nbytes() == {"per_request": 16, "side_cache": 72}
    assert SelectorState(pool, None, row_stride=1).nbytes() == {"per_request": 16, "side_cache": 0}


def test_selector_state_counter_follows_the_pool_device() -> None:
    pool = SequenceStatePool(2, device="meta")
    pool.add_field("a", (2,), torch.float16)
    side = SideCache(16, 4, device="meta")
    side.add_page_field("b", (3,), torch.float32)
    state = SelectorState(pool, side, row_stride=8, kv_page_size=4)
    assert state.nonfinite.device.type == "meta" and state.device.type == "meta"
    assert state.nbytes() == {"per_request": 4, "side_cache": 5 * 12}


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"row_stride": 0}, ValueError, "row_stride must be >= 1, got 0"),
        ({"row_stride": True}, TypeError, "row_stride must be an int, got bool"),
        ({"kv_page_size": 0}, ValueError, "kv_page_size must be >= 1, got 0"),
        ({"kv_page_size": 1.0}, TypeError, "kv_page_size must be an int, got float"),
    ],
    ids=["stride0", "stride-bool", "page0", "page-float"],
)
def test_selector_state_rejects_bad_geometry(kwargs: dict, error: type, fragment: str) -> None:
    fields = {"pool": SequenceStatePool(2), "side": None, "row_stride": 4, **kwargs}
    with pytest.raises(error, match=fragment):
        SelectorState(**fields)


def test_side_cache_tables_are_not_indexed_by_location():
    from prhs_core.state import SideCache

    side = SideCache(10, page_size=2)
    t = side.add_table("centre", (3, 4), torch.float32, 1.5)
    assert t.shape == (3, 4) and side["centre"].shape == (3, 4) and bool((t == 1.5).all())
    assert "centre" in side.field_names and side.nbytes() == 3 * 4 * 4
    side.add_field("rows", (2,), torch.int8)
    assert side["rows"].shape == (11, 2)  # location fields keep their rows
    assert side.initialized == set()
    with pytest.raises(ValueError, match="already exists"):
        side.add_table("centre", (1,))
