"""Selection (fixed-width index lists plus counts, block expansion, masks) and StepStats.

Entries past each row's count hold *garbage* here (valid-looking positions, huge ids, negatives)
rather than ``-1``: nothing may read them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prhs_core import Selection, StepStats

I32 = torch.int32


def i32(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def random_lens(b: int, t: int, g: torch.Generator) -> torch.Tensor:
    lens = torch.randint(1, t + 1, (b,), generator=g, dtype=I32)
    lens[0] = t
    return lens


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(("width", "s"), [(0, 1), (5, 1), (3, 16)], ids=["K0", "K5-s1", "K3-s16"])
def test_allocate_gives_static_int32_buffers(width: int, s: int) -> None:
    stats = StepStats.allocate(2, 3, "cpu", certified=False)
    sel = Selection.allocate(2, 3, width, s, "cpu", stats)
    assert sel.indices.shape == (2, 3, width) and sel.indices.dtype == I32
    assert sel.counts.shape == (2, 3) and sel.counts.dtype == I32
    assert sel.width == width and sel.block_size == s and sel.stats is stats
    assert bool((sel.indices == -1).all()) and not sel.counts.any()
    assert not sel.entry_mask().any()


@pytest.mark.parametrize(
    ("args", "error", "fragment"),
    [
        ((2, 3, -1, 1), ValueError, "width must be >= 0, got -1"),
        ((2, 3, 4, 0), ValueError, "block_size must be >= 1, got 0"),
        ((2, 3, 4.0, 1), TypeError, "width must be an int, got float"),
    ],
    ids=["width-neg", "block0", "width-float"],
)
def test_allocate_rejects_bad_sizes(args: tuple, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        Selection.allocate(*args, device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"indices": torch.zeros(2, 3, 4)}, TypeError, "indices must be an integer tensor"),
        (
            {"indices": torch.zeros(2, 3, 4, dtype=torch.long)},
            TypeError,
            "indices must be int32, got torch.int64",
        ),
        (
            {"indices": torch.zeros(2, 3, 4, dtype=torch.int16)},
            TypeError,
            "indices must be int32, got torch.int16",
        ),
        ({"indices": torch.zeros(2, 3, dtype=I32)}, ValueError, "indices must have 3 dimensions"),
        (
            {"counts": torch.zeros(2, 3, dtype=torch.long)},
            TypeError,
            "counts must be int32, got torch.int64",
        ),
        (
            {"counts": torch.zeros(2, 3, dtype=torch.bool)},
            TypeError,
            "counts must be an integer tensor",
        ),
        (
            {"counts": torch.zeros(3, 2, dtype=I32)},
            ValueError,
            r"counts must have shape \[B, Hkv\] = \[2, 3\], got \[3, 2\]",
        ),
        ({"counts": torch.zeros(2, 3, 1, dtype=I32)}, ValueError, "counts must have 2 dimensions"),
        ({"block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        ({"block_size": True}, TypeError, "block_size must be an int, got bool"),
    ],
    ids=[
        "indices-float",
        "indices-int64",
        "indices-int16",
        "indices-2d",
        "counts-int64",
        "counts-bool",
        "counts-transposed",
        "counts-3d",
        "block0",
        "block-bool",
    ],
)
def test_selection_rejects_bad_fields(kwargs: dict, error: type, fragment: str) -> None:
    fields = {
        "indices": torch.zeros(2, 3, 4, dtype=I32),
        "counts": torch.zeros(2, 3, dtype=I32),
        "block_size": 1,
        **kwargs,
    }
    with pytest.raises(error, match=fragment):
        Selection(**fields)


def test_selection_is_frozen() -> None:
    sel = Selection.allocate(1, 1, 2, 1, "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.block_size = 2  # type: ignore[misc]


# -- positions, num_tokens, to_mask ---------------------------------------------------------


def entry_mask_ref(counts: torch.Tensor, width: int) -> list:
    return [[[k < c for k in range(width)] for c in row] for row in counts.tolist()]


def ref_positions(sel: Selection, seq_lens: torch.Tensor) -> list:
    """Python loops: entry ``k < counts[b, h]`` of block id ``j`` gives ``j*s .. j*s + s - 1``,
    each kept if below the length, else -1; unused entries give ``s`` times -1."""
    s = sel.block_size
    out = []
    for b, plane in enumerate(sel.indices.tolist()):
        n = int(seq_lens[b])
        rows = []
        for h, row in enumerate(plane):
            c = int(sel.counts[b, h])
            pos: list[int] = []
            for k, j in enumerate(row):
                pos += [p if k < c and p < n else -1 for p in range(j * s, j * s + s)]
            rows.append(pos)
        out.append(rows)
    return out


def ref_mask(sel: Selection, seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    b_, h_, _ = sel.indices.shape
    mask = torch.zeros(b_, h_, max_len, dtype=torch.bool)
    s = sel.block_size
    for b in range(b_):
        for h in range(h_):
            for j in sel.indices[b, h, : int(sel.counts[b, h])].tolist():
                for p in range(j * s, min((j + 1) * s, int(seq_lens[b]), max_len)):
                    mask[b, h, p] = True
    return mask


def random_selection(
    b: int, h: int, t: int, s: int, k: int, seed: int
) -> tuple[Selection, torch.Tensor]:
    """Distinct block ids (one wholly past the end allowed), random counts, garbage after them."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = random_lens(b, t, g)
    nblocks = -(-t // s) + 1
    k = min(k, nblocks)
    idx = torch.stack([torch.randperm(nblocks, generator=g)[:k] for _ in range(b * h)]).view(
        b, h, k
    )
    counts = torch.randint(0, k + 1, (b, h), generator=g, dtype=I32)
    counts[0, 0] = k
    garbage = torch.randint(-(2**20), 2**20, (b, h, k), generator=g)
    garbage[..., ::2] = torch.randint(0, nblocks, garbage[..., ::2].shape, generator=g)  # in range
    used = torch.arange(k).view(1, 1, -1) < counts.unsqueeze(-1)
    return Selection(torch.where(used, idx, garbage).to(I32), counts, s), seq_lens


BLOCK_CASES = [
    # (B, Hkv, T, s, K)
    (1, 1, 1, 1, 1),
    (2, 2, 37, 1, 9),
    (3, 2, 37, 4, 5),
    (3, 1, 64, 16, 3),
    (2, 4, 10, 3, 4),
    (4, 2, 33, 8, 6),
]


@pytest.mark.parametrize(
    ("b", "h", "t", "s", "k"),
    BLOCK_CASES,
    ids=[f"B{b}-Hkv{h}-T{t}-s{s}-K{k}" for b, h, t, s, k in BLOCK_CASES],
)
def test_positions_num_tokens_and_mask_match_brute_force(
    b: int, h: int, t: int, s: int, k: int
) -> None:
    sel, seq_lens = random_selection(b, h, t, s, k, seed=b * 100 + t + s)
    before = (sel.indices.clone(), sel.counts.clone())
    assert sel.entry_mask().tolist() == entry_mask_ref(sel.counts, sel.width)
    pos = sel.positions(seq_lens)
    assert pos.dtype == torch.int64 and pos.shape == (b, h, sel.width * s)
    assert pos.tolist() == ref_positions(sel, seq_lens)
    mask = sel.to_mask(seq_lens, t)
    assert mask.dtype == torch.bool and mask.shape == (b, h, t)
    assert torch.equal(mask, ref_mask(sel, seq_lens, t))
    num = sel.num_tokens(seq_lens)
    assert num.dtype == I32 and torch.equal(num, mask.sum(-1).to(I32))
    # Reading a selection changes nothing.
    assert torch.equal(sel.indices, before[0]) and torch.equal(sel.counts, before[1])


def test_block_expansion_clips_at_the_sequence_end_by_hand() -> None:
    # s = 4, length 10: block 2 covers [8, 12) clipped to [8, 10); block 3 lies past the end;
    # entry 3 (block 1) is past the count and must be ignored although it is a valid block.
    sel = Selection(i32([[[2, 0, 3, 1]]]), i32([[3]]), block_size=4)
    lens = i32([10])
    assert sel.positions(lens).tolist() == [
        [[8, 9, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1, -1]]
    ]
    assert torch.nonzero(sel.to_mask(lens, 12)[0, 0]).flatten().tolist() == [0, 1, 2, 3, 8, 9]
    assert sel.num_tokens(lens).tolist() == [[6]]


def test_token_positions_ignore_garbage_past_counts_by_hand() -> None:
    # Row 0 uses [0, 4, 5] with length 5: 5 is past the end. Row 1 uses [2, 1] with length 2:
    # 2 is past the end. The entries after the counts (3, 0, 7) look valid and must be ignored.
    sel = Selection(i32([[[0, 4, 5, 3]], [[2, 1, 0, 7]]]), i32([[3], [2]]))
    lens = i32([5, 2])
    assert sel.positions(lens).tolist() == [[[0, 4, -1, -1]], [[-1, 1, -1, -1]]]
    assert sel.num_tokens(lens).tolist() == [[2], [1]]
    assert sel.to_mask(lens, 5).int().tolist() == [[[1, 0, 0, 0, 1]], [[0, 1, 0, 0, 0]]]


def test_to_mask_drops_positions_at_or_past_max_len() -> None:
    # Positions 6 and 7 are read (length 8) but do not fit a mask of width 6: they are dropped,
    # not wrapped or clamped onto column 5.
    sel = Selection(i32([[[1, 6, 7, 4]]]), i32([[4]]))
    assert sel.to_mask(i32([8]), 6).int().tolist() == [[[0, 1, 0, 0, 1, 0]]]
    assert sel.to_mask(i32([8]), 0).shape == (1, 1, 0)


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (
            lambda s: s.positions(torch.tensor([4.0, 4.0])),
            TypeError,
            "seq_lens must be an integer tensor",
        ),
        (lambda s: s.positions(i32([[4, 4]])), ValueError, "seq_lens must have 1 dimensions"),
        (
            lambda s: s.positions(i32([4])),
            ValueError,
            r"seq_lens must have shape \[B\] = \[2\], got \[1\]",
        ),
        (
            lambda s: s.num_tokens(i32([4, 4, 4])),
            ValueError,
            r"seq_lens must have shape \[B\] = \[2\], got \[3\]",
        ),
        (lambda s: s.to_mask(i32([4]), 4), ValueError, r"seq_lens must have shape \[B\] = \[2\]"),
        (lambda s: s.to_mask(i32([4, 4]), -1), ValueError, "max_len must be >= 0, got -1"),
        (lambda s: s.to_mask(i32([4, 4]), 4.0), TypeError, "max_len must be an int, got float"),
    ],
    ids=[
        "float-lens",
        "2d-lens",
        "lens-B1",
        "lens-B3",
        "mask-lens-B1",
        "max-len-neg",
        "max-len-float",
    ],
)
def test_reads_reject_bad_lengths(call, error: type, fragment: str) -> None:
    sel = Selection(i32([[[0, 1]], [[2, 3]]]), i32([[2], [2]]))
    with pytest.raises(error, match=fragment):
        call(sel)


# -- from_mask ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    h=st.integers(1, 4),
    t=st.integers(1, 40),
    density=st.floats(0.0, 1.0),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_from_mask_to_mask_round_trip(
    b: int, h: int, t: int, density: float, extra: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    seq_lens = random_lens(b, t, g)
    valid = (torch.arange(t).view(1, 1, -1) < seq_lens.view(-1, 1, 1)).expand(-1, h, -1)
    mask = (torch.rand(b, h, t, generator=g) < density) & valid
    widest = int(mask.sum(-1).max())
    sel = (
        Selection.from_mask(mask) if extra == 0 else Selection.from_mask(mask, width=widest + extra)
    )
    assert sel.block_size == 1 and sel.stats is None
    assert sel.indices.dtype == I32 and sel.counts.dtype == I32
    assert sel.width == widest + extra
    assert torch.equal(sel.counts, mask.sum(-1).to(I32))
    assert torch.equal(sel.to_mask(seq_lens, t), mask)
    assert torch.equal(sel.num_tokens(seq_lens), sel.counts)
    # Each row lists its positions ascending, then -1.
    for bi in range(b):
        for hi in range(h):
            row, c = sel.indices[bi, hi].tolist(), int(sel.counts[bi, hi])
            assert row[:c] == torch.nonzero(mask[bi, hi]).flatten().tolist()
            assert row[c:] == [-1] * (len(row) - c)


@pytest.mark.parametrize(("t", "width"), [(5, None), (0, None), (5, 3)], ids=["T5", "T0", "T5-K3"])
def test_from_mask_of_an_empty_mask(t: int, width: int | None) -> None:
    sel = Selection.from_mask(torch.zeros(2, 3, t, dtype=torch.bool), width=width)
    assert sel.indices.shape == (2, 3, width or 0)
    assert not sel.counts.any()
    assert bool((sel.indices == -1).all())
    assert not sel.to_mask(i32([5, 2]), t).any()


@pytest.mark.parametrize(
    ("mask", "width", "error", "fragment"),
    [
        (
            torch.zeros(2, 5, dtype=torch.bool),
            None,
            ValueError,
            r"mask must be a \[B, Hkv, T\] bool tensor",
        ),
        ([[[True]]], None, ValueError, r"mask must be a \[B, Hkv, T\] bool tensor"),
        (
            torch.zeros(1, 2, 5, dtype=torch.int64),
            None,
            TypeError,
            "mask must be a torch.bool mask",
        ),
        (torch.zeros(1, 2, 5, dtype=torch.bool), -1, ValueError, "width must be >= 0, got -1"),
        (torch.zeros(1, 2, 5, dtype=torch.bool), True, TypeError, "width must be an int, got bool"),
    ],
    ids=["2d", "list", "int", "width-neg", "width-bool"],
)
def test_from_mask_rejects_bad_input(
    mask: object, width: object, error: type, fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        Selection.from_mask(mask, width=width)  # type: ignore[arg-type]


# -- StepStats ------------------------------------------------------------------------------


@pytest.mark.parametrize("certified", [False, True], ids=["plain", "certified"])
def test_step_stats_allocate(certified: bool) -> None:
    stats = StepStats.allocate(3, 2, "cpu", certified=certified)
    assert stats.retrieved.dtype == torch.bool and stats.retrieved.shape == (3, 2)
    assert stats.num_selected.dtype == I32 and stats.num_selected.shape == (3, 2)
    assert stats.proxy_bytes.dtype == torch.float64 and stats.proxy_bytes.shape == (3, 2)
    assert (stats.delta_hat is not None) is certified
    if stats.delta_hat is not None:
        assert stats.delta_hat.dtype == torch.float32 and stats.delta_hat.shape == (3, 2)
    for t in (stats.retrieved, stats.num_selected, stats.proxy_bytes):
        assert not t.any()
    assert stats.bytes_read(head_dim=8).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (
            {"retrieved": torch.ones(2, dtype=torch.bool)},
            ValueError,
            r"retrieved must be a \[B, Hkv\] bool tensor",
        ),
        ({"retrieved": [[True]]}, ValueError, r"retrieved must be a \[B, Hkv\] bool tensor"),
        (
            {"retrieved": torch.ones(2, 3, dtype=torch.long)},
            TypeError,
            "retrieved must be a torch.bool mask",
        ),
        ({"num_selected": torch.ones(2, 3)}, TypeError, "num_selected must be an integer tensor"),
        (
            {"num_selected": torch.ones(3, 2, dtype=I32)},
            ValueError,
            r"num_selected must have the shape of retrieved \[2, 3\], got \[3, 2\]",
        ),
        (
            {"num_selected": torch.ones(2, 3, 1, dtype=I32)},
            ValueError,
            "num_selected must have 2 dimensions",
        ),
        (
            {"delta_hat": torch.zeros(2)},
            ValueError,
            r"delta_hat must have the shape of retrieved \[2, 3\], got \[2\]",
        ),
        (
            {"proxy_bytes": torch.zeros(2, 4)},
            ValueError,
            r"proxy_bytes must have the shape of retrieved \[2, 3\], got \[2, 4\]",
        ),
    ],
    ids=[
        "retrieved-1d",
        "retrieved-list",
        "retrieved-int",
        "num-float",
        "num-transposed",
        "num-3d",
        "delta-shape",
        "proxy-shape",
    ],
)
def test_step_stats_rejects_bad_shapes(kwargs: dict, error: type, fragment: str) -> None:
    fields = {
        "retrieved": torch.ones(2, 3, dtype=torch.bool),
        "num_selected": torch.ones(2, 3, dtype=I32),
        "proxy_bytes": torch.zeros(2, 3, dtype=torch.float64),
        **kwargs,
    }
    with pytest.raises(error, match=fragment):
        StepStats(**fields)


NUM = i32([[10, 20], [0, 5]])
PROXY = torch.tensor([[100, 0], [7, 1]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("head_dim", "value_dim", "element_size", "proxy", "expected"),
    [
        # (128 + 128) * 2 = 512 bytes per position: 30 * 512, 5 * 512.
        (128, None, 2, None, [15360.0, 2560.0]),
        (128, None, 2, PROXY, [15460.0, 2568.0]),
        # (128 + 64) * 1 = 192 bytes per position: 30 * 192 + 100, 5 * 192 + 8.
        (128, 64, 1, PROXY, [5860.0, 968.0]),
        # fp32 D=Dv=4: 32 bytes per position.
        (4, None, 4, None, [960.0, 160.0]),
    ],
    ids=["D128-bf16", "D128-bf16-proxy", "D128-Dv64-fp8-proxy", "D4-fp32"],
)
def test_bytes_read_by_hand(
    head_dim: int, value_dim: int | None, element_size: int, proxy, expected
) -> None:
    proxy = torch.zeros(2, 2, dtype=torch.float64) if proxy is None else proxy
    stats = StepStats(torch.zeros(2, 2, dtype=torch.bool), NUM, proxy)
    got = stats.bytes_read(head_dim=head_dim, value_dim=value_dim, element_size=element_size)
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got.tolist() == expected


def test_bytes_read_sums_over_heads_against_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    num = torch.randint(0, 5000, (3, 8), generator=g, dtype=I32)
    proxy = torch.randint(0, 10**6, (3, 8), generator=g).double()
    stats = StepStats(torch.rand(3, 8, generator=g) < 0.5, num, proxy)
    got = stats.bytes_read(head_dim=96, value_dim=80, element_size=2).tolist()
    expected = [
        sum(int(num[b, h]) * (96 + 80) * 2 + int(proxy[b, h]) for h in range(8)) for b in range(3)
    ]
    assert got == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"head_dim": 0}, ValueError, "head_dim must be >= 1"),
        ({"head_dim": 64, "element_size": 0}, ValueError, "element_size must be >= 1"),
        ({"head_dim": 64, "value_dim": 0}, ValueError, "value_dim must be >= 1"),
        ({"head_dim": 64, "value_dim": True}, TypeError, "value_dim must be an int, got bool"),
        ({"head_dim": 64.0}, TypeError, "head_dim must be an int, got float"),
    ],
    ids=["D0", "elem0", "Dv0", "Dv-bool", "D-float"],
)
def test_bytes_read_rejects_bad_sizes(kwargs: dict, error: type, fragment: str) -> None:
    stats = StepStats.allocate(1, 1, "cpu", certified=False)
    with pytest.raises(error, match=fragment):
        stats.bytes_read(**kwargs)
