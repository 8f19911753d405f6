"""Torch references of top-k and top-p index selection into fixed-width lists.

Tie rule: among equal scores any order is valid, and callers and tests must accept any. The CPU
reference breaks ties toward the lower index (a stable sort); on CUDA ``torch.topk``
is used, whose order among ties is unspecified. NaN scores count as ``-inf``: never preferred to
a finite score. Ineligible entries rank below every eligible one (an eligible ``-inf`` or NaN
included), so a row with ``c`` eligible entries lists exactly those when ``k >= c``.
"""

from __future__ import annotations

import torch

__all__ = ["top_p_indices_reference", "topk_indices_reference"]


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
