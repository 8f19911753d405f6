"""prhs_kernels.sparse_decode: attention over a selection against a float64 brute force over the
selected positions, identical on every layout."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core.selection import Compensation, Selection
from prhs_kernels import sparse_decode_attention

# (B, T, Hq, Hkv, D, Dv, s)
CASES = [
    (1, 1, 1, 1, 8, 8, 1),  # T=1
    (2, 1, 4, 1, 8, 8, 8),  # T=1 in a block of 8
    (2, 37, 8, 2, 16, 16, 8),  # GQA 4, T not a multiple of the block
    (3, 40, 8, 8, 16, 16, 1),  # GQA 1
    (2, 64, 8, 1, 32, 32, 8),  # GQA 8, aligned
    (3, 29, 4, 4, 8, 12, 1),  # Dv != D
]
IDS = [f"B{c[0]}-T{c[1]}-Hq{c[2]}-Hkv{c[3]}-D{c[4]}-Dv{c[5]}-s{c[6]}" for c in CASES]
WIDTHS = ["K0", "K3", "Kfull"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OUT_TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}
LSE_TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32 from exact inputs, whatever the cache dtype


def _lens(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, t + 1, (b,), generator=g).tolist()
    lens[0] = t
    return lens


def _query(b, hq, d, dtype, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, d, generator=g, dtype=torch.float64).to(dtype)


def _selection(b, hkv, t, s, width, seed):
    """Random distinct block ids (some past a row's end), random counts with a row of 0 and a
    full row, and garbage (not -1) past every count."""
    g = torch.Generator().manual_seed(seed)
    n_ids = -(-t // s) + 1  # one block past T
    k_max = {"K0": 0, "K3": min(3, n_ids), "Kfull": n_ids}[width]
    idx = torch.stack([torch.randperm(n_ids, generator=g)[:k_max] for _ in range(b * hkv)]).view(
        b, hkv, k_max
    )
    counts = torch.randint(0, k_max + 1, (b, hkv), generator=g)
    counts[0, 0] = k_max
    if b * hkv > 1:
        counts.view(-1)[-1] = 0
    past = torch.arange(k_max).view(1, 1, -1) >= counts.unsqueeze(-1)
    garbage = torch.randint(-5, 2 * n_ids + 3, idx.shape, generator=g)
    idx = torch.where(past, garbage, idx)
    return Selection(idx.to(torch.int32), counts.to(torch.int32), s)


def _brute(query, data, selection, scaling):
    """float64 ``(out [B, Hq, Dv], lse [B, Hq])``: softmax over the selected positions only."""
    b, hq, _ = query.shape
    hkv = data.keys.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hq, data.values.shape[-1], dtype=torch.float64)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float64)
    for bi, n in enumerate(data.lens):
        for h in range(hkv):
            if selection is None:
                pos = list(range(n))
            else:
                s = selection.block_size
                c = int(selection.counts[bi, h])
                ids = [j for j in selection.indices[bi, h, :c].tolist() if j >= 0]
                pos = sorted({j * s + o for j in ids for o in range(s) if j * s + o < n})
            if not pos:
                continue
            k = data.keys[bi, h, pos].double()
            v = data.values[bi, h, pos].double()
            for qh in range(h * g, (h + 1) * g):
                logits = k @ query[bi, qh].double() * scaling
                lse[bi, qh] = torch.logsumexp(logits, 0)
                out[bi, qh] = torch.softmax(logits, 0) @ v
    return out, lse


def _check(got, want, dtype):
    out, lse = got
    want_out, want_lse = want
    torch.testing.assert_close(out.double(), want_out, **OUT_TOL[dtype])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse.double(), want_lse, **LSE_TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(("b", "t", "hq", "hkv", "d", "dv", "s"), CASES, ids=IDS)
def test_matches_float64_brute_force(make_kv, layout_name, b, t, hq, hkv, d, dv, s, width, dtype):
    cache_dtype = DTYPES[dtype]
    data = make_kv(_lens(b, t, seed=t), hkv, d, value_dim=dv, dtype=cache_dtype, seed=t)
    kv = data[layout_name]
    q = _query(b, hq, d, cache_dtype)
    sel = _selection(b, hkv, t, s, width, seed=t + s)
    scaling = d**-0.5
    out, lse = sparse_decode_attention(q, kv, sel, scaling)
    assert (out.shape, out.dtype) == ((b, hq, dv), cache_dtype)
    assert (lse.shape, lse.dtype) == ((b, hq), torch.float32)
    _check((out, lse), _brute(q, data, sel, scaling), cache_dtype)
    # Bit-identical on every layout.
    out_c, lse_c = sparse_decode_attention(q, data["contig"], sel, scaling)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize(("b", "t", "hq", "hkv", "d", "dv", "s"), CASES, ids=IDS)
def test_dense(make_kv, layout_name, b, t, hq, hkv, d, dv, s, dtype):
    cache_dtype = DTYPES[dtype]
    data = make_kv(_lens(b, t, seed=t + 1), hkv, d, value_dim=dv, dtype=cache_dtype)
    kv = data[layout_name]
    q = _query(b, hq, d, cache_dtype)
    got = sparse_decode_attention(q, kv, None, d**-0.5)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    _check(got, _brute(q, data, None, d**-0.5), cache_dtype)
    # A selection of every block gives the same attention.
    nb = -(-t // s)
    every = Selection(
        torch.arange(nb, dtype=torch.int32).expand(b, hkv, nb).contiguous(),
        torch.full((b, hkv), nb, dtype=torch.int32),
        s,
    )
    out_all, lse_all = sparse_decode_attention(q, kv, every, d**-0.5)
    torch.testing.assert_close(out_all, got[0])
    torch.testing.assert_close(lse_all, got[1])
    out_c, lse_c = sparse_decode_attention(q, data["contig"], None, d**-0.5)
    assert torch.equal(got[0], out_c) and torch.equal(got[1], lse_c)


def test_out_and_lse_buffers_are_written_in_place(make_kv, layout_name):
    data = make_kv([37, 12], 2, 16)
    kv = data[layout_name]
    q = _query(2, 8, 16, torch.float32)
    sel = _selection(2, 2, 37, 8, "K3", seed=3)
    want_out, want_lse = sparse_decode_attention(q, kv, sel, 0.25)
    out = torch.full((2, 8, 16), float("nan"))
    lse = torch.full((2, 8), float("nan"))
    o, s = sparse_decode_attention(q, kv, sel, 0.25, out=out, lse=lse)
    assert o is out and s is lse
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # Either buffer alone.
    out2 = torch.full((2, 8, 16), float("nan"))
    o, s = sparse_decode_attention(q, kv, None, 0.25, out=out2)
    assert o is out2 and torch.isfinite(out2).all()
    lse2 = torch.full((2, 8), float("nan"))
    o, s = sparse_decode_attention(q, kv, None, 0.25, lse=lse2)
    assert s is lse2 and torch.equal(o, out2)


def test_empty_rows_give_zeros_and_minus_inf(make_kv, layout_name):
    data = make_kv([20, 5, 9], 2, 8, max_len=24)
    kv = data[layout_name]
    q = _query(3, 4, 8, torch.float32)
    idx = torch.full((3, 2, 2), -1, dtype=torch.int32)
    counts = torch.zeros(3, 2, dtype=torch.int32)
    idx[0, 1] = torch.tensor([1, 4])  # block 4 of 4 covers 16..19: inside row 0 (len 20)
    counts[0, 1] = 2
    idx[1, 0] = torch.tensor([2, 5])  # blocks 2, 5 start at 8 and 20 >= len 5: nothing to read
    counts[1, 0] = 2
    idx[2, 0] = torch.tensor([7, 99])  # garbage past a count of 0
    sel = Selection(idx, counts, 4)
    out, lse = sparse_decode_attention(q, kv, sel, 0.3)
    nonempty = torch.zeros(3, 4, dtype=torch.bool)
    nonempty[0, 2:] = True  # query heads 2, 3 read KV head 1
    assert torch.equal(out[~nonempty], torch.zeros(int((~nonempty).sum()), 8))
    assert torch.isneginf(lse[~nonempty]).all()
    assert torch.isfinite(out[nonempty]).all() and torch.isfinite(lse[nonempty]).all()
    _check((out, lse), _brute(q, data, sel, 0.3), torch.float32)


def test_nan_is_propagated_not_hidden(make_kv, layout_name):
    """A NaN query, or a NaN in a selected key or value, gives NaN; unselected NaNs do not."""
    lens = [16, 10]
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 16, 8, generator=g)
    values = torch.randn(2, 2, 16, 8, generator=g)
    keys[0, 0, 3] = float("nan")  # position 3 of row 0, KV head 0
    values[1, 1, 6] = float("nan")  # position 6 of row 1, KV head 1
    data = make_kv(lens, 2, 8, keys=keys, values=values)
    kv = data[layout_name]
    q = _query(2, 4, 8, torch.float32)
    idx = torch.tensor([[[0, 3], [0, 3]], [[5, 6], [5, 6]]], dtype=torch.int32)
    counts = torch.tensor([[2, 2], [2, 2]], dtype=torch.int32)
    out, lse = sparse_decode_attention(q, kv, Selection(idx, counts), 0.3)
    nan_rows = torch.tensor([[True, True, False, False], [False, False, True, True]])
    assert torch.isnan(out[nan_rows]).all()
    assert torch.isnan(lse[0, :2]).all()  # a NaN key makes the logits NaN
    assert torch.isfinite(lse[1, 2:]).all()  # a NaN value does not touch them
    assert torch.isfinite(out[~nan_rows]).all()
    # Not selected: no NaN anywhere.
    safe = Selection(torch.tensor([[[0, 1]] * 2, [[5, 7]] * 2], dtype=torch.int32), counts)
    out, lse = sparse_decode_attention(q, kv, safe, 0.3)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # A NaN query head gives a NaN output, not zeros; other heads are unchanged.
    q_nan = q.clone()
    q_nan[1, 2] = float("nan")
    ref_out, ref_lse = sparse_decode_attention(q, kv, safe, 0.3)
    out, lse = sparse_decode_attention(q_nan, kv, safe, 0.3)
    assert torch.isnan(out[1, 2]).all() and torch.isnan(lse[1, 2])
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(out[keep], ref_out[keep]) and torch.equal(lse[keep], ref_lse[keep])
    out, _ = sparse_decode_attention(q_nan, kv, None, 0.3)
    assert torch.isnan(out[1, 2]).all()


def test_bad_input_is_rejected(make_kv):
    data = make_kv([10, 4], 2, 8)
    kv = data["paged16"]
    q = _query(2, 4, 8, torch.float32)
    sel = Selection.allocate(2, 2, 3, 1, "cpu")
    with pytest.raises(TypeError, match="cast the query"):
        sparse_decode_attention(q.to(torch.bfloat16), kv, sel, 0.3)
    with pytest.raises(TypeError, match="cast the query"):
        sparse_decode_attention(q.double(), kv, None, 0.3)
    with pytest.raises(ValueError, match=r"selection\.indices must have shape"):
        sparse_decode_attention(q, kv, Selection.allocate(2, 3, 3, 1, "cpu"), 0.3)
    with pytest.raises(ValueError, match="does not match the cache"):
        sparse_decode_attention(q[:1], kv, sel, 0.3)
    with pytest.raises(TypeError, match="Selection or None"):
        sparse_decode_attention(q, kv, torch.zeros(2, 2, 3, dtype=torch.int32), 0.3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must have shape"):
        sparse_decode_attention(q, kv, sel, 0.3, out=torch.empty(2, 2, 8))
    with pytest.raises(ValueError, match="lse must have shape"):
        sparse_decode_attention(q, kv, sel, 0.3, lse=torch.empty(2, 2))


def test_meta_shapes(make_meta_layouts):
    """No value is read on the host: attention runs on ``meta`` tensors."""
    b, hq, hkv, t, d = 2, 8, 2, 40, 16
    meta = torch.device("meta")
    for name, kv in make_meta_layouts(b, hkv, t, d, torch.bfloat16).items():
        q = torch.empty(b, hq, d, dtype=torch.bfloat16, device=meta)
        sel = Selection(
            torch.empty(b, hkv, 5, dtype=torch.int32, device=meta),
            torch.empty(b, hkv, dtype=torch.int32, device=meta),
            8,
        )
        for selection in (sel, None):
            out, lse = sparse_decode_attention(q, kv, selection, 0.25)
            assert (out.shape, out.dtype, out.device.type) == ((b, hq, d), torch.bfloat16, "meta")
            assert (lse.shape, lse.dtype, lse.device.type) == ((b, hq), torch.float32, "meta")
        out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=meta)
        lse = torch.empty(b, hq, device=meta)
        o, s = sparse_decode_attention(q, kv, sel, 0.25, out=out, lse=lse)
        assert o is out and s is lse, name


def test_cuda_path_row_gather_matches_the_reference_gather_on_both_layouts() -> None:
    """``gather_rows`` (the CUDA path's index_select gather) reads the same rows as the
    reference gather wherever a position exists; elsewhere it reads a real row (never junk
    storage), which the attention masks."""
    from prhs_core import ContiguousKV, PagedKV
    from prhs_kernels.kv.reference import gather_kv_reference
    from prhs_kernels.sparse_decode.cuda import gather_rows

    g = torch.Generator().manual_seed(3)
    b, h, t, d = 3, 2, 20, 4
    lens = torch.tensor([20, 7, 12], dtype=torch.int32)
    k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    start = torch.tensor([0, 13, 8], dtype=torch.int32)
    pool_k, pool_v = torch.randn(80, h, d, generator=g), torch.randn(80, h, d, generator=g)
    table = torch.randperm(80, generator=g)[:60].view(3, 20).to(torch.int32)
    layouts = [
        ContiguousKV(k, v, lens, start),
        PagedKV(pool_k, pool_v, table, torch.tensor([2, 0, 1]), lens),
    ]
    pos = torch.randint(-1, 20, (b, h, 9), generator=g)
    pos = torch.where(pos < lens.view(-1, 1, 1), pos, -1)
    ok = (pos >= 0).unsqueeze(-1)
    for kv in layouts:
        fk, fv = gather_rows(kv, pos)
        rk, rv = gather_kv_reference(kv, pos)
        assert torch.equal(torch.where(ok, fk, 0), rk)
        assert torch.equal(torch.where(ok, fv, 0), rv)
        assert bool(torch.isfinite(fk).all()) and bool(torch.isfinite(fv).all())


def test_a_compensation_is_merged_through_the_log_sum_exp(make_kv) -> None:
    """A selection with a :class:`Compensation` gives the softmax over its positions' logits
    and one extra term per query head (log-mass ``lse``, value ``out``); ``-inf`` adds nothing,
    and a row that selects nothing is the compensation alone."""

    data = make_kv([9, 6], 1, 8, max_len=9)
    kv = data["contig"]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 8, generator=g)
    idx = torch.tensor([[[0, 3, 5]], [[1, -1, -1]]], dtype=torch.int32)
    counts = torch.tensor([[3], [0]], dtype=torch.int32)
    comp_lse = torch.tensor([[0.3, float("-inf")], [1.2, -0.5]])
    comp_out = torch.randn(2, 2, 8, generator=g)
    sel = Selection(idx, counts, 1, None, Compensation(comp_lse, comp_out))
    out, lse = sparse_decode_attention(q, kv, sel, 0.5)
    k, v = data.keys.double(), data.values.double()
    for b, chosen in ((0, [0, 3, 5]), (1, [])):
        for h in range(2):
            logits = [0.5 * float(q[b, h].double() @ k[b, 0, t]) for t in chosen]
            values = [v[b, 0, t] for t in chosen]
            if math.isfinite(comp_lse[b, h]):
                logits.append(float(comp_lse[b, h]))
                values.append(comp_out[b, h].double())
            w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
            want = sum(w[i] * x for i, x in enumerate(values))
            torch.testing.assert_close(out[b, h].double(), want, rtol=1e-5, atol=1e-6)
            want_lse = torch.logsumexp(torch.tensor(logits, dtype=torch.float64), 0)
            assert lse[b, h].item() == pytest.approx(want_lse.item(), abs=1e-5)
    with pytest.raises(ValueError, match=r"compensation\.out"):
        bad = Selection(idx, counts, 1, None, Compensation(comp_lse, comp_out[..., :4]))
        sparse_decode_attention(q, kv, bad, 0.5)
