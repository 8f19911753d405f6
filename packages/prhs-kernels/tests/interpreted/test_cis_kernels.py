"""The CIS step's Triton kernels (decide, block scores, compose) against their torch references,
under Triton's interpreter (run by ``../test_triton.py``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.cis import (
    anchor_union_reference,
    cis_compose,
    cis_decide,
    cis_decide_compose,
    cis_local_width,
    cis_path,
    retrieval_block_scores,
    retrieval_compose,
    top_blocks,
    top_blocks_compose,
)
from prhs_kernels.cis import triton as cis_triton
from prhs_kernels.compose import window_widths

PATH = "triton-interpreter"


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


def test_path_rules():
    assert cis_path("cpu", torch.bfloat16, 8) == PATH
    assert cis_path("cpu", torch.bfloat16, 6) == "torch"  # blocks are tiled by powers of two
    assert cis_path("cpu", torch.float32, 8) == "torch"


def _anchors(n, h, g, d, m, gen):
    """A state with random anchor fields over ``n`` slots."""
    q = torch.randn(n, h, g, d, generator=gen)
    length = torch.randint(0, 60, (n, h), generator=gen, dtype=torch.int32)
    cnt = torch.randint(0, m + 1, (n, h), generator=gen, dtype=torch.int32)
    idx = torch.stack([torch.randperm(3 * m, generator=gen)[:m] for _ in range(n * h)])
    idx = idx.view(n, h, m).to(torch.int32)
    idx = torch.where(torch.arange(m) < cnt.unsqueeze(-1), idx, -1)
    logd = torch.randn(n, h, generator=gen, dtype=torch.float64)
    return q, length, idx, cnt, logd


@pytest.mark.parametrize(("g", "d"), [(1, 16), (4, 32), (8, 8)])
def test_decide_matches_the_reference(g, d):
    gen = torch.Generator().manual_seed(g * d)
    b, h, n = 6, 3, 9
    aq, alen, *_ = _anchors(n, h, g, d, 4, gen)
    slots = torch.tensor([4, 0, 8, 2, 7, 8])  # the last two rows share a slot (padding)
    lens = torch.randint(20, 70, (b,), generator=gen, dtype=torch.int32)
    # Half the rows close to their anchor (cos near 1), half far (cos near 0).
    near = torch.rand(b, h, generator=gen) < 0.5
    q_near = aq[slots] + 0.05 * torch.randn(b, h, g, d, generator=gen)
    q = torch.where(near[..., None, None], q_near, torch.randn(b, h, g, d, generator=gen))
    query = q.reshape(b, h * g, d).bfloat16()
    # Non-finite queries: a NaN in one head of a group, an infinity in another group.
    query[1, 0, 3] = float("nan")
    query[4, g * 2 - 1, 0] = float("-inf")
    want_bad = torch.zeros(b, h, dtype=torch.bool)
    want_bad[1, 0] = want_bad[4, 1] = True
    for n_local in (0, 16, 64):
        args = (query, aq, alen, slots, lens)
        count = torch.zeros(1, dtype=torch.int64)
        got, bad = cis_decide(*args, tau=0.8, n_local=n_local, nonfinite=count, path=PATH)
        want, bad_ref = cis_decide(*args, tau=0.8, n_local=n_local, path="torch")
        assert got.dtype == torch.bool and bad.dtype == torch.bool
        assert torch.equal(got, want) and torch.equal(bad, bad_ref)
        assert torch.equal(bad, want_bad) and not (got & bad).any()
        assert count.item() == 2
        if n_local == 64:  # both outcomes occur
            assert 0 < got.sum() < got.numel() - 2
    # Strided anchor views (one layer of a [N, L, H, ...] pool) are read in place.
    pool_q = torch.randn(n, 2, h, g, d, generator=gen)
    pool_q[:, 1] = aq
    pool_len = torch.zeros(n, 2, h, dtype=torch.int32)
    pool_len[:, 1] = alen
    got, _ = cis_decide(query, pool_q[:, 1], pool_len[:, 1], slots, lens, tau=0.8, n_local=16,
                        path=PATH)  # fmt: skip
    assert torch.equal(got, cis_decide(*args, tau=0.8, n_local=16, path="torch")[0])


def test_decide_per_head_thresholds():
    """``tau [Hkv]``: each KV head compares with its own threshold; Triton equals torch, and
    thresholds of -1 / 1.01 force reuse / retrieval wherever the anchor is alive."""
    gen = torch.Generator().manual_seed(5)
    b, h, g, d, n = 5, 3, 2, 16, 6
    aq, alen, *_ = _anchors(n, h, g, d, 4, gen)
    slots = torch.tensor([0, 1, 2, 3, 4])
    alen[:] = 40
    lens = torch.full((b,), 50, dtype=torch.int32)
    q = aq[slots] + 0.6 * torch.randn(b, h, g, d, generator=gen)  # cosines spread around 0.8
    query = q.reshape(b, h * g, d).bfloat16()
    args = (query, aq, alen, slots, lens)
    for tau in ([-1.0, 1.01, 0.8], [0.5, 0.8, 0.95]):
        t = torch.tensor(tau)
        got, _ = cis_decide(*args, tau=t, n_local=16, path=PATH)
        want, _ = cis_decide(*args, tau=t, n_local=16, path="torch")
        assert torch.equal(got, want)
        for j, x in enumerate(tau):  # each column equals the scalar rule at its threshold
            col, _ = cis_decide(*args, tau=x, n_local=16, path="torch")
            assert torch.equal(got[:, j], col[:, j])
    got, _ = cis_decide(*args, tau=torch.tensor([-1.0, 1.01, 0.8]), n_local=16, path=PATH)
    assert not got[:, 0].any() and got[:, 1].all()
    with pytest.raises(ValueError, match=r"\[Hkv\]"):
        cis_decide(*args, tau=torch.tensor([0.8, 0.8]), n_local=16, path="torch")
    with pytest.raises(ValueError, match="float32"):
        cis_decide(*args, tau=torch.tensor([0.8, 0.8, 0.8]).double(), n_local=16, path="torch")


def test_decide_per_slot_thresholds():
    """``tau [N, Hkv]`` (CIS's ``tau="auto"``): row ``b`` compares with row ``slots[b]`` of the
    table, read through a strided view of the layer (as the state holds it); Triton equals
    torch and each (slot, head) equals the scalar rule at its threshold."""
    gen = torch.Generator().manual_seed(6)
    b, h, g, d, n = 4, 3, 2, 16, 7
    aq, alen, *_ = _anchors(n, h, g, d, 4, gen)
    slots = torch.tensor([5, 0, 3, 6])
    alen[:] = 40
    lens = torch.full((b,), 50, dtype=torch.int32)
    q = aq[slots] + 0.6 * torch.randn(b, h, g, d, generator=gen)
    query = q.reshape(b, h * g, d).bfloat16()
    args = (query, aq, alen, slots, lens)
    layers = torch.rand(n, 2, h, generator=gen) * 0.6 + 0.5  # [N, layers, Hkv]
    layers[5, 1] = torch.tensor([-1.0, 1.01, 0.8])
    tau = layers[:, 1]  # a strided [N, Hkv] view
    got, _ = cis_decide(*args, tau=tau, n_local=16, path=PATH)
    want, _ = cis_decide(*args, tau=tau, n_local=16, path="torch")
    assert torch.equal(got, want)
    for i, slot in enumerate(slots.tolist()):
        for j in range(h):
            one, _ = cis_decide(*args, tau=float(tau[slot, j]), n_local=16, path="torch")
            assert bool(got[i, j]) == bool(one[i, j])
    assert not got[0, 0] and got[0, 1]
    with pytest.raises(ValueError, match=r"\[N, Hkv\]"):
        cis_decide(*args, tau=tau[:5], n_local=16, path="torch")


def test_decide_sets_and_compose_clears_the_retrieval_flag():
    """``any_retrieve``: the decision ORs "some row retrieves" into it (Triton and torch alike),
    the composition clears it; a bad flag is refused before anything is written."""
    gen = torch.Generator().manual_seed(11)
    b, h, g, d, n = 4, 2, 2, 16, 5
    aq, alen, aidx, acnt, alogd = _anchors(n, h, g, d, 4, gen)
    alen.fill_(40)  # every anchor alive, 0-10 positions behind its row
    slots = torch.tensor([0, 1, 2, 3])
    lens = torch.tensor([40, 45, 50, 41], dtype=torch.int32)
    query = aq[slots].reshape(b, h * g, d).bfloat16()
    for path in (PATH, "torch"):
        args = (query, aq, alen, slots, lens)
        for tau, n_local, start, want in [
            (-1.0, 16, False, False),  # every row reuses: the flag stays clear
            (-1.0, 16, True, True),  # ... and a set flag stays set (OR, not assignment)
            (-1.0, 8, False, True),  # rows 10 positions past their anchor retrieve
            (1.01, 16, False, True),  # a threshold above 1 makes every live row retrieve
        ]:
            flag = torch.tensor([start])
            retrieve, _ = cis_decide(*args, tau=tau, n_local=n_local, any_retrieve=flag, path=path)
            assert flag.item() is want and (start or bool(retrieve.any()) == want), (path, tau)
        m_blocks, s = 4, 8
        width = window_widths(4, 16, s)[0] + m_blocks + cis_local_width(16, s, False)
        new_idx = torch.zeros(b, h, m_blocks, dtype=torch.int32)
        out_idx = torch.empty(b, h, width, dtype=torch.int32)
        out_cnt = torch.empty(b, h, dtype=torch.int32)
        state = (aq.clone(), alen.clone(), aidx.clone(), acnt.clone(), alogd.clone())
        flag = torch.tensor([True])
        cis_compose(
            query, retrieve, torch.zeros_like(retrieve), new_idx, new_idx.float(), *state, slots,
            lens, n_sink=4, n_local=16, block_size=s, m=0, r=0, out_indices=out_idx,
            out_counts=out_cnt, any_retrieve=flag, path=path,
        )  # fmt: skip
        assert not flag.item(), path
    for bad in (torch.tensor([1]), torch.zeros(2, dtype=torch.bool), "yes"):
        flag_args = (query, aq, alen, slots, lens)
        with pytest.raises(ValueError, match="any_retrieve must be a one-element bool"):
            cis_decide(*flag_args, tau=0.5, n_local=16, any_retrieve=bad, path=PATH)


@pytest.mark.parametrize(
    ("s", "n_sink", "n_local", "score"),
    [(1, 4, 8, "max"), (8, 4, 32, "max"), (4, 0, 0, "max"), (16, 20, 5, "max"), (8, 4, 32, "mass")],
)  # fmt: skip
def test_block_scores_match_the_reference(make_kv, s, n_sink, n_local, score):
    gen = torch.Generator().manual_seed(s + n_local)
    lens = [1300, 77, 1]
    data = make_kv(lens, 2, 16, dtype=torch.bfloat16, seed=s)
    q = torch.randn(3, 8, 16, generator=gen).bfloat16()
    some = torch.tensor([[True, False], [True, True], [False, True]])
    # Some rows, none and all: the persistent grid scores the active rows' tiles and fills
    # the others with -inf (several items per program here: 4 "multiprocessors" on the CPU).
    # Every layout with some rows active; none and all on one layout each, a different one per
    # case (the interpreter takes seconds a launch).
    names = list(data.layouts)
    turn = [names[(s + n_local + i) % len(names)] for i in range(2)]
    cases = ((some, names), (torch.zeros_like(some), turn[:1]), (torch.ones_like(some), turn[1:]))
    for active, layouts in cases:
        for name in layouts:
            kv = data.layouts[name]
            kw = dict(block_size=s, n_sink=n_sink, n_local=n_local, score=score)
            got = retrieval_block_scores(q, kv, 0.25, active, **kw, path=PATH)
            want = retrieval_block_scores(q, kv, 0.25, active, **kw, path="torch")
            assert got.shape == (3, 2, -(-max(lens) // s)), name
            assert torch.equal(torch.isneginf(got), torch.isneginf(want)), name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_block_scores_without_the_idle_fill_write_the_active_rows_only(make_kv):
    lens = [900, 40, 300]
    data = make_kv(lens, 2, 16, dtype=torch.bfloat16, seed=5)
    q = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(5)).bfloat16()
    active = torch.tensor([[True, False], [False, False], [False, True]])
    kv = data.layouts["contig"]
    kw = dict(block_size=8, n_sink=4, n_local=32)
    want = retrieval_block_scores(q, kv, 0.25, active, **kw, path="torch")
    got = retrieval_block_scores(q, kv, 0.25, active, **kw, fill_idle=False, path=PATH)
    torch.testing.assert_close(got[active], want[active], rtol=1e-5, atol=1e-7)
    # What the idle rows hold does not reach a ranking: poisoned, they still rank as nothing.
    poisoned = got.clone()
    poisoned[~active] = float("nan")
    poisoned[1, 0, :5] = float("inf")
    for path in (PATH, "torch"):
        idx, val = top_blocks(poisoned, 6, active, path=path)
        ref_idx, _ = top_blocks(want, 6, active, path=path)
        assert torch.equal(idx[active], ref_idx[active]), path
        assert torch.isneginf(val[~active]).all(), path
        if path == PATH:
            assert (idx[~active] == -1).all()


def test_block_scores_tiles_of_1024_positions(monkeypatch, make_kv):
    # One work item per row: tiles of 1024 positions (what rows of 64k positions take).
    monkeypatch.setitem(cis_triton.TUNING, "block_scores_items_per_row", 1)
    lens = [2100, 5]
    data = make_kv(lens, 2, 16, dtype=torch.bfloat16, seed=3)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    active = torch.tensor([[True, False], [True, True]])
    kv = data.layouts["paged16"]
    kw = dict(block_size=8, n_sink=4, n_local=32)
    got = retrieval_block_scores(q, kv, 0.25, active, **kw, path=PATH)
    want = retrieval_block_scores(q, kv, 0.25, active, **kw, path="torch")
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _compose_case(seed, s, n_sink, n_local, m_blocks, m, r, hold=False):
    gen = torch.Generator().manual_seed(seed)
    b, h, g, d, n = 5, 2, 2, 16, 7
    aq, alen, aidx, acnt, alogd = _anchors(n, h, g, d, m_blocks, gen)
    slots = torch.tensor([3, 0, 6, 1, 6])
    lens = torch.tensor([200, 9, 64, 1, 150], dtype=torch.int32)
    nb = -(-int(lens.max()) // s)
    scores = torch.rand(b, h, nb, generator=gen)
    scores[scores < 0.3] = float("-inf")
    new_idx, new_scores = top_blocks(scores, m_blocks)
    retrieve = torch.rand(b, h, generator=gen) < 0.5
    bad = (torch.rand(b, h, generator=gen) < 0.2) & ~retrieve
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    ws, _ = window_widths(n_sink, n_local, s)
    width = ws + m_blocks + 2 * r * m + cis_local_width(n_local, s, hold)
    state = (aq, alen, aidx, acnt, alogd)
    return query, retrieve, bad, new_idx, new_scores, state, slots, lens, width


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize(
    ("s", "n_sink", "n_local", "m_blocks", "m", "r"),
    [
        (8, 4, 32, 12, 4, 1),
        (1, 2, 6, 10, 3, 2),
        (4, 0, 0, 5, 5, 1),
        (16, 40, 3, 6, 2, 0),
        (4, 2, 8, 6, 0, 2),
    ],  # m = 0: CIS's RandomExpansion composes without dilation
)
def test_compose_matches_the_reference(s, n_sink, n_local, m_blocks, m, r, hold):
    results = []
    for path in (PATH, "torch"):
        query, retrieve, bad, new_idx, new_scores, state, slots, lens, width = _compose_case(
            s + m, s, n_sink, n_local, m_blocks, m, r, hold
        )
        out_idx = torch.full((5, 2, width), 12345, dtype=torch.int32)
        out_cnt = torch.full((5, 2), 12345, dtype=torch.int32)
        cis_compose(
            query, retrieve, bad, new_idx, new_scores, *state, slots, lens,
            n_sink=n_sink, n_local=n_local, block_size=s, m=m, r=r,
            out_indices=out_idx, out_counts=out_cnt, hold_local=hold, path=path,
        )  # fmt: skip
        results.append((out_idx, out_cnt, state, slots))
    (gi, gc, gs, slots), (wi, wc, ws_, _) = results
    # Rows 2 and 4 share slot 6, as padded rows share the scratch slot: what they read and
    # write there is noise by contract (one may see the other's update). The others agree.
    rows, live = torch.tensor([0, 1, 3]), torch.tensor([3, 0, 1])
    assert torch.equal(gc[rows], wc[rows])
    assert torch.equal(gi[rows], wi[rows])  # ascending and distinct, -1 past the count
    for got, want in zip(gs, ws_, strict=True):
        assert torch.equal(got[live], want[live])


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize(
    ("s", "n_sink", "n_local", "m_blocks", "m", "r"),
    [
        (8, 4, 32, 12, 4, 1),
        (1, 2, 6, 10, 3, 2),
        (4, 0, 0, 5, 5, 1),
        (16, 40, 3, 6, 2, 0),
        (4, 2, 8, 6, 0, 2),
        (2, 3, 5, 9, 9, 3),  # every entry dilated, neighbours overlapping each other
    ],
)
def test_compose_with_the_anchors_union_copies_it_on_reuse(
    s, n_sink, n_local, m_blocks, m, r, hold
):
    """With ``anchor_union``, a reusing row's selection is copied from its anchor's union, not
    sorted from its list: the list of every reusing row's anchor is overwritten with junk
    first and the selection is still the reference's (computed from the intact list); the
    retrieving rows store the union the reference stores, and everything else is as without."""
    query, retrieve, bad, new_idx, new_scores, state, slots, lens, width = _compose_case(
        2 * s + m + r, s, n_sink, n_local, m_blocks, m, r, hold
    )
    aq, alen, aidx, acnt, alogd = state
    union, u_cnt = anchor_union_reference(aidx, acnt, m, r)
    ref_state = (*(t.clone() for t in state), union.clone(), u_cnt.clone())
    want_idx = torch.full((5, 2, width), 12345, dtype=torch.int32)
    want_cnt = torch.full((5, 2), 12345, dtype=torch.int32)
    kw = dict(n_sink=n_sink, n_local=n_local, block_size=s, m=m, r=r, hold_local=hold)
    cis_compose(
        query, retrieve, bad, new_idx, new_scores, *ref_state[:5], slots, lens, **kw,
        out_indices=want_idx, out_counts=want_cnt, anchor_union=ref_state[5],
        anchor_union_cnt=ref_state[6], path="torch",
    )  # fmt: skip
    junk = aidx.clone()
    reusing = slots[(~retrieve & ~bad).any(-1)]
    junk[reusing] = torch.randint(0, 50, junk[reusing].shape, dtype=torch.int32)
    got_state = (aq.clone(), alen.clone(), junk, acnt.clone(), alogd.clone(), union.clone(),
                 u_cnt.clone())  # fmt: skip
    got_idx = torch.full_like(want_idx, 12345)
    got_cnt = torch.full_like(want_cnt, 12345)
    cis_compose(
        query, retrieve, bad, new_idx, new_scores, *got_state[:5], slots, lens, **kw,
        out_indices=got_idx, out_counts=got_cnt, anchor_union=got_state[5],
        anchor_union_cnt=got_state[6], path=PATH,
    )  # fmt: skip
    rows, live = torch.tensor([0, 1, 3]), torch.tensor([3, 0, 1])  # slot 6 is shared: noise
    assert torch.equal(got_cnt[rows], want_cnt[rows])
    assert torch.equal(got_idx[rows], want_idx[rows])
    for i, (got, want) in enumerate(zip(got_state, ref_state, strict=True)):
        if i == 2:  # the list: rewritten where a row retrieved, else the junk put there
            fresh = retrieve[rows]
            assert torch.equal(got[live][fresh], want[live][fresh])
            continue
        assert torch.equal(got[live], want[live]), i
    # The union a retrieval stored is the reference's of the list it stored.
    again, again_cnt = anchor_union_reference(got_state[2], got_state[3], m, r)
    fresh = retrieve[rows]
    assert fresh.any() and (~retrieve[rows] & ~bad[rows]).any()  # both kinds of row are here
    assert torch.equal(got_state[5][live][fresh], again[live][fresh])
    assert torch.equal(got_state[6][live][fresh], again_cnt[live][fresh])


def _decide_compose_case(seed, s, n_sink, n_local, m_blocks, m, r):
    """Anchors of every age (fresh: reused at tau -1; too old or none: retrieve), a group with
    a NaN (bad), the anchors' unions, and a retrieval's new lists for the retrieving rows."""
    gen = torch.Generator().manual_seed(seed)
    b, h, g, d, n = 6, 2, 2, 16, 8
    aq, alen, aidx, acnt, alogd = _anchors(n, h, g, d, m_blocks, gen)
    slots = torch.tensor([3, 0, 6, 1, 5, 7])  # distinct: every row's state is compared
    lens = torch.tensor([200, 9, 64, 1, 150, 40], dtype=torch.int32)
    age = torch.randint(0, n_local + 1, (b, h), generator=gen, dtype=torch.int32)
    kind = torch.randint(0, 3, (b, h), generator=gen)
    kind[0] = torch.tensor([0, 1])  # both kinds on one row
    old = (lens.view(-1, 1) - n_local - 3).clamp_min(0)
    fresh = (lens.view(-1, 1) - age).clamp_min(1)
    ta = torch.where(kind == 0, fresh, torch.where(kind == 1, 0, old))
    alen[slots] = ta.to(torch.int32)
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    query[4, g, 3] = float("nan")  # row 4, KV head 1
    nb = -(-int(lens.max()) // s)
    scores = torch.rand(b, h, nb, generator=gen)
    scores[scores < 0.3] = float("-inf")
    new_idx, new_scores = top_blocks(scores, m_blocks)
    union, u_cnt = anchor_union_reference(aidx, acnt, m, r)
    return query, (aq, alen, aidx, acnt, alogd, union, u_cnt), slots, lens, new_idx, new_scores


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize(
    ("s", "n_sink", "n_local", "m_blocks", "m", "r"),
    [
        (8, 4, 32, 12, 4, 1),
        (1, 2, 6, 10, 3, 2),
        (4, 0, 0, 5, 5, 1),
        (16, 40, 3, 6, 2, 0),
        (2, 3, 5, 9, 9, 3),
    ],
)
def test_decide_compose_then_the_retrieving_rows_equal_decide_then_compose(
    s, n_sink, n_local, m_blocks, m, r, hold
):
    """``cis_decide_compose`` (the decision's launch writing every non-retrieving row's
    selection from its anchor's union) then ``cis_compose(retrieving_only=True)`` give what the
    torch decision and composition give: selection, counts, anchors, unions, the non-finite
    count and the retrieval flag. The reusing rows' anchor lists are junk on the kernel's side
    (the decision copies the union, never the list); between the two launches the retrieving
    rows' entries are untouched and no anchor has changed."""
    query, state, slots, lens, new_idx, new_scores = _decide_compose_case(
        3 * s + m_blocks + r, s, n_sink, n_local, m_blocks, m, r
    )
    ws, _ = window_widths(n_sink, n_local, s)
    width = ws + m_blocks + 2 * r * m + cis_local_width(n_local, s, hold)
    kw = dict(n_sink=n_sink, n_local=n_local, block_size=s, m=m, r=r, hold_local=hold)
    runs = {}
    for path in ("torch", PATH):
        st = [t.clone() for t in state]
        out_idx = torch.full((6, 2, width), 12345, dtype=torch.int32)
        out_cnt = torch.full((6, 2), 12345, dtype=torch.int32)
        nonfinite = torch.zeros(1, dtype=torch.int64)
        flag = torch.zeros(1, dtype=torch.bool)
        if path == "torch":
            retrieve, bad = cis_decide(
                query, st[0], st[1], slots, lens, tau=-1.0, n_local=n_local,
                nonfinite=nonfinite, any_retrieve=flag,
            )  # fmt: skip
            seen_flag = flag.clone()
        else:
            reusing = slots[(st[1][slots] > 0).any(-1)]
            st[2][reusing] = torch.randint(0, 50, st[2][reusing].shape, dtype=torch.int32)
            before = [t.clone() for t in st]
            retrieve, bad = cis_decide_compose(
                query, st[0], st[1], st[2], st[3], st[5], st[6], slots, lens, tau=-1.0,
                **kw, out_indices=out_idx, out_counts=out_cnt, nonfinite=nonfinite,
                any_retrieve=flag, path=PATH,
            )  # fmt: skip
            seen_flag = flag.clone()
            for got, was in zip(st, before, strict=True):
                assert torch.equal(got, was)
            assert (out_idx[retrieve] == 12345).all() and (out_cnt[retrieve] == 12345).all()
            assert not (out_cnt[~retrieve] == 12345).any()
        cis_compose(
            query, retrieve, bad, new_idx, new_scores, *st[:5], slots, lens, **kw,
            out_indices=out_idx, out_counts=out_cnt, anchor_union=st[5],
            anchor_union_cnt=st[6], any_retrieve=flag, retrieving_only=path != "torch",
            path=path,
        )  # fmt: skip
        runs[path] = (retrieve, bad, out_idx, out_cnt, st, nonfinite, seen_flag, flag)
    (wr, wb, wi, wc, ws_, wn, wf, wf2), (gr, gb, gi, gc, gs, gn, gf, gf2) = runs.values()
    assert torch.equal(gr, wr) and torch.equal(gb, wb)
    assert gr.any() and (~gr & ~gb).any() and gb.any()  # every kind of row is here
    assert torch.equal(gc, wc)
    assert torch.equal(gi, wi)
    assert torch.equal(gn, wn) and gn.item() == 1
    assert torch.equal(gf, wf) and gf.item() and not gf2.item() and not wf2.item()
    for i, (got, want) in enumerate(zip(gs, ws_, strict=True)):
        if i == 2:  # the list: junk where the row reused (its anchor's stays as it was)
            live = slots[gr.any(-1)]
            fresh = gr[gr.any(-1)]
            assert torch.equal(got[live][fresh], want[live][fresh])
            continue
        assert torch.equal(got, want), i


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize(
    ("s", "n_sink", "n_local", "m_blocks", "m", "r"),
    [(8, 4, 32, 12, 4, 1), (1, 2, 6, 10, 3, 2), (4, 0, 0, 5, 5, 1), (2, 3, 5, 9, 9, 3)],
)
def test_top_blocks_compose_ranks_and_composes_the_retrieving_rows(
    monkeypatch, s, n_sink, n_local, m_blocks, m, r, hold, passes
):
    """The fused top-k (the retrieving rows composed in the program that ranked them, in its
    last pass) after ``cis_decide_compose``: the winners, selection, counts, anchors, unions
    and the cleared flag are the torch path's (``top_blocks`` then ``cis_compose(...,
    retrieving_only=True)``); in one pass and, with the thresholds made small, in several."""
    if passes == 3:
        monkeypatch.setattr(cis_triton, "TOPK_ONE_PASS", 16)
        monkeypatch.setattr(cis_triton, "TOPK_CHUNK", 16)
        monkeypatch.setattr(cis_triton, "TOPK_MAX_N", 512)
    query, state, slots, lens, _, _ = _decide_compose_case(
        5 * s + m_blocks + r, s, n_sink, n_local, m_blocks, m, r
    )
    # Rows as wide as a cache of 100 blocks or more (the block scores' width), -inf past each
    # sequence's own blocks, as the block-score pass writes them.
    nb = max(-(-int(lens.max()) // s), 100)
    gen = torch.Generator().manual_seed(nb + m)
    scores = torch.rand(6, 2, nb, generator=gen)
    own = -(-lens // s)
    scores[(scores < 0.3) | (torch.arange(nb) >= own.view(-1, 1, 1))] = float("-inf")
    k = min(m_blocks, nb)
    if passes == 3:
        plan = cis_triton._topk_plan(nb, k)
        assert plan is not None and len(plan) >= 2, plan
    ws, _ = window_widths(n_sink, n_local, s)
    width = ws + m_blocks + 2 * r * m + cis_local_width(n_local, s, hold)
    kw = dict(n_sink=n_sink, n_local=n_local, block_size=s, m=m, r=r, hold_local=hold)
    runs = []
    for path in ("torch", PATH):
        st = [t.clone() for t in state]
        out_idx = torch.full((6, 2, width), 12345, dtype=torch.int32)
        out_cnt = torch.full((6, 2), 12345, dtype=torch.int32)
        flag = torch.zeros(1, dtype=torch.bool)
        retrieve, bad = cis_decide_compose(
            query, st[0], st[1], st[2], st[3], st[5], st[6], slots, lens, tau=-1.0, **kw,
            out_indices=out_idx, out_counts=out_cnt, any_retrieve=flag, path=path,
        )  # fmt: skip
        assert flag.item()
        got = top_blocks_compose(
            scores, m_blocks, query, retrieve, bad, *st[:5], slots, lens, **kw,
            out_indices=out_idx, out_counts=out_cnt, anchor_union=st[5],
            anchor_union_cnt=st[6], any_retrieve=flag, path=path,
        )  # fmt: skip
        runs.append((retrieve, got, out_idx, out_cnt, st, flag))
    (wr, (wi, wv), wo, wc, ws_, wf), (gr, (gi, gv), go, gc, gs, gf) = runs
    assert torch.equal(gr, wr) and gr.any() and (~gr).any()
    assert torch.equal(gi[gr], wi[gr]) and torch.equal(gv[gr], wv[gr])
    assert torch.equal(go, wo) and torch.equal(gc, wc)
    assert not (gc == 12345).any()
    for i, (a, b) in enumerate(zip(gs, ws_, strict=True)):
        assert torch.equal(a, b), i
    assert not gf.item() and not wf.item()


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize(
    ("g", "s", "layout", "hold", "m_blocks", "m", "r"),
    [(4, 8, "contig", True, 12, 4, 1), (1, 1, "paged16", False, 10, 3, 2),
     (2, 4, "contig0", True, 9, 9, 1), (8, 16, "paged1", False, 6, 2, 1)],
)  # fmt: skip
def test_retrieval_compose_matches_the_torch_path(
    monkeypatch, make_kv, g, s, layout, hold, m_blocks, m, r, passes
):
    """The retrieval by block mass in two launches (block log-sum-exps, then the top-k scoring
    its rows from them and composing) against the torch path's block scores, top-k and
    composition: the same winners (their scores to float32 rounding), selections, counts,
    anchors, unions, and the flag cleared; in one top-k pass and, with the thresholds made
    small, in several (the first scoring its chunks)."""
    if passes == 3:
        monkeypatch.setattr(cis_triton, "TOPK_ONE_PASS", 16)
        monkeypatch.setattr(cis_triton, "TOPK_CHUNK", 16)
        monkeypatch.setattr(cis_triton, "TOPK_MAX_N", 512)
    # At block size 1 a row has a block a position: 600 still takes several top-k passes.
    lens = [1100 if s > 1 else 600, 77, 300, 5 * s + 3]
    h, d, n_sink, n_local = 2, 16, 4, 24
    data = make_kv(lens, h, d, dtype=torch.bfloat16, seed=g * s)
    kv = data[layout]
    gen = torch.Generator().manual_seed(g + s)
    b = len(lens)
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    n = b + 2
    aq, alen, aidx, acnt, alogd = _anchors(n, h, g, d, m_blocks, gen)
    slots = torch.tensor([5, 0, 3, 1])
    seq = torch.tensor(lens, dtype=torch.int32).view(-1, 1)
    # Fresh anchors (reused), old ones (retrieve); one row of each kind per sequence at least.
    fresh = torch.rand(b, h, generator=gen) < 0.5
    fresh[:, 0], fresh[:, 1] = True, False
    fresh[0] = torch.tensor([False, False])
    alen[slots] = torch.where(fresh, seq - 2, (seq - n_local - 5).clamp_min(0)).to(torch.int32)
    union, u_cnt = anchor_union_reference(aidx, acnt, m, r)
    state = (aq, alen, aidx, acnt, alogd, union, u_cnt)
    ws, _ = window_widths(n_sink, n_local, s)
    width = ws + m_blocks + 2 * r * m + cis_local_width(n_local, s, hold)
    kw = dict(n_sink=n_sink, n_local=n_local, block_size=s, m=m, r=r, hold_local=hold)
    if passes == 3:
        plan = cis_triton._topk_plan(-(-kv.max_len // s), m_blocks)
        assert plan is not None and len(plan) >= 2, plan
    runs = []
    for path in ("torch", PATH):
        st = [t.clone() for t in state]
        out_idx = torch.full((b, h, width), 12345, dtype=torch.int32)
        out_cnt = torch.full((b, h), 12345, dtype=torch.int32)
        flag = torch.zeros(1, dtype=torch.bool)
        rb = cis_decide_compose(
            query, st[0], st[1], st[2], st[3], st[5], st[6], slots, kv.seq_lens, tau=-1.0,
            **kw, out_indices=out_idx, out_counts=out_cnt, any_retrieve=flag, path=path,
        )  # fmt: skip
        top = retrieval_compose(
            query, kv, 0.3, m_blocks, *rb, *st[:5], slots, **kw, out_indices=out_idx,
            out_counts=out_cnt, anchor_union=st[5], anchor_union_cnt=st[6],
            any_retrieve=flag, path=path,
        )  # fmt: skip
        runs.append((rb[0], top, out_idx, out_cnt, st, flag))
    (wr, (wi, wv), wo, wc, ws_, wf), (gr, (gi, gv), go, gc, gs, gf) = runs
    assert torch.equal(gr, wr) and gr.any() and (~gr).any()
    assert torch.equal(gi[gr], wi[gr])
    assert torch.equal(torch.isneginf(gv[gr]), torch.isneginf(wv[gr]))
    torch.testing.assert_close(gv[gr], wv[gr], rtol=1e-5, atol=1e-9)
    assert torch.equal(go, wo) and torch.equal(gc, wc) and not (gc == 12345).any()
    for i, (a, b_) in enumerate(zip(gs, ws_, strict=True)):
        assert torch.equal(a, b_), i
    assert not gf.item() and not wf.item()


ROWS = [
    (1, 1, None, 1),
    (20, 5, None, 1),
    (100, 100, None, 1),
    (300, 128, None, 1),
    (64, 3, None, 1),
    # Long rows in several passes (thresholds made small here; 8192 on a GPU):
    (300, 20, 64, 3),  # 5 chunks of 64 win 100, 2 chunks of those win 40, then one pass
    (300, 50, 64, 3),  # chunks of 128 (2k), the last (44) shorter than k
    (256, 256, 64, 1),  # a chunk (2k = 512) would hold the whole row: one pass
    (2000, 100, 64, 4),  # 8 chunks of 256 win 800, then 400, then 200
    (520, 16, 64, 3),  # just over a power of two: 9 chunks win 144, 3 of those 48
    (600, 300, 64, 0),  # 2k > 512 registers: torch.topk
]
SEARCHES = [("default", "default"), (1, 0), (4, 16), (8, 128)]


@pytest.mark.parametrize(
    ("n", "k", "one_pass", "passes", "bits", "segment"),
    # One bit a round takes 32 rounds: up to rows of 300 (several passes included), as longer
    # rows take half a minute each under the interpreter.
    [(*row, *search) for search in SEARCHES for row in ROWS if search[0] != 1 or row[0] <= 300],
)
def test_top_blocks_of_active_rows_match_the_reference(
    monkeypatch, n, k, one_pass, passes, bits, segment
):
    # The search's bits a round (8: by histograms), and the prefix counts' segment (0: one
    # prefix sum).
    if bits != "default":
        monkeypatch.setitem(cis_triton.TUNING, "topk_radix_bits", bits)
        monkeypatch.setitem(cis_triton.TUNING, "topk_scan_segment", segment)
    if one_pass is not None:
        monkeypatch.setattr(cis_triton, "TOPK_ONE_PASS", one_pass)
        monkeypatch.setattr(cis_triton, "TOPK_CHUNK", one_pass)
        monkeypatch.setattr(cis_triton, "TOPK_MAX_N", 512)
    plan = cis_triton._topk_plan(n, k)
    assert (0 if plan is None else len(plan)) == passes
    if plan is not None:
        assert plan[0][0] == n and plan[-1][2] == 1 and plan[-1][0] <= 512
        for (length, chunk, chunks), nxt in itertools.pairwise(plan):
            assert chunk * chunks >= length > chunk * (chunks - 1) and nxt[0] == chunks * k
    gen = torch.Generator().manual_seed(n + k)
    x = torch.rand(6, n, generator=gen)
    x[x < 0.3] = float("-inf")
    x[0] = 0.5  # all tied: lower ids first
    x[1, min(3, n - 1)] = float("nan")  # NaN counts as -inf
    x[2] = float("-inf")
    # Keys that share their upper bytes (a few ulps apart around 0.25), and signed values with
    # infinities: the search must resolve every bit, and order negatives correctly.
    ulps = (torch.randperm(n, generator=gen) % 300).to(torch.int32)
    x[4] = (torch.full((n,), 0.25).view(torch.int32) + ulps).view(torch.float32)
    x[5] = torch.randn(n, generator=gen) * torch.logspace(-30, 30, n)
    x[5, ::7] = -x[5, ::7].abs()
    x[5, n // 2] = float("inf")
    active = torch.tensor([True, True, True, False, True, True])
    idx, val = top_blocks(x, k, active, path=PATH)
    want_idx, want_val = top_blocks(x, k, path="torch")
    assert idx.shape == (6, min(k, n)) and idx.dtype == torch.int32
    assert torch.equal(idx[active], want_idx[active])
    assert torch.equal(val[active], want_val[active])
    # Rows padded to a multiple of 16 (as the block-score pass writes them) rank the same.
    padded = torch.full((6, -(-n // 16) * 16 + 16), 7.0)
    padded[:, :n] = x
    p_idx, p_val = top_blocks(padded[:, :n], k, active, path=PATH)
    assert torch.equal(p_idx, idx) and torch.equal(p_val, val)
    if plan is not None:  # torch.topk (the fallback) ranks every row
        assert (idx[~active] == -1).all() and torch.isneginf(val[~active]).all()


def test_top_blocks_refuses_bad_tuning(monkeypatch):
    x = torch.rand(2, 40)
    active = torch.tensor([True, True])
    monkeypatch.setitem(cis_triton.TUNING, "topk_radix_bits", 3)  # 32 is not a multiple of 3
    with pytest.raises(ValueError, match="topk_radix_bits"):
        cis_triton.top_blocks_triton(x, 4, active)
    monkeypatch.setitem(cis_triton.TUNING, "topk_radix_bits", 2)
    monkeypatch.setitem(cis_triton.TUNING, "topk_scan_segment", 24)  # not a power of two
    with pytest.raises(ValueError, match="topk_scan_segment"):
        cis_triton.top_blocks_triton(x, 4, active)


# --- the re-ranking of a reuse's pool (rescore) ------------------------------------------------
@pytest.mark.parametrize(
    ("s", "hq", "hkv", "hold", "score", "split"),
    [
        (1, 4, 1, True, "mass", False),
        (2, 6, 2, False, "mass", False),
        (4, 2, 2, True, "max", False),
        (1, 4, 2, True, "mass", True),
        (2, 2, 1, False, "max", True),
    ],
    ids=["s1-g4-held", "s2-g3-sliding", "s4-g1-max", "s1-split", "s2-split-max"],
)
def test_rescore_matches_the_reference(make_kv, monkeypatch, s, hq, hkv, hold, score, split):
    from prhs_kernels.cis import cis_rescore

    gen = torch.Generator().manual_seed(s + hq)
    lens = [150, 97, 60]
    data = make_kv(lens, hkv, 16, dtype=torch.bfloat16, seed=s)
    b, m, r, n_local = len(lens), 5, 7, 8
    if split:  # a pool over several programs of tiles of 16 positions, rewritten 16 at a time
        m, r = 6, 20
        monkeypatch.setitem(cis_triton.TUNING, "rescore_tile", 16)
        monkeypatch.setitem(cis_triton.TUNING, "rescore_min_tiles", 1)
        monkeypatch.setitem(cis_triton.TUNING, "rescore_programs_per_sm", 64)
        monkeypatch.setitem(cis_triton.TUNING, "rescore_write_block", 16)
        chunk, n_split = cis_triton.rescore_splits(b * hkv, m + r, 16 // s, torch.device("cpu"))
        assert n_split > 1 and chunk < m + r
    q = torch.randn(b, hq, 16, generator=gen).bfloat16()
    slots = torch.tensor([2, 0, 3])
    reuse = torch.rand(b, hkv, generator=gen) < 0.8
    reuse[0, 0] = True
    n_slots = 4
    anchor_len = torch.tensor([[40], [75], [130], [55]], dtype=torch.int32).expand(n_slots, hkv)
    anchor_len = anchor_len.contiguous()
    nb = 60 // s  # candidate blocks below every anchor's window
    pools = torch.stack([torch.randperm(nb, generator=gen)[: m + r] for _ in range(n_slots * hkv)])
    pools = pools.view(n_slots, hkv, m + r).to(torch.int32)
    pools[1, -1, -2:] = -1  # a short pool
    for name, kv in data.layouts.items():
        fields = {}
        for path in ("torch", PATH):
            idx, nxt = pools[..., :m].clone(), pools[..., m:].clone()
            cnt = torch.full((n_slots, hkv), m, dtype=torch.int32)
            cnt[0, 0] = m - 1  # the list's last entry is not a candidate
            kw = dict(block_size=s, n_sink=2, n_local=n_local, hold_local=hold, score=score)
            cis_rescore(q, kv, 0.25, reuse, anchor_len, idx, cnt, nxt, slots, **kw, path=path)
            fields[path] = (idx, cnt, nxt)
        for want, got in zip(fields["torch"], fields[PATH], strict=True):
            assert torch.equal(got, want), name
        assert not torch.equal(fields[PATH][0], pools[..., :m]), "nothing was re-ranked"


@pytest.mark.parametrize(("n", "m", "r"), [(40, 5, 9), (12, 5, 9), (30, 8, 20)])
def test_retrieval_pool_matches_the_torch_path(monkeypatch, n, m, r):
    """The list (best first), its values and the next blocks (block order) written at each
    retrieving row's slot, with ties, blocks that cannot be chosen (-inf) and fewer candidates
    than m + r; the rest is walked 16 candidates at a time."""
    from prhs_kernels.cis import retrieval_pool

    monkeypatch.setitem(cis_triton.TUNING, "rescore_write_block", 16)
    gen = torch.Generator().manual_seed(n + m)
    b, h = 3, 2
    scores = torch.randint(0, 6, (b, h, n), generator=gen).float()  # many ties
    scores[0, 0, :4] = float("-inf")
    scores[1, 1, n // 2 :] = float("-inf")  # fewer finite blocks than m + r
    retrieve = torch.tensor([[True, True], [False, True], [True, False]])
    slots = torch.tensor([2, 0, 3])
    out = {}
    for path in ("torch", PATH):
        nxt = torch.full((4, h, r), 7, dtype=torch.int32)
        idx, val = retrieval_pool(scores, m, r, retrieve, nxt, slots, path=path)
        out[path] = (idx, val, nxt)
    want, got = out["torch"], out[PATH]
    rows = retrieve.unsqueeze(-1)
    assert torch.equal(torch.where(rows, got[0], -1), torch.where(rows, want[0], -1))
    assert torch.equal(torch.where(rows, got[1], 0.0), torch.where(rows, want[1], 0.0))
    assert torch.equal(got[2], want[2])
    assert bool((got[2][1] == 7).all())  # a slot no row uses
    assert bool((got[2][0, 0] == 7).all()) and bool((got[2][3, 1] == 7).all())  # not retrieving


@pytest.mark.parametrize(("n", "m", "r", "cap_fits"), [(300, 5, 9, True), (300, 20, 40, False)])
def test_retrieval_pool_seeded_by_the_anchor_pool_matches_the_unseeded(monkeypatch, n, m, r,
                                                                       cap_fits):  # fmt: skip
    """A seed (guess, verify, refine) changes nothing but the work: with a good seed (the true
    top m + r, shuffled, with -1 gaps), a poor one (random ids: many candidates), no seed
    (-1 only) and ties, the list, its values and the next blocks equal the unseeded ranking;
    rows flagged by the first pass take the whole-row ranking."""
    from prhs_kernels.cis import retrieval_pool

    monkeypatch.setattr(cis_triton, "TOPK_ONE_PASS", 64)
    monkeypatch.setattr(cis_triton, "TOPK_CHUNK", 64)
    monkeypatch.setattr(cis_triton, "TOPK_MAX_N", 128 if cap_fits else 64)
    monkeypatch.setitem(cis_triton.TUNING, "rescore_write_block", 16)
    assert (cis_triton.seeded_capacity(n, m + r) > 0) is cap_fits
    gen = torch.Generator().manual_seed(n + m)
    b, h = 3, 2
    scores = torch.randn(b, h, n, generator=gen)
    scores[0, 1, ::7] = scores[0, 1, 3]  # ties
    scores[2, 0, :50] = float("-inf")
    scores[2, 1, m + r - 3 :] = float("-inf")  # fewer finite scores than m + r
    scores[2, 1, 1:6] = scores[2, 1, 0]  # ties among them
    retrieve = torch.tensor([[True, True], [True, False], [True, True]])
    slots = torch.tensor([2, 0, 3])
    best = torch.topk(scores, m + r, dim=-1).indices.to(torch.int32)
    seed = best[..., torch.randperm(m + r, generator=gen)]
    seed[0, 0, ::4] = -1  # a seed with gaps: fewer than m + r ids, no threshold
    seed[1, 0] = torch.randperm(n, generator=gen)[: m + r].to(torch.int32)  # a poor seed
    seed[2, 1] = -1  # no seed at all
    out = {}
    for s in (None, seed):
        nxt = torch.full((4, h, r), 7, dtype=torch.int32)
        idx, val = retrieval_pool(scores, m, r, retrieve, nxt, slots, seed=s, path=PATH)
        out[s is None] = (idx, val, nxt)
    for a, b_ in zip(out[True], out[False], strict=True):
        assert torch.equal(a, b_)
    nxt = torch.full((4, h, r), 7, dtype=torch.int32)
    idx, val = retrieval_pool(scores, m, r, retrieve, nxt, slots, path="torch")
    rows = retrieve.unsqueeze(-1)
    assert torch.equal(torch.where(rows, out[False][0], -1), torch.where(rows, idx, -1))
    assert torch.equal(torch.where(rows, out[False][1], 0.0), torch.where(rows, val, 0.0))
    assert torch.equal(out[False][2], nxt)
    # The same seeds as the slots' pools, read in place (anchor_idx, then anchor_next).
    anchor_idx = torch.full((4, h, m), -1, dtype=torch.int32)
    nxt = torch.full((4, h, r), -1, dtype=torch.int32)
    anchor_idx[slots], nxt[slots] = seed[..., :m], seed[..., m:]
    keep = nxt.clone()
    idx, val = retrieval_pool(scores, m, r, retrieve, nxt, slots, anchor_idx=anchor_idx,
                              path=PATH)  # fmt: skip
    assert torch.equal(idx, out[True][0]) and torch.equal(val, out[True][1])
    # Retrieving rows' next blocks are the unseeded ones; the others keep their pools.
    on = torch.zeros(4, h, dtype=torch.bool)
    on[slots] = retrieve
    assert torch.equal(nxt[on], out[True][2][on]) and torch.equal(nxt[~on], keep[~on])
    if cap_fits:  # the good seeds verified; the gapped, poor and empty ones were flagged
        from prhs_kernels.topk import seeded_candidates

        cap = cis_triton.seeded_capacity(n, m + r)
        *_, over = seeded_candidates(scores, m + r, seed, capacity=cap, active=retrieve,
                                     path=PATH)  # fmt: skip
        assert over.tolist() == [[True, False], [True, False], [False, True]]
