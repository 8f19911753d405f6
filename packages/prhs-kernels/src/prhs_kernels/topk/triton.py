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

The CIS top-k (:mod:`prhs_kernels.cis.triton`) and Quest's page selection
(:mod:`prhs_kernels.quest.triton`) are built on them. They are ``triton.jit`` functions inlined
into the kernels that call them; nothing here launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "kth_largest_key",
    "order_key",
    "prefix_count",
    "search_constants",
    "search_warps",
    "take_top",
]


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
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        # The largest t with #{key >= t} >= k, RADIX_BITS bits a round: each round counts the
        # keys at or above 2^RADIX_BITS thresholds cutting [lo, hi] into equal parts in one
        # reduction, and keeps the part holding t (fewer dependent reductions than a
        # bisection, which is what bounds a program that holds its whole row).
        offs_r = tl.arange(0, RADIX)
        for _ in range(32 // RADIX_BITS):
            cut = lo + (offs_r.to(tl.int64) * (hi - lo + 1)) // RADIX  # cut[0] = lo
            # The keys compare in int32 (5-9 % faster than int64).
            cnt = tl.sum((key[:, None] >= cut.to(tl.int32)[None, :]).to(tl.int32), 0)
            j = tl.sum((cnt >= k).to(tl.int32), 0) - 1  # cnt falls with j; cnt[0] >= k
            nxt = tl.sum(tl.where(offs_r == j + 1, cut, 0), 0)
            hi = tl.where(j == RADIX - 1, hi, nxt - 1)
            lo = tl.sum(tl.where(offs_r == j, cut, 0), 0)
        thr = lo.to(tl.int32)
    return thr


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
    greater = ok & (key > thr)
    tie = ok & (key == thr)
    need = k - tl.sum(greater.to(tl.int32), 0)
    take = greater | (tie & (prefix_count(tie, BLOCK, SEG) <= need))
    pos = prefix_count(take, BLOCK, SEG) - 1
    return take, pos
