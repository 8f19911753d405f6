"""prhs_kernels.compose: windows, dilation and union against brute-force Python sets."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.compose import dilate_indices, union_indices, window_indices, window_widths

# (n_sink, n_local, s)
WINDOWS = [
    (0, 0, 1),
    (0, 0, 8),
    (4, 0, 1),
    (0, 6, 1),
    (4, 16, 1),
    (4, 16, 8),
    (5, 13, 4),
    (16, 16, 16),
    (1, 1, 3),
    (30, 50, 7),
]
LENS = [0, 1, 3, 4, 5, 8, 13, 16, 17, 29, 33, 64, 100]


def _window_blocks(n, n_sink, n_local, s):
    sink = {t // s for t in range(min(n_sink, n))}
    local = {t // s for t in range(max(0, n - n_local), n)}
    return sink, local


@pytest.mark.parametrize(
    ("n_sink", "n_local", "s"), WINDOWS, ids=[f"sink{a}-local{b}-s{c}" for a, b, c in WINDOWS]
)
def test_window_indices_match_sets(n_sink, n_local, s):
    ws, wl = window_widths(n_sink, n_local, s)
    assert ws == -(-n_sink // s)
    assert wl == (0 if n_local == 0 else -(-n_local // s) + 1)
    for dtype in (torch.int32, torch.int64):
        sink, local = window_indices(torch.tensor(LENS, dtype=dtype), n_sink, n_local, s)
        assert sink.shape == (len(LENS), ws) and local.shape == (len(LENS), wl)
        assert sink.dtype == torch.int32 and local.dtype == torch.int32
        for i, n in enumerate(LENS):
            want_sink, want_local = _window_blocks(n, n_sink, n_local, s)
            for got, want, what in ((sink[i], want_sink, "sink"), (local[i], want_local, "local")):
                ids = [j for j in got.tolist() if j != -1]
                assert all(j >= 0 for j in got.tolist() if j != -1)
                assert ids == sorted(want), f"len {n} {what}: {got.tolist()} vs {sorted(want)}"
                # Existing blocks first, then -1.
                assert got.tolist() == ids + [-1] * (got.numel() - len(ids))


def _brute_dilate(idx_row, count, m, r):
    out = []
    for p in idx_row[: min(m, count)]:
        if p < 0:
            continue
        out += [p + j for j in range(1, r + 1)] + [p - j for j in range(1, r + 1) if p - j >= 0]
    return sorted(out)


# (m, r, width)
DILATE = [(0, 2, 5), (3, 0, 5), (1, 1, 5), (3, 2, 5), (8, 2, 5), (5, 3, 0)]


@pytest.mark.parametrize(("m", "r", "width"), DILATE, ids=[f"m{a}-r{b}-M{c}" for a, b, c in DILATE])
def test_dilate_indices_matches_brute_force(m, r, width):
    g = torch.Generator().manual_seed(m * 10 + r)
    b, h = 3, 4
    idx = torch.randint(0, 40, (b, h, width), generator=g, dtype=torch.int32)
    idx[0, 0, :2] = torch.tensor([0, 1], dtype=torch.int32)[: min(2, width)]  # near 0
    counts = torch.randint(0, width + 1, (b, h), generator=g, dtype=torch.int32)
    if width:
        counts[0, 0] = width
        idx[1, 1, 0] = -1  # a missing entry inside the count
        counts[1, 1] = width
    # Garbage past each count (valid-looking ids, huge ones, negatives): never dilated.
    past = torch.arange(width).view(1, 1, -1) >= counts.unsqueeze(-1)
    garbage = torch.randint(-50, 1000, idx.shape, generator=g, dtype=torch.int32)
    idx = torch.where(past, garbage, idx)
    for counts_dtype in (torch.int32, torch.int64):
        got = dilate_indices(idx, counts.to(counts_dtype), m, r)
        assert got.dtype == torch.int32
        assert got.shape == (b, h, 2 * r * m if m > 0 and r > 0 else 0)
        for bi in range(b):
            for hi in range(h):
                row = got[bi, hi].tolist()
                want = _brute_dilate(idx[bi, hi].tolist(), int(counts[bi, hi]), m, r)
                assert sorted(j for j in row if j != -1) == want, (bi, hi)
                assert all(j >= -1 for j in row)
    # Shared lists ([B, M] with counts [B]) work the same way.
    got = dilate_indices(idx[:, 0], counts[:, 0], m, r)
    for bi in range(b):
        want = _brute_dilate(idx[bi, 0].tolist(), int(counts[bi, 0]), m, r)
        assert sorted(j for j in got[bi].tolist() if j != -1) == want


def _brute_union(parts, limit, b, h, width):
    idx = []
    counts = []
    for bi in range(b):
        row_i, row_c = [], []
        for hi in range(h):
            ids = set()
            for p in parts:
                lst = p[bi, hi] if p.ndim == 3 else p[bi]
                ids |= {j for j in lst.tolist() if 0 <= j < int(limit[bi])}
            ids = sorted(ids)
            row_c.append(min(len(ids), width))
            ids = ids[:width]
            row_i.append(ids + [-1] * (width - len(ids)))
        idx.append(row_i)
        counts.append(row_c)
    return torch.tensor(idx, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32)


# (part widths as "h" per head / "s" shared, width)
UNIONS = [
    ([("h", 6)], 10),
    ([("s", 4)], 6),
    ([("s", 3), ("h", 8), ("s", 5)], 20),
    ([("s", 3), ("h", 8), ("s", 5)], 4),  # truncated: the width smallest ids
    ([("h", 0), ("s", 2)], 3),
    ([("h", 5), ("h", 5)], 1),
    ([("s", 3), ("s", 6)], 12),  # shared parts only
]


@pytest.mark.parametrize(
    ("spec", "width"),
    UNIONS,
    ids=["+".join(f"{k}{w}" for k, w in sp) + f"-K{wd}" for sp, wd in UNIONS],
)
def test_union_indices_matches_sets(spec, width):
    g = torch.Generator().manual_seed(width)
    b, h = 3, 4
    limit = torch.tensor([12, 1, 30], dtype=torch.int32)
    parts = []
    for kind, w in spec:
        shape = (b, h, w) if kind == "h" else (b, w)
        # Duplicates, -1, ids past the limit and negative garbage.
        parts.append(torch.randint(-3, 34, shape, generator=g, dtype=torch.int32))
    if parts[0].numel():
        parts[0].view(-1)[0] = 0
    out_idx = torch.full((b, h, width), 777, dtype=torch.int32)
    out_counts = torch.full((b, h), 777, dtype=torch.int32)
    ptr = (out_idx.data_ptr(), out_counts.data_ptr())
    assert union_indices(parts, limit, out_idx, out_counts) is None
    assert (out_idx.data_ptr(), out_counts.data_ptr()) == ptr  # written in place
    want_idx, want_counts = _brute_union(parts, limit, b, h, width)
    assert torch.equal(out_counts, want_counts)
    assert torch.equal(out_idx, want_idx)
    for row, c in zip(out_idx.view(-1, width).tolist(), out_counts.view(-1).tolist(), strict=True):
        used = row[:c]
        assert used == sorted(set(used))  # ascending, distinct
        assert all(j == -1 for j in row[c:])


def test_union_with_int64_parts_and_limit():
    parts = [torch.tensor([[5, 2, -1, 2]]), torch.tensor([[[9, 0], [3, 5]]])]
    out_idx = torch.empty(1, 2, 4, dtype=torch.int32)
    out_counts = torch.empty(1, 2, dtype=torch.int32)
    union_indices(parts, torch.tensor([9]), out_idx, out_counts)
    assert out_idx.tolist() == [[[0, 2, 5, -1], [2, 3, 5, -1]]]
    assert out_counts.tolist() == [[3, 3]]


def test_bad_input_is_rejected():
    out_idx = torch.empty(2, 3, 4, dtype=torch.int32)
    out_counts = torch.empty(2, 3, dtype=torch.int32)
    limit = torch.tensor([5, 5])
    with pytest.raises(ValueError, match="at least one part"):
        union_indices([], limit, out_idx, out_counts)
    with pytest.raises(ValueError, match="parts\\[0\\] must have shape"):
        union_indices([torch.zeros(2, 2, 4, dtype=torch.int32)], limit, out_idx, out_counts)
    with pytest.raises(ValueError, match="parts\\[0\\] must have shape"):
        union_indices([torch.zeros(3, 4, dtype=torch.int32)], limit, out_idx, out_counts)
    with pytest.raises(ValueError, match="out_counts must have shape"):
        union_indices([torch.zeros(2, 4, dtype=torch.int32)], limit, out_idx, out_counts[:, :2])
    with pytest.raises(TypeError, match="integer"):
        union_indices([torch.zeros(2, 4)], limit, out_idx, out_counts)
    with pytest.raises(ValueError, match="n_sink must be >= 0"):
        window_indices(limit, -1, 2, 4)
    with pytest.raises(ValueError, match="s must be >= 1"):
        window_indices(limit, 1, 2, 0)
    with pytest.raises(ValueError, match="counts must have 2 dimensions"):
        dilate_indices(out_idx, out_counts[0], 1, 1)


def test_meta_shapes():
    """No value is read on the host: every op runs on ``meta`` tensors."""
    meta = torch.device("meta")
    lens = torch.empty(3, dtype=torch.int32, device=meta)
    sink, local = window_indices(lens, 5, 13, 4)
    assert (sink.shape, local.shape) == ((3, 2), (3, 5))
    assert sink.dtype == local.dtype == torch.int32 and sink.device.type == "meta"
    idx = torch.empty(3, 2, 6, dtype=torch.int32, device=meta)
    counts = torch.empty(3, 2, dtype=torch.int32, device=meta)
    dil = dilate_indices(idx, counts, 4, 2)
    assert (dil.shape, dil.dtype, dil.device.type) == ((3, 2, 16), torch.int32, "meta")
    out_idx = torch.empty(3, 2, 9, dtype=torch.int32, device=meta)
    out_counts = torch.empty(3, 2, dtype=torch.int32, device=meta)
    union_indices([sink, idx, dil, local], lens, out_idx, out_counts)
    assert out_idx.shape == (3, 2, 9) and out_counts.shape == (3, 2)
