"""``prhs_kernels.cis.retrieval_compose`` without a GPU: which launches each case takes (caught on
the CPU), that the two-launch variants compile for a Hopper GPU, and that bad input changes
nothing. Its results against the torch path are tested under the interpreter
(``interpreted/test_cis_kernels.py``), the block log-sum-exp pass in
``interpreted/test_triton_kernels.py``."""

from __future__ import annotations

import pytest
import torch

from prhs_core.layout import ContiguousKV
from prhs_kernels.cis import (
    anchor_union_reference,
    cis_local_width,
    retrieval_compose,
)
from prhs_kernels.compose import window_widths

triton = pytest.importorskip("triton")


def _case(t=512, s=8, mm=16, m=4, r=1, b=2, h=2, g=4, d=64):
    k = torch.zeros(b, h, t, d, dtype=torch.bfloat16)
    kv = ContiguousKV(k=k, v=k, seq_lens=torch.full((b,), t, dtype=torch.int32))
    n = b + 1
    idx = torch.full((n, h, mm), -1, dtype=torch.int32)
    cnt = torch.zeros(n, h, dtype=torch.int32)
    union, u_cnt = anchor_union_reference(idx, cnt, m, r)
    state = (torch.zeros(n, h, g, d), torch.zeros(n, h, dtype=torch.int32), idx, cnt,
             torch.zeros(n, h, dtype=torch.float64))  # fmt: skip
    width = window_widths(4, 32, s)[0] + mm + 2 * r * m + cis_local_width(32, s, True)
    i32 = torch.int32
    out = (torch.full((b, h, width), 99, dtype=i32), torch.full((b, h), 99, dtype=i32))
    flags = torch.ones(b, h, dtype=torch.bool), torch.zeros(b, h, dtype=torch.bool)
    return dict(
        query=torch.zeros(b, h * g, d, dtype=torch.bfloat16), kv=kv, flags=flags, state=state,
        slots=torch.arange(b), union=(union, u_cnt), out=out, mm=mm,
        kw=dict(n_sink=4, n_local=32, block_size=s, m=m, r=r, hold_local=True),
    )  # fmt: skip


def _call(c, path="triton", **change):
    args = dict(query=c["query"], retrieve=c["flags"][0], m_top=c["mm"], score="mass",
                out_counts=c["out"][1], anchor_union=c["union"][0])  # fmt: skip
    args.update(change)
    return retrieval_compose(
        args["query"], c["kv"], 0.125, args["m_top"], args["retrieve"], c["flags"][1],
        *c["state"], c["slots"], **c["kw"], out_indices=c["out"][0],
        out_counts=args["out_counts"], anchor_union=args["anchor_union"],
        anchor_union_cnt=c["union"][1], score=args["score"],
        any_retrieve=torch.zeros(1, dtype=torch.bool), path=path,
    )  # fmt: skip


def _names(launches):
    """``(kernel name, LSE_BS or FROM_LSE)`` of each caught launch, in order."""
    out = []
    for fn, _, kw in launches:
        mode = kw.get("LSE_BS", kw.get("FROM_LSE"))
        out.append((fn.fn.__name__, mode))
    return out


def test_by_mass_the_retrieval_is_two_launches(monkeypatch, catch_launches):
    launches = catch_launches
    _call(_case())
    # The logits pass writing block log-sum-exps, then the top-k scoring from them (and
    # composing): no block-score launch.
    assert _names(launches) == [("_logits_kernel", 8), ("_topk_compose_kernel", True)]


@pytest.mark.parametrize(
    ("case", "score"), [(dict(), "max"), (dict(s=128, t=4096), "mass")]
)  # fmt: skip
def test_otherwise_it_is_the_three_launches(monkeypatch, case, score, catch_launches):
    """By largest probability (not a sum over the block), or blocks wider than a tile of the
    logits pass: the logits, the block scores, the top-k that reads them."""
    launches = catch_launches
    _call(_case(**case), score=score)
    assert _names(launches) == [
        ("_logits_kernel", 0), ("_block_scores_kernel", None), ("_topk_compose_kernel", False)
    ]  # fmt: skip


def test_in_several_passes_the_first_scores_its_chunks(monkeypatch, catch_launches):
    import prhs_kernels.cis.triton as ct

    monkeypatch.setattr(ct, "TOPK_ONE_PASS", 64)
    monkeypatch.setattr(ct, "TOPK_CHUNK", 64)
    monkeypatch.setattr(ct, "TOPK_MAX_N", 512)
    launches = catch_launches
    _call(_case(t=8 * 400, mm=16))  # 400 blocks: chunks of 64, then their winners
    names = _names(launches)
    assert names[0] == ("_logits_kernel", 8) and names[1] == ("_topk_kernel", True)
    assert names[-1] == ("_topk_compose_kernel", False) and len(names) >= 3
    assert all(mode is False for _, mode in names[2:])


@pytest.mark.parametrize(("g", "s", "t"), [(4, 8, 4096), (1, 1, 1024), (8, 64, 8192)])
def test_the_two_launches_compile_for_a_hopper_gpu(
    monkeypatch, hopper_compile, g, s, t, catch_launches
):
    launches = catch_launches
    _call(_case(t=t, s=s, g=g, d=128, mm=max(8, 1024 // s // 2)))
    assert len(launches) == 2
    for fn, args, kw in launches:
        kw = {k: v for k, v in kw.items() if k != "num_stages"}
        assert "ld.global" in hopper_compile(fn, args, kw), fn.fn.__name__


def test_bad_input_is_refused_before_any_write(monkeypatch, catch_launches):
    launches = catch_launches
    c = _case()
    before = [x.clone() for x in (*c["state"], *c["union"], *c["out"])]
    for change, match in [
        (dict(anchor_union=None), "needs the anchors' union"),
        (dict(m_top=17), r"m_top \(17\) must not exceed"),
        (dict(retrieve=c["flags"][0][:1]), "retrieve"),
        (dict(out_counts=c["out"][1][:1]), "out_counts"),
        (dict(score="sum"), "block score must be one of"),
        (dict(query=c["query"][:, :5]), "query"),
    ]:
        with pytest.raises(ValueError, match=match):
            _call(c, **change)
    assert launches == []
    for got, was in zip((*c["state"], *c["union"], *c["out"]), before, strict=True):
        assert torch.equal(got, was)
