"""Torch references of top-k and top-p index selection into fixed-width lists.

Tie rule: among equal scores any order is valid, and callers and tests must accept any. The CPU
reference breaks ties toward the lower index (a stable sort); on CUDA ``torch.topk``
is used, whose order among ties is unspecified. NaN scores count as ``-inf``: never preferred to
a finite score. Ineligible entries rank below every eligible one (an eligible ``-inf`` or NaN
included), so a row with ``c`` eligible entries lists exactly those when ``k >= c``.
"""

from __future__ import annotations

import torch

__all__ = [
    "SEED_EDGES",
    "order_keys",
    "seeded_candidates_reference",
    "top_p_indices_reference",
    "topk_indices_reference",
]


def _clean(scores: torch.Tensor, eligible: torch.Tensor | None) -> torch.Tensor:
    x = scores.nan_to_num(nan=float("-inf"))
    return x if eligible is None else x.masked_fill(~eligible, float("-inf"))


def _rank_key(scores: torch.Tensor, eligible: torch.Tensor | None) -> torch.Tensor:
    """Ascending sort key of ``scores``: ``-score`` (NaN scores as ``-inf``), and NaN for
    ineligible entries, which sorts and ``topk`` place after every number. So an ineligible entry
    ranks below an eligible ``-inf`` or NaN score instead of tying with it."""
    y = -scores.nan_to_num(nan=float("-inf"))
    return y if eligible is None else y.masked_fill(~eligible, float("nan"))


def _ascending(y: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` smallest entries of the last dim (NaN last), smallest first."""
    if y.device.type == "cuda":
        return torch.topk(y, k, dim=-1, largest=False, sorted=True).indices
    return torch.sort(y, dim=-1, stable=True).indices[..., :k]


def topk_indices_reference(
    scores: torch.Tensor, k: int, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [..., k] int32, counts [...] int32)``: the ``k`` largest ``scores`` among the
    ``eligible`` entries of the last dim, largest first; rows with fewer eligible entries get
    ``counts < k`` and ``-1`` past the count."""
    n = scores.shape[-1]
    kk = min(k, n)
    x = _rank_key(scores, eligible)
    n_ok = (
        eligible.sum(-1) if eligible is not None else torch.full(x.shape[:-1], n, device=x.device)
    )
    counts = n_ok.clamp(max=kk).to(torch.int32)
    if kk == 0:
        idx = x.new_full((*x.shape[:-1], 0), -1, dtype=torch.int64)
    else:
        idx = _ascending(x, kk)
    rank = torch.arange(kk, device=x.device, dtype=torch.int32)
    idx = torch.where(rank < counts.unsqueeze(-1), idx, -1).to(torch.int32)
    if kk < k:
        idx = torch.nn.functional.pad(idx, (0, k - kk), value=-1)
    return idx, counts


def top_p_indices_reference(
    mass: torch.Tensor,
    target: float,
    cap: int,
    eligible: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [..., cap] int32, counts [...] int32)``: the smallest top set ``S`` of the
    eligible entries (by ``mass``, largest first) with ``1 − kept − Σ_S mass ≤ target``, capped
    at ``cap`` entries and at least one (when one is eligible).

    ``mass [..., N]`` non-negative (probability mass per entry); ``kept [...]`` mass already
    selected outside the candidates (0 when ``None``).
    """
    n = mass.shape[-1]
    x = _clean(mass.double(), eligible)
    order = torch.sort(_rank_key(mass, eligible), dim=-1, stable=True).indices
    sorted_mass = torch.gather(x, -1, order).clamp_min(0)
    base = kept.double().unsqueeze(-1) if kept is not None else 0.0
    dropped_after = 1.0 - base - torch.cumsum(sorted_mass, dim=-1)
    need = 1 + (dropped_after > target).sum(-1)
    n_ok = eligible.sum(-1) if eligible is not None else torch.full_like(need, n)
    counts = torch.minimum(torch.minimum(need, n_ok), torch.full_like(need, min(cap, n)))
    kk = min(cap, n)
    idx = order[..., :kk]
    rank = torch.arange(kk, device=x.device)
    idx = torch.where(rank < counts.unsqueeze(-1), idx, -1).to(torch.int32)
    if kk < cap:
        idx = torch.nn.functional.pad(idx, (0, cap - kk), value=-1)
    return idx, counts.to(torch.int32)


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys of float32 ``x`` whose signed order is the floats' order (NaN as ``-inf``)."""
    bits = x.float().nan_to_num(nan=float("-inf")).contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


SEED_EDGES = 16
"""Thresholds a seeded top-k tries at once (:func:`seeded_candidates_reference`)."""


def seeded_candidates_reference(
    scores: torch.Tensor,
    k: int,
    seed: torch.Tensor,
    capacity: int,
    active: torch.Tensor | None = None,
    whole_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values [..., C] float32, ids [..., C] int32, overflow [...] bool)``, ``C =
    capacity``: the guess-and-verify passes of a seeded top-k.

    Per row of ``scores [..., N]`` (NaN as ``-inf``; scores compared by their order keys,
    :func:`order_keys`): the seed's scores are those at the row's ``seed [..., S]`` ids (ids
    outside ``[0, N)`` ignored). :data:`SEED_EDGES` thresholds are placed evenly in key space
    from the seed's best score down to its ``k``-th best (integer steps, the last exactly the
    ``k``-th best); the highest threshold that at least ``k`` of the row's scores reach is
    chosen, and every score reaching it is a candidate, in position order, the first ``C``
    written with their positions (``-inf`` / ``-1`` after). The lowest threshold is at most
    the row's own ``k``-th best (the seed's ``k`` best are in the row), so one is always
    reached and the candidates hold the row's top ``k`` unless they overflow. ``overflow``
    flags the rows where they do (more than ``C``), where the seed has fewer than ``k``
    finite scores (no threshold) or where fewer than ``k`` scores reach it (a seed id listed
    twice): their top ``k`` needs the whole row. Rows not ``active`` get no candidate and no
    flag. ``whole_rows``: the rows that would be flagged are refined here instead, their
    candidates exactly their top ``min(k, N)`` (ties toward the lower position), in position
    order, and no row is flagged."""
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    e = SEED_EDGES
    x = scores.float().nan_to_num(nan=float("-inf"))
    key = order_keys(x)
    neg = int(order_keys(torch.tensor(float("-inf"))))
    sid = seed.long()
    s_in = (sid >= 0) & (sid < n)
    skey = torch.gather(key, -1, sid.clamp(0, max(n - 1, 0)))
    s_ok = s_in & (skey > neg)
    on = torch.ones(lead, dtype=torch.bool, device=x.device) if active is None else active
    good = on & (s_ok.sum(-1) >= k)
    lowest = torch.iinfo(torch.int32).min
    masked = torch.where(s_ok, skey, lowest).long()
    kk = min(k, masked.shape[-1])
    low = torch.topk(masked, kk, dim=-1).values[..., -1]
    top = masked.max(-1).values
    j = torch.arange(e, device=x.device)
    edges = top.unsqueeze(-1) - torch.div(
        (top - low).unsqueeze(-1) * j, e - 1, rounding_mode="floor"
    )  # [..., E], falling
    total = (key.long().unsqueeze(-1) >= edges.unsqueeze(-2)).sum(-2)  # [..., E], rising
    pick = (total < k).sum(-1).clamp(max=e - 1)
    thr = torch.gather(edges, -1, pick.unsqueeze(-1))
    n_all = torch.gather(total, -1, pick.unsqueeze(-1)).squeeze(-1)
    take = good.unsqueeze(-1) & (key.long() >= thr)
    overflow = on & (~good | (good & ((n_all > capacity) | (n_all < k))))
    if whole_rows:  # the flagged rows' exact top k, ties toward the lower position
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., : min(k, n)]
        top = torch.zeros_like(take).scatter_(-1, order, True)
        take = torch.where(overflow.unsqueeze(-1), top, take)
        overflow = torch.zeros_like(overflow)
    rank = torch.cumsum(take.to(torch.int64), -1) - 1  # each candidate's place, in order
    keep = take & (rank < capacity)
    values = torch.full((*lead, capacity + 1), float("-inf"), device=x.device)
    ids = torch.full((*lead, capacity + 1), -1, dtype=torch.int32, device=x.device)
    at = torch.where(keep, rank, capacity)  # the extra column takes what is not kept
    pos = torch.arange(n, device=x.device, dtype=torch.int32).expand_as(x)
    values.scatter_(-1, at, torch.where(keep, x, float("-inf")))
    ids.scatter_(-1, at, torch.where(keep, pos, -1))
    return values[..., :capacity], ids[..., :capacity], overflow
