"""KV layouts: construction checks shapes and dtypes (no value read), ``check_values`` checks
lengths, starts, request slots and used table entries on the host, and neither changes data."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from prhs_core import ContiguousKV, KVLayout, PagedKV

I32 = torch.int32


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def contiguous(
    b: int = 2,
    hkv: int = 2,
    t: int = 6,
    d: int = 4,
    dv: int = 3,
    *,
    seq_lens: torch.Tensor | None = None,
    start: torch.Tensor | None = None,
) -> ContiguousKV:
    return ContiguousKV(
        torch.randn(b, hkv, t, d),
        torch.randn(b, hkv, t, dv),
        seq_lens if seq_lens is not None else torch.full((b,), t, dtype=I32),
        start,
    )


def paged(
    *,
    n: int = 8,
    table: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    **kwargs: object,
) -> PagedKV:
    """Two requests in a 3-slot table of width 5; batch rows use request slots 2 and 0."""
    if table is None:
        table = torch.tensor([[4, 5, 6, 7, 99], [-5, -5, -5, -5, -5], [0, 1, 2, 3, -1]], dtype=I32)
    return PagedKV(
        torch.randn(n, 2, 4),
        torch.randn(n, 2, 3),
        table,
        rows if rows is not None else i32(2, 0),
        seq_lens if seq_lens is not None else i32(4, 3),
        **kwargs,  # type: ignore[arg-type]
    )


def snapshot(kv: KVLayout) -> list[torch.Tensor]:
    return [t.clone() for t in vars(kv).values() if isinstance(t, torch.Tensor)]


def assert_unchanged(kv: KVLayout, before: list[torch.Tensor]) -> None:
    after = [t for t in vars(kv).values() if isinstance(t, torch.Tensor)]
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)


# -- ContiguousKV ---------------------------------------------------------------------------


def test_contiguous_geometry_comes_from_shapes() -> None:
    kv = contiguous(3, 2, 7, 4, 5, seq_lens=i32(1, 7, 3), start=i32(6, 0, 2))
    assert (kv.batch_size, kv.num_kv_heads, kv.head_dim, kv.value_dim) == (3, 2, 4, 5)
    assert kv.max_len == 7  # T_cap, whatever the lengths are
    assert kv.dtype == torch.float32 and kv.device == torch.device("cpu")
    assert isinstance(kv, KVLayout)
    kv.check_values()


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (
            lambda: ContiguousKV([0.0], torch.zeros(1, 1, 1, 1), i32(1)),
            TypeError,
            "k must be a torch.Tensor",
        ),
        (
            lambda: ContiguousKV(
                torch.zeros(1, 1, 2, 2, dtype=I32), torch.zeros(1, 1, 2, 2), i32(1)
            ),
            TypeError,
            "k must be a floating-point tensor",
        ),
        (
            lambda: ContiguousKV(torch.zeros(1, 2, 2), torch.zeros(1, 1, 2, 2), i32(1)),
            ValueError,
            r"k must have 4 dimensions, got shape \[1, 2, 2\]",
        ),
        (
            lambda: ContiguousKV(torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 5, 2), i32(1, 1)),
            ValueError,
            r"must agree on B, Hkv and T_cap, got \[2, 1, 4, 2\] and \[2, 1, 5, 2\]",
        ),
        (
            lambda: ContiguousKV(torch.zeros(2, 1, 4, 2), torch.zeros(2, 2, 4, 2), i32(1, 1)),
            ValueError,
            "must agree on B, Hkv and T_cap",
        ),
        (
            lambda: ContiguousKV(
                torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2, dtype=torch.float16), i32(1)
            ),
            TypeError,
            "k and v must share a dtype, got torch.float32 and torch.float16",
        ),
        (
            lambda: contiguous(seq_lens=torch.tensor([6, 6])),
            TypeError,
            "seq_lens must be int32 .* got torch.int64",
        ),
        (
            lambda: contiguous(seq_lens=torch.tensor([6.0, 6.0])),
            TypeError,
            "seq_lens must be an integer tensor",
        ),
        (
            lambda: contiguous(seq_lens=i32(6)),
            ValueError,
            r"seq_lens must have shape \[B\] = \[2\], got \[1\]",
        ),
        (
            lambda: contiguous(seq_lens=torch.ones(2, 1, dtype=I32)),
            ValueError,
            "seq_lens must have 1 dimensions",
        ),
        (
            lambda: contiguous(start=torch.tensor([0, 0])),
            TypeError,
            "start must be int32 .* got torch.int64",
        ),
        (
            lambda: contiguous(start=i32(0, 0, 0)),
            ValueError,
            r"start must have shape \[B\] = \[2\], got \[3\]",
        ),
    ],
    ids=[
        "k-list",
        "k-int",
        "k-3d",
        "T-mismatch",
        "Hkv-mismatch",
        "dtype-mismatch",
        "lens-int64",
        "lens-float",
        "lens-shape",
        "lens-2d",
        "start-int64",
        "start-shape",
    ],
)
def test_contiguous_rejects_bad_shapes_and_dtypes(
    make: Callable[[], object], error: type, fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        make()


@pytest.mark.parametrize(
    ("lens", "start"),
    [((6, 1), None), ((1, 6), (5, 0)), ((3, 2), (3, 4)), ((6, 6), (0, 0))],
    ids=["no-start", "row-ends-at-T", "both-end-at-T", "full"],
)
def test_contiguous_check_values_accepts_rows_that_fit(
    lens: tuple[int, int], start: tuple[int, int] | None
) -> None:
    contiguous(seq_lens=i32(*lens), start=None if start is None else i32(*start)).check_values()


@pytest.mark.parametrize(
    ("lens", "start", "fragment"),
    [
        (
            (6, 0),
            None,
            r"seq_lens\[1\] = 0 is out of range: "
            r"a decode step caches 1 to T_cap - start \(\[1, 6\]\)",
        ),
        ((7, 1), None, r"seq_lens\[0\] = 7 is out of range: .* \(\[1, 6\]\)"),
        ((3, 3), (0, 4), r"seq_lens\[1\] = 3 is out of range: .* \(\[1, 2\]\)"),
        (
            (1, 1),
            (-1, 0),
            r"start\[0\] = -1 is out of range: storage indices of a cache of T_cap=6 \(\[0, 6\]\)",
        ),
        ((1, 1), (0, 7), r"start\[1\] = 7 is out of range"),
        ((1, 1), (0, 6), r"seq_lens\[1\] = 1 is out of range: .* \(\[1, 0\]\)"),
    ],
    ids=["len0", "len>T", "start+len>T", "start-neg", "start>T", "start=T"],
)
def test_contiguous_check_values_names_the_bad_row(
    lens: tuple[int, int], start: tuple[int, int] | None, fragment: str
) -> None:
    kv = contiguous(seq_lens=i32(*lens), start=None if start is None else i32(*start))
    before = snapshot(kv)
    with pytest.raises(ValueError, match=fragment):
        kv.check_values()
    assert_unchanged(kv, before)


# -- PagedKV --------------------------------------------------------------------------------


def test_paged_geometry_and_max_len() -> None:
    kv = paged(page_size=2)
    assert (kv.batch_size, kv.num_kv_heads, kv.head_dim, kv.value_dim) == (2, 2, 4, 3)
    assert kv.num_slots == 8 and kv.page_size == 2
    assert kv.max_len == 5  # the table's width
    assert paged(max_len_hint=4).max_len == 4
    assert paged(max_len_hint=5).max_len == 5
    assert isinstance(kv, KVLayout)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_paged_takes_int32_or_int64_request_rows(dtype: torch.dtype) -> None:
    kv = paged(rows=torch.tensor([2, 0], dtype=dtype))
    kv.check_values()
    assert kv.req_pool_indices.dtype == dtype  # stored as given: no copy, no cast


def _pool(n: int = 8, hkv: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, hkv, 4), torch.zeros(n, hkv, 3)


TABLE = torch.zeros(3, 5, dtype=I32)


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (
            lambda: PagedKV(torch.zeros(8, 4), torch.zeros(8, 2, 3), TABLE, i32(0), i32(1)),
            ValueError,
            r"k_pool must have 3 dimensions, got shape \[8, 4\]",
        ),
        (
            lambda: PagedKV(torch.zeros(8, 2, 4), torch.zeros(7, 2, 3), TABLE, i32(0), i32(1)),
            ValueError,
            r"must agree on N and Hkv, got \[8, 2, 4\] and \[7, 2, 3\]",
        ),
        (
            lambda: PagedKV(torch.zeros(8, 2, 4), torch.zeros(8, 1, 3), TABLE, i32(0), i32(1)),
            ValueError,
            "must agree on N and Hkv",
        ),
        (
            lambda: PagedKV(
                torch.zeros(8, 2, 4, dtype=torch.bfloat16),
                torch.zeros(8, 2, 3),
                TABLE,
                i32(0),
                i32(1),
            ),
            TypeError,
            "k_pool and v_pool must share a dtype",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE.long(), i32(0), i32(1)),
            TypeError,
            "req_to_token must be int32, got torch.int64",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE.float(), i32(0), i32(1)),
            TypeError,
            "req_to_token must be an integer tensor",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE[0], i32(0), i32(1)),
            ValueError,
            "req_to_token must have 2 dimensions",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE, torch.tensor([0.0]), i32(1)),
            TypeError,
            "req_pool_indices must be an integer tensor",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE, i32(0), torch.tensor([1])),
            TypeError,
            "seq_lens must be int32",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE, i32(0, 1), i32(1)),
            ValueError,
            r"seq_lens must have shape \[B\] = \[2\], got \[1\]",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE, i32(0), i32(1), page_size=0),
            ValueError,
            "page_size must be >= 1, got 0",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE, i32(0), i32(1), page_size=True),
            TypeError,
            "page_size must be an int, got bool",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE, i32(0), i32(1), max_len_hint=0),
            ValueError,
            "max_len_hint must be >= 1",
        ),
        (
            lambda: PagedKV(*_pool(), TABLE, i32(0), i32(1), max_len_hint=6),
            ValueError,
            r"max_len_hint \(6\) must be <= the width of req_to_token \(5\)",
        ),
    ],
    ids=[
        "pool-2d",
        "N-mismatch",
        "Hkv-mismatch",
        "dtype-mismatch",
        "table-int64",
        "table-float",
        "table-1d",
        "rows-float",
        "lens-int64",
        "lens-vs-rows",
        "page0",
        "page-bool",
        "hint0",
        "hint>M",
    ],
)
def test_paged_rejects_bad_shapes_and_dtypes(
    make: Callable[[], object], error: type, fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        make()


def test_paged_check_values_ignores_entries_past_each_length_and_unused_requests() -> None:
    # Request slot 1 is full of -5 and request 2's entry 4 is -1, request 0's is 99: none is
    # read (lengths 4 and 3), so none is checked.
    kv = paged()
    before = snapshot(kv)
    kv.check_values()
    assert_unchanged(kv, before)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        (
            {"rows": i32(2, 3)},
            r"req_pool_indices\[1\] = 3 is out of range: request slots \(\[0, 2\]\)",
        ),
        ({"rows": i32(-1, 0)}, r"req_pool_indices\[0\] = -1 is out of range"),
        (
            {"seq_lens": i32(4, 0)},
            r"seq_lens\[1\] = 0 is out of range: a decode step caches 1 to max_len \(\[1, 5\]\)",
        ),
        ({"seq_lens": i32(6, 1)}, r"seq_lens\[0\] = 6 is out of range: .* \(\[1, 5\]\)"),
        (
            {"seq_lens": i32(5, 1), "max_len_hint": 4},
            r"seq_lens\[0\] = 5 is out of range: .* \(\[1, 4\]\)",
        ),
        (
            {"seq_lens": i32(5, 1)},
            r"req_to_token \(used entries\)\[4\] = -1 is out of range: pool slots \(\[0, 7\]\)",
        ),
        (
            {"seq_lens": i32(1, 5)},
            r"req_to_token \(used entries\)\[5\] = 99 is out of range: pool slots \(\[0, 7\]\)",
        ),
        (
            {"n": 6},
            r"req_to_token \(used entries\)\[6\] = 6 is out of range: pool slots \(\[0, 5\]\)",
        ),
        ({"rows": i32(1, 0)}, r"req_to_token \(used entries\)\[0\] = -5 is out of range"),
    ],
    ids=[
        "row=R",
        "row-neg",
        "len0",
        "len>M",
        "len>hint",
        "used-entry-neg",
        "used-entry-huge",
        "used-entry=N",
        "junk-request-row",
    ],
)
def test_paged_check_values_names_the_bad_value(changes: dict, fragment: str) -> None:
    kv = paged(**changes)
    before = snapshot(kv)
    with pytest.raises(ValueError, match=fragment):
        kv.check_values()
    assert_unchanged(kv, before)


# -- the meta device ------------------------------------------------------------------------


def test_layouts_build_and_skip_value_checks_on_the_meta_device() -> None:
    m = "meta"
    c = ContiguousKV(
        torch.empty(2, 1, 9, 4, device=m),
        torch.empty(2, 1, 9, 4, device=m),
        torch.empty(2, dtype=I32, device=m),
        torch.empty(2, dtype=I32, device=m),
    )
    p = PagedKV(
        torch.empty(16, 1, 4, device=m),
        torch.empty(16, 1, 4, device=m),
        torch.empty(3, 9, dtype=I32, device=m),
        torch.empty(2, dtype=I32, device=m),
        torch.empty(2, dtype=I32, device=m),
        max_len_hint=8,
    )
    for kv in (c, p):
        kv.check_values()  # nothing to read: a no-op, not a crash
        assert kv.device.type == "meta" and kv.batch_size == 2
    assert (c.max_len, p.max_len) == (9, 8)
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        ContiguousKV(c.k, c.v, torch.empty(2, dtype=torch.int64, device=m))


def test_layouts_are_frozen() -> None:
    kv = contiguous()
    with pytest.raises(AttributeError):
        kv.seq_lens = i32(1, 1)  # type: ignore[misc]
