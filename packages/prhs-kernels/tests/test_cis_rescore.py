"""prhs_kernels.cis.cis_rescore: a reusing row's anchor pool re-ranked in place at the current
query (the selector-level behaviour is tested in prhs-selectors' test_cis.py); here the pool is
kept as a set, the rows that do not reuse are untouched, every layout gives the same result,
and bad input is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.cis import cis_rescore


def _fields(n: int, h: int, m: int, r: int, gen: torch.Generator):
    pool = torch.stack([torch.randperm(20, generator=gen)[: m + r] for _ in range(n * h)])
    pool = pool.view(n, h, m + r).to(torch.int32)
    idx, nxt = pool[..., :m].clone(), pool[..., m:].clone()
    nxt[0, 0, -1] = -1  # a pool shorter than its width
    cnt = torch.full((n, h), m, dtype=torch.int32)
    if n > 1:  # a list shorter than its width: its tail is not a candidate
        cnt[1, 1] = m - 2
        idx[1, 1, m - 2 :] = -1
    anchor_len = torch.full((n, h), 60, dtype=torch.int32)
    return idx, cnt, nxt, anchor_len


@pytest.mark.parametrize("block_size", [1, 2])
def test_the_pool_is_reranked_in_place_and_other_rows_kept(make_kv, block_size):
    gen = torch.Generator().manual_seed(0)
    b, h, g, d, m, r = 2, 2, 3, 16, 4, 5
    data = make_kv([70, 66], h, d, seed=2)
    q = torch.randn(b, h * g, d, generator=gen)
    slots = torch.tensor([1, 2])  # slot 1, KV head 1: a short list; slot 0: no row
    reuse = torch.tensor([[True, True], [False, True]])
    results = []
    for kv in data.layouts.values():
        idx, cnt, nxt, alen = _fields(3, h, m, r, gen=torch.Generator().manual_seed(1))
        before = (idx.clone(), cnt.clone(), nxt.clone())
        cis_rescore(q, kv, d**-0.5, reuse, alen, idx, cnt, nxt, slots, block_size=block_size,
                    n_sink=2, n_local=6, hold_local=True)  # fmt: skip
        assert torch.equal(idx[0], before[0][0]) and torch.equal(nxt[0], before[2][0])  # no row
        for bi, slot in enumerate(slots.tolist()):
            for hh in range(h):
                old = set(before[0][slot, hh, : before[1][slot, hh]].tolist())
                old |= set(before[2][slot, hh].tolist())
                new = set(idx[slot, hh, : cnt[slot, hh]].tolist()) | set(nxt[slot, hh].tolist())
                old.discard(-1)
                new.discard(-1)
                if not reuse[bi, hh]:
                    assert torch.equal(idx[slot, hh], before[0][slot, hh])
                    assert torch.equal(nxt[slot, hh], before[2][slot, hh])
                    continue
                assert new == old  # the same pool, partitioned again
                assert int(cnt[slot, hh]) == min(m, len(old))
        results.append((idx, cnt, nxt))
    for other in results[1:]:
        for x, y in zip(results[0], other, strict=True):
            assert torch.equal(x, y)


def test_bad_input_is_refused_before_any_write(make_kv):
    data = make_kv([30], 2, 8, seed=0)
    kv = data["contig"]
    q = torch.randn(1, 4, 8)
    idx, cnt, nxt, alen = _fields(1, 2, 3, 2, torch.Generator().manual_seed(0))
    snap = (idx.clone(), cnt.clone(), nxt.clone())
    slots = torch.tensor([0])
    on = torch.ones(1, 2, dtype=torch.bool)
    kw = dict(block_size=1, n_sink=2, n_local=4)
    with pytest.raises(ValueError, match="anchor_next must be int32"):
        cis_rescore(q, kv, 0.3, on, alen, idx, cnt, nxt.long(), slots, **kw)
    with pytest.raises(ValueError, match="reuse must have shape"):
        cis_rescore(q, kv, 0.3, on[:, :1], alen, idx, cnt, nxt, slots, **kw)
    with pytest.raises(ValueError, match="block score"):
        cis_rescore(q, kv, 0.3, on, alen, idx, cnt, nxt, slots, **kw, score="sum")
    with pytest.raises(ValueError, match="anchor_cnt"):
        cis_rescore(q, kv, 0.3, on, alen, idx, cnt[:, :1], nxt, slots, **kw)
    for x, y in zip((idx, cnt, nxt), snap, strict=True):
        assert torch.equal(x, y)


def test_retrieval_pool_keeps_the_next_blocks_in_block_order():
    from prhs_kernels.cis import retrieval_pool

    gen = torch.Generator().manual_seed(3)
    b, h, n, m, r = 2, 2, 30, 4, 6
    scores = torch.rand(b, h, n, generator=gen)
    scores[0, 1, 10:] = float("-inf")  # 10 finite blocks: 4 in the list, 6 next
    scores[1, 0, 7:] = float("-inf")  # 7 finite: 3 next, then -1
    retrieve = torch.tensor([[True, True], [True, False]])
    slots = torch.tensor([1, 0])
    nxt = torch.full((3, h, r), 9, dtype=torch.int32)
    before = nxt.clone()
    idx, val = retrieval_pool(scores, m, r, retrieve, nxt, slots)
    for bi in range(b):
        for hi in range(h):
            order = torch.argsort(scores[bi, hi], descending=True, stable=True)
            finite = order[scores[bi, hi][order] > float("-inf")]
            got = nxt[slots[bi], hi]
            if not retrieve[bi, hi]:
                assert torch.equal(got, before[slots[bi], hi])
                continue
            assert idx[bi, hi].tolist() == finite[:m].tolist()
            assert torch.equal(val[bi, hi], scores[bi, hi][finite[:m]])
            want = sorted(finite[m : m + r].tolist())
            assert got.tolist() == want + [-1] * (r - len(want))
    assert bool((nxt[2] == 9).all())  # a slot no row uses
    with pytest.raises(ValueError, match="anchor_next"):
        retrieval_pool(scores, m, r, retrieve, nxt.long(), slots)
    with pytest.raises(ValueError, match="retrieve"):
        retrieval_pool(scores, m, r, retrieve[:1], nxt, slots)
