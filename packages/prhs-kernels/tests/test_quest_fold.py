"""``prhs_kernels.quest.fold_page_bounds`` without a GPU: the torch path against a plain reading
of the fold (a page's first location resets it, finite keys fold in, non-finite ones are
counted), keys given as rows or read from a cache at columns, the Triton path's one launch
(caught on the CPU) and its sm_90 compile, the torch path for writes too long for one launch,
and bad input refused before any write. The Triton path against the torch path runs under the
interpreter (``interpreted/test_quest_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.quest import fold_page_bounds

P, HKV, D = 4, 2, 8


def _fields(n_loc: int, gen: torch.Generator, dtype=torch.bfloat16):
    """``[R, 3, Hkv, D]`` minima and maxima of earlier writes (random, finite), the last row
    scratch; a test folds into layer 1's strided view."""
    rows = -(-n_loc // P) + 1
    lo = torch.randn(rows, 3, HKV, D, generator=gen).to(dtype)
    return lo, lo + 1.0


def _plain(lo, hi, locs, keys, written):
    """The fold read plainly, page by page: ``(lo, hi, count)``."""
    lo, hi = lo.clone(), hi.clone()
    count = 0
    pages: dict[int, list[int]] = {}
    for i, (loc, ok) in enumerate(zip(locs, written, strict=True)):
        if ok:
            pages.setdefault(loc // P, []).append(i)
            count += int(not bool(torch.isfinite(keys[i]).all()))
    for page, rows in pages.items():
        if any(locs[i] % P == 0 for i in rows):
            lo[page], hi[page] = float("inf"), float("-inf")
        for i in rows:
            if bool(torch.isfinite(keys[i]).all()):
                lo[page] = torch.minimum(lo[page], keys[i].to(lo.dtype))
                hi[page] = torch.maximum(hi[page], keys[i].to(hi.dtype))
    return lo, hi, count


@pytest.mark.parametrize("given", ["rows", "columns"])
def test_the_torch_path_resets_first_locations_and_folds_finite_keys(given):
    gen = torch.Generator().manual_seed(0)
    lo, hi = _fields(64, gen)
    # Page 2 gets its first location (reset) among others, page 4 only later ones (folded into
    # what it held), page 10 one key that is not finite at its first location (reset, not
    # folded), page 7 a non-finite key mid-page; one row writes nowhere.
    locs = [9, 8, 10, 17, -1, 40, 29, 30]
    keys = torch.randn(len(locs), HKV, D, generator=gen).to(torch.bfloat16)
    keys[5, 1, 3] = float("nan")
    keys[7, 0, 0] = float("-inf")
    written = [x >= 0 for x in locs]
    want_lo, want_hi, want_n = _plain(lo[:, 1], hi[:, 1], locs, keys, written)
    count = torch.zeros(1, dtype=torch.int64)
    kw = {}
    key = keys
    if given == "columns":  # a cache [N, Hkv, T, D] whose row i holds its key at column c_i
        cols = torch.randint(0, 6, (len(locs),), generator=gen)
        key = torch.randn(len(locs), HKV, 6, D, generator=gen).to(torch.bfloat16)
        key[torch.arange(len(locs)), :, cols] = keys
        kw = {"columns": cols}
    fold_page_bounds(
        lo[:, 1], hi[:, 1], torch.tensor(locs), key, page_size=P, nonfinite=count, **kw
    )
    assert want_n == 2 and int(count) == want_n
    assert torch.equal(lo[:-1, 1], want_lo[:-1]) and torch.equal(hi[:-1, 1], want_hi[:-1])
    assert bool(torch.isinf(lo[10, 1]).all()) and bool(torch.isinf(hi[10, 1]).all())


def test_a_column_outside_the_cache_writes_nothing():
    gen = torch.Generator().manual_seed(1)
    lo, hi = _fields(32, gen)
    before = (lo.clone(), hi.clone())
    key = torch.full((2, HKV, 5, D), float("nan"), dtype=torch.bfloat16)
    count = torch.zeros(1, dtype=torch.int64)
    cols = torch.tensor([5, -1])
    fold_page_bounds(
        lo[:, 1], hi[:, 1], torch.tensor([4, 9]), key, page_size=P, columns=cols, nonfinite=count
    )
    assert int(count) == 0
    assert torch.equal(lo[:-1], before[0][:-1]) and torch.equal(hi[:-1], before[1][:-1])


def test_given_finite_flags_are_used_and_nothing_is_counted():
    gen = torch.Generator().manual_seed(2)
    lo, hi = _fields(32, gen)
    keys = torch.randn(2, HKV, D, generator=gen).to(torch.bfloat16)
    count = torch.zeros(1, dtype=torch.int64)
    finite = torch.tensor([True, False])  # the host's flags: row 1 is left out though finite
    fold_page_bounds(
        lo[:, 1], hi[:, 1], torch.tensor([8, 9]), keys, page_size=P, finite=finite,
        nonfinite=count,
    )  # fmt: skip
    assert int(count) == 0
    assert torch.equal(lo[2, 1], keys[0]) and torch.equal(hi[2, 1], keys[0])


@pytest.mark.parametrize("given", ["rows", "columns"])
@pytest.mark.parametrize("count", [False, True], ids=["uncounted", "counted"])
def test_the_triton_path_is_one_launch_that_compiles_for_a_hopper_gpu(
    hopper_compile, catch_launches, given, count
):
    pytest.importorskip("triton")
    lo = torch.zeros(1025, 4, 8, 128, dtype=torch.bfloat16)  # [pages + 1, layers, Hkv, D]
    hi = torch.zeros_like(lo)
    n = 16
    locs = torch.arange(n, dtype=torch.int32) * 1024 + 7  # a decode step: one row a sequence
    kw: dict = {"nonfinite": torch.zeros(1, dtype=torch.int64)} if count else {}
    if given == "columns":
        key = torch.zeros(n, 32, 2048, 128, dtype=torch.bfloat16)[:, ::4]  # strided heads
        kw["columns"] = torch.full((n,), 7, dtype=torch.int32)
    else:
        key = torch.zeros(n, 8, 128, dtype=torch.bfloat16)
    fold_page_bounds(lo[:, 2], hi[:, 2], locs, key, page_size=16, path="triton", **kw)
    assert [fn.fn.__name__ for fn, _, _ in catch_launches] == ["_fold_kernel"]
    fn, args, kwargs = catch_launches[0]
    assert "ld.global" in hopper_compile(fn, args, kwargs)


def test_writes_longer_than_one_launch_and_given_flags_take_the_torch_path(catch_launches):
    pytest.importorskip("triton")
    from prhs_kernels.quest.triton import FOLD_MAX_ROWS

    gen = torch.Generator().manual_seed(3)
    n = FOLD_MAX_ROWS + 1
    lo, hi = _fields(n, gen)
    keys = torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16)
    locs = torch.randperm(n, generator=gen)
    want = (lo.clone(), hi.clone())
    fold_page_bounds(want[0][:, 1], want[1][:, 1], locs, keys, page_size=P)
    fold_page_bounds(lo[:, 1], hi[:, 1], locs, keys, page_size=P, path="triton")
    assert not catch_launches
    assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])
    finite = torch.ones(4, dtype=torch.bool)
    fold_page_bounds(lo[:, 1], hi[:, 1], locs[:4], keys[:4], page_size=P, finite=finite,
                     path="triton")  # fmt: skip
    assert not catch_launches


def _bad(change: str):
    lo = torch.zeros(9, HKV, D, dtype=torch.bfloat16)
    hi = torch.zeros_like(lo)
    args = {
        "kmin": lo, "kmax": hi, "locations": torch.tensor([1, 2]),
        "key": torch.ones(2, HKV, D, dtype=torch.bfloat16), "page_size": P, "columns": None,
        "finite": None, "nonfinite": torch.zeros(1, dtype=torch.int64), "path": "torch",
    }  # fmt: skip
    cache = torch.ones(2, HKV, 5, D, dtype=torch.bfloat16)
    args.update(
        {
            "kmax-shape": {"kmax": torch.zeros(9, HKV, D + 1, dtype=torch.bfloat16)},
            "kmax-dtype": {"kmax": torch.zeros(9, HKV, D)},
            "no-scratch": {"kmin": lo[:0], "kmax": hi[:0]},
            "locations-float": {"locations": torch.tensor([1.0, 2.0])},
            "key-rows": {"key": torch.ones(3, HKV, D, dtype=torch.bfloat16)},
            "key-heads": {"key": torch.ones(2, HKV + 1, D, dtype=torch.bfloat16)},
            "cache-without-columns": {"key": cache},
            "columns-rows": {"key": cache, "columns": torch.tensor([0, 1, 2])},
            "columns-float": {"key": cache, "columns": torch.tensor([0.0, 1.0])},
            "rows-with-columns": {"columns": torch.tensor([0, 1])},
            "finite-shape": {"finite": torch.ones(3, dtype=torch.bool)},
            "finite-int": {"finite": torch.ones(2, dtype=torch.int32)},
            "counter-int32": {"nonfinite": torch.zeros(1, dtype=torch.int32)},
            "page-size": {"page_size": 0},
            "path": {"path": "cuda"},
        }[change]
    )
    return args


@pytest.mark.parametrize(
    "change",
    [
        "kmax-shape", "kmax-dtype", "no-scratch", "locations-float", "key-rows", "key-heads",
        "cache-without-columns", "columns-rows", "columns-float", "rows-with-columns",
        "finite-shape", "finite-int", "counter-int32", "page-size", "path",
    ],
)  # fmt: skip
def test_bad_input_raises_before_any_write(change):
    args = _bad(change)
    kmin, kmax = args["kmin"].clone(), args["kmax"].clone()
    with pytest.raises((TypeError, ValueError)) as err:
        fold_page_bounds(
            args["kmin"], args["kmax"], args["locations"], args["key"],
            page_size=args["page_size"], columns=args["columns"], finite=args["finite"],
            nonfinite=args["nonfinite"], path=args["path"],
        )  # fmt: skip
    assert str(err.value)
    assert torch.equal(args["kmin"], kmin) and torch.equal(args["kmax"], kmax)
    assert int(args["nonfinite"].sum()) == 0
