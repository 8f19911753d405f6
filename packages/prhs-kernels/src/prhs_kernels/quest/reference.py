"""Torch references of Quest's step: the page scores (the logit upper bound of every page from
its key minimum and maximum, the group's bound, and ``-inf`` where Quest may not pick a page)
and the selection (the top pages by score between the windows).

Readable and exact: the Triton kernel of :mod:`prhs_kernels.quest.triton` is tested against it,
and the ``quest`` selector runs it wherever the kernel does not apply.
"""

from __future__ import annotations

import torch

from prhs_kernels.cis.reference import block_eligible_reference
from prhs_kernels.compose import union_indices
from prhs_kernels.compose.reference import window_indices_reference
from prhs_kernels.kv.reference import written_rows
from prhs_kernels.score.reference import nonfinite_rows
from prhs_kernels.topk import topk_indices

__all__ = [
    "fold_page_bounds_reference",
    "page_bounds",
    "quest_page_scores_reference",
    "quest_select_reference",
    "written_rows",
]


def page_bounds(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Quest's upper bound of every logit in each page, per query head.

    ``scaling · Σ_j max(q_j·max_j, q_j·min_j)``: each term bounds ``q_j·k_j`` for every key of
    the page, as ``k_j ∈ [min_j, max_j]``.

    Parameters
    ----------
    query:
        ``[B, Hkv, g, D]`` float32.
    kmin, kmax:
        ``[B, Hkv, P, D]`` float32 element-wise key minimum and maximum of each page (finite).
    scaling:
        Logit scale.

    Returns
    -------
    ``[B, Hkv, g, P]`` float32 bounds.
    """
    # q_j·max_j when q_j >= 0, q_j·min_j when q_j < 0: two matmuls instead of a [.., P, D] max.
    pos, neg = query.clamp(min=0), query.clamp(max=0)
    bound = torch.einsum("bhgd,bhpd->bhgp", pos, kmax) + torch.einsum("bhgd,bhpd->bhgp", neg, kmin)
    return bound * scaling


def quest_page_scores_reference(
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
    """``[B, Hkv, P]`` float32: the score Quest's top-k ranks page ``j`` of row ``b`` by.

    The group's bound: the largest :func:`page_bounds` over the ``g`` query heads of KV head
    ``h`` (an upper bound of every logit of every head of the group in the page), from the
    page's key minimum and maximum ``kmin[pages[b, j], h]`` / ``kmax[pages[b, j], h]``
    (``[R, Hkv, D]`` side-cache fields of one layer, any float dtype, read as float32). A NaN
    bound (a page no finite key was folded into: ``kmin = +inf``, ``kmax = -inf``) stays NaN.

    ``-inf`` where Quest may not pick the page: the page does not exist
    (``j · page_size >= seq_lens[b]``), holds one of the first ``n_sink`` or last ``n_local``
    positions, or the row is ``bad`` (``None``: its group's queries hold a NaN or an
    infinity). ``pages[b, j]`` is read only where the page exists.
    """
    b, hq, d = query.shape
    hkv = kmin.shape[1]
    n_pages = pages.shape[1]
    first = torch.arange(n_pages, device=pages.device) * page_size
    exists = first.view(1, -1) < seq_lens.long().view(-1, 1)  # [B, P]
    rows = torch.where(exists, pages.long(), 0)
    keep = exists[:, None, :, None]
    lo = kmin[rows].transpose(1, 2).float()  # [B, Hkv, P, D]
    hi = kmax[rows].transpose(1, 2).float()
    q = query.reshape(b, hkv, hq // hkv, d).float()
    bound = page_bounds(q, torch.where(keep, lo, 0.0), torch.where(keep, hi, 0.0), scaling)
    bound = bound.amax(2)  # [B, Hkv, P]: the group's bound
    if bad is None:
        bad = nonfinite_rows(query, hkv)
    ok = block_eligible_reference(seq_lens, n_pages, page_size, n_sink, n_local)
    ok = ok.unsqueeze(1) & ~bad.unsqueeze(-1)
    return bound.masked_fill(~ok, float("-inf"))


def quest_select_reference(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    bad: torch.Tensor,
    k: int,
    page_size: int,
    n_sink: int,
    n_local: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
) -> None:
    """Quest's selection of every row into ``out_indices [B, Hkv, W]`` / ``out_counts [B, Hkv]``
    (int32): the pages holding the first ``n_sink`` and last ``n_local`` positions, and the
    ``k`` pages of largest ``scores [B, Hkv, P]`` among those Quest may pick (they exist, hold
    no window position, and the row is not ``bad``; NaN and ``-inf`` scores of such pages rank
    last but count). Ascending and distinct, ``-1`` past the count. Ties: any of the tied pages
    (:func:`prhs_kernels.topk.topk_indices`)."""
    n_pages = scores.shape[-1]
    ok = block_eligible_reference(seq_lens, n_pages, page_size, n_sink, n_local)
    ok = (ok.unsqueeze(1) & ~bad.unsqueeze(-1)).expand_as(scores)
    top, _ = topk_indices(scores, k, ok)
    sink, local = window_indices_reference(seq_lens, n_sink, n_local, page_size)
    n_blocks = (seq_lens + (page_size - 1)) // page_size
    union_indices([sink, top, local], n_blocks, out_indices, out_counts)


def fold_page_bounds_reference(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    locations: torch.Tensor,
    key: torch.Tensor,
    page_size: int,
    columns: torch.Tensor | None = None,
    finite: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
) -> None:
    """Fold written keys into the page minima and maxima ``kmin`` / ``kmax`` ``[R, Hkv, D]``
    (page row ``location // page_size``; the last row, ``R - 1``, is scratch).

    A page whose first location is written is reset first (so nothing of an earlier sequence
    survives its reuse); then every written row whose key is finite folds in. A non-finite key
    still resets its page but is not folded in. ``finite [N]`` bool gives which keys are finite;
    ``None``: found here (a row is finite when its whole ``[Hkv, D]`` key is), and the written
    rows that are not are counted into ``nonfinite`` when given. Exact in the fields' dtype.
    Rows that are not written (:func:`written_rows`) go to the scratch row.
    """
    written, rows = written_rows(locations, key, columns)
    if finite is None:
        finite = torch.isfinite(rows).flatten(1).all(-1)
        if nonfinite is not None:
            nonfinite.add_((~finite & written).sum())
    scratch = kmin.shape[0] - 1
    loc = locations.long()
    page = torch.where(written, loc // page_size, scratch)
    first = torch.where(written & (loc % page_size == 0), page, scratch)
    kmin.index_fill_(0, first, float("inf"))
    kmax.index_fill_(0, first, float("-inf"))
    k = rows.to(kmin.dtype)
    at = torch.where(finite & written, page, scratch).view(-1, 1, 1).expand_as(k)
    kmin.scatter_reduce_(0, at, k, "amin", include_self=True)
    kmax.scatter_reduce_(0, at, k, "amax", include_self=True)
