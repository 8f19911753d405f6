"""The sparse decode reference against independent computations (SDPA, prhs_core.theory)."""

from __future__ import annotations

import pytest
import torch

from prhs_core import theory
from prhs_core.cache import ContiguousKVCache, PagedKVCache
from prhs_core.selection import Selection
from prhs_kernels import sparse_decode_attention

CASES = [(1, 1, 1, 1, 8), (2, 37, 4, 2, 16), (3, 64, 8, 1, 32), (2, 100, 6, 3, 8)]


def _case(b, t, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, t, d, generator=g)
    v = torch.randn(b, hkv, t, d, generator=g)
    q = torch.randn(b, hq, d, generator=g)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    lens[0] = t
    return q, k, v, lens


@pytest.mark.parametrize(
    ("b", "t", "hq", "hkv", "d"),
    CASES,
    ids=[f"B{c[0]}-T{c[1]}-Hq{c[2]}-Hkv{c[3]}-D{c[4]}" for c in CASES],
)
def test_dense_selection_matches_sdpa(b, t, hq, hkv, d):
    q, k, v, lens = _case(b, t, hq, hkv, d)
    cache = ContiguousKVCache(k, v, lens)
    out, lse = sparse_decode_attention(q, cache, Selection(None), d**-0.5)
    g = hq // hkv
    for i in range(b):
        n = int(lens[i])
        kk = k[i, :, :n].repeat_interleave(g, 0)
        vv = v[i, :, :n].repeat_interleave(g, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1), kk, vv, scale=d**-0.5
        ).squeeze(1)
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)
        logits = torch.einsum("hd,htd->ht", q[i], kk) * d**-0.5
        torch.testing.assert_close(lse[i], torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize(
    ("b", "t", "hq", "hkv", "d"),
    CASES,
    ids=[f"B{c[0]}-T{c[1]}-Hq{c[2]}-Hkv{c[3]}-D{c[4]}" for c in CASES],
)
def test_sparse_selection_matches_theory_on_both_layouts(b, t, hq, hkv, d, block_size):
    q, k, v, lens = _case(b, t, hq, hkv, d, seed=1)
    nb = -(-t // block_size)
    gen = torch.Generator().manual_seed(2)
    mask_blocks = torch.rand(b, hkv, nb, generator=gen) < 0.4
    mask_blocks[..., 0] = True  # never empty
    sel = Selection.from_mask(mask_blocks)
    sel = Selection(sel.indices, block_size)
    contiguous = ContiguousKVCache(k, v, lens)
    # The same data in a shuffled token pool.
    n_slots = b * t + 5
    perm = torch.randperm(n_slots, generator=gen)[: b * t].view(b, t)
    kp = torch.randn(n_slots, hkv, d)
    vp = torch.randn(n_slots, hkv, d)
    kp[perm] = k.permute(0, 2, 1, 3)
    vp[perm] = v.permute(0, 2, 1, 3)
    paged = PagedKVCache(kp, vp, perm, lens)
    out_c, lse_c = sparse_decode_attention(q, contiguous, sel, d**-0.5)
    out_p, lse_p = sparse_decode_attention(q, paged, sel, d**-0.5)
    torch.testing.assert_close(out_c, out_p)
    torch.testing.assert_close(lse_c, lse_p)
    token_mask = sel.to_mask(lens, t, hkv)
    g = hq // hkv
    logits = torch.einsum("bhd,bhtd->bht", q, k.repeat_interleave(g, 1)) * d**-0.5
    valid = (torch.arange(t).view(1, 1, -1) < lens.view(-1, 1, 1)).expand(b, hq, t)
    sel_q = token_mask.repeat_interleave(g, 1)
    ref = theory.sparse_output(logits, v.repeat_interleave(g, 1), sel_q, valid)
    torch.testing.assert_close(out_c, ref.float(), rtol=1e-5, atol=1e-5)


def test_shape_mismatch_is_rejected():
    q, k, v, lens = _case(2, 10, 4, 2, 8)
    cache = ContiguousKVCache(k, v, lens)
    with pytest.raises(ValueError, match="Hkv=2"):
        sparse_decode_attention(q, cache, Selection(torch.zeros(2, 3, 1, dtype=torch.long)), 0.3)
    with pytest.raises(ValueError, match="does not match the cache"):
        sparse_decode_attention(q[:1], cache, Selection(None), 0.3)
