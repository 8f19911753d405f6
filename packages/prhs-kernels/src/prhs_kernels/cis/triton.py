"""Triton kernels of the CIS step (paper mode): decide, block scores, top-k and compose.

- ``_decide_kernel``, one program per (sequence, KV head): whether the group's queries are
  finite (a non-finite group is skipped and counted), the anchor's age and the cosine of the
  group's queries with the anchor's, read from the state row of the sequence's slot; writes
  whether the row retrieves.
- ``_block_scores_kernel``, a persistent grid that ranks the retrieving rows itself (as the
  logits pass does): from the logits and span statistics of :mod:`prhs_kernels.score.triton`'s
  first pass, each block's largest group-mean probability, a tile of positions per work item,
  spread over every program however few rows retrieve; ``-inf`` for blocks that do not exist or
  hold a sink or local position, and over the rows that do not retrieve (what top-k may not
  pick).
- ``_topk_kernel``: the top ``k`` blocks of each retrieving row, in one pass for rows of up to
  8192 blocks, in two above (each chunk's winners, then theirs). With ``FROM_LSE`` its first
  pass scores its chunk first (``_score_chunk``: each block's mass from the logits pass's block
  log-sum-exps), which stands in for ``_block_scores_kernel`` (``retrieval_compose_triton``);
  ``_topk_compose_kernel`` is its last pass composing the row it ranked.
- ``_compose_kernel``, one program per (sequence, KV head): the row's candidate list (sink,
  the new or the anchor's list with its dilation, local), sorted, made distinct and written as
  the selection; a retrieving row also becomes the anchor (and, with the union fields, stores
  ``S_a ∪ dilate(S_a)`` sorted, which its reusing rows then copy between the windows without
  sorting).

No value is read on the host and every shape is static, so the step can be captured in a CUDA
graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_core.layout import KVLayout
from prhs_kernels.keycodes import KeyCodes
from prhs_kernels.keycodes.triton import code_query, code_scores, row_alignment
from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait
from prhs_kernels.score import triton as score_triton
from prhs_kernels.sparse_decode.triton import _multiprocessors, key_args
from prhs_kernels.topk.triton import (
    FEW_KEYS,
    kth_largest_key_few,
    order_key,
    prefix_count,
    search_constants,
    search_warps,
    seeded_candidates_triton,
    take_at,
    take_top_few,
    winners_in_order,
)

__all__ = [
    "TOPK_CHUNK",
    "TOPK_MAX_N",
    "TOPK_ONE_PASS",
    "TUNING",
    "cis_compose_triton",
    "cis_decide_triton",
    "rescore_rank_fits",
    "rescore_rank_write_triton",
    "rescore_scores_triton",
    "rescore_splits",
    "rescore_write_triton",
    "retrieval_block_scores_triton",
    "retrieval_compose_triton",
    "retrieval_pool_triton",
    "seeded_capacity",
    "top_blocks_compose_triton",
    "top_blocks_fits",
    "top_blocks_triton",
]


TUNING = {
    "block_scores_programs_per_sm": 8,
    "block_scores_items_per_row": 64,
    "compose_warps_wide": 16,
    "topk_sort_warps": 8,
    "topk_radix_bits": 2,
    "topk_scan_segment": 128,
    "rescore_programs_per_sm": 8,
    "rescore_min_tiles": 2,
    "rescore_tile": 64,
    "rescore_tile_codes": 256,
    "rescore_stages": 4,
    "rescore_write_block": 2048,
    "pool_rank_warps": 16,
}
"""Launch parameters. Of the block-score pass: persistent programs per multiprocessor, and the
work items a row is cut into (each a power of two of positions, from 256 to 1024). On an H200
at B16 with 10 % of rows retrieving: 256 positions were best at T 16k (5.1 µs against 6.1 at
1024), 1024 at T 64k (10.8 µs against 15.3 at 256: fewer re-reads of the span statistics).
And the warps of a compose program that sorts 2048 candidates or more (per-token CIS at budget
1024, B16 × 8 KV heads: 30.5 µs at 4 warps, 22.8 at 8, 18.2 at 16, 18.0 at 32); and the fewest
warps of the top-k's last pass, which also sorts its winners (13 of 128 rows for 1024 winners,
whose last pass ranks 2048 candidates: rows of 16 384 in 40.2 µs at 4 warps, 35.5 at 8, 36.9
at 16; 131 072 in 83.3, 78.1, 79.4). And the bits the top-k's search for the ``k``-th key
resolves a round (1, 2 or 4: 32, 16 or 8 block-wide reductions); the same 13 rows, in µs at
1 / 2 / 4 bits: 16 384 positions 54.3 / 47.8 / 160, 65 536 73.5 / 70.5 / 402, 131 072 117 /
106 / 520 (4 bits hold 16 counts per key in registers, and spill); 8 finds it a byte a round
with a 256-bin histogram (4 rounds), 16 384 positions 82.8 against 48.0 at 2 bits, 131 072
185 against 106 (a histogram of a chunk costs about nine two-bit rounds). And the segment of the
top-k's prefix counts (a prefix sum within segments of that many lanes, then over the
segments' totals; 0: one prefix sum over the block); at 2 bits, µs at 0 / 32 / 128 / 512:
16 384 positions 48.1 / 46.1 / 45.9 / 47.4, 65 536 71.3 / 63.5 / 63.2 / 65.8, 131 072 106 /
100 / 99.2 / 103. And the re-ranking of a reuse's pool (``rescore``): programs per multiprocessor
its rows are split into, the fewest tiles a program reads, the positions of a tile (reading
keys, reading code rows), the pipelining depth of its tile loop, and the pool entries the
rewrite walks at a time. On an H100 (B16·T64k, a pool of 3072 for three quarters of the rows):
code rows 86 µs in tiles of 64, 84 at 128, 76 at 256 (3 or 4 stages alike); the keys 91 µs in
tiles of 64. A paged cache's loop has three levels of indirection (pool entry, slot, row),
which Triton pipelines from 4 stages.
Module-level so that a benchmark can sweep them."""


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _copy_between_windows(
    out, OUT_CNT_ROW, ux, sink_end, first, nb_seq, do,
    WL: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Write a reusing row's selection when ``do``: the sink range ``[0, sink_end)``, the
    entries of its anchor's union ``ux`` (ascending and distinct, int32's largest value past its
    count) that lie outside both windows and below the sequence's ``nb_seq`` blocks, and the
    local range ``[first, min(first + WL, nb_seq))`` -- each lane's place computed, nothing
    sorted -- into the row ``out`` (``WIDTH`` entries, ``-1`` past the count) and its count
    into ``OUT_CNT_ROW``. With an empty union: the windows alone (a ``bad`` row's selection)."""
    w = tl.arange(0, BLOCK_W)
    l_end = tl.minimum(first + WL, nb_seq)  # the local range: [first, l_end)
    l0 = tl.maximum(first, sink_end)  # where its part outside the sink starts
    n_loc = tl.maximum(l_end - l0, 0)
    ukeep = (ux >= sink_end) & (ux < nb_seq) & ((ux < first) | (ux >= l_end))
    before = tl.cumsum(ukeep.to(tl.int32), 0) - 1  # kept entries before this one
    below_local = tl.minimum(tl.maximum(tl.minimum(ux, l_end) - l0, 0), n_loc)
    c_lo = tl.sum((ukeep & (ux < first)).to(tl.int32), 0)  # kept entries below the window
    n_sel = sink_end + tl.sum(ukeep.to(tl.int32), 0) + n_loc
    j = w - sink_end - c_lo  # this lane's place in the local range's part
    in_loc = (j >= 0) & (j < n_loc)
    val = tl.where(w < sink_end, w, tl.where(in_loc, l0 + j, -1))
    lanes = ((w < sink_end) | in_loc | (w >= n_sel)) & (w < WIDTH)
    tl.store(out + w, val, mask=lanes & do)
    tl.store(out + sink_end + before + below_local, ux, mask=ukeep & do)
    tl.store(OUT_CNT_ROW, n_sel, mask=do)


def _decide_kernel(
    Q,
    AQ,
    ALEN,
    SLOTS,
    LENS,
    BAD,
    RETRIEVE,
    NONFINITE,
    TAU,
    ANY,
    AUNION,
    AUCNT,
    OUT_IDX,
    OUT_CNT,
    stride_qb,
    stride_qh,
    stride_aq_n,
    stride_aq_h,
    stride_aq_g,
    stride_alen_n,
    stride_alen_h,
    stride_tau_n,
    stride_tau_h,
    stride_un_n,
    stride_un_h,
    stride_uc_n,
    stride_uc_h,
    stride_oi_b,
    stride_oi_h,
    tau,
    n_local,
    n_sink,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    COUNT: tl.constexpr,
    TAU_MODE: tl.constexpr,
    HAS_ANY: tl.constexpr,
    EARLY: tl.constexpr,
    BS: tl.constexpr,
    WL: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    U_W: tl.constexpr,
    BLOCK_U: tl.constexpr,
    HOLD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    slot = tl.load(SLOTS + b).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
    q_ptr = Q + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=mask, other=0.0).to(tl.float32)
    # A group whose query holds a NaN or an infinity is skipped (and counted).
    finite = (q == q) & (tl.abs(q) < float("inf"))
    bad = tl.sum(tl.sum((mask & ~finite).to(tl.int32), 1), 0) > 0
    tl.store(BAD + pid, bad.to(tl.int8))
    if COUNT:  # only the (rare) bad rows touch the counter: no atomics on a clean step
        tl.atomic_add(NONFINITE, bad.to(tl.int64), mask=bad)
    a_ptr = AQ + slot * stride_aq_n + h * stride_aq_h + offs_g[:, None] * stride_aq_g
    qa = tl.load(a_ptr + offs_d[None, :], mask=mask, other=0.0)
    eps = 1e-8
    nq = tl.maximum(tl.sqrt(tl.sum(tl.sum(q * q, 1), 0)), eps)
    na = tl.maximum(tl.sqrt(tl.sum(tl.sum(qa * qa, 1), 0)), eps)
    cos = tl.sum(tl.sum((q / nq) * (qa / na), 1), 0)
    ta = tl.load(ALEN + slot * stride_alen_n + h * stride_alen_h)
    seq = tl.load(LENS + b)
    thr = tau  # TAU_MODE 0: one threshold
    if TAU_MODE == 1:  # one per KV head
        thr = tl.load(TAU + h * stride_tau_h)
    if TAU_MODE == 2:  # one per (slot, KV head)
        thr = tl.load(TAU + slot * stride_tau_n + h * stride_tau_h)
    reuse = (ta > 0) & (seq - ta <= n_local) & (seq >= ta) & (cos >= thr)
    retrieve = (~reuse) & (~bad)
    tl.store(RETRIEVE + pid, retrieve.to(tl.int8))
    if HAS_ANY:  # every retrieving row writes the same 1: a benign race, no atomic needed
        tl.store(ANY, tl.full((), 1, tl.int8), mask=retrieve)
    if EARLY:
        # Every row that does not retrieve gets its selection now (cis_decide_compose): a reuse
        # its anchor's union between its windows, a bad row its windows alone. The union is
        # loaded whole, not cut at its count first: no round trip waits on the count.
        nb_seq = (seq + BS - 1) // BS
        sink_end = (tl.minimum(seq, n_sink) + BS - 1) // BS
        first = tl.maximum(seq - n_local, 0) // BS
        if HOLD:  # a reusing row's local window starts where its anchor's did
            held = tl.maximum(tl.minimum(ta, seq) - n_local, 0) // BS
            first = tl.where(bad, first, held)
        offs_u = tl.arange(0, BLOCK_U)
        n_union = tl.load(AUCNT + slot * stride_uc_n + h * stride_uc_h)
        n_union = tl.where(bad, 0, n_union)
        u_row = AUNION + slot * stride_un_n + h * stride_un_h
        ux = tl.load(u_row + offs_u, mask=offs_u < U_W, other=2147483647)
        ux = tl.where(offs_u < n_union, ux, 2147483647)
        out = OUT_IDX + b.to(tl.int64) * stride_oi_b + h * stride_oi_h
        _copy_between_windows(out, OUT_CNT + pid, ux, sink_end, first, nb_seq, ~retrieve,
                              WL, WIDTH, BLOCK_W)  # fmt: skip


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _row_windows(LENS, b, n_sink, n_local, BS: tl.constexpr):
    """``(nb_seq, sink_end, local_first)`` of sequence ``b``, in blocks of ``BS``: its blocks,
    the end of its sink range and the first block of its local window (``nb_seq`` without
    one) -- a retrieval may pick blocks in ``[sink_end, local_first)``."""
    seq = tl.load(LENS + b)
    nb_seq = (seq + BS - 1) // BS
    sink_end = (tl.minimum(seq, n_sink) + BS - 1) // BS
    local_first = tl.maximum(seq - n_local, 0) // BS
    if n_local == 0:
        local_first = nb_seq
    return nb_seq, sink_end, local_first


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _row_lse(SM, SL, row, n_spans, BLOCK_G: tl.constexpr, G_POW: tl.constexpr,
             BLOCK_S: tl.constexpr):  # fmt: skip
    """Each query head's log-sum-exp over row ``row`` (``[G_POW]``), merged from the logits
    pass's span statistics (``[rows, spans, BLOCK_G]`` max and sum)."""
    offs_g = tl.arange(0, G_POW)  # the statistics' rows are BLOCK_G apart
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_spans
    stat = (row.to(tl.int64) * n_spans + offs_s)[:, None] * BLOCK_G + offs_g[None, :]
    m = tl.load(SM + stat, mask=s_ok[:, None], other=float("-inf"))
    l_s = tl.load(SL + stat, mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    return m_safe + tl.log(tl.sum(l_s * tl.exp(m - m_safe[None, :]), 0))


def _block_scores_kernel(
    ACTIVE,
    LENS,
    LOGITS,
    SM,
    SL,
    SCORES,
    t_max,
    n_rows,
    n_blocks,
    stride_row,
    n_spans,
    n_sink,
    n_local,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    G_POW: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BS: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    FILL_BLOCKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MASS: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    # A persistent grid over two kinds of work item: (active row, tile of TILE_BLOCKS blocks),
    # scored, then (with FILL) (inactive row, FILL_BLOCKS blocks), filled with -inf. Each
    # program ranks the rows itself (prefix sums of the flags), so the scoring of a few
    # retrieving rows is spread over every program instead of queueing behind their
    # neighbours' programs.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    offs_r = tl.arange(0, BLOCK_R)
    flags = tl.load(ACTIVE + offs_r, mask=offs_r < n_rows, other=0) != 0
    idle = (~flags) & (offs_r < n_rows)
    rank_a = tl.cumsum(flags.to(tl.int32), 0) - 1
    rank_i = tl.cumsum(idle.to(tl.int32), 0) - 1
    n_act = tl.sum(flags.to(tl.int32), 0)
    n_tiles = (n_blocks + TILE_BLOCKS - 1) // TILE_BLOCKS
    n_fills = (n_blocks + FILL_BLOCKS - 1) // FILL_BLOCKS
    work_a = n_act * n_tiles
    n_work = work_a
    if FILL:
        n_work += (n_rows - n_act) * n_fills
    offs_g = tl.arange(0, G_POW)
    g_ok = offs_g < G
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        if w < work_a:
            pid = tl.sum(tl.where(flags & (rank_a == w // n_tiles), offs_r, 0), 0)
            tile = w % n_tiles
            nb_seq, sink_end, local_first = _row_windows(LENS, pid // HKV, n_sink, n_local, BS)
            lse = _row_lse(SM, SL, pid, n_spans, BLOCK_G, G_POW, BLOCK_S)
            row = pid.to(tl.int64) * G + offs_g
            j = tile * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)  # block ids of this tile
            pos = j[:, None] * BS + tl.arange(0, BS)[None, :]  # [blocks, BS]
            in_t = (pos < t_max) & (j[:, None] < n_blocks)
            lg = tl.load(
                LOGITS + row[:, None, None] * t_max + pos[None, :, :],
                mask=g_ok[:, None, None] & in_t[None, :, :],
                other=float("-inf"),
            )  # [G_POW, blocks, BS]
            p = tl.sum(tl.where(g_ok[:, None, None], tl.exp(lg - lse[:, None, None]), 0.0), 0) / G
            if MASS:
                best = tl.sum(p, 1)  # [blocks]: the attention mass of each block
            else:
                best = tl.max(p, 1)  # [blocks]: its largest probability
            ok = (j < nb_seq) & (j >= sink_end) & (j < local_first)
            out = SCORES + pid.to(tl.int64) * stride_row + j
            tl.store(out, tl.where(ok, best, float("-inf")), mask=j < n_blocks)
        else:
            # (names differ from the scoring branch's: Triton types a name once per if/else)
            wi = w - work_a
            idle_row = tl.sum(tl.where(idle & (rank_i == wi // n_fills), offs_r, 0), 0)
            jf = (wi % n_fills) * FILL_BLOCKS + tl.arange(0, FILL_BLOCKS)
            fill = SCORES + idle_row.to(tl.int64) * stride_row + jf
            tl.store(fill, tl.full([FILL_BLOCKS], float("-inf"), tl.float32), mask=jf < n_blocks)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _sorted_distinct(x, SCRATCH_ROW, BLOCK: tl.constexpr):
    """``(x sorted ascending, keep, rank, count)`` for ``x [BLOCK]`` int32 whose empty lanes
    hold int32's largest value: ``keep`` marks each distinct value's first lane, ``rank`` its
    place among them (through ``SCRATCH_ROW``, this program's ``BLOCK`` int32 lanes)."""
    offs = tl.arange(0, BLOCK)
    x = tl.sort(x)
    tl.store(SCRATCH_ROW + offs, x)
    tl.debug_barrier()
    prev = tl.load(SCRATCH_ROW + offs - 1, mask=offs > 0, other=-1)
    keep = (x < 2147483647) & (x != prev)
    rank = tl.cumsum(keep.to(tl.int32), 0) - 1
    return x, keep, rank, tl.sum(keep.to(tl.int32), 0)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _compose_row(
    pid,
    retrieve,
    bad,
    Q,
    NEW_IDX,
    NEW_SCORES,
    AQ,
    ALEN,
    AIDX,
    ACNT,
    ALOGD,
    AUNION,
    AUCNT,
    SLOTS,
    LENS,
    SEL_IDX,
    SEL_CNT,
    SEL_SCRATCH,
    stride_qb,
    stride_qh,
    stride_aq_n,
    stride_aq_h,
    stride_aq_g,
    stride_alen_n,
    stride_alen_h,
    stride_aidx_n,
    stride_aidx_h,
    stride_acnt_n,
    stride_acnt_h,
    stride_alogd_n,
    stride_alogd_h,
    stride_un_n,
    stride_un_h,
    stride_uc_n,
    stride_uc_h,
    stride_si_b,
    stride_si_h,
    n_sink,
    n_local,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NEW_M: tl.constexpr,
    DIL_M: tl.constexpr,
    R: tl.constexpr,
    R2: tl.constexpr,
    WS: tl.constexpr,
    WL: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BS: tl.constexpr,
    HOLD: tl.constexpr,
    UNION: tl.constexpr,
    ONLY_RETRIEVING: tl.constexpr,
):
    """Row ``pid``'s composition (``retrieve`` / ``bad``: its decision, int1 scalars): its
    selection written into ``SEL_IDX`` / ``SEL_CNT`` (``ONLY_RETRIEVING``: a retrieving row's
    alone) and, if it retrieves, its anchor updated from ``NEW_IDX`` / ``NEW_SCORES`` (row
    ``pid``'s ``NEW_M`` entries). The compose kernel's program, and the fused top-k's tail."""
    b = pid // HKV
    h = pid % HKV
    slot = tl.load(SLOTS + b).to(tl.int64)
    seq = tl.load(LENS + b)
    nb_seq = (seq + BS - 1) // BS
    big = 2147483647
    w = tl.arange(0, BLOCK_W)
    out = SEL_IDX + b.to(tl.int64) * stride_si_b + h * stride_si_h
    scratch = SEL_SCRATCH + pid.to(tl.int64) * BLOCK_W
    # sink: blocks 0 .. ceil(min(seq, n_sink) / s) - 1
    sink_end = (tl.minimum(seq, n_sink) + BS - 1) // BS
    # local: first = max(seq - n_local, 0) // s, WL blocks from there; with HOLD, a reusing
    # row's window starts where its anchor's did
    first = tl.maximum(seq - n_local, 0) // BS
    if HOLD:
        ta = tl.load(ALEN + slot * stride_alen_n + h * stride_alen_h)
        held = tl.maximum(tl.minimum(ta, seq) - n_local, 0) // BS
        first = tl.where(retrieve | bad, first, held)
    a_base = AIDX + slot * stride_aidx_n + h * stride_aidx_h
    new_base = pid.to(tl.int64) * NEW_M
    u_base = AUNION + slot * stride_un_n + h * stride_un_h
    copy = False
    if UNION:
        copy = (~retrieve) & (~bad)
    skip = False
    if ONLY_RETRIEVING:  # the other rows' selections were written by the decision
        skip = ~retrieve
    if skip:
        pass
    elif copy:
        # A reuse with its anchor's union U = S_a ∪ dilate(S_a) stored ascending and distinct:
        # the selection is the sink range, the entries of U outside both windows (below the
        # sequence's end) and the local range, each lane's place computed, nothing sorted.
        n_union = tl.load(AUCNT + slot * stride_uc_n + h * stride_uc_h)
        offs_u = tl.arange(0, BLOCK_U)
        ux = tl.load(u_base + offs_u, mask=offs_u < n_union, other=big)
        _copy_between_windows(out, SEL_CNT + pid, ux, sink_end, first, nb_seq, True,
                              WL, WIDTH, BLOCK_W)  # fmt: skip
    else:
        # Candidates, laid out as [sink | list | dilation | local | padding] over BLOCK_W.
        cand = tl.full([BLOCK_W], -1, tl.int32)
        cand = tl.where((w < WS) & (w < sink_end), w, cand)
        lo_w = WS + M + 2 * R * DIL_M
        li = w - lo_w
        cand = tl.where((li >= 0) & (li < WL) & (seq > 0), first + li, cand)
        # the list: the new top blocks (retrieval) or the anchor's (reuse)
        k = w - WS
        in_list = (k >= 0) & (k < M)
        a_cnt = tl.load(ACNT + slot * stride_acnt_n + h * stride_acnt_h)
        kk = tl.where(in_list, k, 0)
        if retrieve:
            new_ok = in_list & (k < NEW_M)
            nid = tl.load(NEW_IDX + new_base + kk, mask=new_ok, other=-1)
            nsc = tl.load(NEW_SCORES + new_base + kk, mask=new_ok, other=float("-inf"))
            cand = tl.where(new_ok & (nsc > float("-inf")), nid, cand)
        else:
            aid = tl.load(a_base + kk, mask=in_list & (k < a_cnt), other=-1)
            cand = tl.where(in_list & (k < a_cnt), aid, cand)
            # dilation: entry e (< m, < count) of the anchor list gives p + j and p - j,
            # 1 <= j <= r
            dk = w - (WS + M)
            in_dil = (dk >= 0) & (dk < 2 * R * DIL_M)
            e = tl.where(in_dil, dk // R2, 0)
            jr = tl.where(in_dil, dk % R2, 0)
            off = tl.where(jr < R, jr + 1, -(jr - R + 1))
            p = tl.load(a_base + e, mask=in_dil & (e < a_cnt), other=-1)
            dil = tl.where(p >= 0, p + off, -1)
            cand = tl.where(in_dil & (e < a_cnt) & (p >= 0) & (dil >= 0), dil, cand)
        list_end = WS + M + 2 * R * DIL_M
        if bad:
            cand = tl.where((w >= WS) & (w < list_end), -1, cand)
        # Union: keep ids in [0, nb_seq), sort, drop repeats, write ascending.
        x = tl.where((cand >= 0) & (cand < nb_seq) & (w < WIDTH), cand, big)
        x, keep, rank, count = _sorted_distinct(x, scratch, BLOCK_W)
        tl.store(out + w, tl.full([BLOCK_W], -1, tl.int32), mask=(w >= count) & (w < WIDTH))
        tl.store(out + rank, x, mask=keep)
        tl.store(SEL_CNT + pid, count)

    # A retrieving row becomes the anchor.
    if retrieve:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
        q_ptr = (
            Q + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
        )
        q = tl.load(q_ptr, mask=mask, other=0.0).to(tl.float32)
        a_ptr = AQ + slot * stride_aq_n + h * stride_aq_h + offs_g[:, None] * stride_aq_g
        tl.store(a_ptr + offs_d[None, :], q, mask=mask)
        tl.store(ALEN + slot * stride_alen_n + h * stride_alen_h, seq)
        mi = tl.arange(0, BLOCK_M)
        m_ok = mi < M
        mk = tl.where(m_ok & (mi < NEW_M), mi, 0)
        nid = tl.load(NEW_IDX + new_base + mk, mask=m_ok & (mi < NEW_M), other=-1)
        nsc = tl.load(NEW_SCORES + new_base + mk, mask=m_ok & (mi < NEW_M), other=float("-inf"))
        valid = nsc > float("-inf")
        n_new = tl.sum(valid.to(tl.int32), 0)
        tl.store(a_base + mi, tl.where(valid, nid, -1), mask=m_ok)
        tl.store(ACNT + slot * stride_acnt_n + h * stride_acnt_h, n_new)
        tl.store(ALOGD + slot * stride_alogd_n + h * stride_alogd_h, 0.0)
        if UNION:
            # ... and stores the union its reuses copy: the list's first n_new entries (as the
            # list is stored: -1 where a score is -inf) and the neighbours of its first DIL_M.
            uw = tl.arange(0, BLOCK_U)
            in_l = uw < M
            lk = tl.where(in_l & (uw < NEW_M), uw, 0)
            l_ok = in_l & (uw < NEW_M) & (uw < n_new)
            lid = tl.load(NEW_IDX + new_base + lk, mask=l_ok, other=-1)
            lsc = tl.load(NEW_SCORES + new_base + lk, mask=l_ok, other=float("-inf"))
            ucand = tl.where(l_ok & (lsc > float("-inf")), lid, -1)
            dk = uw - M
            in_dil = (dk >= 0) & (dk < 2 * R * DIL_M)
            e = tl.where(in_dil, dk // R2, 0)
            jr = tl.where(in_dil, dk % R2, 0)
            off = tl.where(jr < R, jr + 1, -(jr - R + 1))
            e_ok = in_dil & (e < n_new) & (e < NEW_M)
            pid_e = tl.load(NEW_IDX + new_base + e, mask=e_ok, other=-1)
            psc = tl.load(NEW_SCORES + new_base + e, mask=e_ok, other=float("-inf"))
            p = tl.where(psc > float("-inf"), pid_e, -1)
            dil = tl.where(p >= 0, p + off, -1)
            ucand = tl.where(e_ok & (p >= 0) & (dil >= 0), dil, ucand)
            ux = tl.where(ucand >= 0, ucand, big)
            tl.debug_barrier()  # the selection's sort is done with this program's scratch
            ux, ukeep, urank, ucount = _sorted_distinct(ux, scratch, BLOCK_U)
            u_w = M + 2 * R * DIL_M
            u_pad = (uw >= ucount) & (uw < u_w)
            tl.store(u_base + uw, tl.full([BLOCK_U], -1, tl.int32), mask=u_pad)
            tl.store(u_base + urank, ux, mask=ukeep)
            tl.store(AUCNT + slot * stride_uc_n + h * stride_uc_h, ucount)


def _compose_kernel(
    Q,
    RETRIEVE,
    BAD,
    NEW_IDX,
    NEW_SCORES,
    AQ,
    ALEN,
    AIDX,
    ACNT,
    ALOGD,
    AUNION,
    AUCNT,
    SLOTS,
    LENS,
    SEL_IDX,
    SEL_CNT,
    SEL_SCRATCH,
    ANY,
    stride_qb,
    stride_qh,
    stride_aq_n,
    stride_aq_h,
    stride_aq_g,
    stride_alen_n,
    stride_alen_h,
    stride_aidx_n,
    stride_aidx_h,
    stride_acnt_n,
    stride_acnt_h,
    stride_alogd_n,
    stride_alogd_h,
    stride_un_n,
    stride_un_h,
    stride_uc_n,
    stride_uc_h,
    stride_si_b,
    stride_si_h,
    n_sink,
    n_local,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NEW_M: tl.constexpr,
    DIL_M: tl.constexpr,
    R: tl.constexpr,
    R2: tl.constexpr,
    WS: tl.constexpr,
    WL: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BS: tl.constexpr,
    HOLD: tl.constexpr,
    UNION: tl.constexpr,
    ONLY_RETRIEVING: tl.constexpr,
    HAS_ANY: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    if HAS_ANY:  # the decision's "some row retrieves" flag is consumed: clear it for the next
        tl.store(ANY, tl.full((), 0, tl.int8), mask=pid == 0)
    retrieve = tl.load(RETRIEVE + pid) != 0
    bad = tl.load(BAD + pid) != 0
    _compose_row(
        pid,
        retrieve,
        bad,
        Q,
        NEW_IDX,
        NEW_SCORES,
        AQ,
        ALEN,
        AIDX,
        ACNT,
        ALOGD,
        AUNION,
        AUCNT,
        SLOTS,
        LENS,
        SEL_IDX,
        SEL_CNT,
        SEL_SCRATCH,
        stride_qb,
        stride_qh,
        stride_aq_n,
        stride_aq_h,
        stride_aq_g,
        stride_alen_n,
        stride_alen_h,
        stride_aidx_n,
        stride_aidx_h,
        stride_acnt_n,
        stride_acnt_h,
        stride_alogd_n,
        stride_alogd_h,
        stride_un_n,
        stride_un_h,
        stride_uc_n,
        stride_uc_h,
        stride_si_b,
        stride_si_h,
        n_sink,
        n_local,
        HKV,
        G,
        BLOCK_G,
        D,
        BLOCK_D,
        M,
        BLOCK_M,
        NEW_M,
        DIL_M,
        R,
        R2,
        WS,
        WL,
        WIDTH,
        BLOCK_W,
        BLOCK_U,
        BS,
        HOLD,
        UNION,
        ONLY_RETRIEVING,
    )


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _score_chunk(
    row,
    lo_pos,
    n_here,
    SCORES,
    stride_row,
    BLSE,
    SM,
    SL,
    LENS,
    stride_lse,
    n_spans,
    n_sink,
    n_local,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    G_POW: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Score blocks ``lo_pos .. lo_pos + n_here - 1`` of row ``row`` by their attention mass
    from the logits pass's block log-sum-exps (``BLSE``, a row per query head) and span
    statistics (``SM`` / ``SL``): ``mean_i exp(block_lse_i - lse_i)``, ``-inf`` for blocks past
    the sequence or holding a sink or local position (as ``_block_scores_kernel`` scores with
    ``MASS``), written into the row's ``SCORES`` for the top-k that follows in this program."""
    nb_seq, sink_end, local_first = _row_windows(LENS, row // HKV, n_sink, n_local, BS)
    lse = _row_lse(SM, SL, row, n_spans, BLOCK_G, G_POW, BLOCK_S)  # [G_POW]
    offs_g = tl.arange(0, G_POW)
    offs = tl.arange(0, BLOCK)
    j = lo_pos + offs
    ok = offs < n_here
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(G):
        lse_i = tl.sum(tl.where(offs_g == i, lse, 0.0), 0)
        x = tl.load(BLSE + (row.to(tl.int64) * G + i) * stride_lse + j, mask=ok,
                    other=float("-inf"))  # fmt: skip
        acc += tl.exp(x - lse_i)
    eligible = (j < nb_seq) & (j >= sink_end) & (j < local_first)
    out = SCORES + row.to(tl.int64) * stride_row + j
    tl.store(out, tl.where(eligible, acc / G, float("-inf")), mask=ok)
    tl.debug_barrier()  # the chunk is read back, by other threads of this program


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _topk_program(
    row,
    c,
    SCORES,
    IDX_IN,
    ACTIVE,
    OUT_IDX,
    OUT_VAL,
    SCRATCH,
    n,
    stride_row,
    k,
    chunk,
    n_chunks,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_IDX: tl.constexpr,
    SORT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    RADIX: tl.constexpr,
    SEG: tl.constexpr,
    FILL: tl.constexpr = True,
):
    """Top ``k`` of one chunk of ``chunk`` scores of a row of ``n`` (NaN as ``-inf``; ties:
    lower index first), for an active row; an inactive row gets ``-1`` / ``-inf``. Program
    ``(row, c)`` writes entries ``(row * n_chunks + c) * k ...``; a chunk shorter than ``k``
    fills its last entries with ``-1`` / ``-inf``. ``HAS_IDX``: the scores are candidates
    whose ids are in ``IDX_IN`` (a second pass over the first's chunk winners, which come in
    position order, so lower lanes are lower ids).

    The chunk sits in registers; its ``k``-th largest key is found by a search over the 32-bit
    order-preserving integer image of the floats, ``RADIX_BITS`` bits a round, then the ``k``
    entries are compacted, and sorted, largest first, if ``SORT`` (else they stay in position
    order: a first pass's winners need no order, and sorting them cost more than the search).
    ``FILL`` off (a pass whose output only the next pass reads, for the active rows alone):
    an inactive row writes nothing.
    Program ``(row, c)``'s work: the top-k kernel's, and the fused top-k's before its
    composition."""
    lo_pos = c * chunk
    n_here = tl.minimum(chunk, n - lo_pos)
    k_here = tl.minimum(k, n_here)
    offs_k = tl.arange(0, BLOCK_K)
    slot = row.to(tl.int64) * n_chunks + c
    out_idx = OUT_IDX + slot * k + offs_k
    out_val = OUT_VAL + slot * k + offs_k
    if tl.load(ACTIVE + row) != 0:
        offs = tl.arange(0, BLOCK)
        ok = offs < n_here
        src = row.to(tl.int64) * stride_row + lo_pos  # a stride of 16k keeps loads vectorised
        x = tl.load(SCORES + src + offs, mask=ok, other=float("-inf"))
        key = tl.where(ok, order_key(x), -2147483648)
        take, pos = take_top_few(key, ok, k_here, SCRATCH + slot * BLOCK_K, BLOCK_K, BLOCK,
                                 RADIX_BITS, RADIX, SEG)  # fmt: skip
        # Largest first with SORT; else the compacted order, which is by position.
        at, _ = winners_in_order(key, take, pos, SCRATCH + slot * BLOCK_K, k_here, BLOCK,
                                 BLOCK_K, SORT)  # fmt: skip
        got = offs_k < k_here
        val = tl.load(SCORES + src + at, mask=got, other=float("-inf"))
        val = tl.where(val != val, float("-inf"), val)
        if HAS_IDX:
            idx = tl.load(IDX_IN + src + at, mask=got, other=-1)
        else:
            idx = tl.where(got, lo_pos + at, -1)
        tl.store(out_idx, idx, mask=offs_k < k)
        tl.store(out_val, val, mask=offs_k < k)
    elif FILL:
        tl.store(out_idx, tl.full([BLOCK_K], -1, tl.int32), mask=offs_k < k)
        tl.store(out_val, tl.full([BLOCK_K], float("-inf"), tl.float32), mask=offs_k < k)


def _topk_kernel(
    SCORES,
    IDX_IN,
    ACTIVE,
    OUT_IDX,
    OUT_VAL,
    SCRATCH,
    n,
    stride_row,
    k,
    chunk,
    n_chunks,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_IDX: tl.constexpr,
    SORT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    RADIX: tl.constexpr,
    SEG: tl.constexpr,
    BLSE,
    SM,
    SL,
    LENS,
    stride_lse,
    n_spans,
    s_sink,
    s_local,
    S_HKV: tl.constexpr,
    S_G: tl.constexpr,
    S_BLOCK_G: tl.constexpr,
    S_G_POW: tl.constexpr,
    S_BLOCK_S: tl.constexpr,
    S_BS: tl.constexpr,
    FROM_LSE: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    # FROM_LSE (a first pass): each program first scores its chunk (_score_chunk) from the
    # logits pass's block log-sum-exps, so no block-score launch runs.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    row = tl.program_id(0)
    c = tl.program_id(1)
    if FROM_LSE:
        if tl.load(ACTIVE + row) != 0:
            lo_pos = c * chunk
            _score_chunk(row, lo_pos, tl.minimum(chunk, n - lo_pos), SCORES, stride_row, BLSE,
                         SM, SL, LENS, stride_lse, n_spans, s_sink, s_local, S_HKV, S_G,
                         S_BLOCK_G, S_G_POW, S_BLOCK_S, S_BS, BLOCK)  # fmt: skip
    _topk_program(
        row,
        c,
        SCORES,
        IDX_IN,
        ACTIVE,
        OUT_IDX,
        OUT_VAL,
        SCRATCH,
        n,
        stride_row,
        k,
        chunk,
        n_chunks,
        BLOCK,
        BLOCK_K,
        HAS_IDX,
        SORT,
        RADIX_BITS,
        RADIX,
        SEG,
        FILL,
    )


def _topk_compose_kernel(
    SCORES,
    IDX_IN,
    ACTIVE,
    OUT_IDX,
    OUT_VAL,
    SCRATCH,
    n,
    stride_row,
    k,
    chunk,
    n_chunks,
    Q,
    AQ,
    ALEN,
    AIDX,
    ACNT,
    ALOGD,
    AUNION,
    AUCNT,
    SLOTS,
    LENS,
    SEL_IDX,
    SEL_CNT,
    SEL_SCRATCH,
    ANY,
    stride_qb,
    stride_qh,
    stride_aq_n,
    stride_aq_h,
    stride_aq_g,
    stride_alen_n,
    stride_alen_h,
    stride_aidx_n,
    stride_aidx_h,
    stride_acnt_n,
    stride_acnt_h,
    stride_alogd_n,
    stride_alogd_h,
    stride_un_n,
    stride_un_h,
    stride_uc_n,
    stride_uc_h,
    stride_si_b,
    stride_si_h,
    n_sink,
    n_local,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_IDX: tl.constexpr,
    SORT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    RADIX: tl.constexpr,
    SEG: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NEW_M: tl.constexpr,
    DIL_M: tl.constexpr,
    R: tl.constexpr,
    R2: tl.constexpr,
    WS: tl.constexpr,
    WL: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BS: tl.constexpr,
    HOLD: tl.constexpr,
    UNION: tl.constexpr,
    ONLY_RETRIEVING: tl.constexpr,
    HAS_ANY: tl.constexpr,
    BLSE,
    SM,
    SL,
    stride_lse,
    n_spans,
    S_BLOCK_G: tl.constexpr,
    S_G_POW: tl.constexpr,
    S_BLOCK_S: tl.constexpr,
    FROM_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    # The last pass of the top-k (one program a row) and then, in the same program, the
    # composition of its row if it retrieves (cis_compose's retrieving_only): the winners are
    # read back from OUT_IDX / OUT_VAL, where this program has just stored them. FROM_LSE (the
    # only pass): the program first scores its row from the logits pass's block log-sum-exps.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    row = tl.program_id(0)
    if HAS_ANY:  # the decision's "some row retrieves" flag is consumed: clear it for the next
        tl.store(ANY, tl.full((), 0, tl.int8), mask=row == 0)
    if FROM_LSE:
        if tl.load(ACTIVE + row) != 0:
            _score_chunk(row, 0, n, SCORES, stride_row, BLSE, SM, SL, LENS, stride_lse, n_spans,
                         n_sink, n_local, HKV, G, S_BLOCK_G, S_G_POW, S_BLOCK_S, BS,
                         BLOCK)  # fmt: skip
    _topk_program(
        row,
        0,
        SCORES,
        IDX_IN,
        ACTIVE,
        OUT_IDX,
        OUT_VAL,
        SCRATCH,
        n,
        stride_row,
        k,
        chunk,
        n_chunks,
        BLOCK,
        BLOCK_K,
        HAS_IDX,
        SORT,
        RADIX_BITS,
        RADIX,
        SEG,
    )
    tl.debug_barrier()
    act = tl.load(ACTIVE + row) != 0
    _compose_row(
        row,
        act,
        act != act,
        Q,
        OUT_IDX,
        OUT_VAL,
        AQ,
        ALEN,
        AIDX,
        ACNT,
        ALOGD,
        AUNION,
        AUCNT,
        SLOTS,
        LENS,
        SEL_IDX,
        SEL_CNT,
        SEL_SCRATCH,
        stride_qb,
        stride_qh,
        stride_aq_n,
        stride_aq_h,
        stride_aq_g,
        stride_alen_n,
        stride_alen_h,
        stride_aidx_n,
        stride_aidx_h,
        stride_acnt_n,
        stride_acnt_h,
        stride_alogd_n,
        stride_alogd_h,
        stride_un_n,
        stride_un_h,
        stride_uc_n,
        stride_uc_h,
        stride_si_b,
        stride_si_h,
        n_sink,
        n_local,
        HKV,
        G,
        BLOCK_G,
        D,
        BLOCK_D,
        M,
        BLOCK_M,
        NEW_M,
        DIL_M,
        R,
        R2,
        WS,
        WL,
        WIDTH,
        BLOCK_W,
        BLOCK_U,
        BS,
        HOLD,
        UNION,
        ONLY_RETRIEVING,
    )


TOPK_MAX_N = 16384
"""Most scores one top-k program holds in registers. A row longer than ``TOPK_ONE_PASS`` is cut
into chunks of ``TOPK_CHUNK`` (or twice ``k``, rounded up to a power of two) whose top ``k``
each are ranked again, in as many passes as it takes to leave one chunk of candidates; ``k``
above ``TOPK_MAX_N / 2`` uses ``torch.topk``."""

TOPK_ONE_PASS = 8192
"""Longest row ranked in one pass: the bisection's cost per key grows with the row held in
registers. On an H200 (13 rows, 128 winners): 8192 blocks take 26 µs in one pass and 29 in
two; 8196 blocks (a register row of 16384) take 50 µs in one pass and 34 in two."""

TOPK_CHUNK = 8192
"""Scores per first-pass program of a long row (an H200, 13 of 128 rows of 65 536 for 1024
winners: 54 µs in chunks of 8192, 68 in chunks of 4096; rows of 16 384: 43–45 µs in chunks
of 2048 or 8192 or in one pass)."""


def _topk_plan(n: int, k: int) -> list[tuple[int, int, int]] | None:
    """The launches that rank a row of ``n`` scores for ``k`` winners, each ``(length, chunk,
    chunks)`` (the last one pass: ``chunks`` 1), or ``None`` when the Triton kernel does not
    apply (``torch.topk`` then). Each pass but the last keeps the top ``k`` of every chunk, so
    the next ranks ``chunks · k`` candidates, until one pass holds them all: rows of any length
    (an H200, 13 of 128 rows active: 131 072 × 1024 in 91 µs, ``torch.topk`` 283; 65 536 × 1024
    in 54 µs, but 65 548 × 1024 in 78, in two passes or three)."""
    chunk = max(TOPK_CHUNK, 2 * triton.next_power_of_2(k))
    if chunk > TOPK_MAX_N:
        return [(n, n, 1)] if n <= TOPK_MAX_N else None
    plan = []
    length = n
    while length > TOPK_ONE_PASS and length > chunk:
        chunks = -(-length // chunk)
        plan.append((length, chunk, chunks))
        length = chunks * k
    plan.append((length, length, 1))
    return plan


def _unread_lse(values: torch.Tensor) -> dict:
    """The scoring arguments of a top-k pass that reads its scores (``FROM_LSE`` off: unread)."""
    return dict(BLSE=values, SM=values, SL=values, LENS=values, stride_lse=0, n_spans=1,
                s_sink=0, s_local=0, S_HKV=1, S_G=1, S_BLOCK_G=16, S_G_POW=2, S_BLOCK_S=2,
                S_BS=1, FROM_LSE=False)  # fmt: skip


def top_blocks_fits(n: int, k: int) -> bool:
    """Whether :func:`top_blocks_triton` ranks rows of ``n`` scores for ``k`` winners."""
    return _topk_plan(n, min(k, n)) is not None


def top_blocks_triton(
    scores: torch.Tensor,
    k: int,
    active: torch.Tensor,
    *,
    sort: bool = True,
    compose: dict | None = None,
    lse: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [..., k] int32, values [..., k])`` of the active rows of ``scores [..., N]``
    (``k <= N``, :func:`top_blocks_fits`), largest first (``sort=False``: in position order, a
    chunk's missing entries last); inactive rows get ``-1`` / ``-inf``. One launch for rows of
    up to ``TOPK_ONE_PASS`` scores, two or more above. ``compose`` (``_compose_row``'s
    arguments by name, ``ANY`` and ``HAS_ANY``; ``sort`` on): the last pass also composes each
    active row (``cis_compose``'s ``retrieving_only``) in the program that ranked it. ``lse``
    (:func:`_score_chunk`'s arguments by the ``_topk_kernel``'s names): ``scores`` is only
    written, each first-pass program scoring its active row's chunk there before ranking it."""
    n = scores.shape[-1]
    plan = _topk_plan(n, k)
    if plan is None:
        raise ValueError(f"rows of {n} scores for {k} winners do not fit the top-k kernel")
    rows = scores.numel() // max(n, 1)
    dev = scores.device
    flags = active.contiguous().view(torch.int8)
    idx = torch.empty(*scores.shape[:-1], k, dtype=torch.int32, device=dev)
    val = torch.empty(*scores.shape[:-1], k, dtype=torch.float32, device=dev)
    block_k = _pow2(k, 2)
    *_, topk = _kernels(interpreting())
    search_constants(TUNING, "topk_radix_bits", "topk_scan_segment", 16)  # checked up front
    # Each pass but the last keeps each chunk's top k by position (so a row's candidates stay
    # in position order and ties toward the lower id); the last sorts and reports the ids.
    # Rows may be padded (a row stride that is a multiple of 16 lets the loads be vectorised:
    # retrieval_block_scores_triton pads its rows so).
    values = scores.reshape(rows, n)
    if n and values.stride(-1) != 1:
        values = values.contiguous()
    stride = values.stride(0) if n else 0
    ids, has_ids = values, False  # unread until a pass ranks the first pass's winners
    for length, chunk, chunks in plan:
        last = chunks == 1
        out_idx = idx if last else torch.empty(rows, chunks * k, dtype=torch.int32, device=dev)
        out_val = val if last else torch.empty(rows, chunks * k, dtype=torch.float32, device=dev)
        scratch = torch.empty(rows * chunks, block_k, dtype=torch.int64, device=dev)
        block = _pow2(chunk, 16)
        score = _unread_lse(values) if lse is None or has_ids else {**lse, "FROM_LSE": True}
        # Only the last pass's output is read for every row: earlier ones skip the idle rows.
        kernel, extra = topk, {**score, "FILL": last}
        if last and compose is not None:
            # The composition's own arguments name the row's sequence lengths, windows and
            # group (LENS, n_sink, n_local, HKV, G, BS): the scoring takes those.
            shared = ("LENS", "s_sink", "s_local", "S_HKV", "S_G", "S_BS")
            score = {n: v for n, v in score.items() if n not in shared}
            kernel, extra = _topk_compose_jit(interpreting()), {**compose, **score}
        kernel[(rows, chunks)](
            values, ids, flags, out_idx, out_val, scratch, length, stride, k, chunk, chunks,
            BLOCK=block, BLOCK_K=block_k, HAS_IDX=has_ids, SORT=last and sort,
            **search_constants(TUNING, "topk_radix_bits", "topk_scan_segment", block), **extra,
            **pdl_args(dev, "cis"), num_warps=_topk_warps(block, last),
        )  # fmt: skip
        values, ids, has_ids, stride = out_val, out_idx, True, chunks * k
    return idx, val


@functools.cache
def _kernels(interpret: bool) -> tuple[object, object, object, object]:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return (
        triton.jit(_decide_kernel),
        triton.jit(_block_scores_kernel),
        triton.jit(_compose_kernel),
        triton.jit(_topk_kernel),
    )


@functools.cache
def _topk_compose_jit(interpret: bool) -> object:
    del interpret  # part of the cache key, as in _kernels
    return triton.jit(_topk_compose_kernel)


def _topk_warps(block: int, sort: bool) -> int:
    """Warps of a top-k program (:func:`~prhs_kernels.topk.triton.search_warps`); at least
    ``TUNING["topk_sort_warps"]`` for the last pass, which also sorts the winners."""
    warps = search_warps(block)
    return max(warps, TUNING["topk_sort_warps"]) if sort else warps


def _scan_segment(block: int) -> int:
    """Lanes per segment of the top-k's prefix counts (``TUNING["topk_scan_segment"]``, at most
    the block; 0: one prefix sum over the block)."""
    seg = TUNING["topk_scan_segment"]
    return 0 if seg == 0 else min(seg, block)


def _compose_warps(block_w: int) -> int:
    """Warps of a compose program, which sorts ``block_w`` candidates."""
    return TUNING["compose_warps_wide"] if block_w >= 2048 else 4


def _pow2(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(n))


def cis_decide_triton(
    query: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    tau: float | torch.Tensor,
    n_local: int,
    nonfinite: torch.Tensor | None,
    any_retrieve: torch.Tensor | None = None,
    early: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decision's launch; with ``early`` (``cis_decide_compose``'s selection arguments:
    ``anchor_union``, ``anchor_union_cnt``, ``out_indices``, ``out_counts``, ``n_sink``,
    ``block_size``, ``windows``, ``hold_local``) it also writes the selection of every row that
    does not retrieve."""
    b, hq, d = query.shape
    h = anchor_len.shape[1]
    g = hq // h
    retrieve = torch.empty(b, h, dtype=torch.bool, device=query.device)
    bad = torch.empty(b, h, dtype=torch.bool, device=query.device)
    tensor = isinstance(tau, torch.Tensor)
    mode = tau.ndim if tensor else 0  # 0: a float, 1: [Hkv], 2: [N, Hkv]
    strides = (0, 0)
    if mode == 1:
        strides = (0, tau.stride(0))
    elif mode == 2:
        strides = (tau.stride(0), tau.stride(1))
    if early is None:  # none of these is read
        union, u_cnt, out_idx, out_cnt = anchor_len, anchor_len, seq_lens, seq_lens
        consts = dict(BS=1, WL=1, WIDTH=1, BLOCK_W=2, U_W=1, BLOCK_U=2, HOLD=False)
        n_sink = 0
        out_strides = (0, 0)
    else:
        union, u_cnt = early["anchor_union"], early["anchor_union_cnt"]
        out_idx, out_cnt = early["out_indices"], early["out_counts"]
        if out_idx.stride(-1) != 1 or not out_cnt.is_contiguous():
            raise ValueError("the selection's buffers must be contiguous")
        n_sink = early["n_sink"]
        u_w = union.shape[-1]
        _, wl = early["windows"]
        width = out_idx.shape[-1]
        consts = dict(
            BS=early["block_size"], WL=wl, WIDTH=width, BLOCK_W=_pow2(width, 16), U_W=u_w,
            BLOCK_U=_pow2(u_w, 16), HOLD=early["hold_local"],
        )  # fmt: skip
        out_strides = (out_idx.stride(0), out_idx.stride(1))
    decide, *_ = _kernels(interpreting())
    decide[(b * h,)](
        query, anchor_q, anchor_len, slots, seq_lens, bad.view(torch.int8),
        retrieve.view(torch.int8), nonfinite if nonfinite is not None else seq_lens,
        tau if tensor else seq_lens,
        any_retrieve.view(torch.int8) if any_retrieve is not None else seq_lens,
        union, u_cnt, out_idx, out_cnt,
        query.stride(0), query.stride(1),
        anchor_q.stride(0), anchor_q.stride(1), anchor_q.stride(2),
        anchor_len.stride(0), anchor_len.stride(1), *strides,
        union.stride(0), union.stride(1), u_cnt.stride(0), u_cnt.stride(1), *out_strides,
        0.0 if tensor else float(tau), n_local, n_sink,
        HKV=h, G=g, BLOCK_G=_pow2(g, 2), D=d, BLOCK_D=_pow2(d, 16), COUNT=nonfinite is not None,
        TAU_MODE=mode, HAS_ANY=any_retrieve is not None, EARLY=early is not None, **consts,
        **pdl_args(query.device, "cis"), num_warps=4,
    )  # fmt: skip
    return retrieve, bad


def retrieval_block_scores_triton(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    block_size: int,
    n_sink: int,
    n_local: int,
    active: torch.Tensor,
    score: str = "max",
    fill_idle: bool = True,
    codes: KeyCodes | None = None,
) -> torch.Tensor:
    b, hq, _ = query.shape
    h = kv.num_kv_heads
    g = hq // h
    t = kv.max_len
    s = block_size
    nb = -(-t // s)
    logits, sm, sl, n_spans, block_g, _ = score_triton.retrieval_logits_triton(
        query, kv, scaling, active, codes=codes
    )
    # Rows padded to a multiple of 16 scores: the top-k's loads stay vectorised whatever nb is.
    nb_pad = -(-nb // 16) * 16
    scores = torch.empty(b, h, nb_pad, dtype=torch.float32, device=query.device)[..., :nb]
    positions = min(
        1024, max(256, triton.next_power_of_2(-(-t // TUNING["block_scores_items_per_row"])))
    )
    tile_blocks = max(1, positions // s)  # blocks per scored item
    fill_blocks = 1024
    n_items = b * h * -(-nb // tile_blocks)
    programs = min(n_items, TUNING["block_scores_programs_per_sm"] * _multiprocessors(query.device))
    _, block_scores, *_ = _kernels(interpreting())
    block_scores[(max(programs, 1),)](
        active.contiguous().view(torch.int8), kv.seq_lens, logits, sm, sl, scores,
        t, b * h, nb, nb_pad, n_spans, n_sink, n_local,
        HKV=h, G=g, BLOCK_G=block_g, G_POW=_pow2(g, 2), BLOCK_S=_pow2(n_spans, 2), BS=s,
        TILE_BLOCKS=_pow2(tile_blocks, 1), FILL_BLOCKS=fill_blocks,
        BLOCK_R=_pow2(b * h, 2), MASS=score == "mass", FILL=fill_idle,
        **pdl_args(query.device, "cis"), num_warps=4,
    )  # fmt: skip
    return scores


def _compose_row_args(
    query: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    anchor_union: torch.Tensor | None,
    anchor_union_cnt: torch.Tensor | None,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    windows: tuple[int, int],
    hold_local: bool,
    new_m: int,
    retrieving_only: bool,
) -> tuple[dict, int]:
    """``_compose_row``'s arguments by name (all but the row, its decision and its new list),
    for the compose kernel and the fused top-k; and the candidates' block width."""
    b, hq, d = query.shape
    h = anchor_len.shape[1]
    g = hq // h
    mm = anchor_idx.shape[-1]
    ws, wl = windows
    block_w = _pow2(ws + mm + 2 * r * m + wl, 16)
    if out_indices.stride(-1) != 1 or not out_counts.is_contiguous():
        raise ValueError("the selection's buffers must be contiguous")
    union = anchor_union is not None and anchor_union_cnt is not None
    u_idx = anchor_union if union else anchor_idx  # not read without UNION
    u_cnt = anchor_union_cnt if union else anchor_cnt
    args = dict(
        Q=query, AQ=anchor_q, ALEN=anchor_len, AIDX=anchor_idx, ACNT=anchor_cnt,
        ALOGD=anchor_log_delta, AUNION=u_idx, AUCNT=u_cnt, SLOTS=slots, LENS=seq_lens,
        SEL_IDX=out_indices, SEL_CNT=out_counts,
        SEL_SCRATCH=torch.empty(b * h, block_w, dtype=torch.int32, device=query.device),
        stride_qb=query.stride(0), stride_qh=query.stride(1),
        stride_aq_n=anchor_q.stride(0), stride_aq_h=anchor_q.stride(1),
        stride_aq_g=anchor_q.stride(2),
        stride_alen_n=anchor_len.stride(0), stride_alen_h=anchor_len.stride(1),
        stride_aidx_n=anchor_idx.stride(0), stride_aidx_h=anchor_idx.stride(1),
        stride_acnt_n=anchor_cnt.stride(0), stride_acnt_h=anchor_cnt.stride(1),
        stride_alogd_n=anchor_log_delta.stride(0), stride_alogd_h=anchor_log_delta.stride(1),
        stride_un_n=u_idx.stride(0), stride_un_h=u_idx.stride(1),
        stride_uc_n=u_cnt.stride(0), stride_uc_h=u_cnt.stride(1),
        stride_si_b=out_indices.stride(0), stride_si_h=out_indices.stride(1),
        n_sink=n_sink, n_local=n_local,
        HKV=h, G=g, BLOCK_G=_pow2(g, 2), D=d, BLOCK_D=_pow2(d, 16), M=mm, BLOCK_M=_pow2(mm, 2),
        NEW_M=new_m, DIL_M=m, R=r, R2=max(1, 2 * r), WS=ws, WL=wl, WIDTH=out_indices.shape[-1],
        BLOCK_W=block_w, BLOCK_U=_pow2(mm + 2 * r * m, 16), BS=block_size, HOLD=hold_local,
        UNION=union, ONLY_RETRIEVING=retrieving_only,
    )  # fmt: skip
    return args, block_w


def cis_compose_triton(
    query: torch.Tensor,
    retrieve: torch.Tensor,
    bad: torch.Tensor,
    new_idx: torch.Tensor,
    new_scores: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    windows: tuple[int, int],
    hold_local: bool = False,
    any_retrieve: torch.Tensor | None = None,
    anchor_union: torch.Tensor | None = None,
    anchor_union_cnt: torch.Tensor | None = None,
    retrieving_only: bool = False,
) -> None:
    b, h = retrieve.shape
    new_idx = new_idx.contiguous()
    new_scores = new_scores.contiguous()
    args, block_w = _compose_row_args(
        query, anchor_q, anchor_len, anchor_idx, anchor_cnt, anchor_log_delta, anchor_union,
        anchor_union_cnt, slots, seq_lens, n_sink=n_sink, n_local=n_local,
        block_size=block_size, m=m, r=r, out_indices=out_indices, out_counts=out_counts,
        windows=windows, hold_local=hold_local, new_m=new_idx.shape[-1],
        retrieving_only=retrieving_only,
    )  # fmt: skip
    _, _, compose, _ = _kernels(interpreting())
    compose[(b * h,)](
        RETRIEVE=retrieve.contiguous().view(torch.int8), BAD=bad.contiguous().view(torch.int8),
        NEW_IDX=new_idx, NEW_SCORES=new_scores,
        ANY=any_retrieve.view(torch.int8) if any_retrieve is not None else args["SEL_SCRATCH"],
        HAS_ANY=any_retrieve is not None, **args, **pdl_args(query.device, "cis"),
        num_warps=_compose_warps(block_w),
    )  # fmt: skip


def top_blocks_compose_triton(
    scores: torch.Tensor,
    k: int,
    retrieve: torch.Tensor,
    query: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    anchor_union: torch.Tensor,
    anchor_union_cnt: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    windows: tuple[int, int],
    hold_local: bool,
    any_retrieve: torch.Tensor | None,
    lse: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_blocks_triton` whose last pass also composes each retrieving row (``lse``:
    as :func:`top_blocks_triton`'s)."""
    args, _ = _compose_row_args(
        query, anchor_q, anchor_len, anchor_idx, anchor_cnt, anchor_log_delta, anchor_union,
        anchor_union_cnt, slots, seq_lens, n_sink=n_sink, n_local=n_local,
        block_size=block_size, m=m, r=r, out_indices=out_indices, out_counts=out_counts,
        windows=windows, hold_local=hold_local, new_m=k, retrieving_only=True,
    )  # fmt: skip
    flag = any_retrieve.view(torch.int8) if any_retrieve is not None else args["SEL_SCRATCH"]
    args.update(ANY=flag, HAS_ANY=any_retrieve is not None)
    return top_blocks_triton(scores, k, retrieve, compose=args, lse=lse)


def retrieval_compose_triton(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    k: int,
    retrieve: torch.Tensor,
    *compose_args: torch.Tensor,
    block_size: int,
    n_sink: int,
    n_local: int,
    codes: KeyCodes | None = None,
    **compose_kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A retrieval by block mass in two launches: the logits pass writing each block's
    log-sum-exp (:func:`prhs_kernels.score.triton.retrieval_block_lse_triton`), then the top-k
    whose first pass scores its retrieving rows from them and whose last composes them
    (``compose_args`` / ``compose_kw``: :func:`top_blocks_compose_triton`'s after ``query``).
    The block scores are the block-score pass's with ``MASS`` (to rounding) and are written
    only inside the top-k's programs, for the rows that retrieve."""
    b, hq, _ = query.shape
    h = kv.num_kv_heads
    g = hq // h
    blse, sm, sl, n_spans, block_g = score_triton.retrieval_block_lse_triton(
        query, kv, scaling, retrieve, block_size, codes
    )
    nb = -(-kv.max_len // block_size)
    nb_pad = -(-nb // 16) * 16  # as retrieval_block_scores_triton's rows
    scores = torch.empty(b, h, nb_pad, dtype=torch.float32, device=query.device)[..., :nb]
    lse = dict(BLSE=blse, SM=sm, SL=sl, LENS=kv.seq_lens, stride_lse=blse.stride(0),
               n_spans=n_spans, s_sink=n_sink, s_local=n_local, S_HKV=h, S_G=g,
               S_BLOCK_G=block_g, S_G_POW=_pow2(g, 2), S_BLOCK_S=_pow2(n_spans, 2),
               S_BS=block_size)  # fmt: skip
    return top_blocks_compose_triton(
        scores, k, retrieve, query, *compose_args, n_sink=n_sink, n_local=n_local,
        block_size=block_size, **compose_kw, lse=lse,
    )  # fmt: skip


# --- the re-ranking of a reuse's pool (rescore) ------------------------------------------------
@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _pool_ids(AIDX, ANEXT, a_base, cnt, n_base, entry, ok, m_list):
    """Block ids of pool ``entry`` (a tensor of entries) of one row: the anchor's list below
    ``m_list`` (its first ``cnt`` entries, ``anchor_cnt`` read once by the caller, outside its
    loops, which a pipelined loop needs), then its next blocks; ``-1`` for none."""
    in_list = entry < m_list
    from_list = tl.load(AIDX + a_base + entry, mask=ok & in_list & (entry < cnt), other=-1)
    from_next = tl.load(ANEXT + n_base + (entry - m_list), mask=ok & (entry >= m_list), other=-1)
    return tl.where(in_list, from_list, from_next).to(tl.int64)


def _rescore_logits_kernel(
    Q, K, AIDX, ACNT, ANEXT, ALEN, SLOTS, REUSE, LENS, START, REQ2TOK, REQIDX, SCR, PART,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_rt,
    stride_ai_n, stride_ai_h, stride_ac_n, stride_ac_h, stride_an_n, stride_an_h,
    stride_al_n, stride_al_h,
    scaling, n_pool, m_list, n_sink, n_local, n_local_w, chunk, n_split,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
    PAGED: tl.constexpr, HAS_START: tl.constexpr, HOLD: tl.constexpr, UPCAST: tl.constexpr,
    CODES: tl.constexpr, BLOCK_DH: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Program (row, split): the logits of the split's pool entries (split 0: and of the sink's
    # and the local window's keys) into the row's scratch, and each head's running max and sum
    # over them into the row's partials. Rows that do not reuse do nothing.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    BLOCK_N: tl.constexpr = BLOCK_E * BS
    row = pid.to(tl.int64)
    if tl.load(REUSE + pid) != 0:
        slot = tl.load(SLOTS + b).to(tl.int64)
        seq = tl.load(LENS + b).to(tl.int64)
        if HOLD:  # the window starts where the anchor's did
            alen = tl.load(ALEN + slot * stride_al_n + h * stride_al_h).to(tl.int64)
            lo = tl.maximum(tl.minimum(alen, seq) - n_local, 0)
        else:
            lo = tl.maximum(seq - n_local, 0)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        q = tl.load(
            Q
            + b.to(tl.int64) * stride_qb
            + (h * G + offs_g)[:, None] * stride_qh
            + offs_d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if CODES:  # K holds code rows (prhs_kernels.keycodes): the query's two halves
            q_base = Q + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh
            q_lo, q_hi, q_sum, offs_c, c_ok = code_query(q_base, g_ok, D, BLOCK_DH)
        req = 0
        if PAGED:
            req = tl.load(REQIDX + b).to(tl.int64)
        pad = 0
        if HAS_START:
            pad = tl.load(START + b).to(tl.int64)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        if sp == 0:  # the windows: the sink (the part before the local window), the local one
            w = tl.arange(0, BLOCK_W)
            pos_w = tl.where(w < n_sink, w, lo + (w - n_sink)).to(tl.int64)
            ok_w = (w < n_sink + n_local_w) & (pos_w < seq) & ((w >= n_sink) | (pos_w < lo))
            if PAGED:
                slot_w = tl.load(REQ2TOK + req * stride_rt + pos_w, mask=ok_w, other=0)
                k_row = slot_w.to(tl.int64) * stride_kt + h * stride_kh
            else:
                k_row = b.to(tl.int64) * stride_kb + h * stride_kh + (pos_w + pad) * stride_kt
            if CODES:
                qk = code_scores(q_lo, q_hi, q_sum, K, k_row, ok_w, offs_c, c_ok, D // 2, ALIGN,
                                 UPCAST)  # fmt: skip
            else:
                k = tl.load(
                    K + k_row[:, None] + offs_d[None, :], mask=ok_w[:, None] & d_ok[None, :],
                    other=0.0,
                )  # fmt: skip
                if UPCAST:  # the interpreter multiplies bf16 as integers: exact float32 instead
                    qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                                input_precision="ieee")  # fmt: skip
                else:
                    qk = tl.dot(q, tl.trans(k))
            qk = tl.where(ok_w[None, :], qk * scaling, float("-inf"))
            m_i = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            l_i = tl.sum(tl.exp(qk - m_safe[:, None]), 1)
        # The split's pool entries e, positions id(e)·BS + j.
        a_base = slot * stride_ai_n + h * stride_ai_h
        n_base = slot * stride_an_n + h * stride_an_h
        cnt_off = slot * stride_ac_n + h * stride_ac_h
        a_cnt = tl.load(ACNT + cnt_off)
        v = tl.arange(0, BLOCK_N)
        scr = SCR + (row * G + offs_g)[:, None].to(tl.int64) * (n_pool * BS)
        e_lo = sp * chunk
        e_hi = tl.minimum(e_lo + chunk, n_pool)
        for e0 in tl.range(e_lo, e_hi, BLOCK_E, num_stages=STAGES):  # every load pipelined
            entry = e0 + v // BS
            in_pool = entry < e_hi
            ids = _pool_ids(AIDX, ANEXT, a_base, a_cnt, n_base, entry, in_pool, m_list)
            pos = ids * BS + v % BS
            ok = in_pool & (ids >= 0) & (pos < seq)
            if PAGED:
                slot_k = tl.load(REQ2TOK + req * stride_rt + pos, mask=ok, other=0).to(tl.int64)
                kr = slot_k * stride_kt + h * stride_kh
            else:
                kr = b.to(tl.int64) * stride_kb + h * stride_kh + (pos + pad) * stride_kt
            if CODES:
                qkp = code_scores(q_lo, q_hi, q_sum, K, kr, ok, offs_c, c_ok, D // 2, ALIGN,
                                  UPCAST)  # fmt: skip
            else:
                kp = tl.load(
                    K + kr[:, None] + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0
                )
                if UPCAST:
                    qkp = tl.dot(q.to(tl.float32), tl.trans(kp.to(tl.float32)),
                                 input_precision="ieee")  # fmt: skip
                else:
                    qkp = tl.dot(q, tl.trans(kp))
            qkp = tl.where(ok[None, :], qkp * scaling, float("-inf"))
            tl.store(scr + (e0 * BS + v)[None, :], qkp, mask=g_ok[:, None] & in_pool[None, :])
            m_new = tl.maximum(m_i, tl.max(qkp, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(qkp - m_safe[:, None]), 1)
            m_i = m_new
        part = PART + ((row * n_split + sp) * 2 * BLOCK_G).to(tl.int64)
        tl.store(part + offs_g, m_i)
        tl.store(part + BLOCK_G + offs_g, l_i)


def _rescore_scores_kernel(
    AIDX, ACNT, ANEXT, SLOTS, REUSE, SCR, PART, OUT,
    stride_ai_n, stride_ai_h, stride_ac_n, stride_ac_h, stride_an_n, stride_an_h,
    n_pool, m_list, chunk, n_split,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, G_POW: tl.constexpr,
    BS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, MASS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Program (row, split): each head's log-sum-exp from the row's partials, then the score of
    # each of the split's pool blocks from its heads' probabilities, averaged over the group;
    # -inf for empty entries and for rows that do not reuse.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    row = pid.to(tl.int64)
    e_lo = sp * chunk
    e_hi = tl.minimum(e_lo + chunk, n_pool)
    e_loc = tl.arange(0, BLOCK_E)
    if tl.load(REUSE + pid) != 0:
        slot = tl.load(SLOTS + b).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_gp = tl.arange(0, G_POW)
        gp_ok = offs_gp < G
        part = PART + (row * n_split + offs_s).to(tl.int64)[:, None] * (2 * BLOCK_G)
        s_ok = (offs_s < n_split)[:, None] & gp_ok[None, :]
        pm = tl.load(part + offs_gp[None, :], mask=s_ok, other=float("-inf"))
        pl = tl.load(part + BLOCK_G + offs_gp[None, :], mask=s_ok, other=0.0)
        mx = tl.max(pm, 0)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        pm_safe = tl.where(pm == float("-inf"), mx_safe[None, :], pm)
        l_i = tl.sum(pl * tl.exp(pm_safe - mx_safe[None, :]), 0)
        lse = mx_safe + tl.log(tl.where(l_i > 0, l_i, 1.0))  # [G_POW]
        lse = tl.where(l_i > 0, lse, float("inf"))  # a head with nothing to read: probabilities 0
        a_base = slot * stride_ai_n + h * stride_ai_h
        n_base = slot * stride_an_n + h * stride_an_h
        cnt_off = slot * stride_ac_n + h * stride_ac_h
        a_cnt = tl.load(ACNT + cnt_off)
        j = tl.arange(0, BS)
        scr_p = SCR + (row * G + offs_gp).to(tl.int64) * (n_pool * BS)
        for e0 in range(e_lo, e_hi, BLOCK_E):
            e = e0 + e_loc
            in_pool = e < e_hi
            blk = _pool_ids(AIDX, ANEXT, a_base, a_cnt, n_base, e, in_pool, m_list)
            flat = e[:, None] * BS + j[None, :]  # [BLOCK_E, BS]
            lg = tl.load(
                scr_p[:, None, None] + flat[None, :, :],
                mask=gp_ok[:, None, None] & in_pool[None, :, None],
                other=float("-inf"),
            )  # [G_POW, BLOCK_E, BS]
            p = tl.exp(lg - lse[:, None, None])
            p = tl.sum(tl.where(gp_ok[:, None, None], p, 0.0), 0) / G  # [BLOCK_E, BS]
            if MASS:
                score = tl.sum(p, 1)
            else:
                score = tl.max(p, 1)
            tl.store(OUT + row * n_pool + e, tl.where(blk >= 0, score, float("-inf")), mask=in_pool)
    else:
        for e0 in range(e_lo, e_hi, BLOCK_E):
            e = e0 + e_loc
            tl.store(OUT + row * n_pool + e, tl.full([BLOCK_E], float("-inf"), tl.float32),
                     mask=e < e_hi)  # fmt: skip


def _rescore_write_kernel(
    AIDX, ACNT, ANEXT, SLOTS, REUSE, CHOSEN, CVAL, FLAG, TMP,
    stride_ai_n, stride_ai_h, stride_ac_n, stride_ac_h, stride_an_n, stride_an_h,
    n_pool, m_list, r_next,
    HKV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
    SEG: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per reusing row: the chosen pool entries (best first) become the list, the
    # others, in pool order, the next blocks. Everything is read (the new list into registers,
    # the next blocks into the row's TMP) before the row's anchor fields are written.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    row = pid.to(tl.int64)
    if tl.load(REUSE + pid) != 0:
        slot = tl.load(SLOTS + b).to(tl.int64)
        a_base = slot * stride_ai_n + h * stride_ai_h
        n_base = slot * stride_an_n + h * stride_an_h
        cnt_off = slot * stride_ac_n + h * stride_ac_h
        a_cnt = tl.load(ACNT + cnt_off)
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < m_list
        ch = tl.load(CHOSEN + row * m_list + offs_m, mask=m_ok, other=-1)
        cv = tl.load(CVAL + row * m_list + offs_m, mask=m_ok, other=float("-inf"))
        chosen = m_ok & (ch >= 0) & (cv > float("-inf"))
        ch = tl.where(chosen, ch, 0).to(tl.int64)
        new_list = _pool_ids(AIDX, ANEXT, a_base, a_cnt, n_base, ch, chosen, m_list)
        new_list = tl.where(chosen, new_list, -1)
        # Mark the chosen entries, then compact the others (in pool order) into TMP.
        flag = FLAG + row * n_pool
        offs_p = tl.arange(0, BLOCK_P)
        for p0 in range(0, n_pool, BLOCK_P):
            tl.store(flag + p0 + offs_p, tl.zeros([BLOCK_P], tl.int8), mask=p0 + offs_p < n_pool)
        tl.debug_barrier()
        tl.store(flag + ch, tl.full([BLOCK_M], 1, tl.int8), mask=chosen)
        tl.debug_barrier()
        tmp = TMP + row * r_next
        done = pid * 0  # an int32 scalar: the type the loop carries
        for p0 in range(0, n_pool, BLOCK_P):
            e = p0 + offs_p
            in_pool = e < n_pool
            rest = in_pool & (tl.load(flag + e, mask=in_pool, other=1) == 0)
            ids = _pool_ids(AIDX, ANEXT, a_base, a_cnt, n_base, e, rest, m_list)
            at = done + prefix_count(rest, BLOCK_P, SEG) - 1
            tl.store(tmp + at, ids.to(tl.int32), mask=rest & (at < r_next))
            done += tl.sum(rest.to(tl.int32), 0)
        tl.debug_barrier()
        tl.store(AIDX + a_base + offs_m, new_list.to(tl.int32), mask=m_ok)
        tl.store(ACNT + cnt_off, tl.sum((new_list >= 0).to(tl.int32), 0))
        offs_r = tl.arange(0, BLOCK_R)
        for r0 in range(0, r_next, BLOCK_R):
            rr = r0 + offs_r
            nxt = tl.load(tmp + rr, mask=rr < r_next, other=-1)
            tl.store(ANEXT + n_base + rr, nxt, mask=rr < r_next)


@functools.cache
def _rescore_jit(interpret: bool) -> tuple[object, object, object]:
    del interpret  # part of the cache key, as for the other kernels
    return (
        triton.jit(_rescore_logits_kernel),
        triton.jit(_rescore_scores_kernel),
        triton.jit(_rescore_write_kernel),
    )


def rescore_splits(rows: int, n_pool: int, block_e: int, device: torch.device) -> tuple[int, int]:
    """``(chunk, splits)``: pool entries per program (a multiple of ``block_e``) and programs
    per row, enough for ``TUNING["rescore_programs_per_sm"]`` programs per multiprocessor and no
    chunk shorter than ``TUNING["rescore_min_tiles"]`` tiles. A function of shapes only."""
    want = max(1, -(-TUNING["rescore_programs_per_sm"] * _multiprocessors(device) // max(rows, 1)))
    tiles = max(1, -(-n_pool // block_e))
    per = max(TUNING["rescore_min_tiles"], -(-tiles // want))
    chunk = per * block_e
    return chunk, max(1, -(-n_pool // chunk))


def _rescore_block_e(block_size: int, codes: bool = False) -> int:
    key = "rescore_tile_codes" if codes else "rescore_tile"
    n = TUNING[key]
    if n < 16 or n & (n - 1):
        raise ValueError(f'TUNING["{key}"] must be a power of two >= 16, got {n!r}')
    return max(1, n // block_size)


def rescore_scores_triton(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    reuse: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    n_sink: int,
    n_local: int,
    hold_local: bool,
    score: str,
    codes: KeyCodes | None = None,
) -> torch.Tensor:
    """``[B, Hkv, P]`` float32, ``P = M + R``: each pool entry's score at the current query (each
    head's probabilities over the pool's keys, the sink's and the local window's, averaged over
    the group; the block's sum or max), ``-inf`` for empty entries and rows that do not reuse.
    The pool is read from the anchor fields of each row's slot (the list's first
    ``anchor_cnt`` entries, then the next blocks). Two launches over ``(row, split)`` programs:
    the logits into a scratch row and each split's partial log-sum-exps, then the scores.
    ``codes``: the logits from the keys' code rows (:mod:`prhs_kernels.keycodes`)."""

    b, hq, d = query.shape
    h = kv.num_kv_heads
    g = hq // h
    m_list, r_next = anchor_idx.shape[-1], anchor_next.shape[-1]
    n_pool = m_list + r_next
    s = block_size
    dev = query.device
    out = torch.empty(b, h, n_pool, dtype=torch.float32, device=dev)
    if b * h == 0 or n_pool == 0:
        return out.fill_(float("-inf"))
    block_e = _rescore_block_e(s, codes is not None)
    chunk, n_split = rescore_splits(b * h, n_pool, block_e, dev)
    block_g = _pow2(g, 16)
    scr = torch.empty(b * h * g, n_pool * s, dtype=torch.float32, device=dev)
    part = torch.empty(b * h * n_split, 2 * block_g, dtype=torch.float32, device=dev)
    if query.stride(-1) != 1:
        query = query.contiguous()
    k, (skb, skh, skt), req2tok, reqidx, stride_rt, start, has_start, paged = key_args(kv)
    if codes is not None:  # one code row per location, no left padding
        k = codes.rows
        skt, skh = k.stride(0), k.stride(1)
        skb, has_start = codes.row_stride * skt, False
    if k.stride(-1) != 1:
        raise ValueError("the Triton path needs a cache whose last dim is contiguous")
    flags = reuse.contiguous().view(torch.int8)
    fields = (anchor_idx, anchor_cnt, anchor_next)
    strides = (*anchor_idx.stride()[:2], *anchor_cnt.stride(), *anchor_next.stride()[:2])
    wl = 2 * n_local if hold_local else n_local
    logits, scores, _ = _rescore_jit(interpreting())
    logits[(b * h, n_split)](
        query, k, *fields, anchor_len, slots, flags, kv.seq_lens, start, req2tok, reqidx, scr,
        part, query.stride(0), query.stride(1), skb, skh, skt, stride_rt, *strides,
        *anchor_len.stride(), float(scaling), n_pool, m_list, n_sink, n_local, wl, chunk,
        n_split,
        HKV=h, G=g, BLOCK_G=block_g, D=d, BLOCK_D=_pow2(d, 16), BS=s, BLOCK_E=block_e,
        BLOCK_W=_pow2(n_sink + wl, 16), PAGED=paged, HAS_START=has_start, HOLD=hold_local,
        UPCAST=interpreting(), CODES=codes is not None, BLOCK_DH=_pow2(d // 2, 16),
        ALIGN=row_alignment(codes.rows) if codes is not None else 1,
        STAGES=TUNING["rescore_stages"], **pdl_args(query.device, "cis"), num_warps=4,
    )  # fmt: skip
    scores[(b * h, n_split)](
        *fields, slots, flags, scr, part, out, *strides, n_pool, m_list, chunk, n_split,
        HKV=h, G=g, BLOCK_G=block_g, G_POW=_pow2(g, 1), BS=s, BLOCK_E=block_e,
        BLOCK_S=_pow2(n_split, 1), MASS=score == "mass", **pdl_args(query.device, "cis"),
        num_warps=4,
    )  # fmt: skip
    return out


def rescore_write_triton(
    chosen: torch.Tensor,
    values: torch.Tensor,
    reuse: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write the re-ranked pools of the ``reuse [B, Hkv]`` rows in place: ``chosen [B, Hkv, M]``
    (int32, best first) are the pool entries that become the list where ``values`` is finite;
    the other entries, in pool order, become the next blocks. One launch, a program per row."""
    b, h, m_list = chosen.shape
    r_next = anchor_next.shape[-1]
    n_pool = m_list + r_next
    if b * h == 0 or m_list == 0:
        return
    dev = chosen.device
    flag = torch.empty(b * h, n_pool, dtype=torch.int8, device=dev)
    tmp = torch.empty(b * h, max(r_next, 1), dtype=torch.int32, device=dev)
    block_p = min(_pow2(n_pool, 16), TUNING["rescore_write_block"])
    strides = (*anchor_idx.stride()[:2], *anchor_cnt.stride(), *anchor_next.stride()[:2])
    *_, write = _rescore_jit(interpreting())
    write[(b * h,)](
        anchor_idx, anchor_cnt, anchor_next, slots, reuse.contiguous().view(torch.int8),
        chosen.to(torch.int32).contiguous(), values.contiguous(), flag, tmp, *strides, n_pool,
        m_list, r_next,
        HKV=h, BLOCK_M=_pow2(m_list, 16), BLOCK_P=block_p, BLOCK_R=min(_pow2(r_next, 16), 1024),
        SEG=_scan_segment(block_p), **pdl_args(dev, "cis"), num_warps=4 if block_p <= 1024 else 8,
    )  # fmt: skip


def _rescore_rank_kernel(
    SCORES, AIDX, ACNT, ANEXT, SLOTS, REUSE, SCRATCH,
    stride_ai_n, stride_ai_h, stride_ac_n, stride_ac_h, stride_an_n, stride_an_h,
    n_pool, m_list, r_next,
    HKV: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, RADIX_BITS: tl.constexpr,
    RADIX: tl.constexpr, SEG: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per reusing row, the ranking and the rewrite in one: the row's pool scores
    # in registers, their top m_list found (ties toward the earlier entry) and sorted, best
    # first; those with a finite score become the list, every other entry (in pool order) the
    # next blocks. Every anchor field the row reads is read before the first write.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    row = pid.to(tl.int64)
    if tl.load(REUSE + pid) != 0:
        slot = tl.load(SLOTS + b).to(tl.int64)
        a_base = slot * stride_ai_n + h * stride_ai_h
        n_base = slot * stride_an_n + h * stride_an_h
        cnt_off = slot * stride_ac_n + h * stride_ac_h
        a_cnt = tl.load(ACNT + cnt_off)
        offs = tl.arange(0, BLOCK)
        in_pool = offs < n_pool
        x = tl.load(SCORES + row * n_pool + offs, mask=in_pool, other=float("-inf"))
        key = tl.where(in_pool, order_key(x), -2147483647 - 1)
        take, pos = take_top_few(key, in_pool, m_list, SCRATCH + row * BLOCK_M, BLOCK_M, BLOCK,
                                 RADIX_BITS, RADIX, SEG)  # fmt: skip
        lane, key_m = winners_in_order(key, take, pos, SCRATCH + row * BLOCK_M, m_list, BLOCK,
                                       BLOCK_M, True)  # fmt: skip
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < m_list
        finite_m = m_ok & (key_m > order_key(tl.full([BLOCK_M], float("-inf"), tl.float32)))
        new_list = _pool_ids(AIDX, ANEXT, a_base, a_cnt, n_base, lane, finite_m, m_list)
        new_list = tl.where(finite_m, new_list, -1)
        chosen = take & (key > order_key(tl.full([BLOCK], float("-inf"), tl.float32)))
        rest = in_pool & ~chosen
        rest_ids = _pool_ids(AIDX, ANEXT, a_base, a_cnt, n_base, offs, rest, m_list)
        at = prefix_count(rest, BLOCK, SEG) - 1
        tl.debug_barrier()  # the pool is read whole before it is rewritten
        tl.store(AIDX + a_base + offs_m, new_list.to(tl.int32), mask=m_ok)
        tl.store(ACNT + cnt_off, tl.sum((new_list >= 0).to(tl.int32), 0))
        tl.store(ANEXT + n_base + at, rest_ids.to(tl.int32), mask=rest & (at < r_next))


@functools.cache
def _rescore_rank_jit(interpret: bool) -> object:
    del interpret  # part of the cache key, as for the other kernels
    return triton.jit(_rescore_rank_kernel)


def rescore_rank_fits(n_pool: int, m_list: int) -> bool:
    """Whether :func:`rescore_rank_write_triton` ranks pools of ``n_pool`` entries for
    ``m_list`` (one program holds the pool: at most ``TOPK_ONE_PASS`` entries)."""
    return 1 <= m_list <= n_pool <= TOPK_ONE_PASS


def rescore_rank_write_triton(
    scores: torch.Tensor,
    reuse: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """The re-ranked pools of the ``reuse [B, Hkv]`` rows, ranked and written in one launch (a
    program per row, :func:`rescore_rank_fits`): the top ``M`` of ``scores [B, Hkv, M + R]``
    (best first, ties toward the earlier entry) with a finite score become the list, the other
    entries, in pool order, the next blocks -- what :func:`top_blocks_triton` then
    :func:`rescore_write_triton` write, without the ranking's outputs in between."""
    b, h, n_pool = scores.shape
    m_list = anchor_idx.shape[-1]
    if b * h == 0:
        return
    dev = scores.device
    block = _pow2(n_pool, 16)
    block_m = _pow2(m_list, 16)
    scratch = torch.empty(b * h, block_m, dtype=torch.int64, device=dev)
    strides = (*anchor_idx.stride()[:2], *anchor_cnt.stride(), *anchor_next.stride()[:2])
    consts = search_constants(TUNING, "topk_radix_bits", "topk_scan_segment", block)
    _rescore_rank_jit(interpreting())[(b * h,)](
        scores.contiguous(), anchor_idx, anchor_cnt, anchor_next, slots,
        reuse.contiguous().view(torch.int8), scratch, *strides, n_pool, m_list,
        anchor_next.shape[-1],
        HKV=h, BLOCK=block, BLOCK_M=block_m, **consts, **pdl_args(dev, "cis"),
        num_warps=_topk_warps(block, True),
    )  # fmt: skip


def _pool_rest_kernel(
    CAND, CVAL, PICK, PVAL, ACTIVE, SLOTS, FLAG, LIST, ANEXT,
    stride_an_n, stride_an_h, n_cand, m_list, r_next,
    HKV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, SEG: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # One program per active row: the picked candidates (best first) become the list, and the
    # other finite candidates, in candidate (position) order, the row's next blocks (then -1).
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    row = pid.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < m_list
    if tl.load(ACTIVE + pid) != 0:
        slot = tl.load(SLOTS + b).to(tl.int64)
        pk = tl.load(PICK + row * m_list + offs_m, mask=m_ok, other=-1)
        pv = tl.load(PVAL + row * m_list + offs_m, mask=m_ok, other=float("-inf"))
        picked = m_ok & (pk >= 0) & (pv > float("-inf"))
        pk = tl.where(picked, pk, 0).to(tl.int64)
        ids = tl.load(CAND + row * n_cand + pk, mask=picked, other=-1)
        tl.store(LIST + row * m_list + offs_m, tl.where(picked, ids, -1), mask=m_ok)
        flag = FLAG + row * n_cand
        offs_p = tl.arange(0, BLOCK_P)
        for p0 in range(0, n_cand, BLOCK_P):
            tl.store(flag + p0 + offs_p, tl.zeros([BLOCK_P], tl.int8), mask=p0 + offs_p < n_cand)
        tl.debug_barrier()
        tl.store(flag + pk, tl.full([BLOCK_M], 1, tl.int8), mask=picked)
        tl.debug_barrier()
        nxt = ANEXT + slot * stride_an_n + h * stride_an_h
        done = pid * 0  # an int32 scalar: the type the loop carries
        for p0 in range(0, n_cand, BLOCK_P):
            e = p0 + offs_p
            in_c = e < n_cand
            cv = tl.load(CVAL + row * n_cand + e, mask=in_c, other=float("-inf"))
            rest = in_c & (cv > float("-inf")) & (tl.load(flag + e, mask=in_c, other=1) == 0)
            cid = tl.load(CAND + row * n_cand + e, mask=rest, other=-1)
            at = done + prefix_count(rest, BLOCK_P, SEG) - 1
            tl.store(nxt + at, cid, mask=rest & (at < r_next))
            done += tl.sum(rest.to(tl.int32), 0)
        for p0 in range(0, r_next, BLOCK_P):
            e = p0 + offs_p
            tl.store(nxt + e, tl.full([BLOCK_P], -1, tl.int32), mask=(e >= done) & (e < r_next))
    else:
        tl.store(LIST + row * m_list + offs_m, tl.full([BLOCK_M], -1, tl.int32), mask=m_ok)


@functools.cache
def _pool_rest_jit(interpret: bool) -> object:
    del interpret  # part of the cache key, as for the other kernels
    return triton.jit(_pool_rest_kernel)


def _pool_rank_kernel(
    CVAL, CIDX, BRACKET, ACTIVE, SLOTS, SCRATCH, LIST, LVAL, ANEXT,
    stride_an_n, stride_an_h, cap, k_all, m_list, r_next,
    HKV: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    RADIX: tl.constexpr, SEG: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    FEW: tl.constexpr = min(FEW_KEYS, 2 * BLOCK_M)  # keys the searches rank in the scratch
    # One program per row, the seeded retrieval's last launch: the row's candidates (its
    # top k_all among them, in position order) held in registers; the top k_all found from
    # the bracket the collection left, the top m_list of those found and sorted (best first:
    # the list and its values), the others with a finite score written in position order as
    # the row's next blocks at its slot (then -1). Ties toward the lower position throughout.
    # Rows not active: the list -1 / -inf, their next blocks untouched.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    row = pid.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < m_list
    if tl.load(ACTIVE + pid) != 0:
        offs = tl.arange(0, BLOCK)
        ok = offs < cap
        x = tl.load(CVAL + row * cap + offs, mask=ok, other=float("-inf"))
        key = tl.where(ok, order_key(x), -2147483647 - 1)
        lo = tl.load(BRACKET + row * 2)
        hi = tl.load(BRACKET + row * 2 + 1)
        few = (SCRATCH + row * BLOCK_M).to(tl.pointer_type(tl.int32))  # before the winners
        thr = kth_largest_key_few(key, k_all, lo, hi, few, BLOCK, RADIX, FEW, SEG)
        take_all, _ = take_at(key, ok, k_all, thr, BLOCK, SEG)
        key_all = tl.where(take_all, key, -2147483647 - 1)
        thr_m = kth_largest_key_few(key_all, m_list, thr, tl.full([], 2147483647, tl.int32), few,
                                    BLOCK, RADIX, FEW, SEG)  # fmt: skip
        take_m, pos_m = take_at(key_all, take_all, m_list, thr_m, BLOCK, SEG)
        # The list: the top m_list sorted by key, then lane.
        lane, _ = winners_in_order(key, take_m, pos_m, SCRATCH + row * BLOCK_M, m_list, BLOCK,
                                   BLOCK_M, True)  # fmt: skip
        val = tl.load(CVAL + row * cap + lane, mask=m_ok, other=float("-inf"))
        val = tl.where(val != val, float("-inf"), val)
        picked = m_ok & (val > float("-inf"))
        ids = tl.load(CIDX + row * cap + lane, mask=picked, other=-1)
        tl.store(LIST + row * m_list + offs_m, tl.where(picked, ids, -1), mask=m_ok)
        tl.store(LVAL + row * m_list + offs_m, val, mask=m_ok)
        # The next blocks: the other winners with a finite score, in position order.
        finite = key > order_key(tl.full([BLOCK], float("-inf"), tl.float32))
        rest = take_all & ~take_m & finite
        at = prefix_count(rest, BLOCK, SEG) - 1
        slot = tl.load(SLOTS + pid // HKV).to(tl.int64)
        nxt = ANEXT + slot * stride_an_n + (pid % HKV) * stride_an_h
        cid = tl.load(CIDX + row * cap + offs, mask=rest, other=-1)
        tl.store(nxt + at, cid, mask=rest & (at < r_next))
        n_rest = tl.sum(rest.to(tl.int32), 0)
        offs_r = tl.arange(0, BLOCK_R)
        for r0 in range(0, r_next, BLOCK_R):
            e = r0 + offs_r
            tl.store(nxt + e, tl.full([BLOCK_R], -1, tl.int32), mask=(e >= n_rest) & (e < r_next))
    else:
        tl.store(LIST + row * m_list + offs_m, tl.full([BLOCK_M], -1, tl.int32), mask=m_ok)
        tl.store(LVAL + row * m_list + offs_m, tl.full([BLOCK_M], float("-inf"), tl.float32),
                 mask=m_ok)  # fmt: skip


@functools.cache
def _pool_rank_jit(interpret: bool) -> object:
    del interpret  # part of the cache key, as for the other kernels
    return triton.jit(_pool_rank_kernel)


def seeded_capacity(n: int, k: int) -> int:
    """The candidate buffer of a seeded top-``k`` over rows of ``n`` scores: twice ``k``
    rounded up to a power of two, held by one top-k pass; 0 (no seeding) where the row itself
    is ranked in one pass, or the buffer would not fit one."""
    cap = _pow2(2 * k, 16)
    if n <= TOPK_ONE_PASS or cap > TOPK_MAX_N or cap >= n:
        return 0
    return cap


def retrieval_pool_triton(
    scores: torch.Tensor,
    m: int,
    r: int,
    retrieve: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
    seed: torch.Tensor | None = None,
    anchor_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A retrieval that keeps its next ``r`` blocks (``rescore``): ``(list [B, Hkv, m'] int32,
    values)``, the top ``m' = min(m, N)`` blocks of each retrieving row of ``scores [B, Hkv,
    N]``, best first, and, written into ``anchor_next [N_slots, Hkv, r]`` at each retrieving
    row's slot, the blocks ranked ``m' + 1 … m' + r`` in block order (``-1`` after them). The
    top ``m + r`` unsorted, then the top ``m'`` of those sorted, then one launch for the rest:
    cheaper than sorting ``m + r`` winners (rows of 16 384 at ``m`` 1024, ``r`` 2048 on an
    H200: 146 µs sorted, 54 + 25 + the rest's launch). The caller checks
    :func:`top_blocks_fits` for both rankings. ``seed [B, Hkv, S]`` (block ids, e.g. each row's
    current anchor pool): the top ``m + r`` are found among the scores reaching the seed's
    ``(m + r)``-th best (:func:`prhs_kernels.topk.seeded_candidates`) where the row is long
    enough for it to pay (:func:`seeded_capacity`), the whole row only where that fails.
    ``anchor_idx [N_slots, Hkv, S]`` (instead of ``seed``): each row is seeded with its slot's
    current pool, ``anchor_idx`` and ``anchor_next`` at ``slots``, read in place."""
    b, h, n = scores.shape
    k_all = min(m + r, n)
    mm = min(m, k_all)
    cap = seeded_capacity(n, k_all)
    if (seed is not None or anchor_idx is not None) and cap and b * h and mm:
        # Guess-verify-refine: the candidates reaching the seed's k_all-th score (the rows a
        # seed cannot serve refined over the whole row, in the same launch), then one program
        # per row ranks them, sorts the list and writes the next blocks (_pool_rank_kernel).
        seeds = (seed,) if seed is not None else (anchor_idx, anchor_next)
        bracket = torch.empty(b * h, 2, dtype=torch.int32, device=scores.device)
        c_val, c_id, _, ranked = seeded_candidates_triton(
            scores, k_all, seeds, cap, retrieve, None if seed is not None else slots,
            whole_rows=True, bracket=bracket,
        )  # fmt: skip
        out = torch.empty(b, h, mm, dtype=torch.int32, device=scores.device)
        val = torch.empty(b, h, mm, dtype=torch.float32, device=scores.device)
        block_m = _pow2(mm, 16)
        scratch = torch.empty(b * h, block_m, dtype=torch.int64, device=scores.device)
        block = _pow2(cap, 16)
        consts = search_constants(TUNING, "topk_radix_bits", "topk_scan_segment", block)
        _pool_rank_jit(interpreting())[(b * h,)](
            c_val, c_id, bracket, ranked.view(torch.int8), slots, scratch, out, val,
            anchor_next, *anchor_next.stride()[:2], cap, k_all, mm, r,
            HKV=h, BLOCK=block, BLOCK_M=block_m, BLOCK_R=min(_pow2(r, 16), 1024),
            RADIX=consts["RADIX"], SEG=consts["SEG"], **pdl_args(scores.device, "cis"),
            num_warps=TUNING["pool_rank_warps"],
        )  # fmt: skip
        return out, val
    cand, cval = top_blocks_triton(scores, k_all, retrieve, sort=False)
    pick, pval = top_blocks_triton(cval, mm, retrieve)
    out = torch.empty(b, h, mm, dtype=torch.int32, device=scores.device)
    if b * h == 0 or mm == 0:
        return out.fill_(-1), pval
    flag = torch.empty(b * h, k_all, dtype=torch.int8, device=scores.device)
    block_p = min(_pow2(k_all, 16), TUNING["rescore_write_block"])
    _pool_rest_jit(interpreting())[(b * h,)](
        cand, cval, pick, pval, retrieve.contiguous().view(torch.int8), slots, flag, out,
        anchor_next, *anchor_next.stride()[:2], k_all, mm, r,
        HKV=h, BLOCK_M=_pow2(mm, 16), BLOCK_P=block_p, SEG=_scan_segment(block_p),
        **pdl_args(scores.device, "cis"), num_warps=4 if block_p <= 1024 else 8,
    )  # fmt: skip
    return out, pval
