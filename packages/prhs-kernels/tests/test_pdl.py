"""Programmatic dependent launch (prhs_kernels.pdl): where it is used, and that every decode-path
kernel launched with it compiles for a Hopper GPU with the wait before its first read (no GPU:
the launches are caught on the CPU and compiled for sm_90)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import pdl

triton = pytest.importorskip("triton")


def test_pdl_is_off_unless_asked_and_possible(monkeypatch):
    monkeypatch.setitem(pdl.PDL, "enabled", False)
    assert pdl.pdl_args("cpu", "cis") == {"PDL": False}
    monkeypatch.setitem(pdl.PDL, "enabled", True)
    assert not pdl.pdl_supported("cpu")
    assert pdl.pdl_args("cpu", "cis") == {"PDL": False}  # asked for, but not a GPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_supported("cuda")  # the interpreter: nothing to launch with it
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    assert pdl.pdl_args("cuda", "cis") == {"PDL": True, "launch_pdl": True}
    monkeypatch.setitem(pdl.PDL, "enabled", False)
    assert pdl.pdl_args("cuda", "cis") == {"PDL": False}


def test_pdl_launches_early_only_the_families_asked_for(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    monkeypatch.setitem(pdl.PDL, "enabled", True)
    monkeypatch.setitem(pdl.PDL, "kernels", frozenset({"cis", "merge"}))
    assert pdl.pdl_args("cuda", "cis") == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_args("cuda", "merge") == {"PDL": True, "launch_pdl": True}
    # The others still signal their dependents, but start in order.
    assert pdl.pdl_args("cuda", "sparse") == {"PDL": True}
    assert pdl.pdl_args("cuda", "gemm") == {"PDL": True}
    with pytest.raises(ValueError, match="unknown kernel family 'attention'"):
        pdl.pdl_args("cuda", "attention")


@pytest.mark.parametrize(
    ("value", "enabled", "kernels"),
    [("0", False, set(pdl.KERNELS)), ("", False, set(pdl.KERNELS)), ("1", True, set(pdl.KERNELS)),
     ("all", True, set(pdl.KERNELS)), ("On", True, set(pdl.KERNELS)),
     ("cis, score,rows", True, {"cis", "score", "rows"})],
)  # fmt: skip
def test_pdl_from_the_environment(value, enabled, kernels):
    got = pdl._from_env(value)
    assert got["enabled"] is enabled and set(got["kernels"]) == kernels


def test_pdl_environment_with_an_unknown_family_is_an_error():
    with pytest.raises(ValueError, match=r"unknown kernel families \['gemms'\].*gemm, cis"):
        pdl._from_env("cis,gemms")


def test_pdl_needs_a_hopper_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_triton_launches_pdl", lambda: True)
    for major, want in [(8, False), (9, True), (10, True)]:
        monkeypatch.setattr(pdl, "_hopper_or_later", lambda device, m=major: m >= 9)
        assert pdl.pdl_supported("cuda:0") is want


def _decode_launches():
    """One call of each decode-path launcher, on CPU tensors (caught, never run)."""
    from prhs_core.layout import ContiguousKV
    from prhs_core.selection import Selection
    from prhs_kernels.cis import (
        cis_decide_compose,
        cis_local_width,
        retrieval_block_scores,
        retrieval_compose,
        top_blocks_compose,
    )
    from prhs_kernels.compose import window_widths
    from prhs_kernels.gemm.triton import decode_linear_triton
    from prhs_kernels.kv.triton import row_bounds_triton
    from prhs_kernels.sparse_decode.triton import sparse_decode_attention_triton

    b, h, g, d, t, s, mm, m, r, n = 2, 2, 4, 64, 512, 8, 16, 4, 1, 3
    q = torch.zeros(b, h * g, d, dtype=torch.bfloat16)
    k = torch.zeros(b, h, t, d, dtype=torch.bfloat16)
    kv = ContiguousKV(k=k, v=torch.zeros_like(k), seq_lens=torch.full((b,), t, dtype=torch.int32))
    sel = Selection(indices=torch.zeros(b, h, 24, dtype=torch.int32),
                    counts=torch.zeros(b, h, dtype=torch.int32), block_size=s)  # fmt: skip
    sparse_decode_attention_triton(q, kv, sel, 0.1)  # split (and merge)
    decode_linear_triton(torch.zeros(2, 256, dtype=torch.bfloat16),
                         torch.zeros(128, 256, dtype=torch.bfloat16), None)  # fmt: skip
    row_bounds_triton(torch.ones(b, t, dtype=torch.bool))
    state = (torch.zeros(n, h, g, d), torch.zeros(n, h, dtype=torch.int32),
             torch.zeros(n, h, mm, dtype=torch.int32), torch.zeros(n, h, dtype=torch.int32),
             torch.zeros(n, h, dtype=torch.float64))  # fmt: skip
    union = dict(anchor_union=torch.zeros(n, h, mm + 2 * r * m, dtype=torch.int32),
                 anchor_union_cnt=torch.zeros(n, h, dtype=torch.int32))  # fmt: skip
    width = window_widths(4, 32, s)[0] + mm + 2 * r * m + cis_local_width(32, s, True)
    out = dict(out_indices=torch.zeros(b, h, width, dtype=torch.int32),
               out_counts=torch.zeros(b, h, dtype=torch.int32))  # fmt: skip
    slots, lens = torch.arange(b), torch.full((b,), t, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.bool)
    retrieve, bad = cis_decide_compose(
        q, *state[:4], union["anchor_union"], union["anchor_union_cnt"], slots, lens, tau=-1.0,
        n_local=32, n_sink=4, block_size=s, m=m, r=r, hold_local=True, any_retrieve=flag,
        nonfinite=torch.zeros(1, dtype=torch.int64), path="triton", **out,
    )  # fmt: skip
    scores = retrieval_block_scores(q, kv, 0.1, retrieve, block_size=s, n_sink=4, n_local=32,
                                    fill_idle=False, path="triton")  # fmt: skip
    top_blocks_compose(
        torch.zeros(b, h, t // s), mm, q, retrieve, bad, *state, slots, lens, n_sink=4,
        n_local=32, block_size=s, m=m, r=r, hold_local=True, any_retrieve=flag, path="triton",
        **union, **out,
    )  # fmt: skip
    retrieval_compose(
        q, kv, 0.1, mm, retrieve, bad, *state, slots, n_sink=4, n_local=32, block_size=s, m=m,
        r=r, hold_local=True, any_retrieve=flag, path="triton", **union, **out,
    )  # fmt: skip
    del scores


def test_every_decode_kernel_launches_with_pdl_and_compiles_for_a_hopper_gpu(
    monkeypatch, hopper_compile, catch_launches
):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(pdl.PDL, "enabled", True)
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    launches = catch_launches
    _decode_launches()
    names = {fn.fn.__name__ for fn, _, _ in launches}
    want = {"_split_kernel", "_decode_linear_kernel", "_row_bounds_kernel", "_decide_kernel",
            "_logits_kernel", "_block_scores_kernel", "_topk_compose_kernel"}  # fmt: skip
    assert want <= names, want - names
    seen = set()
    for fn, args, kw in launches:
        assert kw.get("PDL") is True and kw.get("launch_pdl") is True, fn.fn.__name__
        # Each kernel once per variant (the retrieval's block log-sum-exp / scoring ones too).
        key = (fn.fn.__name__, kw.get("LSE_BS"), kw.get("FROM_LSE"))
        if key in seen:
            continue
        seen.add(key)
        ptx = hopper_compile(fn, args, kw)
        # The wait comes first: nothing is loaded before it.
        wait = ptx.index("griddepcontrol.wait")
        assert "griddepcontrol.launch_dependents" in ptx[wait:], fn.fn.__name__
        assert "ld.global" not in ptx[:wait], fn.fn.__name__


def _family(fn) -> str:
    """The :data:`prhs_kernels.pdl.KERNELS` family of a caught launch's kernel."""
    module = fn.fn.__module__.split(".")[1]
    if module == "sparse_decode":
        return "sparse" if fn.fn.__name__ == "_split_kernel" else "merge"
    return {"gemm": "gemm", "cis": "cis", "score": "score", "kv": "rows"}[module]


def test_pdl_scoped_to_families_launches_only_those_early(monkeypatch, catch_launches):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(pdl.PDL, "enabled", True)
    monkeypatch.setitem(pdl.PDL, "kernels", frozenset({"cis", "rows"}))
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    launches = catch_launches
    _decode_launches()
    families = {_family(fn) for fn, _, _ in launches}
    assert {"cis", "rows", "sparse", "gemm", "score"} <= families, families
    for fn, _, kw in launches:
        assert kw.get("PDL") is True, fn.fn.__name__  # every kernel still signals its dependents
        assert kw.get("launch_pdl", False) is (_family(fn) in {"cis", "rows"}), fn.fn.__name__


def test_without_pdl_the_kernels_hold_no_grid_dependency_control(
    monkeypatch, hopper_compile, catch_launches
):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(pdl.PDL, "enabled", False)
    launches = catch_launches
    _decode_launches()
    for _, _, kw in launches:
        assert kw.get("PDL") is False and "launch_pdl" not in kw
    fn, args, kw = next(x for x in launches if x[0].fn.__name__ == "_split_kernel")
    assert "griddepcontrol" not in hopper_compile(fn, args, kw)
