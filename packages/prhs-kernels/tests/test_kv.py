"""prhs_kernels.kv: token locations and gathers, against brute-force loops, on every layout."""

from __future__ import annotations

import pytest
import torch

from prhs_core.layout import ContiguousKV
from prhs_kernels.kv import gather_kv, row_bounds, row_bounds_reference, token_locations


def test_helper_layouts_hold_nan_where_unused(make_kv):
    """The premise of every layout test: unused storage is NaN, tables are shuffled."""
    data = make_kv([5, 37, 20], 2, 8, max_len=40)
    n_used = sum(data.lens) * 2 * 8
    for name, kv in data.layouts.items():
        storage = kv.k if isinstance(kv, ContiguousKV) else kv.k_pool
        assert int(torch.isfinite(storage).sum()) == n_used, name
        assert torch.isnan(storage).any(), name
        if isinstance(kv, ContiguousKV):
            assert (kv.start is None) == (name == "contig0")
        else:
            assert kv.max_len == 40 < kv.req_to_token.shape[1]
            assert not torch.equal(kv.req_pool_indices, torch.arange(3, dtype=torch.int32))
            rows = kv.req_to_token[kv.req_pool_indices.long()]
            if kv.page_size > 1:  # each page starts page-aligned at a page's first position
                first = rows[:, :: kv.page_size]
                assert all(
                    int(first[b, j]) % kv.page_size == 0
                    for b, n in enumerate(data.lens)
                    for j in range(-(-n // kv.page_size))
                )
    assert data["contig"].start.tolist() != [0, 0, 0]


# (lens, Hkv, D, Dv, max_len)
CASES = [
    ([1], 1, 4, 4, 1),
    ([5, 37], 2, 16, 8, 40),
    ([33, 1, 17], 3, 8, 8, 33),
]
IDS = [f"B{len(c[0])}-T{c[4]}-Hkv{c[1]}-D{c[2]}-Dv{c[3]}" for c in CASES]


def _positions(lens, hkv, k, t, seed):
    """Random positions ``[B, Hkv, K]``: valid ones, negatives, and ones past each length."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(-3, t + 4, (len(lens), hkv, k), generator=g)
    pos[..., 0] = -1
    pos[..., 1] = torch.tensor(lens).view(-1, 1)  # == seq_len: just past the end
    pos[..., 2] = torch.tensor(lens).view(-1, 1) - 1  # the last position
    pos[..., 3] = 0
    return pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("lens", "hkv", "d", "dv", "t"), CASES, ids=IDS)
def test_gather_returns_stored_values_and_zeros(make_kv, layout_name, lens, hkv, d, dv, t, dtype):
    data = make_kv(lens, hkv, d, value_dim=dv, dtype=dtype, max_len=t)
    kv = data[layout_name]
    for pos in (_positions(lens, hkv, 24, t, seed=1), _positions(lens, hkv, 4, t, seed=2)):
        k, v = gather_kv(kv, pos)
        assert k.dtype == dtype and v is not None and v.dtype == dtype
        assert k.shape == (len(lens), hkv, pos.shape[-1], d)
        assert v.shape == (len(lens), hkv, pos.shape[-1], dv)
        want_k = torch.zeros_like(k)
        want_v = torch.zeros_like(v)
        for b, n in enumerate(lens):
            for h in range(hkv):
                for i, p in enumerate(pos[b, h].tolist()):
                    if 0 <= p < n:
                        want_k[b, h, i] = data.keys[b, h, p]
                        want_v[b, h, i] = data.values[b, h, p]
        # Exact: a gather never changes a value (and padding NaN never shows up).
        assert torch.equal(k, want_k)
        assert torch.equal(v, want_v)
        k_only, none = gather_kv(kv, pos, values=False)
        assert none is None
        assert torch.equal(k_only, want_k)


def test_gather_of_no_position(make_kv, layout_name):
    data = make_kv([3, 7], 2, 4)
    k, v = gather_kv(data[layout_name], torch.zeros(2, 2, 0, dtype=torch.int64))
    assert k.shape == (2, 2, 0, 4) and v is not None and v.shape == (2, 2, 0, 4)


@pytest.mark.parametrize("row_stride", [64, 100])
@pytest.mark.parametrize("pos_shape", [(), (5,), (3, 4)], ids=["B", "B-K", "B-H-K"])
@pytest.mark.parametrize(("lens", "hkv", "d", "dv", "t"), CASES, ids=IDS)
def test_token_locations(make_kv, layout_name, lens, hkv, d, dv, t, pos_shape, row_stride):
    data = make_kv(lens, hkv, d, value_dim=dv, max_len=t)
    kv = data[layout_name]
    g = torch.Generator().manual_seed(3)
    b = len(lens)
    pos = torch.randint(-2, t + 3, (b, *pos_shape), generator=g)
    for dtype in (torch.int64, torch.int32):
        loc = token_locations(kv, pos.to(dtype), row_stride)
        assert loc.dtype == torch.int64 and loc.shape == pos.shape
        flat_pos = pos.reshape(b, -1)
        flat_loc = loc.reshape(b, -1)
        for i, n in enumerate(lens):
            for p, got in zip(flat_pos[i].tolist(), flat_loc[i].tolist(), strict=True):
                if not 0 <= p < n:
                    assert got == -1
                elif isinstance(kv, ContiguousKV):
                    assert got == i * row_stride + p
                else:
                    req = int(kv.req_pool_indices[i])
                    assert got == int(kv.req_to_token[req, p])
                    # The location of a paged position is the pool slot holding its key.
                    assert torch.equal(kv.k_pool[got], data.keys[i, :, p])
                    assert torch.equal(kv.v_pool[got], data.values[i, :, p])


def test_contiguous_locations_are_distinct_and_fit_row_stride(make_kv):
    """Contiguous locations tile ``[0, B * row_stride)`` without overlap (a side cache of
    ``B * row_stride`` rows holds every position)."""
    data = make_kv([7, 3, 10], 1, 4)
    pos = torch.arange(10).expand(3, 10)
    for name in ("contig", "contig0"):
        loc = token_locations(data[name], pos, 10)
        used = loc[loc >= 0]
        assert used.unique().numel() == used.numel() == sum(data.lens)
        assert int(used.max()) < 3 * 10


def test_bad_input_is_rejected(make_kv):
    data = make_kv([3, 4], 2, 4)
    kv = data["paged16"]
    with pytest.raises(TypeError, match="ContiguousKV or a PagedKV"):
        gather_kv(object(), torch.zeros(2, 2, 1, dtype=torch.int64))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Hkv=2"):
        gather_kv(kv, torch.zeros(2, 3, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer"):
        gather_kv(kv, torch.zeros(2, 2, 1))
    with pytest.raises(ValueError, match="B=2"):
        token_locations(kv, torch.zeros(3, 1, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="row_stride"):
        token_locations(kv, torch.zeros(2, 1, dtype=torch.int64), 0)


def test_meta_shapes(make_meta_layouts):
    """No value is read on the host: every op runs on ``meta`` tensors."""
    b, hkv, t, d = 2, 3, 40, 8
    for name, kv in make_meta_layouts(b, hkv, t, d, torch.bfloat16).items():
        pos = torch.empty(b, hkv, 7, dtype=torch.int64, device="meta")
        k, v = gather_kv(kv, pos)
        assert k.device.type == "meta" and v is not None, name
        assert (k.shape, k.dtype) == ((b, hkv, 7, d), torch.bfloat16), name
        assert (v.shape, v.dtype) == ((b, hkv, 7, d), torch.bfloat16), name
        loc = token_locations(kv, torch.empty(b, 5, dtype=torch.int32, device="meta"), 64)
        assert (loc.shape, loc.dtype, loc.device.type) == ((b, 5), torch.int64, "meta"), name


def _masks() -> list[torch.Tensor]:
    """Validity masks: a left-padded run, a static cache's filled prefix, an empty row, a full
    one, a single column; and a strided view of a [B, 1, Tq, T] attention mask."""
    m = torch.zeros(4, 37, dtype=torch.bool)
    m[0, 5:] = True  # left padding
    m[1, :12] = True  # a filled prefix, then capacity
    m[3, 36] = True  # only the last column
    full = torch.ones(2, 3, dtype=torch.bool)
    four = torch.zeros(3, 1, 2, 20, dtype=torch.bool)
    four[0, 0, -1, 4:9] = True
    four[2, 0, -1, :] = True
    return [m, full, four[:, 0, -1, :]]


def test_row_bounds_torch_path():
    for m in _masks():
        start, lens = row_bounds(m, torch.float32)
        assert start.dtype == lens.dtype == torch.int32
        for r in range(m.shape[0]):
            cols = m[r].nonzero().flatten().tolist()
            assert int(lens[r]) == len(cols)
            assert int(start[r]) == (cols[0] if cols else 0)
        ref = row_bounds_reference(m)
        assert torch.equal(start, ref[0]) and torch.equal(lens, ref[1])


def test_row_bounds_rejects_bad_input_and_runs_on_meta():
    for bad in (torch.zeros(2, 3), torch.zeros(2, 3, 4, dtype=torch.bool), [[True]]):
        with pytest.raises(ValueError, match=r"\[B, T\] bool"):
            row_bounds(bad, torch.bfloat16)  # type: ignore[arg-type]
    start, lens = row_bounds(torch.empty(3, 50, dtype=torch.bool, device="meta"), torch.bfloat16)
    assert (start.shape, start.dtype, start.device.type) == ((3,), torch.int32, "meta")
    assert (lens.shape, lens.dtype, lens.device.type) == ((3,), torch.int32, "meta")
