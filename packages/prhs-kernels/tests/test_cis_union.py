"""The anchor union a CIS retrieval stores for its reuses (``anchor_union_reference``) and
``cis_compose``'s union fields on the torch path (the Triton kernel's copy of it is tested under
the interpreter, ``interpreted/test_cis_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.cis import (
    anchor_union_reference,
    cis_compose,
    cis_decide,
    cis_decide_compose,
    cis_local_width,
    top_blocks_compose,
)
from prhs_kernels.compose import window_widths


def _brute(idx, cnt, m, r):
    """The union by Python sets: the first ``cnt`` entries and the ``±1..±r`` neighbours of
    the first ``min(m, cnt)``, none below 0."""
    out = set()
    for e in range(int(cnt)):
        p = int(idx[e])
        if p < 0:
            continue
        out.add(p)
        if e < m:
            out.update(q for j in range(1, r + 1) for q in (p + j, p - j) if q >= 0)
    return sorted(out)


@pytest.mark.parametrize(("mm", "m", "r"), [(6, 2, 1), (5, 5, 2), (4, 0, 3), (7, 3, 0), (1, 1, 4)])
def test_the_union_is_the_sorted_distinct_list_and_its_dilation(mm, m, r):
    gen = torch.Generator().manual_seed(mm * 10 + m + r)
    idx = torch.randint(0, 12, (3, 4, mm), generator=gen, dtype=torch.int32)
    idx[0, 0, 1:] = -1  # a list of one, then none
    cnt = torch.randint(0, mm + 1, (3, 4), generator=gen, dtype=torch.int32)
    cnt[0, 0] = 1
    union, count = anchor_union_reference(idx, cnt, m, r)
    assert union.shape == (3, 4, mm + 2 * r * m) and union.dtype == torch.int32
    for i in range(3):
        for j in range(4):
            want = _brute(idx[i, j], cnt[i, j], m, r)
            assert int(count[i, j]) == len(want)
            assert union[i, j, : len(want)].tolist() == want
            assert (union[i, j, len(want) :] == -1).all()


def _case():
    b, h, g, d, n, mm, s = 2, 2, 2, 8, 3, 4, 8
    gen = torch.Generator().manual_seed(3)
    state = (
        torch.randn(n, h, g, d, generator=gen),
        torch.full((n, h), 100, dtype=torch.int32),
        torch.randint(0, 12, (n, h, mm), generator=gen, dtype=torch.int32),
        torch.full((n, h), mm, dtype=torch.int32),
        torch.zeros(n, h, dtype=torch.float64),
    )
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    retrieve = torch.tensor([[True, False], [False, True]])
    bad = torch.zeros_like(retrieve)
    new_idx = torch.tensor([[[5, 9, 1, 2]] * h] * b, dtype=torch.int32)
    new_scores = torch.tensor([[[3.0, 2.0, 1.0, float("-inf")]] * h] * b)
    slots = torch.tensor([2, 0])
    lens = torch.tensor([120, 110], dtype=torch.int32)
    width = window_widths(4, 16, s)[0] + mm + 2 * 1 * 2 + cis_local_width(16, s, True)
    out = (torch.empty(b, h, width, dtype=torch.int32), torch.empty(b, h, dtype=torch.int32))
    kw = dict(n_sink=4, n_local=16, block_size=s, m=2, r=1, hold_local=True)
    return query, retrieve, bad, new_idx, new_scores, state, slots, lens, out, kw


def test_compose_stores_a_retrieving_rows_union_and_keeps_the_others():
    query, retrieve, bad, new_idx, new_scores, state, slots, lens, out, kw = _case()
    union = torch.full((3, 2, 4 + 2 * 2), 77, dtype=torch.int32)
    u_cnt = torch.full((3, 2), 77, dtype=torch.int32)
    cis_compose(query, retrieve, bad, new_idx, new_scores, *state, slots, lens, **kw,
                out_indices=out[0], out_counts=out[1], anchor_union=union,
                anchor_union_cnt=u_cnt)  # fmt: skip
    # Slot 2 head 0 and slot 0 head 1 retrieved [5, 9, 1] (the -inf entry is no block):
    # {5, 9, 1} ∪ {4, 6, 8, 10} (the top 2 dilated by one).
    for slot, head in ((2, 0), (0, 1)):
        assert u_cnt[slot, head] == 7
        assert union[slot, head].tolist() == [1, 4, 5, 6, 8, 9, 10, -1]
    for slot, head in ((2, 1), (0, 0), (1, 0), (1, 1)):  # reused, or no row: untouched
        assert u_cnt[slot, head] == 77 and (union[slot, head] == 77).all()


def test_compose_refuses_bad_union_fields_before_any_write():
    query, retrieve, bad, new_idx, new_scores, state, slots, lens, out, kw = _case()
    good_u = torch.zeros(3, 2, 8, dtype=torch.int32)
    good_c = torch.zeros(3, 2, dtype=torch.int32)
    before = [t.clone() for t in state]
    for u, c, match in [
        (good_u, None, "give both or neither"),
        (None, good_c, "give both or neither"),
        (good_u[..., :7], good_c, r"anchor_union must be int32 \[3, 2, 8\]"),
        (good_u.long(), good_c, "anchor_union must be int32"),
        (good_u, torch.zeros(3, 2, dtype=torch.int64), "anchor_union_cnt must be int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            cis_compose(query, retrieve, bad, new_idx, new_scores, *state, slots, lens, **kw,
                        out_indices=out[0], out_counts=out[1], anchor_union=u,
                        anchor_union_cnt=c)  # fmt: skip
    for got, want in zip(state, before, strict=True):
        assert torch.equal(got, want)
    assert (good_u == 0).all() and (good_c == 0).all()


class _Catch:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((args, kw))


def _caught_state(n, h, g, d, mm, m, r):
    state = (torch.zeros(n, h, g, d), torch.zeros(n, h, dtype=torch.int32),
             torch.zeros(n, h, mm, dtype=torch.int32), torch.zeros(n, h, dtype=torch.int32),
             torch.zeros(n, h, dtype=torch.float64))  # fmt: skip
    union = dict(anchor_union=torch.zeros(n, h, mm + 2 * r * m, dtype=torch.int32),
                 anchor_union_cnt=torch.zeros(n, h, dtype=torch.int32))  # fmt: skip
    return state, union


@pytest.mark.parametrize(
    ("mm", "m", "r", "s", "union", "retrieving_only"),
    [
        (64, 10, 2, 4, True, False),
        (128, 42, 1, 8, True, False),
        (64, 7, 3, 1, True, False),
        (64, 10, 2, 4, False, False),
        (128, 42, 1, 8, True, True),
        (64, 7, 3, 1, True, True),
    ],
)
def test_the_compose_kernel_compiles_for_a_hopper_gpu(
    monkeypatch, hopper_compile, mm, m, r, s, union, retrieving_only
):
    """The kernel's launch, caught on the CPU and compiled for sm_90 (no GPU needed): Triton's
    compiler rejects what its interpreter runs, e.g. a name bound to tensors of two shapes in
    the two branches of a runtime ``if`` (the copy's and the sort's, when the union's block is
    narrower than the candidates')."""
    pytest.importorskip("triton")
    import prhs_kernels.cis.triton as ct

    catch = _Catch()
    real = ct._kernels(False)
    monkeypatch.setattr(ct, "_kernels", lambda interp: (*real[:2], catch, real[3]))
    b, h, g, d, n = 4, 2, 4, 128, 5
    state, fields = _caught_state(n, h, g, d, mm, m, r)
    width = window_widths(4, 32, s)[0] + mm + 2 * r * m + cis_local_width(32, s, True)
    no = torch.zeros(b, h, dtype=torch.bool)
    cis_compose(
        torch.zeros(b, h * g, d, dtype=torch.bfloat16), no, no,
        torch.zeros(b, h, mm, dtype=torch.int32), torch.zeros(b, h, mm), *state,
        torch.arange(b), torch.full((b,), 10, dtype=torch.int32), n_sink=4, n_local=32,
        block_size=s, m=m, r=r, out_indices=torch.zeros(b, h, width, dtype=torch.int32),
        out_counts=torch.zeros(b, h, dtype=torch.int32), hold_local=True,
        **(fields if union else {}), retrieving_only=retrieving_only, path="triton",
    )  # fmt: skip
    hopper_compile(real[2], *catch.launches.pop())


@pytest.mark.parametrize(
    ("mm", "m", "r", "s", "hold"),
    [(128, 42, 1, 8, True), (64, 7, 3, 1, False), (64, 64, 2, 16, True)],
)
def test_the_decision_with_the_early_composition_compiles_for_a_hopper_gpu(
    monkeypatch, hopper_compile, mm, m, r, s, hold
):
    """``cis_decide_compose``'s launch (the decision kernel writing the non-retrieving rows'
    selections), caught on the CPU and compiled for sm_90, as the composition's above."""
    pytest.importorskip("triton")
    import prhs_kernels.cis.triton as ct

    catch = _Catch()
    real = ct._kernels(False)
    monkeypatch.setattr(ct, "_kernels", lambda interp: (catch, *real[1:]))
    b, h, g, d, n = 4, 2, 4, 128, 5
    state, fields = _caught_state(n, h, g, d, mm, m, r)
    width = window_widths(4, 32, s)[0] + mm + 2 * r * m + cis_local_width(32, s, hold)
    cis_decide_compose(
        torch.zeros(b, h * g, d, dtype=torch.bfloat16), *state[:4], fields["anchor_union"],
        fields["anchor_union_cnt"], torch.arange(b), torch.full((b,), 10, dtype=torch.int32),
        tau=-1.0, n_local=32, n_sink=4, block_size=s, m=m, r=r,
        out_indices=torch.zeros(b, h, width, dtype=torch.int32),
        out_counts=torch.zeros(b, h, dtype=torch.int32), hold_local=hold,
        nonfinite=torch.zeros(1, dtype=torch.int64), any_retrieve=torch.zeros(1, dtype=torch.bool),
        path="triton",
    )  # fmt: skip
    hopper_compile(real[0], *catch.launches.pop())


def _decide_case(n_local=16, hold=True):
    """Rows reusing a fresh anchor, retrieving (no anchor / an old one), one bad group."""
    b, h, g, d, n, mm, s, m, r = 3, 2, 2, 8, 4, 6, 4, 2, 1
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 30, (n, h, mm), generator=gen, dtype=torch.int32)
    cnt = torch.randint(1, mm + 1, (n, h), generator=gen, dtype=torch.int32)
    union, u_cnt = anchor_union_reference(idx, cnt, m, r)
    lens = torch.tensor([120, 70, 95], dtype=torch.int32)
    alen = torch.tensor([[0, 0], [60, 0], [115, 110], [90, 10]], dtype=torch.int32)
    state = [torch.randn(n, h, g, d, generator=gen), alen, idx, cnt, union, u_cnt]
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    query[2, 1] = float("nan")  # row 2 (slot 3), KV head 0: bad
    slots = torch.tensor([2, 1, 3])
    width = window_widths(4, n_local, s)[0] + mm + 2 * r * m + cis_local_width(n_local, s, hold)
    kw = dict(n_sink=4, n_local=n_local, block_size=s, m=m, r=r, hold_local=hold)
    return query, state, slots, lens, width, kw


@pytest.mark.parametrize("hold", [False, True])
def test_decide_compose_then_the_retrieving_rows_equal_the_two_ops_on_the_torch_path(hold):
    """The torch path of the split (the decision writing the other rows, the composition the
    retrieving ones) gives the selection, anchors and unions of decide-then-compose."""
    query, state, slots, lens, width, kw = _decide_case(hold=hold)
    nb = -(-int(lens.max()) // 4)
    scores = torch.rand(3, 2, nb, generator=torch.Generator().manual_seed(1))
    new_idx, new_scores = scores.topk(6, dim=-1)
    new_idx = new_idx.to(torch.int32)
    got, want = [t.clone() for t in state], [t.clone() for t in state]
    log_d = (torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64))
    outs = []
    for st, split, ld in ((got, True, log_d[0]), (want, False, log_d[1])):
        out = (torch.full((3, 2, width), 99, dtype=torch.int32),
               torch.full((3, 2), 99, dtype=torch.int32))  # fmt: skip
        nonfinite = torch.zeros(1, dtype=torch.int64)
        if split:
            retrieve, bad = cis_decide_compose(
                query, *st, slots, lens, tau=-1.0, **kw, out_indices=out[0], out_counts=out[1],
                nonfinite=nonfinite,
            )  # fmt: skip
            assert (out[1][retrieve] == 99).all() and (out[1][~retrieve] != 99).all()
        else:
            retrieve, bad = cis_decide(query, st[0], st[1], slots, lens, tau=-1.0,
                                       n_local=kw["n_local"], nonfinite=nonfinite)  # fmt: skip
        cis_compose(query, retrieve, bad, new_idx, new_scores, *st[:4], ld, slots, lens, **kw,
                    out_indices=out[0], out_counts=out[1], anchor_union=st[4],
                    anchor_union_cnt=st[5], retrieving_only=split)  # fmt: skip
        outs.append((retrieve, bad, out, nonfinite))
    (gr, gb, (gi, gc), gn), (wr, wb, (wi, wc), wn) = outs
    assert torch.equal(gr, wr) and torch.equal(gb, wb) and gn.item() == wn.item() == 1
    assert gr.any() and (~gr & ~gb).any()  # rows that retrieve and rows that reuse
    assert torch.equal(gi, wi) and torch.equal(gc, wc)
    for a, b_ in zip(got, want, strict=True):
        assert torch.equal(a, b_)


def test_decide_compose_refuses_bad_input_before_deciding_anything():
    """A bad selection argument is refused before the decision counts a non-finite group,
    raises the retrieval flag or writes a row."""
    query, state, slots, lens, width, kw = _decide_case()
    out = (torch.full((3, 2, width), 99, dtype=torch.int32),
           torch.full((3, 2), 99, dtype=torch.int32))  # fmt: skip
    nonfinite = torch.zeros(1, dtype=torch.int64)
    flag = torch.zeros(1, dtype=torch.bool)
    before = [t.clone() for t in state]
    cases = [
        (dict(out_indices=out[0][..., :-1]), "out_indices"),
        (dict(out_counts=out[1][:, :1]), "out_counts"),
        (dict(m=7), "m \\(7\\) must not exceed"),
        (dict(anchor_union=state[4][..., :-1]), "anchor_union must be int32"),
        (dict(anchor_union_cnt=state[5].long()), "anchor_union_cnt must be int32"),
        (dict(anchor_cnt=state[3][:2]), "anchor_cnt"),
        (dict(n_local=-1), "n_local"),
    ]
    for change, match in cases:
        args = dict(anchor_q=state[0], anchor_len=state[1], anchor_idx=state[2],
                    anchor_cnt=state[3], anchor_union=state[4], anchor_union_cnt=state[5],
                    out_indices=out[0], out_counts=out[1], **kw)  # fmt: skip
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=match):
            cis_decide_compose(query, slots=slots, seq_lens=lens, tau=-1.0, nonfinite=nonfinite,
                               any_retrieve=flag, **args)  # fmt: skip
    assert nonfinite.item() == 0 and not flag.item()
    assert (out[0] == 99).all() and (out[1] == 99).all()
    for got, was in zip(state, before, strict=True):
        assert torch.equal(got, was)


def test_compose_retrieving_only_needs_the_union():
    query, retrieve, bad, new_idx, new_scores, state, slots, lens, out, kw = _case()
    with pytest.raises(ValueError, match="retrieving_only composes after cis_decide_compose"):
        cis_compose(query, retrieve, bad, new_idx, new_scores, *state, slots, lens, **kw,
                    out_indices=out[0], out_counts=out[1], retrieving_only=True)  # fmt: skip


@pytest.mark.parametrize(("nb", "mm", "m", "r", "s"), [(512, 128, 42, 1, 8), (2048, 64, 7, 3, 1)])
def test_the_fused_top_k_and_composition_compiles_for_a_hopper_gpu(
    monkeypatch, hopper_compile, nb, mm, m, r, s
):
    """``top_blocks_compose``'s launch (the top-k's last pass composing its row), caught on the
    CPU and compiled for sm_90, as the composition's above."""
    pytest.importorskip("triton")
    import prhs_kernels.cis.triton as ct

    catch = _Catch()
    real = ct._topk_compose_jit(False)
    monkeypatch.setattr(ct, "_topk_compose_jit", lambda interp: catch)
    b, h, g, d, n = 4, 2, 4, 128, 5
    state, fields = _caught_state(n, h, g, d, mm, m, r)
    width = window_widths(4, 32, s)[0] + mm + 2 * r * m + cis_local_width(32, s, True)
    no = torch.zeros(b, h, dtype=torch.bool)
    top_blocks_compose(
        torch.zeros(b, h, nb), mm, torch.zeros(b, h * g, d, dtype=torch.bfloat16), no, no,
        *state, torch.arange(b), torch.full((b,), 10, dtype=torch.int32), n_sink=4, n_local=32,
        block_size=s, m=m, r=r, out_indices=torch.zeros(b, h, width, dtype=torch.int32),
        out_counts=torch.zeros(b, h, dtype=torch.int32), hold_local=True, **fields,
        any_retrieve=torch.zeros(1, dtype=torch.bool), path="triton",
    )  # fmt: skip
    hopper_compile(real, *catch.launches.pop())


def test_top_blocks_compose_refuses_bad_input_before_any_write():
    query, retrieve, bad, _, _, state, slots, lens, out, kw = _case()
    union = torch.zeros(3, 2, 8, dtype=torch.int32)
    u_cnt = torch.zeros(3, 2, dtype=torch.int32)
    scores = torch.rand(2, 2, 20)
    before = [t.clone() for t in (*state, union, u_cnt)]
    out[0].fill_(99)
    out[1].fill_(99)
    for change, match in [
        (dict(anchor_union=None), "needs the anchors' union"),
        (dict(scores=scores[:1]), "scores"),
        (dict(m_top=5), r"m_top \(5\) must not exceed"),
        (dict(retrieve=retrieve[:1]), "retrieve"),
        (dict(out_counts=out[1][:1]), "out_counts"),
    ]:
        args = dict(scores=scores, m_top=4, retrieve=retrieve, anchor_union=union,
                    out_counts=out[1])  # fmt: skip
        args.update(change)
        with pytest.raises(ValueError, match=match):
            top_blocks_compose(
                args["scores"], args["m_top"], query, args["retrieve"], bad, *state, slots,
                lens, **kw, out_indices=out[0], out_counts=args["out_counts"],
                anchor_union=args["anchor_union"], anchor_union_cnt=u_cnt,
            )  # fmt: skip
    assert (out[0] == 99).all() and (out[1] == 99).all()
    for got, was in zip((*state, union, u_cnt), before, strict=True):
        assert torch.equal(got, was)
