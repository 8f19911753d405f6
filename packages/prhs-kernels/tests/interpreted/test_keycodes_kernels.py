"""Compressed keys' Triton kernels against their torch references, under Triton's interpreter
(run by ``../test_triton.py``): the write of code rows (byte for byte, in place through columns,
non-finite keys counted), and the scorers that read code rows instead of keys -- a retrieval's
probabilities and block scores, the fused retrieval by block mass, and the re-ranking of a pool
-- on every layout, GQA 1 / 4 / 8, D 32 / 64 / 128, bf16 and fp16."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.cis import (
    anchor_union_reference,
    cis_decide_compose,
    cis_local_width,
    cis_rescore,
    retrieval_block_scores,
    retrieval_compose,
)
from prhs_kernels.compose import window_widths
from prhs_kernels.keycodes import code_bytes, write_key_codes
from prhs_kernels.score import retrieval_probs

PATH = "triton-interpreter"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


@pytest.mark.parametrize(("columns", "centred"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize(("h", "d"), [(1, 16), (3, 64), (8, 128)])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_write_matches_the_reference_byte_for_byte(h, d, dtype, columns, centred):
    gen = torch.Generator().manual_seed(h * d)
    n, n_loc = 6, 20
    keys = (torch.randn(n, h, 5, d, generator=gen) * 3).to(dtype)
    keys[1, -1, 2, 0] = float("inf")  # a non-finite key at row 1's column
    keys[4, 0, 1, d - 1] = float("nan")  # ... and one at row 4's column
    keys[3, :, 2] = 0.75  # a constant key
    loc = torch.tensor([3, 0, 17, 9, -1, 12])
    cols = torch.tensor([2, 2, 4, 2, 1, 7])  # the last outside [0, 5): not written
    if not columns:
        keys, cols = keys[torch.arange(n), :, cols.clamp(max=4)], None
        keys[-1] = float("nan")  # not written (location -1 ... below): not counted
        loc = torch.tensor([3, 0, 17, 9, 12, -1])
    rows0 = torch.randint(0, 256, (n_loc + 1, 2, h, code_bytes(d)), generator=gen,
                          dtype=torch.uint8)  # fmt: skip
    center = torch.randn(h, d, generator=gen) * 2 if centred else None
    out = {}
    for path in ("torch", PATH):
        rows = rows0.clone()
        count = torch.zeros(1, dtype=torch.int64)
        write_key_codes(rows[:, 1], loc, keys, columns=cols, nonfinite=count, center=center,
                        path=path)  # fmt: skip
        out[path] = (rows, count)
    (want, wc), (got, gc) = out["torch"], out[PATH]
    assert torch.equal(got[:-1], want[:-1])  # the last row is scratch
    assert torch.equal(got[:, 0], rows0[:, 0])  # the other layer is untouched
    assert int(gc) == int(wc) == (1 if columns else 2)


CASES = [  # (lens, Hq, Hkv, D)
    ([1], 4, 4, 32),
    ([150, 97, 3], 8, 2, 64),
    ([600, 41], 8, 1, 128),
    ([70, 66], 4, 1, 64),
]
IDS = [f"T{max(c[0])}-B{len(c[0])}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}" for c in CASES]


@pytest.mark.parametrize(("lens", "hq", "hkv", "d"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_retrieval_probs_from_codes_match_the_torch_path(
    make_kv, make_codes, lens, hq, hkv, d, dtype
):
    gen = torch.Generator().manual_seed(hq * d)
    data = make_kv(lens, hkv, d, dtype=dtype, seed=len(lens))
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    active = torch.rand(len(lens), hkv, generator=gen) < 0.6
    active[0, 0] = True
    for name in data.layouts:
        kv, codes = data[name], make_codes(data, name)
        assert paths.kernel_path("cpu", dtype) == PATH
        got = retrieval_probs(q, kv, 0.2, active, codes=codes)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PRHS_KERNELS", "torch")
            want = retrieval_probs(q, kv, 0.2, active, codes=codes)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)
        if max(lens) > 1:
            assert not torch.equal(got, retrieval_probs(q, kv, 0.2, active)), "read the keys"


@pytest.mark.parametrize(("s", "score"), [(1, "mass"), (4, "max"), (8, "mass")])
def test_block_scores_from_codes_match_the_torch_path(make_kv, make_codes, s, score):
    gen = torch.Generator().manual_seed(s)
    lens = [300, 77, 5 * s + 3]
    data = make_kv(lens, 2, 64, dtype=torch.bfloat16, seed=s)
    q = torch.randn(3, 8, 64, generator=gen).bfloat16()
    active = torch.tensor([[True, False], [True, True], [False, True]])
    kw = dict(block_size=s, n_sink=4, n_local=16, score=score)
    for name in ("contig", "paged16"):
        kv, codes = data[name], make_codes(data, name)
        want = retrieval_block_scores(q, kv, 0.3, active, codes=codes, **kw, path="torch")
        got = retrieval_block_scores(q, kv, 0.3, active, codes=codes, **kw, path=PATH)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=2e-5, atol=1e-8)


@pytest.mark.parametrize(("g", "s", "layout"), [(4, 8, "contig"), (1, 1, "paged16"),
                                                (8, 4, "paged1")])  # fmt: skip
def test_retrieval_compose_from_codes_matches_the_torch_path(make_kv, make_codes, g, s, layout):
    """The fused retrieval by block mass (block log-sum-exps of code logits, then the top-k and
    the composition) against the torch path's: the same winners, selections and anchors."""
    lens = [700 if s > 1 else 400, 77, 300]
    h, d, n_sink, n_local, m_blocks, m, r = 2, 32, 4, 24, 10, 3, 1
    data = make_kv(lens, h, d, dtype=torch.bfloat16, seed=g * s)
    kv, codes = data[layout], make_codes(data, layout)
    gen = torch.Generator().manual_seed(g + s)
    b = len(lens)
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    n = b + 2
    aq = torch.randn(n, h, g, d, generator=gen)
    alen = torch.zeros(n, h, dtype=torch.int32)  # every anchor too old: every row retrieves
    aidx = torch.full((n, h, m_blocks), -1, dtype=torch.int32)
    acnt = torch.zeros(n, h, dtype=torch.int32)
    alogd = torch.zeros(n, h, dtype=torch.float64)
    slots = torch.tensor([4, 0, 2])
    union, u_cnt = anchor_union_reference(aidx, acnt, m, r)
    ws, _ = window_widths(n_sink, n_local, s)
    width = ws + m_blocks + 2 * r * m + cis_local_width(n_local, s, True)
    kw = dict(n_sink=n_sink, n_local=n_local, block_size=s, m=m, r=r, hold_local=True)
    runs = []
    for path in ("torch", PATH):
        st = [t.clone() for t in (aq, alen, aidx, acnt, alogd, union, u_cnt)]
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
            any_retrieve=flag, codes=codes, path=path,
        )  # fmt: skip
        runs.append((rb[0], top, out_idx, out_cnt, st))
    (wr, (wi, wv), wo, wc, wst), (gr, (gi, gv), go, gc, gst) = runs
    assert torch.equal(gr, wr) and bool(gr.all())
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gv, wv, rtol=2e-5, atol=1e-9)
    assert torch.equal(go, wo) and torch.equal(gc, wc)
    for a, b_ in zip(gst, wst, strict=True):
        assert torch.equal(a, b_)


@pytest.mark.parametrize(("s", "hq", "hkv", "hold"), [(1, 8, 2, True), (4, 4, 1, False),
                                                       (2, 8, 8, True)])  # fmt: skip
def test_rescore_from_codes_matches_the_torch_path(make_kv, make_codes, s, hq, hkv, hold):
    gen = torch.Generator().manual_seed(s + hq)
    lens = [150, 97, 60]
    data = make_kv(lens, hkv, 64, dtype=torch.bfloat16, seed=s)
    b, m, r, n_local = len(lens), 5, 7, 8
    q = torch.randn(b, hq, 64, generator=gen).bfloat16()
    slots = torch.tensor([2, 0, 3])
    reuse = torch.rand(b, hkv, generator=gen) < 0.8
    reuse[0, 0] = True
    n_slots = 4
    alen = torch.tensor([[40], [75], [130], [55]], dtype=torch.int32).expand(n_slots, hkv)
    alen = alen.contiguous()
    nb = 60 // s
    pools = torch.stack([torch.randperm(nb, generator=gen)[: m + r] for _ in range(n_slots * hkv)])
    pools = pools.view(n_slots, hkv, m + r).to(torch.int32)
    for name in data.layouts:
        kv, codes = data[name], make_codes(data, name)
        fields = {}
        for path in ("torch", PATH):
            idx, nxt = pools[..., :m].clone(), pools[..., m:].clone()
            cnt = torch.full((n_slots, hkv), m, dtype=torch.int32)
            kw = dict(block_size=s, n_sink=2, n_local=n_local, hold_local=hold)
            cis_rescore(q, kv, 0.25, reuse, alen, idx, cnt, nxt, slots, **kw, codes=codes,
                        path=path)  # fmt: skip
            fields[path] = (idx, cnt, nxt)
        for want, got in zip(fields["torch"], fields[PATH], strict=True):
            assert torch.equal(got, want), name
        assert not torch.equal(fields[PATH][0], pools[..., :m]), "nothing was re-ranked"
