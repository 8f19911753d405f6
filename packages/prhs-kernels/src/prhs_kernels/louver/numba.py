"""Numba (CPU) path of Louver's index build: the balanced principal-axis clustering of
:func:`~prhs_kernels.louver.reference.balanced_clusters_reference`.

The same construction: a group is split at the median of its members' projections on the
first principal axis (``POWER_ITERATIONS`` power iterations of the covariance from the fixed
start ``centred[0] − centred[-1] + 1e-6``, normalised with the same floor), the lower half
first in a stable order, and each half again, down to ``cluster_size`` members. Two
differences, both in how it computes, not what:

- the covariance is never formed: each power iteration is ``Cᵀ(C·v)`` for the centred members
  ``C`` (``2·m·D`` products instead of ``m·D²``), in float64;
- groups whose ``active`` flag is false are not clustered: their permutation is the identity,
  as the reference writes for them. A decode step indexes a full buffer at one step in
  ``buffer``, so the build costs nothing at the others.

In float64 the projections are more precise than the reference's float32 ones, so a split can
differ from the reference's where two members' projections agree to within float32 rounding
(duplicates tie exactly in both and keep their order). The clusters are as tight (the tests
compare radii), and every bound built on them holds for any permutation.

Importing this module imports Numba; :mod:`prhs_kernels.louver` imports it only when the Numba
path runs. The kernel compiles at its first call (cached on disk for later processes:
:mod:`prhs_kernels._jit`); :func:`warm_up` does it up front.
"""

from __future__ import annotations

import numpy as np
import torch

from prhs_kernels._jit import njit
from prhs_kernels.louver.reference import POWER_ITERATIONS

__all__ = ["balanced_clusters_numba", "warm_up"]


@njit
def _split(x, perm, lo, m, centred, axis, tmp, proj, order, scratch, iterations):
    """Reorder ``perm[lo : lo + m]`` (indices into ``x [P, D]``) so the members whose
    projections on the group's principal axis (``iterations`` power iterations) are smallest
    come first (stable)."""
    d = x.shape[1]
    for j in range(d):
        axis[j] = 0.0
    for i in range(m):
        row = perm[lo + i]
        for j in range(d):
            axis[j] += x[row, j]
    for j in range(d):
        axis[j] /= m
    for i in range(m):
        row = perm[lo + i]
        for j in range(d):
            centred[i, j] = x[row, j] - axis[j]
    for j in range(d):
        axis[j] = centred[0, j] - centred[m - 1, j] + 1e-6
    for _ in range(iterations):
        for i in range(m):  # proj = C·v
            acc = 0.0
            for j in range(d):
                acc += centred[i, j] * axis[j]
            proj[i] = acc
        for j in range(d):
            tmp[j] = 0.0
        for i in range(m):  # tmp = Cᵀ·proj
            p = proj[i]
            for j in range(d):
                tmp[j] += centred[i, j] * p
        norm = 0.0
        for j in range(d):
            norm += tmp[j] * tmp[j]
        norm = max(np.sqrt(norm), 1e-30)
        for j in range(d):
            axis[j] = tmp[j] / norm
    for i in range(m):
        acc = 0.0
        for j in range(d):
            acc += centred[i, j] * axis[j]
        proj[i] = acc
    order[:m] = np.argsort(proj[:m], kind="mergesort")
    for i in range(m):
        scratch[i] = perm[lo + order[i]]
    for i in range(m):
        perm[lo + i] = scratch[i]


@njit
def _cluster_groups(x, active, cluster_size, iterations, out):
    """``out [N, P]``: the clustering permutation of each group ``x [N, P, D]`` (the identity
    where ``active`` is false)."""
    n, p, d = x.shape
    centred = np.empty((p, d), np.float64)
    axis = np.empty(d, np.float64)
    tmp = np.empty(d, np.float64)
    proj = np.empty(p, np.float64)
    order = np.empty(p, np.int64)
    scratch = np.empty(p, np.int64)
    for g in range(n):
        perm = out[g]
        for i in range(p):
            perm[i] = i
        if not active[g]:
            continue
        groups = 1
        while p // groups > cluster_size:
            m = p // groups
            for k in range(groups):
                _split(x[g], perm, k * m, m, centred, axis, tmp, proj, order, scratch, iterations)
            groups *= 2


def balanced_clusters_numba(
    keys: torch.Tensor, cluster_size: int, active: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`~prhs_kernels.louver.reference.balanced_clusters_reference` on the CPU, with
    Numba (``active [...]``: which groups to cluster; the others get the identity)."""
    *lead, p, d = keys.shape
    x = keys.detach().reshape(-1, p, d).to(torch.float64).contiguous().numpy()
    n = x.shape[0]
    if active is None:
        flags = np.ones(n, np.bool_)
    else:
        flags = active.detach().reshape(-1).to(torch.bool).contiguous().numpy()
    out = np.empty((n, p), np.int64)
    _cluster_groups(x, flags, cluster_size, POWER_ITERATIONS, out)
    return torch.from_numpy(out).view(*lead, p).to(keys.device)


def warm_up() -> None:
    """Compile the kernel now (about a second), not at the first decode step."""
    keys = torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(0))
    balanced_clusters_numba(keys, 4, torch.tensor([True, False]))
