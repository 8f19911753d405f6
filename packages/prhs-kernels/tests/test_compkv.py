"""prhs_kernels.compkv: CompKV's block estimates and compensation from side-cache fields against
the keys and values they summarise, on every layout; blocks that are not valid are -inf and add
nothing, whatever their page rows hold; bad input is refused."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_kernels.compkv import block_compensation, block_estimates
from prhs_kernels.kv import token_locations


def block_fields(data, name: str, p: int, layers: int = 2, empty: int = -1):
    """CompKV's side-cache fields of layer 1 of ``layers`` built through ``name``'s KV locations
    (strided views), and ``pages [B, NB]``. Rows no block uses hold NaN; block ``empty`` of row
    0 (if >= 0) holds no key (count 0)."""
    kv = data[name]
    b, hkv, t, d = data.keys.shape
    row_stride = -(-t // p) * p + p
    n_loc = b * row_stride if name.startswith("contig") else kv.k_pool.shape[0]
    n_rows = -(-n_loc // p) + 1
    shape = (n_rows, layers, hkv, d)
    ksum, ksq, vsum = (torch.full(shape, float("nan")) for _ in range(3))
    count = torch.full((n_rows, layers), float("nan"))
    pos = torch.arange(t).view(1, -1).expand(b, -1)
    loc = token_locations(kv, pos, row_stride)
    nb = -(-t // p)
    pages = torch.full((b, nb), -7, dtype=torch.int64)  # garbage where a block does not exist
    for i, n in enumerate(data.lens):
        for j in range(-(-n // p)):
            lo, hi = j * p, min((j + 1) * p, n)
            page = int(loc[i, lo]) // p
            pages[i, j] = page
            k = data.keys[i, :, lo:hi].double()
            v = data.values[i, :, lo:hi].double()
            ksum[page, 1], ksq[page, 1] = k.sum(1).float(), (k * k).sum(1).float()
            vsum[page, 1], count[page, 1] = v.sum(1).float(), hi - lo
            if i == 0 and j == empty:
                count[page, 1] = 0.0
    return ksum[:, 1], ksq[:, 1], vsum[:, 1], count[:, 1], pages


CASES = [([1], 2, 2, 8, 4), ([37, 5, 16], 8, 2, 16, 16)]


@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "p"), CASES)
def test_estimates_and_compensation_summarise_each_block(make_kv, lens, hq, hkv, d, p) -> None:
    data = make_kv(lens, hkv, d)
    for name in data.layouts:
        if name != "paged1" or p == 1:  # pages of one slot hold no whole block
            check_layout(data, name, lens, hq, hkv, d, p)


def check_layout(data, layout_name, lens, hq, hkv, d, p) -> None:
    ksum, ksq, vsum, count, pages = block_fields(data, layout_name, p, empty=0 if p > 4 else -1)
    b, g = len(lens), hq // hkv
    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(1))
    s = d**-0.5
    seq = data.seq_lens
    lm, lv = block_estimates(q, ksum, ksq, count, pages, seq, block_size=p, scaling=s)
    nb = pages.shape[1]
    assert lm.shape == lv.shape == (b, hkv, g, nb)
    w = torch.rand(b, hkv, g, nb, generator=torch.Generator().manual_seed(2))
    out = block_compensation(w, vsum, count, pages, seq, block_size=p, kv_dtype=torch.float32)
    want_out = torch.zeros(b, hkv, g, d, dtype=torch.float64)
    qd = q.double().view(b, hkv, g, d)
    for i, n in enumerate(lens):
        for j in range(nb):
            lo, hi = j * p, min((j + 1) * p, n)
            if lo >= n or (i == 0 and j == 0 and p > 4):  # no block, or the empty one
                assert bool(torch.isneginf(lm[i, :, :, j]).all()), (i, j)
                assert bool(torch.isneginf(lv[i, :, :, j]).all()), (i, j)
                continue
            k = data.keys[i, :, lo:hi].double()  # [Hkv, m, D]
            mu, var = k.mean(1), k.var(1, unbiased=False)
            want_m = math.log(hi - lo) + s * torch.einsum("hgd,hd->hg", qd[i], mu)
            want_v = torch.log(s * s * torch.einsum("hgd,hd->hg", qd[i] ** 2, var))
            torch.testing.assert_close(lm[i, :, :, j].double(), want_m, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(lv[i, :, :, j].double(), want_v, rtol=1e-3, atol=1e-3)
            vbar = data.values[i, :, lo:hi].double().mean(1)  # [Hkv, D]
            want_out[i] += w[i, :, :, j].double().unsqueeze(-1) * vbar.unsqueeze(1)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-4)


def test_bad_input_is_refused(make_kv) -> None:
    data = make_kv([20], 2, 8)
    ksum, ksq, vsum, count, pages = block_fields(data, "contig", 4)
    q = torch.randn(1, 4, 8)
    seq = data.seq_lens

    def est(**change):
        kw = dict(query=q, ksum=ksum, ksq=ksq, count=count, pages=pages, seq_lens=seq)
        kw.update(change)
        return block_estimates(**kw, block_size=4, scaling=1.0)

    with pytest.raises(ValueError, match="multiple of the fields' KV heads"):
        est(query=torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match=r"ksq must be float32 \[R=\d+, Hkv=2, D=8\]"):
        est(ksq=ksq.double())
    with pytest.raises(TypeError, match="pages must be an int32 or int64"):
        est(pages=pages.float())
    with pytest.raises(TypeError, match="seq_lens must be an int32"):
        est(seq_lens=seq.long())
    with pytest.raises(ValueError, match="count must have the fields'"):
        est(count=count[:3])
    w = torch.zeros(1, 2, 2, pages.shape[1])
    with pytest.raises(ValueError, match="weight's NB"):
        block_compensation(
            w[..., :2], vsum, count, pages, seq, block_size=4, kv_dtype=torch.float32
        )
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_compensation(w, vsum, count, pages, seq, block_size=0, kv_dtype=torch.float32)
