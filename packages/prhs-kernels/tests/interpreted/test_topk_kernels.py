"""The top-k kernels under Triton's interpreter (run by ``../test_triton.py``) against their
torch references.

The seeded top-k's first pass (guess, verify): the same candidates in the same order and the
same flags, on rows with ties, NaN and ``-inf`` scores, good, partial, poor, duplicated and
empty seeds, candidate buffers that overflow, rows of one chunk and of several, and inactive
rows.

``topk_indices``' one-program-per-row kernel: a valid top set (any order among equal scores),
on rows with ties, NaN, ``-inf``, ineligible entries (none eligible, fewer than ``k``), ``k``
0 and above ``N``, several leading dims, strided inputs, float32, bf16 and fp16; and rows past
its limit, which take the reference."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from prhs_kernels import paths
from prhs_kernels.topk import (
    seeded_candidates,
    seeded_candidates_reference,
    topk_indices,
    topk_indices_reference,
    topk_path,
)
from prhs_kernels.topk import triton as topk_triton
from prhs_kernels.topk.triton import kth_largest_key_few, order_key

PATH = "triton-interpreter"


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


@pytest.mark.parametrize(("n", "k", "cap", "chunk"), [(700, 30, 64, 128), (50, 8, 16, 4096),
                                                     (1000, 100, 256, 256)])  # fmt: skip
def test_seeded_candidates_match_the_reference(monkeypatch, n, k, cap, chunk):
    monkeypatch.setitem(topk_triton.SEEDED_TUNING, "chunk", chunk)
    gen = torch.Generator().manual_seed(n + k)
    rows = 7
    x = torch.randn(rows, n, generator=gen)
    x[1, ::5] = x[1, 2]  # ties at the threshold
    x[2, :20] = float("nan")
    x[2, 20:40] = float("-inf")
    best = torch.topk(x.nan_to_num(nan=float("-inf")), k + 10, dim=-1).indices
    s = k + 10
    seed = best[:, torch.randperm(s, generator=gen)].to(torch.int32)
    seed[3] = torch.randperm(n, generator=gen)[:s].to(torch.int32)  # poor: overflows
    seed[4] = -1  # none
    seed[5, :] = seed[5, 0]  # one id many times: too few candidates, flagged
    seed[6, -5:] = n + 5  # ids outside the row are ignored
    active = torch.ones(rows, dtype=torch.bool)
    active[0] = False
    got = seeded_candidates(x, k, seed, capacity=cap, active=active, path=PATH)
    want = seeded_candidates_reference(x, k, seed, cap, active)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) or torch.equal(a.nan_to_num(), b.nan_to_num())
    _, ids, over = got
    assert bool(over[4]) and not bool(over[0])  # no seed: flagged; inactive: nothing
    if n > 100:  # a long row: the good seeds verify, the poor one does not
        assert over[[1, 2, 3, 6]].tolist() == [False, False, True, False]
    for r in range(1, rows):  # every verified row: its candidates hold the top k, in order
        if over[r]:
            continue
        c = ids[r][ids[r] >= 0]
        assert bool((c[1:] > c[:-1]).all())
        top = torch.topk(x[r].nan_to_num(nan=float("-inf")), k).values[-1]
        assert set(torch.nonzero(x[r] >= top).flatten().tolist()) <= set(c.tolist())
    assert bool((ids[0] == -1).all()) and not bool(over[0])


def test_seeds_read_in_place_at_their_rows_match_one_gathered_seed():
    """Two seeds read in place at ``seed_rows`` (a state's per-slot pools at a batch's slots,
    rows ``[B, Hkv]``) give what one gathered, concatenated seed gives, flags included; the
    Triton launcher also says which active rows need no whole-row ranking."""
    from prhs_kernels.topk.triton import seeded_candidates_triton

    gen = torch.Generator().manual_seed(3)
    b, h, n, k = 3, 2, 600, 40
    x = torch.randn(b, h, n, generator=gen)
    best = torch.topk(x, k, dim=-1).indices.to(torch.int32)  # [B, Hkv, k]
    slots = torch.tensor([4, 0, 2])
    first = torch.full((5, h, 15), -1, dtype=torch.int32)  # an anchor's list, per slot
    second = torch.full((5, h, k - 15), -1, dtype=torch.int32)  # and its next blocks
    first[slots], second[slots] = best[..., :15], best[..., 15:]
    second[0, 1, :3] = -1  # slot 0 (row 1), head 1: a partial pool, no threshold
    active = torch.tensor([[True, True], [True, True], [False, True]])
    got = seeded_candidates(x, k, (first, second), capacity=128, active=active,
                            seed_rows=slots, path=PATH)  # fmt: skip
    whole = torch.cat([first[slots], second[slots]], -1)
    want = seeded_candidates_reference(x, k, whole, 128, active)
    for a, b_ in zip(got, want, strict=True):
        assert torch.equal(a, b_)
    assert got[2].tolist() == [[False, False], [False, True], [False, False]]
    *_, over, ranked = seeded_candidates_triton(x, k, (first, second), 128, active, slots)
    assert torch.equal(over.view(b, h), got[2])
    assert torch.equal(ranked.view(b, h), active & ~got[2])


@pytest.mark.parametrize(("n", "k", "cap", "chunk"), [(700, 30, 64, 128), (50, 8, 16, 4096)])
def test_rows_a_seed_cannot_serve_are_refined_over_the_whole_row(monkeypatch, n, k, cap, chunk):
    """``whole_rows``: the rows the first pass would flag (a poor seed whose candidates
    overflow, with ties at its k-th score; no seed; one id many times) get exactly their top k
    in position order, ties toward the lower position and NaN as -inf, as the reference gives
    them; no row is flagged; the other rows keep the candidates they had; and the bracket each
    ranked row is given holds its k-th largest key."""
    from prhs_kernels.topk.reference import order_keys
    from prhs_kernels.topk.triton import seeded_candidates_triton

    monkeypatch.setitem(topk_triton.SEEDED_TUNING, "chunk", chunk)
    gen = torch.Generator().manual_seed(n + 3 * k)
    rows = 6
    x = torch.randn(rows, n, generator=gen)
    x[3, ::3] = torch.topk(x[3], k).values[-1]  # many ties at the poor row's k-th score
    x[4, :10] = float("nan")
    s = k + 10
    best = torch.topk(x.nan_to_num(nan=float("-inf")), s, dim=-1).indices
    seed = best[:, torch.randperm(s, generator=gen)].to(torch.int32)
    seed[3] = torch.randperm(n, generator=gen)[:s].to(torch.int32)  # poor
    seed[4] = -1  # none
    seed[5, :] = seed[5, 0]  # one id many times
    active = torch.ones(rows, dtype=torch.bool)
    active[0] = False
    flagged = seeded_candidates(x, k, seed, capacity=cap, active=active, path=PATH)
    got = seeded_candidates(x, k, seed, capacity=cap, active=active, whole_rows=True, path=PATH)
    want = seeded_candidates_reference(x, k, seed, cap, active, whole_rows=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    vals, ids, over = got
    assert not bool(over.any())
    assert bool(flagged[2][4]) and bool(flagged[2][5])
    if n > 100:
        assert bool(flagged[2][3])
    key = order_keys(x)
    for r in range(1, rows):
        if flagged[2][r]:  # the exact top k: k winners in position order, ties lower first
            order = torch.sort(key[r], descending=True, stable=True).indices[:k]
            assert ids[r][:k].tolist() == sorted(order.tolist())
            assert bool((ids[r][k:] == -1).all())
        else:
            assert torch.equal(ids[r], flagged[1][r]) and torch.equal(vals[r], flagged[0][r])
    bracket = torch.empty(rows, 2, dtype=torch.int32)
    seeded_candidates_triton(x, k, seed, cap, active, whole_rows=True, bracket=bracket)
    kth = torch.topk(key, k, dim=-1).values[:, -1]
    for r in range(1, rows):
        assert int(bracket[r, 0]) <= int(kth[r]) <= int(bracket[r, 1]), r


def _topk_case(lead, n, dtype, seed):
    """Scores ``[*lead, n]`` of ``dtype`` (ties on a coarse grid, NaN, ``-inf``, ``inf``, signed
    zeros) and an eligibility mask: the first row every entry eligible, the second none, the
    third three (fewer than most ``k``)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, n)
    x = torch.randn(shape, generator=gen)
    coarse = torch.rand(shape, generator=gen) < 0.5
    x = torch.where(coarse, torch.randint(-3, 4, shape, generator=gen).float() / 2, x)
    odd = torch.rand(shape, generator=gen)
    x[odd < 0.08] = float("nan")
    x[(odd >= 0.08) & (odd < 0.16)] = float("-inf")
    x[(odd >= 0.16) & (odd < 0.18)] = float("inf")
    x[(odd >= 0.18) & (odd < 0.2)] = -0.0
    ok = torch.rand(shape, generator=gen) < 0.7
    flat = ok.view(-1, n)
    flat[0] = True
    if flat.shape[0] > 1:
        flat[1] = False
    if flat.shape[0] > 2:
        flat[2] = False
        flat[2, torch.randperm(n, generator=gen)[: min(3, n)]] = True
    return x.to(dtype), ok


def _check_valid_top(scores, k, eligible, idx, counts):
    """``(idx, counts)`` meets ``topk_indices_reference``'s contract: the same counts and ``-1``
    past them, distinct eligible ids whose scores (NaN as ``-inf``) are the reference's, in
    order, and the same id set wherever no equal score straddles a row's cut."""
    want_idx, want_cnt = topk_indices_reference(scores, k, eligible)
    assert idx.dtype == counts.dtype == torch.int32
    assert idx.shape == want_idx.shape and counts.shape == want_cnt.shape
    assert torch.equal(counts, want_cnt)
    assert torch.equal(idx < 0, want_idx < 0)  # -1 exactly past each count
    n = scores.shape[-1]
    x = scores.float().reshape(-1, n)
    x = torch.where(x.isnan(), float("-inf"), x)  # not nan_to_num: it clamps the infinities
    ok = torch.ones_like(x, dtype=torch.bool) if eligible is None else eligible.reshape(-1, n)
    got, want = idx.reshape(x.shape[0], k), want_idx.reshape(x.shape[0], k)
    for r, c in enumerate(counts.reshape(-1).tolist()):
        g, w = got[r, :c].long(), want[r, :c].long()
        assert len(set(g.tolist())) == c and bool(ok[r, g].all()), f"row {r}: distinct, eligible"
        assert torch.equal(x[r, g], x[r, w]), f"row {r}: the reference's scores, in order"
        if c == 0 or c == int(ok[r].sum()):
            assert set(g.tolist()) == set(w.tolist()), f"row {r}: every eligible entry"
            continue
        cut = x[r, w[-1]]
        left = ok[r].clone()
        left[w] = False
        if not bool((x[r][left] == cut).any()):  # no tie straddles the cut: one top set
            assert set(g.tolist()) == set(w.tolist()), f"row {r}: the reference's set"


TOPK_CASES = [  # (leading dims, N, k)
    ((5,), 37, 7),
    ((2, 3), 300, 64),
    ((4,), 17, 0),
    ((2, 2), 13, 40),  # k above N
    ((3,), 1, 1),
    ((3, 1, 2), 100, 100),
]


TOPK_IDS = [f"{'x'.join(map(str, c[0]))}xN{c[1]}-k{c[2]}" for c in TOPK_CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("lead", "n", "k"), TOPK_CASES, ids=TOPK_IDS)
def test_topk_indices_kernel_is_a_valid_top_set(lead, n, k, dtype):
    assert topk_path("cpu", dtype, n, PATH) == PATH
    x, ok = _topk_case(lead, n, dtype, seed=n + k)
    for eligible in (ok, None):
        idx, counts = topk_indices(x, k, eligible, path=PATH)
        _check_valid_top(x, k, eligible, idx, counts)


def test_topk_indices_kernel_reads_strided_rows_and_half_scores():
    """A strided view of the scores (read in place), an expanded mask (as selectors pass one)
    and fp16 scores; ties toward the lower position among the ``-inf`` that fill a row."""
    x, ok = _topk_case((4, 3), 150, torch.float32, seed=5)
    view = x.transpose(0, 1)[..., ::2]  # [3, 4, 75], rows of stride 2
    mask = ok[:1, :, :75].expand(4, 3, 75).transpose(0, 1)
    idx, counts = topk_indices(view, 20, mask, path=PATH)
    _check_valid_top(view, 20, mask, idx, counts)
    half = x.to(torch.float16)
    idx, counts = topk_indices(half, 33, ok, path=PATH)
    _check_valid_top(half, 33, ok, idx, counts)
    row = torch.tensor([[float("-inf"), 2.0, float("nan"), float("-inf"), 1.0]])
    idx, counts = topk_indices(row, 4, path=PATH)
    assert idx.tolist() == [[1, 4, 0, 2]] and counts.tolist() == [4]


def test_topk_indices_rows_past_the_kernel_take_the_reference(monkeypatch):
    """Rows longer than one program holds (``TOPK_MAX_N``, made small here) take the reference
    (the Numba kernel on the CPU), with the same contract, and no launch."""
    monkeypatch.setattr(topk_triton, "TOPK_MAX_N", 64)
    x, ok = _topk_case((3,), 100, torch.float32, seed=9)
    assert topk_path("cpu", torch.float32, 100, PATH) in ("numba", "torch")
    assert topk_path("cpu", torch.float32, 64, PATH) == PATH
    launched = []
    kernel = topk_triton.topk_indices_triton
    monkeypatch.setattr(topk_triton, "topk_indices_triton",
                        lambda *a: launched.append(a) or kernel(*a))  # fmt: skip
    idx, counts = topk_indices(x, 10, ok, path=PATH)
    assert not launched
    _check_valid_top(x, 10, ok, idx, counts)
    idx, counts = topk_indices(x[..., :64], 10, ok[..., :64], path=PATH)
    assert len(launched) == 1
    _check_valid_top(x[..., :64], 10, ok[..., :64], idx, counts)


# --- the k-th key by narrowing, then ranking the few left (kth_largest_key_few) ---------------
@triton.jit
def _kth_few_kernel(X, BOUNDS, OUT, SCRATCH, n, k, BLOCK: tl.constexpr, RADIX: tl.constexpr,
                    FEW: tl.constexpr, BRACKET: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=float("-inf"))
    key = tl.where(offs < n, order_key(x), -2147483647 - 1)
    if BRACKET:
        lo = tl.load(BOUNDS)
        hi = tl.load(BOUNDS + 1)
    else:
        lo = tl.min(tl.where(offs < n, key, 2147483647), 0)
        hi = tl.full([], 2147483647, tl.int32)
    tl.store(OUT, kth_largest_key_few(key, k, lo, hi, SCRATCH, BLOCK, RADIX, FEW, 16))


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    x = torch.where(torch.isnan(x), float("-inf"), x)
    bits = x.view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@pytest.mark.parametrize("few", [16, 128])
@pytest.mark.parametrize("bracket", [False, True])
def test_kth_key_by_narrowing_then_ranking_the_few(few, bracket):
    """``kth_largest_key_few`` returns each row's ``k``-th largest key, whether the rounds end
    with the interval closed (many equal keys) or with at most ``few`` keys in it, from no
    bracket or from one around the answer (its ends, one key wide, beyond the keys)."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for n, k in [(1, 1), (37, 37), (37, 1), (300, 100), (1000, 999), (2048, 700), (4096, 1024)]:
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)
        cases.append((x, k))
        y = x.clone()
        y[torch.randperm(n, generator=g)[: n // 2]] = y[0].item()  # half the row ties
        cases.append((y, k))
        z = x.clone()
        z[::3] = float("-inf")
        z[1::5] = float("nan")
        cases.append((z, k))
        cases.append((torch.full((n,), 2.5), k))
    for x, k in cases:
        n = x.numel()
        keys = _order_keys(x)
        want = torch.sort(keys, descending=True).values[k - 1]
        block = max(16, 1 << (n - 1).bit_length())
        bounds = [
            (want, want),  # closed from the start
            (torch.min(keys), torch.max(keys)),
            (want - 1, want + 1),
            (max(int(torch.min(keys)) - 1000, -(2**31) + 1), 2**31 - 1),  # beyond the keys
        ]
        for lo, hi in bounds if bracket else [(0, 0)]:
            out = torch.zeros(1, dtype=torch.int32)
            scratch = torch.full((few,), 7, dtype=torch.int32)
            b = torch.tensor([int(lo), int(hi)], dtype=torch.int32)
            _kth_few_kernel[(1,)](x, b, out, scratch, n, k, BLOCK=block, RADIX=4, FEW=few,
                                  BRACKET=bracket)  # fmt: skip
            assert out.item() == int(want), (n, k, int(lo), int(hi))
