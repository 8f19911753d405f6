"""Torch reference of Louver's index: balanced clusters of keys, per-subspace centres and radii,
and the upper bound of every logit in a cluster.

Clusters are formed within groups of ``P`` keys (a page) by a balanced principal-axis tree: a
group is split at the median of its keys' projections on their first principal axis (a few
power iterations from a fixed start), and each half again, until groups of ``cluster_size``
remain. Every step has static shapes (all groups of a level have the same size), so a batch of
pages is clustered at once without reading a value on the host.

For a cluster with centre ``c`` and radius ``ρ_s = max_{k} ‖k_s − c_s‖`` in each of ``S``
channel subspaces, Cauchy–Schwarz in each subspace gives, for every member ``k``,
``q·k = Σ_s q_s·c_s + q_s·(k_s − c_s) ≤ Σ_s (q_s·c_s + ‖q_s‖·ρ_s)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "balanced_clusters_reference",
    "cluster_bounds",
    "cluster_scores_reference",
    "cluster_upper_bounds",
    "index_pages_reference",
]

POWER_ITERATIONS = 6
RADIUS_SLACK = 1e-5
"""Relative amount added to every stored radius: covers the float32 rounding of the distances
and of the bound, so the bound stays above every member's logit."""


def balanced_clusters_reference(
    keys: torch.Tensor, cluster_size: int = 4, active: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., P]`` int64: a permutation of each group of ``keys [..., P, D]`` in which entries
    ``[c·m, (c+1)·m)`` are the members of cluster ``c`` (``m = cluster_size``; ``P / m`` a power
    of two). ``active [...]`` (bool, optional): the groups to cluster; the others get the
    identity (every group is still computed here, so the shapes stay static)."""
    *lead, p, d = keys.shape
    x = keys.reshape(-1, p, d).float()
    n = x.shape[0]
    perm = torch.arange(p, device=keys.device).expand(n, p).clone()
    groups = 1
    while p // groups > cluster_size:
        m = p // groups
        g = torch.gather(x, 1, perm.unsqueeze(-1).expand(n, p, d)).view(n, groups, m, d)
        centred = g - g.mean(2, keepdim=True)
        axis = centred[:, :, 0] - centred[:, :, -1] + 1e-6  # a fixed, data-derived start
        cov = centred.transpose(-1, -2) @ centred  # [n, G, D, D]
        axis = axis.unsqueeze(-1)
        for _ in range(POWER_ITERATIONS):
            axis = cov @ axis
            axis = axis / axis.norm(dim=-2, keepdim=True).clamp_min(1e-30)
        proj = (centred @ axis).squeeze(-1)
        order = torch.argsort(proj, dim=-1, stable=True)  # lower half, upper half
        perm = torch.gather(perm.view(n, groups, m), 2, order).view(n, p)
        groups *= 2
    if active is not None:
        perm = torch.where(active.reshape(n, 1), perm, torch.arange(p, device=keys.device))
    return perm.view(*lead, p)


def cluster_bounds(
    keys: torch.Tensor, perm: torch.Tensor, subspaces: int, cluster_size: int = 4,
    center_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(centres [..., C, D] in center_dtype, radii [..., C, S] float32)`` of the clusters
    ``perm [..., P]`` of ``keys [..., P, D]``: the centre is the members' mean (rounded to
    ``center_dtype``), the radius in subspace ``s`` (contiguous channel slices of ``D/S``) the
    largest distance of a member to the stored centre there, raised by :data:`RADIUS_SLACK`."""
    *lead, p, d = keys.shape
    c = p // cluster_size
    members = torch.gather(keys.float(), -2, perm.unsqueeze(-1).expand(*lead, p, d))
    members = members.view(*lead, c, cluster_size, d)
    centres = members.mean(-2).to(center_dtype)
    diff = (members - centres.float().unsqueeze(-2)).view(*lead, c, cluster_size, subspaces, -1)
    radii = diff.norm(dim=-1).amax(-2)  # [..., C, S]
    return centres, radii * (1 + RADIUS_SLACK) + RADIUS_SLACK * centres.float().view(
        *lead, c, subspaces, -1
    ).norm(dim=-1)


def cluster_upper_bounds(
    query: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor
) -> torch.Tensor:
    """``[..., g, C]`` float32 ``Σ_s (q_s·c_s + ‖q_s‖·ρ_s)`` for ``query [..., g, D]`` and the
    clusters' ``centres [..., C, D]`` / ``radii [..., C, S]`` (same leading dims)."""
    s = radii.shape[-1]
    q = query.float()
    dot = q @ centres.float().transpose(-1, -2)
    qn = q.view(*q.shape[:-1], s, -1).norm(dim=-1)  # [..., g, S]
    return dot + qn @ radii.transpose(-1, -2)


def cluster_scores_reference(
    query: torch.Tensor,
    centres: torch.Tensor,
    radii: torch.Tensor,
    rows: torch.Tensor,
    threshold: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``[B, Hkv, NP·C]`` float32: for each cluster of each (sequence, KV head), the largest over
    the group's query heads of ``s·ub − threshold``, ``ub`` the cluster's logit upper bound
    (:func:`cluster_upper_bounds`). Non-negative exactly when some query head's bound reaches
    its threshold. ``query [B, Hq, D]``; one layer's index ``centres [R, Hkv, C, D]`` and
    ``radii [R, Hkv, C, S]`` read at the page rows ``rows [B, NP]``; ``threshold [B, Hkv, g]``."""
    b, hq, d = query.shape
    h, c = centres.shape[1], centres.shape[2]
    g = hq // h
    n_pages = rows.shape[1]
    q = query.float().view(b, h, 1, g, d)
    cen = centres[rows].transpose(1, 2)  # [B, Hkv, NP, C, D]
    rad = radii[rows].transpose(1, 2)
    ub = cluster_upper_bounds(q, cen, rad)  # [B, Hkv, NP, g, C]
    ub = ub.transpose(2, 3).reshape(b, h, g, n_pages * c) * scaling
    return (ub - threshold.float().unsqueeze(-1)).amax(2)


def index_pages_reference(
    keys: torch.Tensor,
    rows: torch.Tensor,
    active: torch.Tensor,
    perm: torch.Tensor,
    centres: torch.Tensor,
    radii: torch.Tensor,
    cluster_size: int = 4,
    *,
    clusters: Callable[..., torch.Tensor] | None = None,
) -> None:
    """Cluster the pages ``keys [B, Hkv, NP, P, D]`` (non-finite entries read as 0) and write each
    page's index into one layer's fields at its page row ``rows [B, NP]``: ``perm [R, Hkv, P]``
    (int16, :func:`balanced_clusters_reference`), ``centres [R, Hkv, C, D]`` and ``radii [R, Hkv,
    C, S]`` (float32; :func:`cluster_bounds`, centres rounded to ``centres``' dtype). Sequences
    with ``active [B]`` false write nothing (their rows are read and written back unchanged, so
    the shapes stay static). ``clusters(keys, cluster_size, active)``: the clustering to run
    (default :func:`balanced_clusters_reference`; the launcher passes its CPU kernel)."""
    b, h, n_pages, p, d = keys.shape
    c = p // cluster_size
    s = radii.shape[-1]
    k = keys.float()
    k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
    cluster = balanced_clusters_reference if clusters is None else clusters
    order = cluster(k, cluster_size, active.view(b, 1, 1).expand(b, h, n_pages))
    cen, rad = cluster_bounds(k, order, s, cluster_size, centres.dtype)
    flat = rows.reshape(-1).long()
    on = active.view(b, 1).expand(b, n_pages).reshape(-1, 1, 1)
    # [B, Hkv, NP, ...] -> [(B NP), Hkv, ...]: one row per page.
    new_perm = order.transpose(1, 2).reshape(-1, h, p).to(perm.dtype)
    new_cen = cen.transpose(1, 2).reshape(-1, h, c, d)
    new_rad = rad.transpose(1, 2).reshape(-1, h, c, s)
    perm[flat] = torch.where(on, new_perm, perm[flat])
    centres[flat] = torch.where(on.unsqueeze(-1), new_cen, centres[flat])
    radii[flat] = torch.where(on.unsqueeze(-1), new_rad, radii[flat])
