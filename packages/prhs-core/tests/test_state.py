"""SequenceStatePool: the create/append/release lifecycle, and failed calls changing nothing."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from prhs_core import SequenceStatePool


def snapshot(pool: SequenceStatePool) -> dict[str, Any]:
    return {
        "active": pool.active_slots,
        "lengths": pool.lengths.clone(),
        "host_lengths": [pool.length(s) for s in range(pool.capacity)],
        "fields": {n: pool[n].clone() for n in pool.field_names},
        "names": pool.field_names,
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["active"] == b["active"]
    assert torch.equal(a["lengths"], b["lengths"])
    assert a["host_lengths"] == b["host_lengths"]
    assert a["names"] == b["names"]
    for n in a["fields"]:
        assert torch.equal(a["fields"][n], b["fields"][n]), n


def assert_lengths_agree(pool: SequenceStatePool) -> None:
    assert pool.lengths.tolist() == [pool.length(s) for s in range(pool.capacity)]


@pytest.fixture
def pool() -> SequenceStatePool:
    p = SequenceStatePool(6)
    p.add_field("anchor", (2, 3), torch.float32, fill=-1.0)
    p.add_field("count", (), torch.int64, fill=7)
    p.add_field("flag", (4,), torch.bool, fill=True)
    return p


def test_lifecycle_create_append_release(pool: SequenceStatePool) -> None:
    assert pool.active_slots == ()
    assert pool.lengths.dtype == torch.int64 and pool.lengths.shape == (6,)
    pool.create([4, 1], [3, 10])
    assert pool.active_slots == (1, 4)
    assert pool.is_active(1) and pool.is_active(4) and not pool.is_active(0)
    assert (pool.length(1), pool.length(4)) == (10, 3)
    pool.append([4])
    pool.append([1, 4], [2, 5])
    assert (pool.length(1), pool.length(4)) == (12, 9)
    assert_lengths_agree(pool)
    pool.release([1])
    assert pool.active_slots == (4,)
    assert pool.length(1) == 0 and pool.length(4) == 9
    assert_lengths_agree(pool)


def test_create_defaults_to_zero_and_accepts_tensors(pool: SequenceStatePool) -> None:
    pool.create(torch.tensor([0, 5], dtype=torch.int32))
    assert (pool.length(0), pool.length(5)) == (0, 0)
    pool.append(torch.tensor([5, 0]), torch.tensor([4, 1]))
    pool.append([0], 3)  # an int applies to every slot
    assert (pool.length(0), pool.length(5)) == (4, 4)
    pool.create([2, 3], torch.tensor([8, 9]))
    assert pool.lengths.tolist() == [4, 0, 8, 9, 0, 4]
    assert_lengths_agree(pool)


def test_slot_reuse_resets_only_that_slots_fields(pool: SequenceStatePool) -> None:
    pool.create([1, 2], [5, 6])
    pool["anchor"][[1, 2]] = torch.arange(12, dtype=torch.float32).view(2, 2, 3)
    pool["count"][[1, 2]] = torch.tensor([100, 200])
    pool["flag"][1] = False
    pool.release([1])
    pool.create([1], [3])
    assert torch.equal(pool["anchor"][1], torch.full((2, 3), -1.0))
    assert int(pool["count"][1]) == 7
    assert bool(pool["flag"][1].all())
    # Slot 2 lived through the reuse of slot 1 untouched.
    assert torch.equal(pool["anchor"][2], torch.arange(6, 12, dtype=torch.float32).view(2, 3))
    assert int(pool["count"][2]) == 200
    assert pool.length(1) == 3 and pool.length(2) == 6


def test_add_field_returns_the_pool_tensor_filled_for_every_slot(pool: SequenceStatePool) -> None:
    pool.create([0], [2])
    t = pool.add_field("score", (5,), torch.float16, fill=0.5)
    assert t is pool["score"]
    assert t.shape == (6, 5) and t.dtype == torch.float16
    assert bool((t == 0.5).all())
    assert "score" in pool and "nope" not in pool
    assert pool.field_names == ("anchor", "count", "flag", "score")
    t[0] = 2.0  # a write through the returned tensor is what the pool holds
    assert bool((pool["score"][0] == 2.0).all())


def test_release_all_frees_every_slot(pool: SequenceStatePool) -> None:
    pool.create([0, 3, 5], [1, 2, 3])
    pool.release_all()
    assert pool.active_slots == ()
    assert not pool.lengths.any()
    assert_lengths_agree(pool)
    pool.create([0, 3, 5], [4, 4, 4])  # every slot is free again
    assert pool.active_slots == (0, 3, 5)
    pool.release_all()
    pool.release_all()  # nothing live: a no-op
    assert pool.active_slots == ()


def test_empty_slot_lists_change_nothing(pool: SequenceStatePool) -> None:
    pool.create([2], [5])
    before = snapshot(pool)
    pool.create([])
    pool.append(torch.zeros(0, dtype=torch.long))
    pool.release([])
    assert_same(before, snapshot(pool))


def test_queries_outside_the_pool(pool: SequenceStatePool) -> None:
    assert not pool.is_active(6) and not pool.is_active(-1)
    with pytest.raises(ValueError, match=r"slot must lie in \[0, 6\), got 6"):
        pool.length(6)
    with pytest.raises(ValueError, match="slot must be >= 0, got -1"):
        pool.length(-1)
    with pytest.raises(
        KeyError, match=r"no field 'nope' in this pool; fields: \['anchor', 'count', 'flag'\]"
    ):
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


# -- failed calls leave the pool as it was --------------------------------------------------

# The pool before each bad call: slots 1 and 4 live (lengths 10 and 3), fields written.
BAD_CALLS = [
    ("create", ([1],), {}, ValueError, r"create: slots \[1\] are in use; release them first"),
    ("create", ([0, 4],), {"lengths": [1, 1]}, ValueError, r"create: slots \[4\] are in use"),
    ("create", ([6],), {}, ValueError, r"create: slots must lie in \[0, 6\), got \[6\]"),
    ("create", ([0, -1],), {}, ValueError, r"create: slots must lie in \[0, 6\), got \[-1\]"),
    ("create", ([0, 2, 0],), {}, ValueError, r"create: slots must be distinct, got \[0, 2, 0\]"),
    ("create", ([0, 2],), {"lengths": [3, -1]}, ValueError, r"lengths must be >= 0, got \[3, -1\]"),
    ("create", ([0, 2],), {"lengths": -2}, ValueError, "lengths must be >= 0"),
    (
        "create",
        ([0, 2],),
        {"lengths": [1, 2, 3]},
        ValueError,
        r"lengths must give one value per slot \(2\), got 3",
    ),
    (
        "create",
        ([0, 2],),
        {"lengths": torch.tensor([1])},
        ValueError,
        r"lengths must give one value per slot \(2\), got 1",
    ),
    (
        "create",
        ([0],),
        {"lengths": torch.tensor([1.5])},
        TypeError,
        "lengths must be an integer tensor",
    ),
    ("create", ([0],), {"lengths": True}, TypeError, "lengths must be an int, got bool"),
    ("create", ([0],), {"lengths": 2.5}, TypeError, "lengths must be an int, got float"),
    ("create", ([0, True],), {}, TypeError, "create: slot must be an int, got bool"),
    (
        "create",
        (torch.tensor([[0, 2]]),),
        {},
        ValueError,
        "create: slots must be a 1-D integer tensor",
    ),
    (
        "create",
        (torch.tensor([0.0]),),
        {},
        ValueError,
        "create: slots must be a 1-D integer tensor",
    ),
    ("append", ([0],), {}, ValueError, r"append: slots \[0\] hold no sequence; create them first"),
    ("append", ([1, 2, 4],), {}, ValueError, r"append: slots \[2\] hold no sequence"),
    ("append", ([1, 4],), {"num_tokens": [1, -1]}, ValueError, r"num_tokens must be >= 0"),
    (
        "append",
        ([1, 4],),
        {"num_tokens": [1]},
        ValueError,
        r"num_tokens must give one value per slot \(2\), got 1",
    ),
    ("append", ([1, 1],), {}, ValueError, r"append: slots must be distinct"),
    ("append", ([1, 7],), {}, ValueError, r"append: slots must lie in \[0, 6\), got \[7\]"),
    ("append", (torch.tensor([4, 1, 4]),), {}, ValueError, r"append: slots must be distinct"),
    ("release", ([0],), {}, ValueError, r"release: slots \[0\] hold no sequence"),
    ("release", ([1, 3],), {}, ValueError, r"release: slots \[3\] hold no sequence"),
    ("release", ([4, 4],), {}, ValueError, r"release: slots must be distinct"),
    ("release", ([-6],), {}, ValueError, r"release: slots must lie in \[0, 6\)"),
]


@pytest.mark.parametrize(
    ("op", "args", "kwargs", "error", "fragment"),
    BAD_CALLS,
    ids=[
        "create-busy",
        "create-some-busy",
        "create-slot=cap",
        "create-slot-neg",
        "create-dup",
        "create-len-neg",
        "create-len-int-neg",
        "create-too-many-lens",
        "create-too-few-lens-tensor",
        "create-len-float-tensor",
        "create-len-bool",
        "create-len-float",
        "create-slot-bool",
        "create-slots-2d",
        "create-slots-float",
        "append-idle",
        "append-some-idle",
        "append-neg",
        "append-count-mismatch",
        "append-dup",
        "append-out-of-range",
        "append-dup-tensor",
        "release-idle",
        "release-some-idle",
        "release-dup",
        "release-neg",
    ],
)
def test_bad_calls_raise_and_change_nothing(
    pool: SequenceStatePool, op: str, args: tuple, kwargs: dict, error: type, fragment: str
) -> None:
    pool.create([1, 4], [10, 3])
    pool["anchor"][1] = 5.0
    pool["count"][4] = 42
    before = snapshot(pool)
    with pytest.raises(error, match=fragment):
        getattr(pool, op)(*args, **kwargs)
    assert_same(before, snapshot(pool))


@pytest.mark.parametrize(
    ("name", "shape", "kwargs", "error", "fragment"),
    [
        ("anchor", (1,), {}, ValueError, "field 'anchor' already exists in this pool"),
        ("1abc", (1,), {}, ValueError, "field name must be an identifier, got '1abc'"),
        ("a-b", (1,), {}, ValueError, "field name must be an identifier, got 'a-b'"),
        ("", (1,), {}, ValueError, "field name must be an identifier, got ''"),
        (3, (1,), {}, ValueError, "field name must be an identifier, got 3"),
        ("neg", (2, -1), {}, ValueError, r"shape\[1\] of field 'neg' must be >= 0, got -1"),
        ("flt", (2.0,), {}, TypeError, r"shape\[0\] of field 'flt' must be an int"),
        ("dt", (2,), {"dtype": "float32"}, TypeError, "dtype must be a torch.dtype, got str"),
        ("fill", (2,), {"fill": "x"}, TypeError, "fill"),
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
    pool.create([2], [1])
    before = snapshot(pool)
    with pytest.raises(error, match=fragment):
        pool.add_field(name, shape, **kwargs)  # type: ignore[arg-type]
    assert_same(before, snapshot(pool))
    pool.create([3])  # the pool still works: every declared field has a tensor
    assert pool.active_slots == (2, 3)


@pytest.mark.parametrize("seed", range(4), ids=[f"seed{s}" for s in range(4)])
def test_random_operations_match_a_python_model(seed: int) -> None:
    rng = random.Random(seed)
    cap = 5
    pool = SequenceStatePool(cap)
    pool.add_field("x", (2,), torch.int32, fill=-3)
    model: dict[int, int] = {}  # slot -> length
    for _ in range(80):
        op = rng.choice(["create", "append", "release"])
        slots = rng.sample(range(cap), rng.randint(1, 3))
        counts = [rng.randint(0, 4) for _ in slots]
        before = snapshot(pool)
        busy = [s for s in slots if s in model]
        ok = not busy if op == "create" else len(busy) == len(slots)
        if ok:
            if op == "create":
                pool.create(slots, counts)
                model.update(zip(slots, counts, strict=True))
                assert bool((pool["x"][slots] == -3).all())
                pool["x"][slots] = rng.randint(0, 9)  # the selector writes its state
            elif op == "append":
                pool.append(slots, counts)
                for s, c in zip(slots, counts, strict=True):
                    model[s] += c
            else:
                pool.release(slots)
                for s in slots:
                    del model[s]
        else:
            with pytest.raises(ValueError, match=f"{op}: slots"):
                getattr(pool, op)(slots, counts) if op != "release" else pool.release(slots)
            assert_same(before, snapshot(pool))
        assert pool.active_slots == tuple(sorted(model))
        assert pool.lengths.tolist() == [model.get(s, 0) for s in range(cap)]
        assert_lengths_agree(pool)
