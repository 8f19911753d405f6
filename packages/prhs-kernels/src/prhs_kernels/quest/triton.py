"""Triton kernels of Quest's step: the page scores (one launch reads each eligible page's key
minimum and maximum once and writes the group's bound), then the selection (one launch ranks
every row's pages and writes its selection with the windows).

``_page_scores_kernel``, a flat grid of ``B * Hkv * ceil(P / BLOCK_P)`` programs (one axis:
the second and third of a CUDA grid stop at 65535): a program takes one (sequence, KV head) and
a span of ``BLOCK_P`` consecutive pages. It works out which of them Quest may pick (they exist,
hold no sink or local position, and the row is not ``bad``) and loads the side rows ``kmin`` /
``kmax`` of those pages only (``[BLOCK_P, D]`` in the cache dtype, read in place through the
page rows of ``pages``). For each of the group's ``g`` query heads (its query loaded as float32)
it sums ``max(q_j, 0)·max_j + min(q_j, 0)·min_j`` over ``j`` in float32; the score is the
largest bound over the group times the scaling, NaN when a head's bound is NaN (as ``amax``
propagates it), and ``-inf`` for the pages Quest may not pick.

Bytes read: per (sequence, KV head), ``2 · D · element_size`` per eligible page plus the page
rows (8 bytes a page, shared by the row's KV heads through the cache) and the group's queries;
windows, pages past the end and ``bad`` rows are not read. No tensor-core ``tl.dot`` (the
interpreter multiplies bf16 wrongly in it, and ``g`` is below its tile), no value is read on the
host and every shape is static, so the launch can be captured in a CUDA graph.

``_select_kernel``, one program per (sequence, KV head), holds the row's ``P`` page scores in
registers (``P`` up to :data:`MAX_PAGES`) and finds the top ``k`` of the pages Quest may pick
with the search of :mod:`prhs_kernels.topk.triton` (no sort: NaN and ``-inf`` bounds of such
pages rank last but still count, ties go to the lower page). The winners lie between the sink
and the local window, so the selection -- the sink's pages, the winners in page order, the local
window's pages -- is ascending and distinct as written: each winner is stored at its place among
the winners, the windows and the ``-1`` tail around them, and the count beside.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait
from prhs_kernels.topk.triton import order_key, search_constants, search_warps, take_top

__all__ = [
    "FOLD_MAX_KEY",
    "FOLD_MAX_ROWS",
    "MAX_PAGES",
    "TUNING",
    "fold_fits",
    "fold_page_bounds_triton",
    "quest_page_scores_triton",
    "quest_select_fits",
    "quest_select_triton",
]

FOLD_MAX_ROWS = 4096
"""Most rows one :func:`fold_page_bounds_triton` launch folds (a decode step writes one a
sequence); longer writes (a prompt's) take the torch path."""

FOLD_MAX_KEY = 16384
"""Most values of a ``[Hkv, D]`` key (padded to powers of two) a fold program holds."""

MAX_PAGES = 16384
"""Most pages a row may have for ``_select_kernel`` (one program holds them in registers);
longer rows are ranked by the torch path."""

TUNING = {
    "radix_bits": 2,
    "scan_segment": 128,
    "select_warps": 4,
    "scores_tile": 4096,
    "scores_warps": 4,
}
"""The selection's search: bits of the ``k``-th key found a round (1, 2, 4 or 8), the segment
of its prefix counts (0 or a power of two >= 16), as the CIS top-k's
(:data:`prhs_kernels.cis.triton.TUNING`), and the fewest warps a program (more where
:func:`prhs_kernels.topk.triton.search_warps` gives more). The page scores': values of a
program's ``[pages, D]`` tile (a power of two: ``scores_tile / D`` pages a program) and its
warps. On an H100, 8 bits and 8 warps made the selection alone faster on random scores (16
layers back to back in a CUDA graph: 10.6 µs a layer at B1·Hkv32·T32k against 11.6) but the
whole decode step slower (Llama-2-7B B1·T32k 7.29 ms against 6.94): the defaults stay. No tile
or warp count of the page scores beat theirs by more than 3 %."""


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _row_bad(
    Q,
    BAD,
    b,
    h,
    pid,
    stride_qb,
    stride_qh,
    FIND_BAD: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Whether row ``pid = b · Hkv + h`` picks nothing: read from ``BAD`` or, with
    ``FIND_BAD``, found here (its group's queries hold a NaN or an infinity)."""
    if FIND_BAD:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
        q_ptr = Q + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh
        q = tl.load(q_ptr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        finite = (q == q) & (tl.abs(q) < float("inf"))
        bad = tl.sum(tl.sum((mask & ~finite).to(tl.int32), 1), 0) > 0
    else:
        bad = tl.load(BAD + pid) != 0
    return bad


def _page_scores_kernel(
    Q,
    KMIN,
    KMAX,
    PAGES,
    LENS,
    BAD,
    OUT,
    stride_qb,
    stride_qh,
    stride_lo_n,
    stride_lo_h,
    stride_hi_n,
    stride_hi_h,
    stride_pb,
    stride_pp,
    n_pages,
    n_spans,
    scaling,
    n_sink,
    n_local,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PS: tl.constexpr,
    FIND_BAD: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    prog = tl.program_id(0)
    pid = prog // n_spans  # the (sequence, KV head) row, b * HKV + h
    span = prog % n_spans
    b = pid // HKV
    h = pid % HKV
    seq = tl.load(LENS + b)
    bad = _row_bad(Q, BAD, b, h, pid, stride_qb, stride_qh, FIND_BAD, G, BLOCK_G, D, BLOCK_D)
    # What Quest may pick: pages that exist, outside the sink and local windows, on good rows.
    nb_seq = (seq + PS - 1) // PS
    sink_end = (tl.minimum(seq, n_sink) + PS - 1) // PS
    local_first = tl.where(n_local > 0, tl.maximum(seq - n_local, 0) // PS, nb_seq)
    j = span * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = (j < n_pages) & (j < nb_seq) & (j >= sink_end) & (j < local_first) & (~bad)
    rows = tl.load(PAGES + b.to(tl.int64) * stride_pb + j * stride_pp, mask=ok, other=0)
    rows = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m2 = ok[:, None] & d_ok[None, :]
    lo_ptr = KMIN + rows[:, None] * stride_lo_n + h * stride_lo_h + offs_d[None, :]
    hi_ptr = KMAX + rows[:, None] * stride_hi_n + h * stride_hi_h + offs_d[None, :]
    lo = tl.load(lo_ptr, mask=m2, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    hi = tl.load(hi_ptr, mask=m2, other=0.0).to(tl.float32)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_P], tl.int1)
    q_row = Q + b.to(tl.int64) * stride_qb + (h * G) * stride_qh
    for gi in tl.static_range(G):
        q = tl.load(q_row + gi * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        pos = tl.where(q > 0.0, q, 0.0)
        neg = tl.where(q < 0.0, q, 0.0)
        bound = tl.sum(pos[None, :] * hi + neg[None, :] * lo, 1) * scaling
        nan = nan | (bound != bound)
        best = tl.maximum(best, bound)
    best = tl.where(nan, float("nan"), best)
    out = OUT + pid.to(tl.int64) * n_pages + j
    tl.store(out, tl.where(ok, best, float("-inf")), mask=j < n_pages)


def _select_kernel(
    SCORES,
    LENS,
    BAD,
    Q,
    NONFINITE,
    SEL_IDX,
    SEL_CNT,
    stride_qb,
    stride_qh,
    stride_sb,
    stride_sh,
    stride_cb,
    stride_ch,
    n_pages,
    k,
    n_sink,
    n_local,
    HKV: tl.constexpr,
    PS: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    RADIX: tl.constexpr,
    SEG: tl.constexpr,
    FIND_BAD: tl.constexpr,
    COUNT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)  # the (sequence, KV head) row, b * HKV + h
    b = pid // HKV
    h = pid % HKV
    seq = tl.load(LENS + b)
    bad = _row_bad(Q, BAD, b, h, pid, stride_qb, stride_qh, FIND_BAD, G, BLOCK_G, D, BLOCK_D)
    if COUNT:  # only the (rare) bad rows touch the counter: no atomics on a clean step
        tl.atomic_add(NONFINITE, bad.to(tl.int64), mask=bad)
    # The page scores' windows: pages [0, sink_end) and [local_first, nb_seq) are always read.
    nb_seq = (seq + PS - 1) // PS
    sink_end = (tl.minimum(seq, n_sink) + PS - 1) // PS
    local_first = tl.where(n_local > 0, tl.maximum(seq - n_local, 0) // PS, nb_seq)
    j = tl.arange(0, BLOCK)
    ok = (j < n_pages) & (j < nb_seq) & (j >= sink_end) & (j < local_first) & (~bad)
    x = tl.load(SCORES + pid.to(tl.int64) * n_pages + j, mask=ok, other=float("-inf"))
    key = tl.where(ok, order_key(x), -2147483648)
    k_here = tl.minimum(k, tl.sum(ok.to(tl.int32), 0))
    take, pos = take_top(key, ok, k_here, BLOCK, RADIX_BITS, RADIX, SEG)
    row = SEL_IDX + b.to(tl.int64) * stride_sb + h * stride_sh
    tl.store(row + sink_end + pos, j, mask=take)  # the winners, in page order
    # The sink's pages before them; after them the local window's (those the sink does not
    # hold already), then -1.
    local_start = tl.maximum(local_first, sink_end)
    after = sink_end + k_here
    count = after + nb_seq - local_start
    o = tl.arange(0, BLOCK_W)
    v = tl.where(o < sink_end, o, local_start + (o - after))
    v = tl.where(o < count, v, -1)
    tl.store(row + o, v, mask=(o < WIDTH) & ((o < sink_end) | (o >= after)))
    tl.store(SEL_CNT + b * stride_cb + h * stride_ch, count)


def _fold_kernel(
    KMIN,
    KMAX,
    LOC,
    KEY,
    COL,
    NONFINITE,
    n,
    n_cols,
    stride_kn,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_lo_r,
    stride_lo_h,
    stride_lo_d,
    stride_hi_r,
    stride_hi_h,
    stride_hi_d,
    PS: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_COL: tl.constexpr,
    COUNT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    i = tl.program_id(0)  # the write's row
    offs_n = tl.arange(0, BLOCK_N)
    locs = tl.load(LOC + offs_n, mask=offs_n < n, other=-1).to(tl.int64)
    if HAS_COL:
        cols = tl.load(COL + offs_n, mask=offs_n < n, other=-1).to(tl.int64)
        locs = tl.where((cols >= 0) & (cols < n_cols), locs, -1)
    loc = tl.max(tl.where(offs_n == i, locs, -1), 0)  # this row's (-1: not written)
    page = tl.where(loc >= 0, loc // PS, -1)
    pages = tl.where(locs >= 0, locs // PS, -2)  # never equal to a row's page, -1 included
    same = pages == page
    # The page's leader -- its first written row -- resets and folds it; the others only
    # count their own key.
    leader = (loc >= 0) & (tl.sum((same & (offs_n < i)).to(tl.int32), 0) == 0)
    reset = tl.sum((same & (locs % PS == 0)).to(tl.int32), 0) > 0
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m2 = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    kh = offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    col = 0
    if HAS_COL:
        col = tl.load(COL + i).to(tl.int64)
    row = KEY + i.to(tl.int64) * stride_kn + col * stride_kt  # int64: a cache passes 2^31
    x = tl.load(row + kh, mask=m2 & (loc >= 0), other=0.0)
    x = x.to(tl.float32)
    fin = tl.sum(tl.sum((m2 & ~((x == x) & (tl.abs(x) < float("inf")))).to(tl.int32), 1), 0) == 0
    if COUNT:  # only the (rare) non-finite rows touch the counter
        out = (loc >= 0) & ~fin
        tl.atomic_add(NONFINITE, out.to(tl.int64), mask=out)
    if leader:
        lo_ptr = KMIN + page * stride_lo_r + offs_h[:, None] * stride_lo_h
        lo_ptr += offs_d[None, :] * stride_lo_d
        hi_ptr = KMAX + page * stride_hi_r + offs_h[:, None] * stride_hi_h
        hi_ptr += offs_d[None, :] * stride_hi_d
        lo = tl.load(lo_ptr, mask=m2 & ~reset, other=float("inf")).to(tl.float32)
        hi = tl.load(hi_ptr, mask=m2 & ~reset, other=float("-inf")).to(tl.float32)
        lo = tl.where(fin, tl.minimum(lo, x), lo)
        hi = tl.where(fin, tl.maximum(hi, x), hi)
        # The page's later rows (at most PS - 1 at distinct locations), lowest first.
        later = same & (offs_n > i)
        for _ in range(tl.sum(later.to(tl.int32), 0)):
            j = tl.min(tl.where(later, offs_n, BLOCK_N), 0)
            later = later & (offs_n != j)
            cj = 0
            if HAS_COL:
                cj = tl.load(COL + j).to(tl.int64)
            y = tl.load(KEY + j.to(tl.int64) * stride_kn + cj * stride_kt + kh, mask=m2, other=0.0)
            y = y.to(tl.float32)
            ok = (m2 & ~((y == y) & (tl.abs(y) < float("inf")))).to(tl.int32)
            fin_j = tl.sum(tl.sum(ok, 1), 0) == 0
            lo = tl.where(fin_j, tl.minimum(lo, y), lo)
            hi = tl.where(fin_j, tl.maximum(hi, y), hi)
        tl.store(lo_ptr, lo.to(KMIN.dtype.element_ty), mask=m2)
        tl.store(hi_ptr, hi.to(KMAX.dtype.element_ty), mask=m2)


@functools.cache
def _kernels(interpret: bool) -> tuple[object, object, object]:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_page_scores_kernel), triton.jit(_select_kernel), triton.jit(_fold_kernel)


def _pow2(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(n))


def _flags(bad: torch.Tensor | None, unread: torch.Tensor) -> torch.Tensor:
    """``bad`` as the kernels read it (int8), or a tensor they leave unread."""
    return unread if bad is None else bad.contiguous().view(torch.int8)


def quest_page_scores_triton(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    bad: torch.Tensor | None,
    scaling: float,
    page_size: int,
    n_sink: int,
    n_local: int,
) -> torch.Tensor:
    """One launch (arguments checked by :func:`prhs_kernels.quest.quest_page_scores`); ``bad``
    ``None``: each program finds its row's from the group's queries."""
    b, hq, d = query.shape
    h = kmin.shape[1]
    n_pages = pages.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if kmin.stride(-1) != 1:
        kmin = kmin.contiguous()
    if kmax.stride(-1) != 1:
        kmax = kmax.contiguous()
    scores = torch.empty(b, h, n_pages, dtype=torch.float32, device=query.device)
    if scores.numel() == 0:
        return scores
    block_d = _pow2(d, 16)
    # Two [BLOCK_P, BLOCK_D] float32 tiles of TUNING["scores_tile"] values each per program.
    block_p = min(_pow2(n_pages, 1), max(1, TUNING["scores_tile"] // block_d))
    n_spans = triton.cdiv(n_pages, block_p)
    kernel, _, _ = _kernels(interpreting())
    kernel[(b * h * n_spans,)](
        query, kmin, kmax, pages, seq_lens, _flags(bad, seq_lens), scores,
        query.stride(0), query.stride(1),
        kmin.stride(0), kmin.stride(1), kmax.stride(0), kmax.stride(1),
        pages.stride(0), pages.stride(1),
        n_pages, n_spans, float(scaling), n_sink, n_local,
        HKV=h, G=hq // h, D=d, BLOCK_D=block_d, BLOCK_P=block_p, PS=page_size,
        FIND_BAD=bad is None, BLOCK_G=_pow2(hq // h, 2),
        **pdl_args(query.device, "score"), num_warps=TUNING["scores_warps"],
    )  # fmt: skip
    return scores


def quest_select_fits(n_pages: int) -> bool:
    """Whether :func:`quest_select_triton` ranks rows of ``n_pages`` pages."""
    return n_pages <= MAX_PAGES


def quest_select_triton(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    bad: torch.Tensor | None,
    k: int,
    page_size: int,
    n_sink: int,
    n_local: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    query: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """One launch: each row's selection from its page scores ``[B, Hkv, P]`` (``P`` at most
    :data:`MAX_PAGES`) into ``out_indices [B, Hkv, W]`` / ``out_counts [B, Hkv]`` (int32);
    ``bad`` ``None``: each program finds its row's from ``query``, and counts it into
    ``nonfinite`` when given. Arguments are checked by :func:`prhs_kernels.quest.quest_select`."""
    b, h, n_pages = scores.shape
    if b * h == 0:
        return
    block = _pow2(n_pages, 16)
    search = search_constants(TUNING, "radix_bits", "scan_segment", block)
    scores = scores.contiguous()
    width = out_indices.shape[-1]
    if query is None:  # rows marked by ``bad``: the query is not read
        q, strides, g, d = seq_lens, (0, 0), 1, 1
    else:
        q = query if query.stride(-1) == 1 else query.contiguous()
        strides, g, d = (q.stride(0), q.stride(1)), q.shape[1] // h, q.shape[2]
    _, kernel, _ = _kernels(interpreting())
    kernel[(b * h,)](
        scores, seq_lens, _flags(bad, seq_lens), q,
        nonfinite if nonfinite is not None else seq_lens, out_indices, out_counts, *strides,
        out_indices.stride(0), out_indices.stride(1), out_counts.stride(0), out_counts.stride(1),
        n_pages, k, n_sink, n_local,
        HKV=h, PS=page_size, BLOCK=block, WIDTH=width, BLOCK_W=_pow2(width, 16), **search,
        FIND_BAD=bad is None, COUNT=bad is None and nonfinite is not None,
        G=g, BLOCK_G=_pow2(g, 2), D=d, BLOCK_D=_pow2(d, 16),
        **pdl_args(scores.device, "score"),
        num_warps=max(TUNING["select_warps"], search_warps(block)),
    )  # fmt: skip


def fold_fits(n: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`fold_page_bounds_triton` folds a write of ``n`` rows of
    ``[num_kv_heads, head_dim]`` keys (a program holds every row's location and one key)."""
    return n <= FOLD_MAX_ROWS and _pow2(num_kv_heads, 1) * _pow2(head_dim, 16) <= FOLD_MAX_KEY


def fold_page_bounds_triton(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    locations: torch.Tensor,
    key: torch.Tensor,
    page_size: int,
    columns: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """One launch, a program per written row (arguments checked by
    :func:`prhs_kernels.quest.fold_page_bounds`; the write fits :func:`fold_fits`): finds the
    row's non-finite key (counted into ``nonfinite`` when given), and the leader of each page
    -- its first written row -- resets the page where one of its rows is the page's first
    location and folds every finite key of its rows."""
    n = locations.shape[0]
    if n == 0:
        return
    h, d = kmin.shape[1], kmin.shape[2]
    if columns is None:
        strides, n_cols = (key.stride(0), key.stride(1), 0, key.stride(2)), 1
    else:
        strides, n_cols = key.stride(), key.shape[2]
    _, _, kernel = _kernels(interpreting())
    block_h, block_d = _pow2(h, 1), _pow2(d, 16)
    kernel[(n,)](
        kmin, kmax, locations, key, columns if columns is not None else locations,
        nonfinite if nonfinite is not None else locations, n, n_cols, *strides,
        *kmin.stride(), *kmax.stride(),
        PS=page_size, HKV=h, D=d, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=_pow2(n, 16),
        HAS_COL=columns is not None, COUNT=nonfinite is not None,
        **pdl_args(key.device, "score"), num_warps=4 if block_h * block_d <= 4096 else 8,
    )  # fmt: skip
