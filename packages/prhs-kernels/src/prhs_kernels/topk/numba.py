"""Numba (CPU) paths of top-k and top-p index selection.

Same outputs as the CPU references of :mod:`prhs_kernels.topk.reference`, bit for bit: largest
first, ties toward the lower index (the references' stable sort), scores ranked as the
references' ``nan_to_num(nan=-inf)`` leaves them (NaN as ``-inf``, ``±inf`` as the dtype's
finite extremes), ineligible entries below every eligible one (so never listed), ``-1`` past
each count, the same counts. The references sort every row in full. Here a row that keeps at
most ``1/16`` of its eligible entries keeps a heap of the best ``k`` (then a heap sort); any
other row sorts its eligible entries, gathered in index order, with a stable LSD radix sort of
their keys' order-preserving integer bits (so ties stay in index order).

Top-p sums the kept masses in float64 one after another in rank order, as the reference's
``cumsum`` does on the CPU, and stops at the first prefix whose dropped mass is within the
target (the dropped mass never increases along the order, so the reference's count of prefixes
above the target is that stopping point).

Importing this module imports Numba; :mod:`prhs_kernels.topk` imports it only when the Numba
path runs. The kernels compile at the first call for each dtype, and the compiled code is
cached on disk (:mod:`prhs_kernels._jit`), so later processes load it; :func:`warm_up` compiles
or loads them for float32 and float64 scores (about 10 s to compile on the shared 2-core CPU of
the measurements, Numba's first-use set-up included when it runs first); call it before serving
to keep that out of a decode step. Half-precision scores are widened to float32
first (exact: the order and the ties are unchanged; ``±inf`` still map to the half dtype's
extremes).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from prhs_kernels._jit import njit

__all__ = ["top_p_indices_numba", "topk_indices_numba", "warm_up"]


_FULL_SORT = 16
"""A row keeping more than ``1/_FULL_SORT`` of its eligible entries is sorted in full."""


@njit
def _key(v, pmax, pmin):
    """Ascending rank key of score ``v``: ``-v`` after ``nan_to_num(nan=-inf)``."""
    if v != v:
        return np.inf
    if v == np.inf:
        return -pmax
    if v == -np.inf:
        return -pmin
    return -v


@njit
def _worse(ka, ia, kb, ib):
    """Whether entry ``a`` ranks after entry ``b``: a larger key, or an equal key and a larger
    index (keys are negated scores, so the largest score first, ties toward the lower index)."""
    return ka > kb or (ka == kb and ia > ib)


@njit
def _sift_down(keys, pos, start, n):
    """Restore the heap (worst entry at the root) below ``start`` in ``keys[:n]``/``pos[:n]``."""
    i = start
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _worse(keys[c + 1], pos[c + 1], keys[c], pos[c]):
            c += 1
        if not _worse(keys[c], pos[c], keys[i], pos[i]):
            return
        keys[i], keys[c] = keys[c], keys[i]
        pos[i], pos[c] = pos[c], pos[i]
        i = c


@njit
def _radix_sort(bits, pos, n, n_bytes, tmp_b, tmp_p):
    """Stable ascending sort of the ``n_bytes``-byte unsigned patterns ``bits[:n]`` (int64;
    ``pos[:n]`` alongside), least significant byte first; a byte that every key shares is
    skipped. Entries gathered in index order keep equal keys in index order."""
    count = np.empty(256, np.int64)
    src_b, src_p, dst_b, dst_p = bits, pos, tmp_b, tmp_p
    swapped = False
    for shift in range(0, 8 * n_bytes, 8):
        count[:] = 0
        for i in range(n):
            count[(src_b[i] >> shift) & 0xFF] += 1
        if count[(src_b[0] >> shift) & 0xFF] == n:
            continue
        total = 0
        for d in range(256):
            c = count[d]
            count[d] = total
            total += c
        for i in range(n):
            d = (src_b[i] >> shift) & 0xFF
            o = count[d]
            count[d] = o + 1
            dst_b[o] = src_b[i]
            dst_p[o] = src_p[i]
        src_b, src_p, dst_b, dst_p = dst_b, dst_p, src_b, src_p
        swapped = not swapped
    if swapped:
        bits[:n] = tmp_b[:n]
        pos[:n] = tmp_p[:n]


@njit
def _top_order(x, elig, has_elig, row, length, pmax, pmin, sc, out):
    """Write the ``min(length, eligible)`` best entries of ``x[row]`` into ``out[:]``, best
    first, and return how many. Scores are ranked as the reference's ``nan_to_num(nan=-inf)``
    leaves them: NaN as ``-inf``, ``±inf`` as ``pmax`` / ``pmin`` (the dtype's finite extremes);
    ties toward the lower index. ``sc``: the scratch of :func:`_scratch`."""
    keys, key_int, int_max, n_bytes, bits, pos = sc
    n = x.shape[1]
    if length <= 0:
        return 0
    c = 0
    for j in range(n):
        if not has_elig or elig[row, j]:
            c += 1
    if _FULL_SORT * length >= c:  # most of the row: a stable sort of every eligible entry
        c = 0
        for j in range(n):
            if has_elig and not elig[row, j]:
                continue
            keys[c] = _key(x[row, j], pmax, pmin) + 0.0  # -0.0 ties with 0.0, as in a sort
            pos[c] = j
            c += 1
        # Keys as integers in the same order: the float's bits, the negative ones' magnitude
        # bits flipped; then offset to unsigned patterns for the radix sort.
        for i in range(c):
            m = np.int64(key_int[i])
            if m < 0:
                m ^= int_max
            bits[i] = m + int_max + 1
        if c > 0:
            _radix_sort(bits, pos, c, n_bytes, bits[n:], pos[n:])
        kk = min(length, c)
        for i in range(kk):
            out[i] = pos[i]
        return kk
    # A few of many: a heap of the best ``length`` (worst at the root), then a heap sort.
    kk = 0
    for j in range(n):
        if has_elig and not elig[row, j]:
            continue
        key = _key(x[row, j], pmax, pmin)
        if kk < length:
            i = kk
            keys[i] = key
            pos[i] = j
            kk += 1
            while i > 0:
                parent = (i - 1) // 2
                if not _worse(keys[i], pos[i], keys[parent], pos[parent]):
                    break
                keys[i], keys[parent] = keys[parent], keys[i]
                pos[i], pos[parent] = pos[parent], pos[i]
                i = parent
        elif _worse(keys[0], pos[0], key, j):  # better than the worst kept: replace it
            keys[0] = key
            pos[0] = j
            _sift_down(keys, pos, 0, kk)
    for end in range(kk - 1, 0, -1):  # move the worst to the end: best first
        keys[0], keys[end] = keys[end], keys[0]
        pos[0], pos[end] = pos[end], pos[0]
        _sift_down(keys, pos, 0, end)
    for i in range(kk):
        out[i] = pos[i]
    return kk


@njit
def _topk_rows(x, elig, has_elig, k, pmax, pmin, sc, out_idx, out_cnt):
    rows = x.shape[0]
    for row in range(rows):
        out_cnt[row] = _top_order(x, elig, has_elig, row, k, pmax, pmin, sc, out_idx[row])


@njit
def _top_p_rows(x, elig, has_elig, kept, target, cap, pmax, pmin, sc, out_idx, out_cnt):
    rows = x.shape[0]
    big = np.finfo(np.float64).max
    for row in range(rows):
        kk = _top_order(x, elig, has_elig, row, cap, pmax, pmin, sc, out_idx[row])
        if kk == 0:
            out_cnt[row] = 0
            continue
        # The reference's count: 1 + #(prefixes of the order whose dropped mass exceeds the
        # target), at most kk; masses as its float64 ``nan_to_num(nan=-inf)`` then
        # ``clamp_min(0)`` leave them.
        base = 1.0 - kept[row]
        cum = 0.0
        cnt = kk
        for i in range(kk - 1):
            v = np.float64(x[row, out_idx[row, i]])
            if v != v or v < 0.0:
                v = 0.0
            elif v == np.inf:
                v = big
            cum += v
            if not base - cum > target:
                cnt = i + 1
                break
        out_cnt[row] = cnt
        for i in range(cnt, kk):
            out_idx[row, i] = -1


def _scores_rows(
    scores: torch.Tensor, eligible: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray, bool, tuple[int, ...], int]:
    n = scores.shape[-1]
    lead = tuple(scores.shape[:-1])
    rows = math.prod(lead)
    x = scores.detach()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # exact for half precision; order and ties unchanged
    x = x.reshape(rows, n).contiguous().numpy()
    if eligible is None:
        elig = np.ones((1, 1), np.bool_)
    else:
        elig = eligible.detach().reshape(rows, n).contiguous().numpy()
    return x, elig, eligible is not None, lead, rows


def _scratch(x: np.ndarray) -> tuple:
    """Per-call scratch of the kernels for rows of ``N`` scores: the float keys and the same
    memory read as signed integers of their width (with that width's largest value and byte
    count), and ``2·N`` int64 sort keys and positions (a radix sort's two buffers)."""
    n = x.shape[1]
    keys = np.empty(n, x.dtype)
    itype = np.int32 if x.dtype == np.float32 else np.int64
    bits = np.empty(2 * n, np.int64)
    pos = np.empty(2 * n, np.int64)
    return keys, keys.view(itype), np.int64(np.iinfo(itype).max), itype().itemsize, bits, pos


def _extremes(dtype: torch.dtype) -> tuple[float, float]:
    """What ``nan_to_num`` replaces ``+inf`` / ``-inf`` with in ``dtype``."""
    info = torch.finfo(dtype)
    return float(info.max), float(info.min)


def topk_indices_numba(
    scores: torch.Tensor, k: int, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~prhs_kernels.topk.reference.topk_indices_reference` on the CPU, with Numba."""
    x, elig, has_elig, lead, rows = _scores_rows(scores, eligible)
    out_idx = np.full((rows, k), -1, np.int32)
    out_cnt = np.zeros(rows, np.int32)
    _topk_rows(x, elig, has_elig, k, *_extremes(scores.dtype), _scratch(x), out_idx, out_cnt)
    return torch.from_numpy(out_idx).view(*lead, k), torch.from_numpy(out_cnt).view(lead)


def top_p_indices_numba(
    mass: torch.Tensor,
    target: float,
    cap: int,
    eligible: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~prhs_kernels.topk.reference.top_p_indices_reference` on the CPU, with Numba."""
    if kept is not None:  # a ``kept`` that broadcasts past ``mass`` widens the result
        lead = torch.broadcast_shapes(tuple(mass.shape[:-1]), tuple(kept.shape))
        if lead != tuple(mass.shape[:-1]):
            mass = mass.expand(*lead, mass.shape[-1])
            eligible = None if eligible is None else eligible.expand(*lead, mass.shape[-1])
    x, elig, has_elig, lead, rows = _scores_rows(mass, eligible)
    if kept is None:
        base = np.zeros(rows, np.float64)
    else:
        base = kept.detach().double().expand(lead).reshape(rows).contiguous().numpy()
    out_idx = np.full((rows, cap), -1, np.int32)
    out_cnt = np.zeros(rows, np.int32)
    _top_p_rows(
        x,
        elig,
        has_elig,
        base,
        float(target),
        cap,
        *_extremes(mass.dtype),
        _scratch(x),
        out_idx,
        out_cnt,
    )
    return torch.from_numpy(out_idx).view(*lead, cap), torch.from_numpy(out_cnt).view(lead)


def warm_up() -> None:
    """Compile the kernels for float32 and float64 scores, with and without an eligibility
    mask, on both branches of the selection (the first call of each otherwise compiles it)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.arange(16, dtype=dtype).view(1, 16)
        ok = x > 2
        for k in (2, 16):
            topk_indices_numba(x, k, ok)
            topk_indices_numba(x, k)
            top_p_indices_numba(x, 0.1, k, ok, x[:, 0])
