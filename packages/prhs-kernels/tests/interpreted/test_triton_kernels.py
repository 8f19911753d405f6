"""The Triton kernels against their torch references, under Triton's CPU interpreter: small
shapes, odd ones included, every layout (contiguous with and without left padding, paged with
page size 1 and 16), fp16 and bf16 caches.

Triton picks interpreter or compiler when it is imported, so these tests run in their own
pytest process started with ``TRITON_INTERPRET=1`` (``../test_triton.py`` starts it; the outer
run does not collect this folder). On a GPU the same comparisons run at real sizes in
``benchmarks/scripts/kernels.py check``.
"""

from __future__ import annotations

import pytest
import torch

from prhs_core.selection import Selection
from prhs_kernels import paths
from prhs_kernels.score import retrieval_path, retrieval_probs
from prhs_kernels.sparse_decode import sparse_decode_attention, sparse_decode_path

pytest.importorskip("triton")

# (lens, Hq, Hkv, D, Dv, s)
CASES = [
    ([1], 4, 4, 16, 16, 1),  # T = 1, GQA 1
    ([37, 5], 8, 2, 16, 16, 8),  # GQA 4, T not a multiple of the block or the tile
    ([70, 64, 3], 4, 4, 32, 32, 1),  # GQA 1, a row longer than one tile
    ([130, 17], 8, 1, 64, 64, 4),  # GQA 8, a list spread over several splits
    ([29, 29], 4, 4, 16, 24, 1),  # Dv != D
]
IDS = [f"T{max(c[0])}-B{len(c[0])}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-Dv{c[4]}-s{c[5]}" for c in CASES]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OUT_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}  # probabilities enter P·V rounded


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Every test here runs the Triton kernels through the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


def _reference(monkeypatch, fn, *args, **kwargs):
    """``fn`` on its torch path (``PRHS_KERNELS=torch``)."""
    with monkeypatch.context() as m:
        m.setenv("PRHS_KERNELS", "torch")
        return fn(*args, **kwargs)


def _selection(b, hkv, t, s, k_max, gen):
    """Distinct random block ids (some past a row's end), counts from 0 to ``k_max`` with a row
    of 0 and a full row, garbage past every count."""
    n_ids = -(-t // s) + k_max + 1
    idx = torch.stack([torch.randperm(n_ids, generator=gen)[:k_max] for _ in range(b * hkv)])
    idx = idx.view(b, hkv, k_max)
    counts = torch.randint(0, k_max + 1, (b, hkv), generator=gen)
    counts[0, 0] = k_max
    if b * hkv > 1:
        counts.view(-1)[-1] = 0
    past = torch.arange(k_max).view(1, 1, -1) >= counts.unsqueeze(-1)
    idx = torch.where(past, torch.randint(-5, 3 * n_ids, idx.shape, generator=gen), idx)
    return Selection(idx.to(torch.int32), counts.to(torch.int32), s)


def _close_attention(got, want, dtype):
    out, lse = got
    ref_out, ref_lse = want
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        out.float(), ref_out.float(), rtol=OUT_TOL[dtype], atol=OUT_TOL[dtype]
    )


def test_the_interpreter_path_is_taken_and_named():
    assert sparse_decode_path("cpu", torch.bfloat16) == "triton-interpreter"
    assert retrieval_path("cpu", torch.float16) == "triton-interpreter"
    assert sparse_decode_path("cpu", torch.float32) == "torch"  # float32 caches: the reference


def test_paths_follow_the_environment(monkeypatch):
    monkeypatch.setenv("PRHS_KERNELS", "torch")
    assert sparse_decode_path("cpu", torch.bfloat16) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PRHS_KERNELS", "auto")
    assert paths.kernel_path("cpu", torch.bfloat16) == "torch"
    monkeypatch.setenv("PRHS_KERNELS", "fast")
    with pytest.raises(ValueError, match="PRHS_KERNELS must be 'auto' or 'torch'"):
        paths.kernel_path("cpu", torch.bfloat16)


def test_the_path_is_logged_once(caplog, make_kv):
    data = make_kv([9], 2, 16, dtype=torch.bfloat16)
    q = torch.randn(1, 4, 16).bfloat16()
    paths._announced.clear()
    with caplog.at_level("INFO", logger="prhs_kernels"):
        sparse_decode_attention(q, data["contig"], None, 0.25)
        sparse_decode_attention(q, data["contig"], None, 0.25)
    lines = [r.getMessage() for r in caplog.records if "sparse_decode_attention" in r.getMessage()]
    assert lines == [
        "prhs_kernels: sparse_decode_attention runs its triton-interpreter path on cpu"
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "dv", "s"), CASES, ids=IDS)
def test_sparse_decode_matches_the_reference(monkeypatch, make_kv, lens, hq, hkv, d, dv, s, dtype):
    cache = DTYPES[dtype]
    gen = torch.Generator().manual_seed(sum(lens) + s)
    data = make_kv(lens, hkv, d, value_dim=dv, dtype=cache, seed=len(lens))
    b, t = len(lens), max(lens)
    q = torch.randn(b, hq, d, generator=gen).to(cache)
    selections = [None] + [_selection(b, hkv, t, s, k, gen) for k in (0, 3, -(-t // s) + 2)]
    for sel in selections:
        for name, kv in data.layouts.items():
            got = sparse_decode_attention(q, kv, sel, d**-0.5)
            want = _reference(monkeypatch, sparse_decode_attention, q, kv, sel, d**-0.5)
            assert got[0].dtype == cache and got[1].dtype == torch.float32
            _close_attention(got, want, cache)
            if name != "contig":  # the same K/V through another layout: the same numbers
                first = sparse_decode_attention(q, data["contig"], sel, d**-0.5)
                assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])


def test_sparse_decode_empty_rows_and_nan(make_kv, layout_name):
    lens = [16, 10]
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 16, 16, generator=gen)
    values = torch.randn(2, 2, 16, 16, generator=gen)
    keys[0, 0, 3] = float("nan")
    values[1, 1, 6] = float("nan")
    data = make_kv(lens, 2, 16, keys=keys, values=values, dtype=torch.bfloat16)
    kv = data[layout_name]
    q = torch.randn(2, 4, 16, generator=gen).bfloat16()
    idx = torch.tensor([[[0, 3], [0, 3]], [[5, 6], [12, 11]]], dtype=torch.int32)
    counts = torch.tensor([[2, 2], [2, 2]], dtype=torch.int32)
    out, lse = sparse_decode_attention(q, kv, Selection(idx, counts), 0.3)
    assert torch.isnan(out[0, :2]).all() and torch.isnan(lse[0, :2]).all()  # a NaN key
    assert torch.isfinite(out[0, 2:]).all() and torch.isfinite(out[1, :2]).all()
    assert torch.isfinite(lse[1, :2]).all()
    # Row (1, 1) lists positions 12 and 11, both past its length of 10: nothing to read.
    assert torch.equal(out[1, 2:], torch.zeros(2, 16, dtype=torch.bfloat16))
    assert torch.isneginf(lse[1, 2:]).all()
    values_nan = Selection(torch.tensor([[[0, 1]] * 2, [[5, 6]] * 2], dtype=torch.int32), counts)
    out, lse = sparse_decode_attention(q, kv, values_nan, 0.3)
    assert torch.isnan(out[1, 2:]).all() and torch.isfinite(lse[1, 2:]).all()  # a NaN value


def test_sparse_decode_writes_strided_out_buffers(monkeypatch, make_kv):
    data = make_kv([40, 23], 2, 16, dtype=torch.float16)
    kv = data["paged16"]
    q = torch.randn(2, 8, 16).half()
    sel = _selection(2, 2, 40, 1, 12, torch.Generator().manual_seed(1))
    want = _reference(monkeypatch, sparse_decode_attention, q, kv, sel, 0.25)
    out = torch.full((2, 16, 8), float("nan"), dtype=torch.float16).transpose(1, 2)  # strided
    lse_store = torch.full((2, 8, 3), float("nan"))
    lse = lse_store[..., 1]  # strided
    o, s = sparse_decode_attention(q, kv, sel, 0.25, out=out, lse=lse)
    assert o is out and s is lse
    _close_attention((out, lse), want, torch.float16)
    assert torch.isnan(lse_store[..., 0]).all() and torch.isnan(lse_store[..., 2]).all()


def _count_merge_launches(monkeypatch, sd) -> list:
    """The sparse kernel's merge launches from now on, each ``(grid, args)`` (they go ahead)."""
    launches = []
    split_kernel, merge_kernel = sd._kernels(True)

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, args))
                return merge_kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(sd, "_kernels", lambda interpret: (split_kernel, Counted()))
    return launches


@pytest.mark.parametrize("waves", [0, 64], ids=["one-slice", "many-slices"])
def test_sparse_decode_merges_only_when_a_list_is_split(monkeypatch, make_kv, waves):
    # ``waves`` 0 makes every list one slice: the split kernel writes the output and lse itself
    # and the merge is not launched; 64 spreads each list over several slices and merges them.
    from prhs_kernels.sparse_decode import triton as sd

    monkeypatch.setitem(sd.TUNING, "waves", waves)
    monkeypatch.setitem(sd.TUNING, "merge_last", 0)  # the merge launch (its own test below)
    launches = _count_merge_launches(monkeypatch, sd)
    data = make_kv([300, 77], 2, 16, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 16, generator=gen).bfloat16()
    sel = _selection(2, 2, 300, 1, 260, gen)
    splits = sd.num_splits(4, 260, torch.device("cpu"))
    assert (splits == 1) is (waves == 0)
    for kv in data.layouts.values():
        out = torch.full((2, 8, 16), float("nan"), dtype=torch.bfloat16)
        lse = torch.full((2, 8), float("nan"))
        sparse_decode_attention(q, kv, sel, 0.25, out=out, lse=lse)
        want = _reference(monkeypatch, sparse_decode_attention, q, kv, sel, 0.25)
        _close_attention((out, lse), want, torch.bfloat16)
    assert len(launches) == (0 if waves == 0 else len(data.layouts))


def test_sparse_decode_slices_cut_each_rows_count_not_the_width(monkeypatch, make_kv):
    # Rows of 4 and 5 tiles in a list 8 tiles wide, over 4 slices: every slice reads a tile
    # of its row (cut from the width, the last two slices of the 4-tile row would read
    # nothing and its first two twice as much), and the merged output is the reference's.
    from prhs_kernels.sparse_decode import triton as sd

    monkeypatch.setitem(sd.TUNING, "waves", 2)
    monkeypatch.setitem(sd.TUNING, "merge_last", 0)
    launches = _count_merge_launches(monkeypatch, sd)
    data = make_kv([600, 600], 1, 16, dtype=torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 16, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(75, generator=gen)[:64] for _ in range(2)]).view(2, 1, 64)
    sel = Selection(idx.to(torch.int32), torch.tensor([[32], [40]], dtype=torch.int32), 8)
    assert sd.num_splits(2, 64 * 8, torch.device("cpu")) == 4
    kv = data.layouts["contig"]
    got = sparse_decode_attention(q, kv, sel, 0.25)
    _close_attention(got, _reference(monkeypatch, sparse_decode_attention, q, kv, sel, 0.25),
                     torch.bfloat16)  # fmt: skip
    ((_, args),) = launches
    part_l = args[2]  # PL [B, Hq, S]: each slice's sum
    assert part_l.shape == (2, 2, 4) and (part_l > 0).all()


def test_sparse_decode_merge_last_merges_in_the_split_kernel(monkeypatch, make_kv):
    # ``merge_last``: a row's last slice to finish merges its partials; no merge launch, the
    # reference's numbers (rows with nothing to read included), and every counter back at 0.
    from prhs_kernels.sparse_decode import triton as sd

    monkeypatch.setitem(sd.TUNING, "waves", 64)
    monkeypatch.setitem(sd.TUNING, "merge_last", 1 << 20)
    monkeypatch.setattr(sd, "_ARRIVALS", {})
    launches = _count_merge_launches(monkeypatch, sd)
    data = make_kv([300, 77], 2, 16, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 16, generator=gen).bfloat16()
    sel = _selection(2, 2, 300, 1, 260, gen)
    sel.counts[1, 0] = 0  # a row with nothing to read: out 0, lse -inf
    assert sd.num_splits(4, 260, torch.device("cpu")) > 1
    for strided in (False, True):  # the second round starts from the counters the first left
        for kv in data.layouts.values():
            out = torch.full((2, 8, 16), float("nan"), dtype=torch.bfloat16)
            lse = torch.full((2, 8), float("nan"))
            if strided:  # written in place through their strides, as a host's buffers
                out = torch.full((8, 2, 16), float("nan"), dtype=torch.bfloat16).transpose(0, 1)
                lse = torch.full((2, 8, 3), float("nan"))[..., 1]
            o, s = sparse_decode_attention(q, kv, sel, 0.25, out=out, lse=lse)
            assert o is out and s is lse
            want = _reference(monkeypatch, sparse_decode_attention, q, kv, sel, 0.25)
            _close_attention((out, lse), want, torch.bfloat16)
            assert torch.isneginf(lse[1, :4]).all() and not out[1, :4].any()
    assert launches == []
    (counters,) = sd._ARRIVALS.values()
    assert counters.dtype == torch.int32 and not counters.any()


def test_merge_last_counters_grow_without_freeing_what_a_graph_may_hold(monkeypatch):
    from prhs_kernels.sparse_decode import triton as sd

    monkeypatch.setattr(sd, "_ARRIVALS", {})
    monkeypatch.setattr(sd, "_RETIRED", [])
    cpu = torch.device("cpu")
    first = sd._arrivals(cpu, 10)
    assert first.numel() == 1024 and sd._arrivals(cpu, 1024) is first  # no growth: the same
    grown = sd._arrivals(cpu, 1500)
    assert grown.numel() == 2048 and not grown.any()
    assert len(sd._RETIRED) == 1 and sd._RETIRED[0] is first  # a captured graph may use it


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "dv", "s"), CASES, ids=IDS)
def test_retrieval_probs_match_the_reference(monkeypatch, make_kv, lens, hq, hkv, d, dv, s, dtype):
    cache = DTYPES[dtype]
    gen = torch.Generator().manual_seed(sum(lens))
    data = make_kv(lens, hkv, d, value_dim=dv, dtype=cache, seed=len(lens) + 5)
    b = len(lens)
    q = torch.randn(b, hq, d, generator=gen).to(cache)
    active = torch.rand(b, hkv, generator=gen) < 0.5
    active.view(-1)[0] = True
    for act in (None, active, torch.zeros_like(active)):
        for kv in data.layouts.values():
            got = retrieval_probs(q, kv, d**-0.5, act)
            want = _reference(monkeypatch, retrieval_probs, q, kv, d**-0.5, act)
            assert got.shape == (b, hkv, max(lens)) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if act is not None:
                assert torch.equal(got[~act], torch.zeros_like(got[~act]))


def test_retrieval_merges_spans(monkeypatch, make_kv):
    """Rows longer than one span (1024 positions): the spans' log-sum-exps are merged."""
    from prhs_kernels.score import triton as score_triton

    lens = [score_triton.TUNING["span"] * 2 + 37, 700]
    data = make_kv(lens, 2, 16, dtype=torch.bfloat16, seed=9)
    q = torch.randn(2, 4, 16).bfloat16()
    active = torch.tensor([[True, False], [True, True]])
    for kv in (data["contig"], data["paged16"]):
        for act in (None, active):
            got = retrieval_probs(q, kv, 0.25, act)
            want = _reference(monkeypatch, retrieval_probs, q, kv, 0.25, act)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("s", [1, 8, 64])
def test_block_lse_pass_writes_each_blocks_log_sum_exp(make_kv, s):
    """The logits pass's block mode: each block's log-sum-exp of the logits the plain pass
    writes (positions past a sequence count as -inf: a block wholly past it is -inf), the same
    span statistics; over spans, partial last blocks and every layout."""
    from prhs_kernels.score import triton as score_triton

    lens = [score_triton.TUNING["span"] * 2 + 37, 700, 5]
    data = make_kv(lens, 2, 16, dtype=torch.bfloat16, seed=s)
    q = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(s)).bfloat16()
    active = torch.tensor([[True, False], [True, True], [False, True]])
    rows = active.repeat_interleave(4, dim=1).reshape(-1)  # the query heads' rows
    for name, kv in data.layouts.items():
        logits, sm, sl, n_spans, _, _ = score_triton.retrieval_logits_triton(q, kv, 0.25, active)
        blse, bsm, bsl, b_spans, _ = score_triton.retrieval_block_lse_triton(q, kv, 0.25, active, s)
        nb = -(-kv.max_len // s)
        assert blse.shape[1] % 16 == 0 and blse.shape[1] >= nb and b_spans == n_spans
        pad = nb * s - kv.max_len
        want = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
        want = torch.logsumexp(want.view(-1, nb, s), -1)
        got = blse[:, :nb]
        assert torch.equal(torch.isneginf(got[rows]), torch.isneginf(want[rows])), name
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-6, atol=1e-5)
        act = active.reshape(-1)
        assert torch.equal(bsm[act], sm[act]) and torch.equal(bsl[act], sl[act]), name


def test_block_lse_pass_takes_tile_dividing_powers_of_two(make_kv):
    from prhs_kernels.score import triton as score_triton

    kv = make_kv([10], 2, 16, dtype=torch.bfloat16)["contig"]
    q = torch.randn(1, 4, 16).bfloat16()
    active = torch.ones(1, 2, dtype=torch.bool)
    for s in (3, 128, 0):
        assert not score_triton.block_lse_fits(s)
        with pytest.raises(ValueError, match="block_size must be a power of two of at most 64"):
            score_triton.retrieval_block_lse_triton(q, kv, 0.25, active, s)


def test_retrieval_reads_no_key_of_an_inactive_row(make_kv):
    """NaN keys in a row that does not retrieve do not reach its (zero) output, nor others'."""
    keys = torch.randn(2, 2, 20, 16)
    keys[1, 0] = float("nan")
    data = make_kv([20, 20], 2, 16, keys=keys, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 16).bfloat16()
    active = torch.tensor([[True, True], [False, True]])
    for kv in data.layouts.values():
        p = retrieval_probs(q, kv, 0.25, active)
        assert torch.isfinite(p).all() and torch.equal(p[1, 0], torch.zeros(20))
        torch.testing.assert_close(p[active].sum(-1), torch.ones(3))
        out = torch.full((2, 2, 20), float("nan"))
        assert retrieval_probs(q, kv, 0.25, active, out=out) is out
        assert torch.equal(out, p)


def test_retrieval_rejects_bad_input(make_kv):
    data = make_kv([10], 2, 16, dtype=torch.bfloat16)
    kv = data["contig"]
    q = torch.randn(1, 4, 16).bfloat16()
    with pytest.raises(TypeError, match=r"active must be a torch\.bool mask"):
        retrieval_probs(q, kv, 0.25, torch.ones(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"active must have shape \[1, 2\]"):
        retrieval_probs(q, kv, 0.25, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="out must be a float32"):
        retrieval_probs(q, kv, 0.25, out=torch.empty(1, 2, 10, dtype=torch.float16))


def test_row_bounds_kernel_matches_reference(monkeypatch):
    """One program a row over tiles of columns: rows shorter and longer than a tile, empty,
    full, strided (a view of a 4-D attention mask), each row's run anywhere."""
    from prhs_kernels.kv import row_bounds, row_bounds_reference
    from prhs_kernels.kv import triton as kv_triton

    monkeypatch.setattr(kv_triton, "BLOCK", 16)  # tiles of 16 columns: several a row
    gen = torch.Generator().manual_seed(0)
    for b, t in ((1, 1), (3, 16), (5, 37), (4, 100)):
        four = torch.zeros(b, 1, 2, t, dtype=torch.bool)
        for r in range(b):
            lo = int(torch.randint(0, t + 1, (1,), generator=gen))
            hi = int(torch.randint(lo, t + 1, (1,), generator=gen))
            four[r, 0, -1, lo:hi] = True
        four[0, 0, -1, :] = True
        if b > 2:
            four[2, 0, -1, :] = False
        for m in (four[:, 0, -1, :], four[:, 0, -1, :].contiguous()):
            assert paths.kernel_path(m.device, torch.bfloat16) == "triton-interpreter"
            got = row_bounds(m, torch.bfloat16)
            ref = row_bounds_reference(m)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (b, t)
