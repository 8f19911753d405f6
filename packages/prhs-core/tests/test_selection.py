"""Selection (index lists, block expansion, masks) and StepStats (shapes, bytes read)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prhs_core import Selection, StepStats


def random_lens(b: int, t: int, g: torch.Generator) -> torch.Tensor:
    lens = torch.randint(0, t + 1, (b,), generator=g)
    lens[0] = t
    return lens


def valid_mask(seq_lens: torch.Tensor, h: int, t: int) -> torch.Tensor:
    return (torch.arange(t).view(1, 1, -1) < seq_lens.view(-1, 1, 1)).expand(-1, h, -1)


# -- from_mask / to_mask --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    h=st.integers(1, 4),
    t=st.integers(1, 40),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_from_mask_to_mask_round_trip(b: int, h: int, t: int, density: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    seq_lens = random_lens(b, t, g)
    mask = (torch.rand(b, h, t, generator=g) < density) & valid_mask(seq_lens, h, t)
    sel = Selection.from_mask(mask)
    assert sel.block_size == 1 and not sel.is_dense
    assert sel.indices is not None
    assert sel.indices.shape == (b, h, int(mask.sum(-1).max()))
    assert torch.equal(sel.to_mask(seq_lens, t, h), mask)
    # Each row lists its selected positions in increasing order, then -1 padding.
    for bi in range(b):
        for hi in range(h):
            row = sel.indices[bi, hi].tolist()
            chosen = [p for p in row if p >= 0]
            assert chosen == torch.nonzero(mask[bi, hi]).flatten().tolist()
            assert row[len(chosen) :] == [-1] * (len(row) - len(chosen))


def test_from_mask_keeps_stats_and_to_mask_drops_positions_past_seq_len() -> None:
    stats = StepStats(torch.ones(1, 2, dtype=torch.bool), torch.tensor([[3, 1]]))
    mask = torch.tensor([[[True, False, True, True], [False, False, False, True]]])
    sel = Selection.from_mask(mask, stats=stats)
    assert sel.stats is stats
    assert sel.indices.tolist() == [[[0, 2, 3], [3, -1, -1]]]
    # A shorter sequence than the mask: position 3 no longer exists.
    assert sel.to_mask(torch.tensor([3]), 4, 2).tolist() == [
        [[True, False, True, False], [False] * 4]
    ]


def test_from_mask_of_an_empty_mask_has_no_columns() -> None:
    sel = Selection.from_mask(torch.zeros(2, 3, 5, dtype=torch.bool))
    assert sel.indices.shape == (2, 3, 0)
    assert not sel.to_mask(torch.tensor([5, 2]), 5, 3).any()


@pytest.mark.parametrize(
    ("mask", "error", "fragment"),
    [
        (
            torch.zeros(2, 5, dtype=torch.bool),
            ValueError,
            r"mask must be a \[B, Hkv, T\] bool tensor",
        ),
        ([[[True]]], ValueError, r"mask must be a \[B, Hkv, T\] bool tensor"),
        (torch.zeros(1, 2, 5, dtype=torch.int64), TypeError, "mask must be a torch.bool mask"),
    ],
    ids=["2d", "list", "int"],
)
def test_from_mask_rejects_bad_masks(mask: object, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        Selection.from_mask(mask)  # type: ignore[arg-type]


# -- blocks ---------------------------------------------------------------------------------


def ref_positions(indices: torch.Tensor, s: int, seq_lens: torch.Tensor) -> list:
    out = []
    for b, plane in enumerate(indices.tolist()):
        n = int(seq_lens[b])
        out.append(
            [
                [p if j >= 0 and p < n else -1 for j in row for p in range(j * s, (j + 1) * s)]
                for row in plane
            ]
        )
    return out


def ref_mask(indices: torch.Tensor, s: int, seq_lens: torch.Tensor, t: int) -> torch.Tensor:
    b_, h_, _ = indices.shape
    mask = torch.zeros(b_, h_, t, dtype=torch.bool)
    for b in range(b_):
        for h in range(h_):
            for j in indices[b, h].tolist():
                if j < 0:
                    continue
                for p in range(j * s, min((j + 1) * s, int(seq_lens[b]))):
                    mask[b, h, p] = True
    return mask


BLOCK_CASES = [
    # (B, Hkv, T, s, K)
    (1, 1, 1, 1, 1),
    (2, 2, 37, 4, 5),
    (3, 1, 64, 16, 3),
    (2, 4, 10, 3, 4),
    (4, 2, 33, 8, 6),
]


@pytest.mark.parametrize(
    ("b", "h", "t", "s", "k"),
    BLOCK_CASES,
    ids=[f"B{b}-Hkv{h}-T{t}-s{s}-K{k}" for b, h, t, s, k in BLOCK_CASES],
)
def test_block_positions_and_mask_match_brute_force(b: int, h: int, t: int, s: int, k: int) -> None:
    g = torch.Generator().manual_seed(b * 100 + t)
    seq_lens = random_lens(b, t, g)
    nblocks = -(-t // s) + 1  # one block id entirely past the end
    indices = torch.stack([torch.randperm(nblocks, generator=g)[:k] for _ in range(b * h)]).view(
        b, h, -1
    )[..., :k]
    indices = torch.where(torch.rand(indices.shape, generator=g) < 0.25, -1, indices)  # padding
    sel = Selection(indices, block_size=s)
    pos = sel.positions(seq_lens)
    assert pos.shape == (b, h, indices.shape[-1] * s)
    assert pos.tolist() == ref_positions(indices, s, seq_lens)
    assert torch.equal(sel.to_mask(seq_lens, t, h), ref_mask(indices, s, seq_lens, t))


def test_block_expands_and_clips_at_seq_len_by_hand() -> None:
    # s = 4, seq_len 10: block 2 covers [8, 12) clipped to [8, 10); block 3 is past the end.
    sel = Selection(torch.tensor([[[2, 0, -1, 3]]]), block_size=4)
    assert sel.positions(torch.tensor([10])).tolist() == [
        [[8, 9, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1, -1]]
    ]
    assert torch.nonzero(sel.to_mask(torch.tensor([10]), 12, 1)[0, 0]).flatten().tolist() == [
        0,
        1,
        2,
        3,
        8,
        9,
    ]


def test_token_positions_drop_entries_past_seq_len() -> None:
    sel = Selection(torch.tensor([[[0, 4, 5, -1]], [[2, 1, -1, -1]]]))
    assert sel.positions(torch.tensor([5, 2])).tolist() == [[[0, 4, -1, -1]], [[-1, 1, -1, -1]]]


# -- dense ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("b", "h", "t"),
    [(1, 1, 1), (3, 2, 17), (2, 4, 64)],
    ids=["B1-Hkv1-T1", "B3-Hkv2-T17", "B2-Hkv4-T64"],
)
def test_dense_selection_mask_is_the_valid_mask(b: int, h: int, t: int) -> None:
    seq_lens = random_lens(b, t, torch.Generator().manual_seed(t))
    sel = Selection(None)
    assert sel.is_dense
    mask = sel.to_mask(seq_lens, t, h)
    assert torch.equal(mask, valid_mask(seq_lens, h, t))
    # The result owns its memory: flipping one head's entry leaves the other heads alone.
    before = mask.clone()
    mask[0, 0, 0] = not bool(mask[0, 0, 0])
    assert torch.equal(mask[:, 1:], before[:, 1:])
    assert torch.equal(sel.to_mask(seq_lens, t, h), before)
    with pytest.raises(ValueError, match="a dense selection has no index list"):
        sel.positions(seq_lens)


# -- Selection validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (
            {"indices": torch.zeros(1, 1, 2), "block_size": 1},
            TypeError,
            "indices must be an integer tensor",
        ),
        (
            {"indices": torch.zeros(1, 2, dtype=torch.long), "block_size": 1},
            ValueError,
            "indices must have 3 dimensions",
        ),
        ({"indices": None, "block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        ({"indices": None, "block_size": True}, TypeError, "block_size must be an int, got bool"),
    ],
    ids=["float-indices", "2d-indices", "block0", "block-bool"],
)
def test_selection_rejects_bad_fields(kwargs: dict, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        Selection(**kwargs)


def test_to_mask_rejects_indices_of_another_batch_or_head_count() -> None:
    sel = Selection(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"indices must have shape \[B=2, Hkv=2, K\], got \[2, 3, 4\]"
    ):
        sel.to_mask(torch.tensor([4, 4]), 4, 2)
    with pytest.raises(ValueError, match=r"indices must have shape \[B=1, Hkv=3, K\]"):
        sel.to_mask(torch.tensor([4]), 4, 3)
    with pytest.raises(TypeError, match="seq_lens must be an integer tensor"):
        sel.to_mask(torch.tensor([4.0, 4.0]), 4, 3)


def test_selection_is_frozen() -> None:
    sel = Selection(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.block_size = 2  # type: ignore[misc]


# -- StepStats ------------------------------------------------------------------------------


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
            {"num_selected": torch.ones(3, 2, dtype=torch.long)},
            ValueError,
            r"num_selected must have the shape of retrieved \[2, 3\], got \[3, 2\]",
        ),
        (
            {"num_selected": torch.ones(2, 3, 1, dtype=torch.long)},
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
        "num_selected": torch.ones(2, 3, dtype=torch.long),
        **kwargs,
    }
    with pytest.raises(error, match=fragment):
        StepStats(**fields)


NUM = torch.tensor([[10, 20], [0, 5]])
PROXY = torch.tensor([[100, 0], [7, 1]])


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
    stats = StepStats(torch.zeros(2, 2, dtype=torch.bool), NUM, proxy_bytes=proxy)
    got = stats.bytes_read(head_dim=head_dim, value_dim=value_dim, element_size=element_size)
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got.tolist() == expected


def test_bytes_read_sums_over_heads_against_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    num = torch.randint(0, 5000, (3, 8), generator=g)
    proxy = torch.randint(0, 10**6, (3, 8), generator=g)
    stats = StepStats(torch.rand(3, 8, generator=g) < 0.5, num, proxy_bytes=proxy)
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
    stats = StepStats(torch.zeros(1, 1, dtype=torch.bool), torch.ones(1, 1, dtype=torch.long))
    with pytest.raises(error, match=fragment):
        stats.bytes_read(**kwargs)
