"""Triton building blocks of an in-register top-k, shared by the kernels that rank a row.

A program holds a row (or a chunk of one) of float32 scores in registers and finds its top ``k``
without sorting it:

- :func:`order_key` maps each score to an int32 whose signed order is the scores' order (NaN
  ranks as ``-inf``);
- :func:`kth_largest_key` finds the ``k``-th largest key of the lanes that may be picked, a few
  bits a round (``RADIX_BITS`` 1, 2 or 4: one block-wide count per candidate threshold; 8: a
  256-bin histogram a round, four rounds);
- :func:`take_top` marks the ``k`` winners (ties toward the lower lane) and gives each its
  place among them in lane order (:func:`prefix_count`), so that a program can write them
  compacted, in position order, without a sort.

The CIS top-k (:mod:`prhs_kernels.cis.triton`), Quest's page selection
(:mod:`prhs_kernels.quest.triton`) and :func:`topk_indices_triton` are built on them. They are
``triton.jit`` functions inlined into the kernels that call them.

:func:`topk_indices_triton` is :func:`prhs_kernels.topk.topk_indices`' CUDA path: a program per
row of up to :data:`TOPK_MAX_N` scores (float32, bf16 or fp16) finds the row's top ``k`` among
its eligible entries with :func:`take_top`, writes the winners compacted into a scratch row and
sorts them there, largest first.

Three kernels launch from here, the guess-and-verify passes of a seeded top-k
(:func:`seeded_candidates_triton`, after TensorRT-LLM's Guess-Verify-Refine): a program per row
takes the scores at the row's seed ids (a set that held the top ``k`` of a nearby query: an
anchor's pool) and places :data:`EDGES` thresholds from their best to their ``k``-th best (a
threshold no higher than the row's own ``k``-th best); programs over chunks of the row count
what reaches each threshold; then the same programs choose the highest threshold that at least
``k`` scores reach and write those scores, with their positions, in position order into a
buffer of fixed capacity. That buffer holds the row's top ``k``, and one top-k pass over it
finishes the job; a row whose seed gives no threshold, or whose candidates overflow the buffer,
is flagged for the full top-k.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait
from prhs_kernels.topk.reference import SEED_EDGES

__all__ = [
    "EDGES",
    "FEW_KEYS",
    "SEEDED_TUNING",
    "TOPK_MAX_N",
    "TOPK_TUNING",
    "kth_largest_key",
    "kth_largest_key_few",
    "kth_largest_key_in",
    "order_key",
    "prefix_count",
    "search_constants",
    "search_warps",
    "seeded_candidates_triton",
    "take_at",
    "take_top",
    "take_top_few",
    "topk_indices_triton",
    "winners_in_order",
]

SEEDED_TUNING = {"chunk": 4096, "radix_bits": 2, "scan_segment": 128}
"""The seeded passes: positions per program of the count and the collection, and the seed's
search's bits a round and the prefix counts' segment (:func:`search_constants`)."""

FEW_KEYS = tl.constexpr(64)
"""The most keys :func:`kth_largest_key_few` ranks against each other once its rounds have
narrowed the interval to them (a ``[FEW_KEYS, FEW_KEYS]`` comparison)."""

TOPK_MAX_N = 16384
"""Longest row :func:`topk_indices_triton` ranks: one program holds its whole row in registers
(:func:`search_warps`: 16 warps, 32 keys a thread, at 16 384). Longer rows take the reference
(``torch.topk``) in :func:`prhs_kernels.topk.topk_indices`."""

TOPK_TUNING = {"radix_bits": 2, "scan_segment": 128, "sort_warps": 8}
""":func:`topk_indices_triton`'s search (bits a round, the prefix counts' segment:
:func:`search_constants`) and the fewest warps of its programs, which also sort their winners:
the values the CIS top-k's one-pass kernel measured best (``prhs_kernels.cis.triton.TUNING``),
not tuned for this kernel."""

EDGES = SEED_EDGES
"""Thresholds a seeded top-k tries at once, evenly spaced in the scores' order keys from the
seed's best score to its ``k``-th best (:func:`.reference.seeded_candidates_reference`)."""


def search_constants(tuning: dict, bits_key: str, segment_key: str, block: int) -> dict:
    """The launch constants of a search over rows held in ``block`` lanes, from a kernel
    family's ``tuning`` dict: ``RADIX_BITS`` (``tuning[bits_key]``: 1, 2, 4 or 8), ``RADIX`` and
    ``SEG`` (``tuning[segment_key]``: 0 or a power of two >= 16, at most the block). A bad
    value raises ``ValueError`` naming the key, before anything is launched."""
    bits = tuning[bits_key]
    if bits not in (1, 2, 4, 8):
        raise ValueError(f'TUNING["{bits_key}"] must be 1, 2, 4 or 8, got {bits!r}')
    seg = tuning[segment_key]
    if seg != 0 and (seg < 16 or seg & (seg - 1)):
        raise ValueError(f'TUNING["{segment_key}"] must be 0 or a power of two >= 16, got {seg!r}')
    return {"RADIX_BITS": bits, "RADIX": 1 << bits, "SEG": 0 if seg == 0 else min(seg, block)}


def search_warps(block: int) -> int:
    """Warps of a program that holds ``block`` keys: at most 32 keys per thread (an H200, 13
    rows of 16384 keys in registers: 50 µs at 16 warps, 72 at 8; 8192 keys: 26 µs at 8, 29 at
    16)."""
    return 16 if block >= 16384 else 8 if block >= 4096 else 4


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def order_key(x):
    """int32 keys of float32 ``x`` whose signed order is the order of the floats (NaN: as
    ``-inf``). No key is int32's smallest value, which callers use for lanes that may not be
    picked."""
    x = tl.where(x != x, float("-inf"), x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def prefix_count(flags, BLOCK: tl.constexpr, SEG: tl.constexpr):
    """Inclusive prefix count of ``flags [BLOCK]`` (bool), in segments of ``SEG`` lanes: a
    prefix sum within each segment, plus the exclusive prefix sum of the segments' totals
    (``SEG`` 0: one prefix sum over the block)."""
    x = flags.to(tl.int32)
    if SEG == 0:
        out = tl.cumsum(x, 0)
    else:
        x2 = tl.reshape(x, [BLOCK // SEG, SEG])
        total = tl.sum(x2, 1)
        before = tl.cumsum(total, 0) - total
        out = tl.reshape(before[:, None] + tl.cumsum(x2, 1), [BLOCK])
    return out


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def kth_largest_key(key, ok, k, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, RADIX: tl.constexpr):
    """The largest int32 ``t`` with at least ``k`` of the ``ok`` lanes' keys ``>= t`` (``k`` at
    most the number of ``ok`` lanes; 0 gives a threshold no key exceeds). ``key`` must hold
    int32's smallest value on the lanes that are not ``ok``."""
    if RADIX_BITS == 8:
        # The k-th largest key digit by digit, 8 bits a round: a 256-bin histogram of the
        # next digit of the keys that share the digits found so far, then the digit whose
        # count from the top reaches what is still needed (4 dependent rounds, not 16).
        u = key ^ -2147483648  # the unsigned order of the keys, in int32 bits
        bins = tl.arange(0, 256)
        match = ok
        prefix = tl.full([], 0, tl.int32)
        rest = k
        for r in tl.static_range(4):
            digit = (u >> (24 - 8 * r)) & 255
            # Unmatched keys go to bin 0 and are taken back out (no mask in older Triton).
            hist = tl.histogram(tl.where(match, digit, 0), 256)
            hist = hist - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), 0), 0)
            from_top = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with digit >= b
            j = tl.sum((from_top >= rest).to(tl.int32), 0) - 1
            rest = rest - (tl.sum(tl.where(bins == j, from_top - hist, 0), 0))
            match = match & (digit == j)
            prefix = prefix | (j << (24 - 8 * r))
        thr = prefix ^ -2147483648
    else:
        # RADIX_BITS bits a round over every key (:func:`kth_largest_key_in`): 32 / RADIX_BITS
        # rounds, each one block-wide count at 2^RADIX_BITS thresholds (fewer dependent
        # reductions than a bisection, which is what bounds a program that holds its row).
        thr = kth_largest_key_in(key, k, tl.full([], -2147483648, tl.int32),
                                 tl.full([], 2147483647, tl.int32), RADIX)  # fmt: skip
    return thr


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _narrow(key, k, lo, hi, RADIX: tl.constexpr):
    """One round of the search for the largest ``t`` in ``[lo, hi]`` (int64) with at least
    ``k`` keys ``>= t``: the keys counted at ``RADIX`` thresholds cutting the interval into equal
    parts (one block-wide reduction), the part holding ``t`` kept. Returns ``(lo, hi, n_lo,
    n_hi)``: the new interval, how many keys reach its ``lo``, and how many exceed its ``hi``
    (``-1`` where ``hi`` was kept, the count above it unchanged)."""
    offs_r = tl.arange(0, RADIX)
    cut = lo + (offs_r.to(tl.int64) * (hi - lo + 1)) // RADIX  # cut[0] = lo
    # The keys compare in int32 (5-9 % faster than int64).
    cnt = tl.sum((key[:, None] >= cut.to(tl.int32)[None, :]).to(tl.int32), 0)
    j = tl.sum((cnt >= k).to(tl.int32), 0) - 1  # cnt falls with j; cnt[0] >= k
    last = j == RADIX - 1
    hi = tl.where(last, hi, tl.sum(tl.where(offs_r == j + 1, cut, 0), 0) - 1)
    n_hi = tl.where(last, -1, tl.sum(tl.where(offs_r == j + 1, cnt, 0), 0))
    lo = tl.sum(tl.where(offs_r == j, cut, 0), 0)
    n_lo = tl.sum(tl.where(offs_r == j, cnt, 0), 0)
    return lo, hi, n_lo, n_hi


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def kth_largest_key_in(key, k, lo, hi, RADIX: tl.constexpr):
    """The largest int32 ``t`` with at least ``k`` of ``key``'s lanes ``>= t``, searched in
    ``[lo, hi]`` only: the caller knows that at least ``k`` keys reach ``lo`` and fewer than
    ``k`` exceed ``hi`` (``hi`` int32's largest value: no bound). As
    :func:`kth_largest_key` at ``RADIX`` thresholds a round, but the rounds run only until the
    interval closes: a narrow bracket (a seed's neighbouring thresholds) takes a few rounds,
    not ``32 / log2(RADIX)``; ``lo == hi`` takes none. Lanes that may not be picked must hold
    int32's smallest value."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while lo < hi:
        lo, hi, _, _ = _narrow(key, k, lo, hi, RADIX)
    return lo.to(tl.int32)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def kth_largest_key_few(key, k, lo, hi, SCRATCH, BLOCK: tl.constexpr, RADIX: tl.constexpr,
                        FEW: tl.constexpr, SEG: tl.constexpr):  # fmt: skip
    """:func:`kth_largest_key_in`'s answer (same contract: at least ``k`` keys reach ``lo``,
    fewer than ``k`` exceed ``hi``) in fewer dependent rounds: ``hi`` is first lowered to the
    largest key, and the rounds at ``RADIX`` thresholds stop as soon as the interval holds at
    most ``FEW`` keys; those are then written compacted into ``SCRATCH`` (``FEW`` int32, the
    program's own) and ranked against each other in one ``[FEW, FEW]`` comparison. A round
    narrows the interval by about ``RADIX`` in keys as well as in key space where the keys are
    spread, so 8 192 keys take about four rounds at ``RADIX`` 4 where the interval, a float's
    exponent and mantissa wide, took 12 to 16. Returns the key (int32)."""
    hi = tl.minimum(hi, tl.max(key, 0))  # nothing exceeds the largest key: still < k above
    n_above = tl.sum((key > hi).to(tl.int32), 0)  # keys above the interval
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    n_in = n_above * 0 + FEW + 1  # unknown until a round has counted: one always runs
    while (lo < hi) & (n_in > FEW):
        lo, hi, n_lo, n_hi = _narrow(key, k, lo, hi, RADIX)
        n_above = tl.where(n_hi < 0, n_above, n_hi)
        n_in = n_lo - n_above
    thr = lo.to(tl.int32)
    if lo < hi:  # at most FEW keys in [lo, hi]; the (k - n_above)-th largest of them
        inside = (key >= thr) & (key <= hi.to(tl.int32))
        at = prefix_count(inside, BLOCK, SEG) - 1
        tl.store(SCRATCH + at, key, mask=inside)
        tl.debug_barrier()  # read back by other threads of this program
        offs_f = tl.arange(0, FEW)
        few = tl.load(SCRATCH + offs_f, mask=offs_f < n_in, other=-2147483647 - 1)
        tl.debug_barrier()  # the scratch is the caller's again
        want = k - n_above  # 1 <= want <= n_in
        # The keys with fewer than `want` keys above them are those at least the answer: it
        # is the least of them (padding lanes have all n_in keys above them).
        gt = tl.sum((few[None, :] > few[:, None]).to(tl.int32), 1)
        thr = tl.min(tl.where(gt < want, few, 2147483647), 0)
    return thr


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def take_top_few(key, ok, k, SCRATCH_ROW, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
                 RADIX_BITS: tl.constexpr, RADIX: tl.constexpr, SEG: tl.constexpr):  # fmt: skip
    """:func:`take_top` for a program with a scratch row (``SCRATCH_ROW``: ``BLOCK_N`` int64,
    the row :func:`winners_in_order` then uses): the ``k``-th key by
    :func:`kth_largest_key_few` between the least and the largest key of the ``ok`` lanes
    (``k`` at least 1 and at most their number), ranking up to :data:`FEW_KEYS` keys in the
    scratch; ``RADIX_BITS`` 8 (a histogram a round) keeps :func:`kth_largest_key`."""
    if RADIX_BITS == 8:
        thr = kth_largest_key(key, ok, k, BLOCK, RADIX_BITS, RADIX)
    else:
        FEW: tl.constexpr = min(FEW_KEYS, 2 * BLOCK_N)
        lo = tl.min(tl.where(ok, key, 2147483647), 0)
        thr = kth_largest_key_few(key, k, lo, tl.full([], 2147483647, tl.int32),
                                  SCRATCH_ROW.to(tl.pointer_type(tl.int32)), BLOCK, RADIX, FEW,
                                  SEG)  # fmt: skip
    return take_at(key, ok, k, thr, BLOCK, SEG)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def take_at(key, ok, k, thr, BLOCK: tl.constexpr, SEG: tl.constexpr):
    """``(take, pos)`` as :func:`take_top` returns them, given the ``k``-th largest key ``thr``
    of the ``ok`` lanes: every key above it and, in lane order, as many keys equal to it as
    ``k`` still needs."""
    greater = ok & (key > thr)
    tie = ok & (key == thr)
    need = k - tl.sum(greater.to(tl.int32), 0)
    take = greater | (tie & (prefix_count(tie, BLOCK, SEG) <= need))
    pos = prefix_count(take, BLOCK, SEG) - 1
    return take, pos


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def take_top(
    key,
    ok,
    k,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    RADIX: tl.constexpr,
    SEG: tl.constexpr,
):
    """``(take, pos)``: the ``k`` largest keys of the ``ok`` lanes (``k`` at most their number;
    ties toward the lower lane) and each winner's place among the winners in lane order
    (``0 .. k - 1``; meaningless elsewhere). ``key`` must hold int32's smallest value on the
    lanes that are not ``ok``."""
    thr = kth_largest_key(key, ok, k, BLOCK, RADIX_BITS, RADIX)
    return take_at(key, ok, k, thr, BLOCK, SEG)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def winners_in_order(key, take, pos, SCRATCH_ROW, n, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     SORT: tl.constexpr):  # fmt: skip
    """``(lane, key)`` ``[BLOCK_N]`` of the ``n`` winners ``take`` marks (``pos``: their
    places in lane order, as :func:`take_top` gives them): largest key first, ties toward the
    lower lane, with ``SORT``; in lane order without. Entries at ``n`` and past it are
    meaningless. The winners go through the program's scratch row ``SCRATCH_ROW`` (``BLOCK_N``
    int64) as ``(key << 32) | (INT32_MAX - lane)``."""
    offs = tl.arange(0, BLOCK)
    comp = (key.to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
    tl.store(SCRATCH_ROW + pos, comp, mask=take)
    tl.debug_barrier()  # the winners are read back, by other threads of this program
    offs_n = tl.arange(0, BLOCK_N)
    cc = tl.load(SCRATCH_ROW + offs_n, mask=offs_n < n, other=-9223372036854775807 - 1)
    if SORT:
        cc = tl.sort(cc, descending=True)
    return 2147483647 - (cc & 0xFFFFFFFF).to(tl.int32), (cc >> 32).to(tl.int32)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _edge_keys(EDGE, row, E: tl.constexpr):
    """The row's ``E`` threshold keys (descending; the last its seed's ``k``-th best) and its
    state: 0 not ranked, 1 ranked without a threshold (no seed), 2 ranked from the seed."""
    offs_e = tl.arange(0, E)
    top = tl.load(EDGE + row.to(tl.int64) * (E + 1))
    low = tl.load(EDGE + row.to(tl.int64) * (E + 1) + 1)
    state = tl.load(EDGE + row.to(tl.int64) * (E + 1) + 2)
    span = top.to(tl.int64) - low.to(tl.int64)
    keys = (top.to(tl.int64) - (span * offs_e) // (E - 1)).to(tl.int32)
    return keys, state


def _seed_edges_kernel(
    SCORES, SEED, SEED2, SROWS, ACTIVE, EDGE, n, stride_row, n_seed, n_seed2, stride_s0,
    stride_s1, stride_t0, stride_t1, per_row, k,
    E: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr, RADIX: tl.constexpr,
    HAS_SEED2: tl.constexpr, HAS_SROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per row: the seed's best and k-th best order keys, and whether they exist.
    # Row (b, i) of the scores (i < per_row) reads its seed at [SROWS[b] (or b), i]: the ids of
    # SEED, then SEED2's.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    row = tl.program_id(0)
    base = SCORES + row.to(tl.int64) * stride_row
    b = row // per_row
    i = (row % per_row).to(tl.int64)
    if HAS_SROWS:
        srow = tl.load(SROWS + b).to(tl.int64)
    else:
        srow = b.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    sid = tl.load(SEED + srow * stride_s0 + i * stride_s1 + offs_s, mask=offs_s < n_seed,
                  other=-1)  # fmt: skip
    if HAS_SEED2:
        o2 = offs_s - n_seed
        sid2 = tl.load(SEED2 + srow * stride_t0 + i * stride_t1 + o2,
                       mask=(o2 >= 0) & (o2 < n_seed2), other=-1)  # fmt: skip
        sid = tl.where(offs_s < n_seed, sid, sid2)
    s_in = (sid >= 0) & (sid < n)
    skey = order_key(tl.load(base + sid, mask=s_in, other=float("-inf")))
    s_ok = s_in & (skey > order_key(tl.full([BLOCK_S], float("-inf"), tl.float32)))
    active = tl.load(ACTIVE + row) != 0
    n_ok = tl.sum(s_ok.to(tl.int32), 0)
    good = active & (n_ok >= k)
    if n_ok == k:  # a seed of exactly k (an anchor pool, full): its k-th best is its least
        low = tl.min(tl.where(s_ok, skey, 2147483647), 0)
    else:
        low = kth_largest_key(tl.where(s_ok, skey, -2147483648), s_ok, k, BLOCK_S, RADIX_BITS,
                              RADIX)  # fmt: skip
    top = tl.max(tl.where(s_ok, skey, -2147483648), 0)
    out = EDGE + row.to(tl.int64) * (E + 1)
    tl.store(out, top)
    tl.store(out + 1, low)
    tl.store(out + 2, active.to(tl.int32) + good.to(tl.int32))


def _seed_count_kernel(
    SCORES, EDGE, COUNT, n, stride_row, n_chunks, chunk,
    E: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Program (row, chunk): how many of the chunk's scores reach each threshold.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    row = tl.program_id(0)
    c = tl.program_id(1)
    keys, state = _edge_keys(EDGE, row, E)
    cnt = tl.zeros([E], tl.int32)
    if state == 2:
        base = SCORES + row.to(tl.int64) * stride_row
        lo = c * chunk
        for t0 in range(lo, tl.minimum(lo + chunk, n), BLOCK):
            pos = t0 + tl.arange(0, BLOCK)
            x = tl.load(base + pos, mask=pos < n, other=float("-inf"))
            kx = tl.where(pos < n, order_key(x), -2147483648)
            cnt += tl.sum((kx[:, None] >= keys[None, :]).to(tl.int32), 0)
    tl.store(COUNT + (row.to(tl.int64) * n_chunks + c) * E + tl.arange(0, E), cnt)


def _seed_collect_kernel(
    SCORES, EDGE, COUNT, CVAL, CIDX, OVER, RANK, BRACKET, n, stride_row, n_chunks, chunk, k,
    cap,
    E: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, SEG: tl.constexpr,
    WHOLE: tl.constexpr, RADIX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Program (row, chunk): the highest threshold at least k scores of the row reach; the
    # chunk's scores reaching it, written after the earlier chunks'; the last program pads the
    # buffer and flags the row: OVER (the whole row must be ranked) or RANK (the candidates
    # hold its top k), neither for an inactive row, and writes BRACKET, the keys between which
    # the row's k-th largest lies. WHOLE: a row that would be flagged is refined by its chunk-0
    # program alone (_whole_row), and the others leave it be.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    row = tl.program_id(0)
    c = tl.program_id(1)
    keys, state = _edge_keys(EDGE, row, E)
    ok = state == 2
    offs_c = tl.arange(0, BLOCK_C)
    offs_e = tl.arange(0, E)
    counts = tl.load(COUNT + (row.to(tl.int64) * n_chunks + offs_c)[:, None] * E + offs_e[None, :],
                     mask=(offs_c < n_chunks)[:, None], other=0)  # fmt: skip
    total = tl.sum(counts, 0)  # [E], rising with the index (the keys fall)
    j = tl.minimum(tl.sum((total < k).to(tl.int32), 0), E - 1)  # the first edge reaching k
    thr = tl.sum(tl.where(offs_e == j, keys, 0), 0)
    # The edge above (fewer than k reach it), or no bound for the first one.
    above = tl.where(j > 0, tl.sum(tl.where(offs_e == j - 1, keys, 0), 0) - 1, 2147483647)
    n_all = tl.sum(tl.where(offs_e == j, total, 0), 0)
    before = tl.sum(tl.sum(tl.where((offs_c < c)[:, None] & (offs_e == j)[None, :], counts, 0),
                           1), 0)  # fmt: skip
    cv = CVAL + row.to(tl.int64) * cap
    ci = CIDX + row.to(tl.int64) * cap
    offs = tl.arange(0, BLOCK)
    over = (state == 1) | (ok & ((n_all > cap) | (n_all < k)))
    if WHOLE:
        refine = over
    else:
        refine = state < 0  # never
    base = SCORES + row.to(tl.int64) * stride_row
    done = before
    if ok & ~refine:
        lo = c * chunk
        for t0 in range(lo, tl.minimum(lo + chunk, n), BLOCK):
            pos = t0 + offs
            x = tl.load(base + pos, mask=pos < n, other=float("-inf"))
            take = (pos < n) & (order_key(x) >= thr)
            at = done + prefix_count(take, BLOCK, SEG) - 1
            keep = take & (at < cap)
            tl.store(cv + at, x, mask=keep)
            tl.store(ci + at, pos, mask=keep)
            done += tl.sum(take.to(tl.int32), 0)
    if refine:
        if c == 0:
            # The k-th largest key lies between the chosen edge and the one above it when
            # the candidates only overflowed; anywhere when the seed gave no threshold.
            narrow = ok & (n_all > cap)
            lo_b = tl.where(narrow, thr, -2147483647 - 1)
            hi_b = tl.where(narrow, above, 2147483647)
            kth = _whole_row(base, n, tl.minimum(k, n), lo_b, hi_b, cv, ci, cap, BLOCK, SEG,
                             RADIX)  # fmt: skip
            tl.store(OVER + row, tl.full([], 0, tl.int8))
            tl.store(RANK + row, tl.full([], 1, tl.int8))
            tl.store(BRACKET + row.to(tl.int64) * 2, kth)
            tl.store(BRACKET + row.to(tl.int64) * 2 + 1, kth)
    elif c == n_chunks - 1:
        written = tl.where(ok, tl.minimum(n_all, cap), 0)
        for p0 in range(0, cap, BLOCK):
            e = p0 + offs
            pad = (e >= written) & (e < cap)
            tl.store(cv + e, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)
            tl.store(ci + e, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(OVER + row, over.to(tl.int8))
        tl.store(RANK + row, ((state != 0) & ~over).to(tl.int8))
        tl.store(BRACKET + row.to(tl.int64) * 2, thr)
        tl.store(BRACKET + row.to(tl.int64) * 2 + 1, above)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _whole_row(base, n, k, lo, hi, CV, CI, cap, BLOCK: tl.constexpr, SEG: tl.constexpr,
               RADIX: tl.constexpr):  # fmt: skip
    """The top ``k`` of a row of ``n`` scores at ``base`` (``k <= n``; NaN as ``-inf``, ties
    toward the lower position), found by one program reading the row from memory: its
    ``k``-th largest key searched in ``[lo, hi]`` (:func:`kth_largest_key_in`'s contract), a
    pass counting the keys above it, then the winners written in position order into ``CV`` /
    ``CI`` (``-inf`` / ``-1`` after them, up to ``cap``). Returns the ``k``-th key. A slow path
    (the row read once a round): for the rows a seed could not serve."""
    offs = tl.arange(0, BLOCK)
    offs_r = tl.arange(0, RADIX)
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while lo < hi:
        cut = (lo + (offs_r.to(tl.int64) * (hi - lo + 1)) // RADIX).to(tl.int32)
        acc = tl.zeros([BLOCK, RADIX], tl.int32)
        for t0 in range(0, n, BLOCK):
            pos = t0 + offs
            x = tl.load(base + pos, mask=pos < n, other=float("-inf"))
            kx = tl.where(pos < n, order_key(x), -2147483647 - 1)
            acc += ((kx[:, None] >= cut[None, :]) & (pos < n)[:, None]).to(tl.int32)
        cnt = tl.sum(acc, 0)
        j = tl.sum((cnt >= k).to(tl.int32), 0) - 1
        nxt = tl.sum(tl.where(offs_r == j + 1, cut.to(tl.int64), 0), 0)
        hi = tl.where(j == RADIX - 1, hi, nxt - 1)
        lo = tl.sum(tl.where(offs_r == j, cut.to(tl.int64), 0), 0)
    kth = lo.to(tl.int32)
    n_gt = tl.zeros([BLOCK], tl.int32)
    for t0 in range(0, n, BLOCK):
        pos = t0 + offs
        x = tl.load(base + pos, mask=pos < n, other=float("-inf"))
        n_gt += ((pos < n) & (order_key(x) > kth)).to(tl.int32)
    need = k - tl.sum(n_gt, 0)  # the ties to take, the first ones in position order
    done = need * 0
    ties = need * 0
    for t0 in range(0, n, BLOCK):
        pos = t0 + offs
        x = tl.load(base + pos, mask=pos < n, other=float("-inf"))
        x = tl.where(x != x, float("-inf"), x)
        kx = order_key(x)
        tie = (pos < n) & (kx == kth)
        take = ((pos < n) & (kx > kth)) | (tie & (ties + prefix_count(tie, BLOCK, SEG) <= need))
        at = done + prefix_count(take, BLOCK, SEG) - 1
        tl.store(CV + at, x, mask=take)
        tl.store(CI + at, pos, mask=take)
        done += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    for p0 in range(0, cap, BLOCK):
        e = p0 + offs
        pad = (e >= done) & (e < cap)
        tl.store(CV + e, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)
        tl.store(CI + e, tl.full([BLOCK], -1, tl.int32), mask=pad)
    return kth


@functools.cache
def _seeded_jit(interpret: bool) -> tuple[object, object, object]:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return (
        triton.jit(_seed_edges_kernel),
        triton.jit(_seed_count_kernel),
        triton.jit(_seed_collect_kernel),
    )


def seeded_candidates_triton(
    scores: torch.Tensor,
    k: int,
    seed: torch.Tensor | tuple[torch.Tensor, ...],
    capacity: int,
    active: torch.Tensor,
    seed_rows: torch.Tensor | None = None,
    *,
    whole_rows: bool = False,
    bracket: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launcher's Triton path (arguments checked by
    :func:`prhs_kernels.topk.seeded_candidates`): three launches, the seed's thresholds (a
    program per row), the counts and the collection (a program per chunk of a row). ``seed``:
    one or two tensors whose ids a row takes together, read in place (at ``seed_rows`` when
    given). Returns ``(values [R, C], ids [R, C], overflow [R], ranked [R])`` over the ``R``
    rows, ``ranked`` the active rows whose candidates hold their top ``k`` (active and not
    flagged), so that a caller needs no launch to combine the flags. ``whole_rows``: the
    collection's chunk-0 program refines each row that would be flagged over its whole row
    (read from memory once a search round: slow, for the rows a seed cannot serve), so no row
    is flagged and no launch ranks whole rows. ``bracket [R, 2]`` (int32, written for the
    ranked rows): two order keys between which each row's ``k``-th largest key lies (equal
    for a refined row), which a ranking of the candidates can start its search from
    (:func:`kth_largest_key_in`)."""
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    rows = scores.numel() // max(n, 1)
    dev = scores.device
    values = scores.reshape(rows, n)
    if values.stride(-1) != 1:
        values = values.contiguous()
    seeds = (seed,) if isinstance(seed, torch.Tensor) else tuple(seed)
    per_row = max(1, rows // max(lead[0], 1)) if lead else 1
    views = []
    for s in seeds:  # [rows of seed_rows' index (or B), per_row, S], strides as they are
        v = s.reshape(s.shape[0] if lead else 1, per_row, s.shape[-1])
        if v.stride(-1) != 1:
            v = v.contiguous()
        views.append(v)
    cval = torch.empty(rows, capacity, dtype=torch.float32, device=dev)
    cidx = torch.empty(rows, capacity, dtype=torch.int32, device=dev)
    over = torch.empty(rows, dtype=torch.bool, device=dev)
    ranked = torch.empty(rows, dtype=torch.bool, device=dev)
    if rows == 0:
        return cval, cidx, over, ranked
    t = SEEDED_TUNING
    chunk = max(16, min(t["chunk"], triton.next_power_of_2(max(n, 1))))
    n_chunks = max(1, -(-n // chunk))
    block = min(chunk, 1024)
    n_seed = sum(v.shape[-1] for v in views)
    block_s = max(16, triton.next_power_of_2(max(n_seed, 1)))
    consts = search_constants(t, "radix_bits", "scan_segment", block)
    edges = torch.empty(rows, EDGES + 1, dtype=torch.int32, device=dev)
    counts = torch.empty(rows, n_chunks, EDGES, dtype=torch.int32, device=dev)
    k_edges, k_count, k_collect = _seeded_jit(interpreting())
    flags = active.reshape(rows).contiguous().view(torch.int8)
    pdl = pdl_args(dev, "cis")
    first, second = views[0], views[-1]
    k_edges[(rows,)](
        values, first, second, seed_rows if seed_rows is not None else flags, flags, edges, n,
        values.stride(0), first.shape[-1], second.shape[-1] if len(views) == 2 else 0,
        first.stride(0), first.stride(1), second.stride(0), second.stride(1), per_row, k,
        E=EDGES, BLOCK_S=block_s, RADIX_BITS=consts["RADIX_BITS"], RADIX=consts["RADIX"],
        HAS_SEED2=len(views) == 2, HAS_SROWS=seed_rows is not None, **pdl,
        num_warps=search_warps(block_s),
    )  # fmt: skip
    k_count[(rows, n_chunks)](
        values, edges, counts, n, values.stride(0), n_chunks, chunk, E=EDGES, BLOCK=block, **pdl,
        num_warps=4,
    )  # fmt: skip
    if bracket is None:
        bracket = torch.empty(rows, 2, dtype=torch.int32, device=dev)
    k_collect[(rows, n_chunks)](
        values, edges, counts, cval, cidx, over.view(torch.int8), ranked.view(torch.int8),
        bracket, n, values.stride(0), n_chunks, chunk, k, capacity, E=EDGES, BLOCK=block,
        BLOCK_C=max(2, triton.next_power_of_2(n_chunks)), SEG=consts["SEG"], WHOLE=whole_rows,
        RADIX=consts["RADIX"], **pdl, num_warps=4,
    )  # fmt: skip
    return cval, cidx, over, ranked


def _topk_rows_kernel(
    SCORES, ELIG, OUT_IDX, OUT_CNT, SCRATCH, n, k, stride_row, stride_elig,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ELIG: tl.constexpr,
    RADIX_BITS: tl.constexpr, RADIX: tl.constexpr, SEG: tl.constexpr,
):  # fmt: skip
    # One program per row of n scores (n <= BLOCK, k >= 1, min(k, n) <= BLOCK_K): its eligible
    # lanes' keys, the top min(k, eligible) of them marked and compacted into the row's scratch
    # as (key << 32) | (INT32_MAX - lane), sorted there largest first (equal keys: the lower
    # lane first), their lanes written, -1 after them up to k, and the count.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    in_row = offs < n
    x = tl.load(SCORES + row * stride_row + offs, mask=in_row, other=float("-inf"))
    ok = in_row
    if HAS_ELIG:
        ok = ok & (tl.load(ELIG + row * stride_elig + offs, mask=in_row, other=0) != 0)
    # order_key(-inf) (an eligible -inf or NaN) is above int32's smallest value (ineligible).
    key = tl.where(ok, order_key(x.to(tl.float32)), -2147483648)
    kk = tl.minimum(tl.sum(ok.to(tl.int32), 0), k)
    take, pos = take_top_few(key, ok, kk, SCRATCH + row * BLOCK_K, BLOCK_K, BLOCK, RADIX_BITS,
                             RADIX, SEG)  # fmt: skip
    lane, _ = winners_in_order(key, take, pos, SCRATCH + row * BLOCK_K, kk, BLOCK, BLOCK_K, True)
    offs_k = tl.arange(0, BLOCK_K)
    got = offs_k < kk
    out = OUT_IDX + row * k
    tl.store(out + offs_k, tl.where(got, lane, -1), mask=offs_k < k)
    for p0 in range(BLOCK_K, k, BLOCK_K):  # k above the row: -1 up to k
        tl.store(out + p0 + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=p0 + offs_k < k)
    tl.store(OUT_CNT + row, kk)


@functools.cache
def _topk_rows_jit(interpret: bool) -> object:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_topk_rows_kernel)


def topk_indices_triton(
    scores: torch.Tensor, k: int, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prhs_kernels.topk.topk_indices` on its Triton path (arguments checked there; rows
    of ``N <= TOPK_MAX_N`` scores, float32, bf16 or fp16): ``(indices [..., k], counts [...])``
    int32, the ``k`` largest eligible ``scores [..., N]`` largest first (equal scores: the lower
    position first, but ``0.0`` above ``-0.0``; NaN ranks as ``-inf``, an ineligible entry
    below every eligible one), ``counts = min(eligible, k)``, ``-1`` past each count.

    One launch, a program per row; strided rows are read in place where their last dim is
    contiguous (copied otherwise, ``eligible`` too, e.g. an expanded mask). Nothing is read
    on the host. ``k`` 0, ``N`` 0 or no row: nothing launches (``-1`` indices, zero counts)."""
    n = scores.shape[-1]
    lead = tuple(scores.shape[:-1])
    rows = math.prod(lead)
    dev = scores.device
    if n > TOPK_MAX_N:
        raise ValueError(f"rows of {n} scores exceed the Triton top-k's {TOPK_MAX_N}")
    if k == 0 or n == 0 or rows == 0:
        idx = torch.full((*lead, k), -1, dtype=torch.int32, device=dev)
        return idx, torch.zeros(lead, dtype=torch.int32, device=dev)
    values = scores.reshape(rows, n)
    if values.stride(-1) != 1:
        values = values.contiguous()
    if eligible is not None:
        flags = eligible.reshape(rows, n)
        if flags.stride(-1) != 1:
            flags = flags.contiguous()
        flags = flags.view(torch.int8)
    else:
        flags = values  # unread
    idx = torch.empty(*lead, k, dtype=torch.int32, device=dev)
    counts = torch.empty(lead, dtype=torch.int32, device=dev)
    block = max(16, triton.next_power_of_2(n))
    block_k = max(16, triton.next_power_of_2(min(k, n)))
    scratch = torch.empty(rows, block_k, dtype=torch.int64, device=dev)
    t = TOPK_TUNING
    _topk_rows_jit(interpreting())[(rows,)](
        values, flags, idx, counts, scratch, n, k, values.stride(0), flags.stride(0),
        BLOCK=block, BLOCK_K=block_k, HAS_ELIG=eligible is not None,
        **search_constants(t, "radix_bits", "scan_segment", block),
        num_warps=max(search_warps(block), t["sort_warps"]),
    )  # fmt: skip
    return idx, counts
