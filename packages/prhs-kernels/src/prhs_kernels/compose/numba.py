"""Numba (CPU) paths of the list algebra: the union of index lists and dilation.

Same outputs as :mod:`prhs_kernels.compose.reference`, bit for bit (ids, ``-1`` padding, counts,
dtypes and shapes). The torch references sort the concatenated lists twice per row; here each
``(sequence, head)`` row gathers its in-range ids and either marks them in a byte map over their
span (dense rows) or sorts them (sparse rows), then writes the distinct ids ascending and stops
at the output's width.

Importing this module imports Numba; :mod:`prhs_kernels.compose` imports it only when the Numba
path runs. The kernels compile at the first call for each index dtype, and the compiled code
is cached on disk (:mod:`prhs_kernels._jit`), so later processes load it; :func:`warm_up`
compiles or loads them for int32 and int64 ids (4–6 s to compile on the shared 2-core CPU of
the measurements, Numba's import and first-use set-up included); call it before serving to
keep that out of a decode step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from prhs_kernels._jit import njit

__all__ = ["dilate_indices_numba", "union_indices_numba", "warm_up"]

_INDEX_DTYPES = (torch.int32, torch.int64)


@njit
def _union_rows(head, shared, limit, out_idx, out_cnt):
    """``out_idx [B, H, K]`` / ``out_cnt [B, H]`` (``out_idx`` filled with ``-1``): the distinct
    ids in ``[0, limit[b])`` of ``head [B, H, w1]`` and ``shared [B, w2]``, ascending."""
    b, h, width = out_idx.shape
    w1 = head.shape[2]
    w2 = shared.shape[1]
    buf = np.empty(w1 + w2, np.int64)
    for i in range(b):
        lim = limit[i]
        for hh in range(h):
            n = 0
            lo = lim
            hi = np.int64(-1)
            for j in range(w1):
                v = np.int64(head[i, hh, j])
                if v >= 0 and v < lim:
                    buf[n] = v
                    n += 1
                    lo = min(lo, v)
                    hi = max(hi, v)
            for j in range(w2):
                v = np.int64(shared[i, j])
                if v >= 0 and v < lim:
                    buf[n] = v
                    n += 1
                    lo = min(lo, v)
                    hi = max(hi, v)
            if n == 0 or width == 0:
                continue
            c = 0
            span = hi - lo + 1
            if span <= 4 * n + 64:  # dense: a byte map over [lo, hi]
                seen = np.zeros(span, np.uint8)
                for j in range(n):
                    seen[buf[j] - lo] = 1
                for u in range(span):
                    if seen[u]:
                        out_idx[i, hh, c] = lo + u
                        c += 1
                        if c == width:
                            break
            else:  # sparse: sort, then skip repeats
                vals = np.sort(buf[:n])
                prev = np.int64(-1)
                for j in range(n):
                    v = vals[j]
                    if v != prev:
                        out_idx[i, hh, c] = v
                        c += 1
                        prev = v
                        if c == width:
                            break
            out_cnt[i, hh] = c


@njit
def _dilate_rows(idx, cnt, m, r, out):
    """``out [R, 2·r·m]`` (filled with ``-1``): ``p ± j`` around the first ``min(m, cnt)``
    non-negative entries ``p`` of each row of ``idx [R, M]``."""
    rows, width = idx.shape
    mm = min(m, width)
    for row in range(rows):
        c = min(cnt[row], np.int64(mm))
        for e in range(c):
            p = np.int64(idx[row, e])
            if p < 0:
                continue
            base = e * 2 * r
            for j in range(1, r + 1):
                out[row, base + j - 1] = p + j
                if p - j >= 0:
                    out[row, base + r + j - 1] = p - j


def _index_array(t: torch.Tensor, *, contiguous: bool = True) -> np.ndarray:
    """A NumPy view (or copy) of an integer tensor: int32 and int64 kept, any other integer
    dtype widened to int64 as the references' ``.long()`` does."""
    if t.dtype not in _INDEX_DTYPES:
        t = t.long()
    t = t.detach()
    return (t.contiguous() if contiguous else t).numpy()


def _cat_index(arrays: list[np.ndarray], shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """``arrays`` broadcast to ``[*shape, w_i]`` and concatenated along the last dim as
    ``dtype`` (C-contiguous)."""
    if not arrays:
        return np.empty((*shape, 0), dtype)
    if len(arrays) == 1 and arrays[0].shape[:-1] == shape:
        return np.ascontiguousarray(arrays[0], dtype)
    parts = [np.broadcast_to(a, (*shape, a.shape[-1])) for a in arrays]
    return np.concatenate(parts, axis=-1, dtype=dtype)


def union_indices_numba(
    parts: Sequence[torch.Tensor], limit: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~prhs_kernels.compose.reference.union_indices_reference` on the CPU, with Numba."""
    b = limit.shape[0]
    h = max((p.shape[1] for p in parts if p.ndim == 3), default=1)
    # int32 ids stay int32 (the common case); any other integer dtype is read as int64.
    dtype = np.int32 if all(p.dtype == torch.int32 for p in parts) else np.int64
    arrays = [_index_array(p, contiguous=False) for p in parts]
    head = _cat_index([a for a in arrays if a.ndim == 3], (b, h), dtype)
    shared = _cat_index([a for a in arrays if a.ndim != 3], (b,), dtype)
    lim = _index_array(limit, contiguous=False).astype(np.int64)
    out_idx = np.full((b, h, width), -1, np.int32)
    out_cnt = np.zeros((b, h), np.int32)
    _union_rows(head, shared, lim, out_idx, out_cnt)
    return torch.from_numpy(out_idx), torch.from_numpy(out_cnt)


def dilate_indices_numba(
    indices: torch.Tensor, counts: torch.Tensor, m: int, r: int
) -> torch.Tensor:
    """:func:`~prhs_kernels.compose.reference.dilate_indices_reference` on the CPU, with Numba."""
    if m <= 0 or r <= 0:
        return indices.new_full((*indices.shape[:-1], 0), -1)
    lead = tuple(indices.shape[:-1])
    if tuple(counts.shape) != lead:  # counts that broadcast (the reference broadcasts them)
        lead = torch.broadcast_shapes(lead, tuple(counts.shape))
        indices = indices.expand(*lead, indices.shape[-1])
        counts = counts.expand(lead)
    rows, width = math.prod(lead), indices.shape[-1]
    idx = _index_array(indices.reshape(rows, width))
    cnt = counts.detach().reshape(rows).numpy().astype(np.int64)
    out = np.full((idx.shape[0], 2 * r * m), -1, np.int32)
    _dilate_rows(idx, cnt, m, r, out)
    return torch.from_numpy(out).view(*lead, 2 * r * m)


def warm_up() -> None:
    """Compile the kernels for int32 and int64 ids (the first call of each otherwise compiles
    it)."""
    for dtype in _INDEX_DTYPES:
        ids = torch.tensor([[3, -1, 1, 3]], dtype=dtype)
        cnt = torch.tensor([2], dtype=dtype)
        union_indices_numba([ids, ids.unsqueeze(1)], cnt, 4)
        union_indices_numba([ids.unsqueeze(1)], cnt, 4)
        dilate_indices_numba(ids, cnt, 2, 1)
