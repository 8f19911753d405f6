"""Louver's cluster index: balanced clusters of keys, per-subspace centres and radii, and the
upper bound of every logit of a cluster (:mod:`.reference` states the construction and the
bound).

:func:`cluster_scores` is the scan a selection makes: for every cluster of every (sequence, KV
head), the largest over the group's query heads of its scaled bound minus that head's
threshold, from one layer's index read at each page's row. Its path (:func:`louver_path`):
``"triton"`` on CUDA for fp16/bf16 caches (one launch reading each centre and its radii once,
float32 products, :mod:`.triton`), ``"triton-interpreter"`` on the CPU under
``TRITON_INTERPRET=1``, else ``"torch"`` (the rows gathered).

:func:`balanced_clusters` builds the index's clusters. On the CPU it runs a Numba kernel
(:mod:`.numba`, chosen by :func:`~prhs_kernels.paths.numba_path`; ``PRHS_KERNELS=torch`` keeps
the reference) that skips the groups a step does not index; elsewhere the torch reference,
which clusters every group so that its shapes stay static.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from prhs_core.checks import (
    check_bool_mask,
    check_device,
    check_float_tensor,
    check_int,
    shape_str,
)
from prhs_kernels.louver.reference import (
    POWER_ITERATIONS,
    RADIUS_SLACK,
    balanced_clusters_reference,
    cluster_bounds,
    cluster_scores_reference,
    cluster_upper_bounds,
    index_pages_reference,
)
from prhs_kernels.paths import announce, kernel_path, numba_path

__all__ = [
    "RADIUS_SLACK",
    "balanced_clusters",
    "balanced_clusters_reference",
    "cluster_bounds",
    "cluster_scores",
    "cluster_scores_reference",
    "cluster_upper_bounds",
    "index_pages",
    "index_pages_reference",
    "louver_path",
]


@functools.cache
def _numba() -> ModuleType:
    """The Numba kernel, imported and compiled at its first use."""
    from prhs_kernels.louver import numba as kernels

    kernels.warm_up()
    return kernels


def balanced_clusters(
    keys: torch.Tensor, cluster_size: int = 4, active: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., P]`` int64: a permutation of each group of ``keys [..., P, D]`` in which entries
    ``[c·m, (c+1)·m)`` are the members of cluster ``c`` (``m = cluster_size``; ``P / m`` a power
    of two), split at the median of the principal axis level by level
    (:func:`~prhs_kernels.louver.reference.balanced_clusters_reference`). ``active [...]``
    (bool, optional): the groups to cluster; the others get the identity permutation."""
    check_float_tensor("keys", keys, min_ndim=2)
    check_int("cluster_size", cluster_size, minimum=1)
    *lead, p, _ = keys.shape
    groups = p // cluster_size
    if p % cluster_size or groups & (groups - 1):
        raise ValueError(
            f"the group size P={p} must be cluster_size ({cluster_size}) times a power of two"
        )
    if active is not None:
        check_bool_mask("active", active, lead)
        check_device(("keys", "active"), (keys, active))
    if numba_path(keys.device):
        announce("balanced_clusters", "numba", keys.device)
        return _numba().balanced_clusters_numba(keys, cluster_size, active)
    return balanced_clusters_reference(keys, cluster_size, active)


def louver_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path :func:`cluster_scores` takes for a KV cache of ``dtype`` on ``device``."""
    return kernel_path(device, dtype)


def cluster_scores(
    query: torch.Tensor,
    centres: torch.Tensor,
    radii: torch.Tensor,
    rows: torch.Tensor,
    threshold: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``[B, Hkv, NP·C]`` float32: cluster ``p·C + j`` (cluster ``j`` of page ``p``) scores
    ``max_g (s·ub_g − threshold_g)``, ``ub_g`` query head ``g``'s bound of every logit in the
    cluster; ``>= 0`` exactly when some head's bound reaches its threshold.

    ``query [B, Hq, D]`` in the cache dtype; one layer's index ``centres [R, Hkv, C, D]`` (the
    cache dtype) and ``radii [R, Hkv, C, S]`` float32, strided views read in place;
    ``rows [B, NP]`` integer page rows (every entry in ``[0, R)``: pages that are not indexed
    get a score too, mask them after); ``threshold [B, Hkv, g]``. ``S`` must divide ``D``."""
    check_float_tensor("query", query, ndim=3)
    check_float_tensor("centres", centres, ndim=4)
    check_float_tensor("radii", radii, ndim=4)
    check_float_tensor("threshold", threshold, ndim=3)
    b, hq, d = query.shape
    r, h, c, dc = centres.shape
    s = radii.shape[-1]
    if h < 1 or hq % h or dc != d:
        raise ValueError(
            f"centres [R, Hkv, C, D] = {shape_str(centres)} must have the query's D={d} and a "
            f"number of KV heads dividing its {hq} heads"
        )
    if tuple(radii.shape[:3]) != (r, h, c) or s < 1 or d % s:
        raise ValueError(
            f"radii must be [R={r}, Hkv={h}, C={c}, S] with S dividing D={d}, got "
            f"{shape_str(radii)}"
        )
    if centres.stride(-1) != 1 or radii.stride(-1) != 1:
        raise ValueError("centres and radii must have a contiguous last dim")
    if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64):
        raise TypeError("rows must be an int32 or int64 tensor [B, NP] of page rows")
    if rows.ndim != 2 or rows.shape[0] != b:
        raise ValueError(f"rows must be [B={b}, NP], got {shape_str(rows)}")
    if tuple(threshold.shape) != (b, h, hq // h):
        raise ValueError(
            f"threshold must be [B={b}, Hkv={h}, g={hq // h}], got {shape_str(threshold)}"
        )
    check_device(
        ("query", "centres", "radii", "rows", "threshold"),
        (query, centres, radii, rows, threshold),
    )
    path = louver_path(query.device, query.dtype)
    announce("cluster_scores", path, query.device)
    args = (query, centres, radii, rows, threshold, float(scaling))
    if path.startswith("triton"):
        from prhs_kernels.louver.triton import cluster_scores_triton

        return cluster_scores_triton(*args)
    return cluster_scores_reference(*args)


def index_pages(
    keys: torch.Tensor,
    rows: torch.Tensor,
    active: torch.Tensor,
    perm: torch.Tensor,
    centres: torch.Tensor,
    radii: torch.Tensor,
    cluster_size: int = 4,
) -> None:
    """Build the index of the pages ``keys [B, Hkv, NP, P, D]`` (non-finite entries read as 0)
    and write it into one layer's fields at each page's row ``rows [B, NP]``: the clustering
    permutation ``perm [R, Hkv, P]`` (int16, :func:`balanced_clusters`), the centres
    ``centres [R, Hkv, C, D]`` (the members' mean, rounded to its dtype) and the radii
    ``radii [R, Hkv, C, S]`` float32 (:func:`cluster_bounds`). A sequence whose ``active [B]``
    flag is false writes nothing.

    Path (:func:`louver_path` of the keys): on CUDA for fp16/bf16 keys, one Triton launch, a
    program per page, that returns at once for a sequence that is not active (a decode step
    indexes a full buffer once in ``buffer`` steps, so the others cost a launch); elsewhere
    :func:`index_pages_reference`, whose clustering is the Numba kernel on the CPU."""
    check_float_tensor("keys", keys, ndim=5)
    check_int("cluster_size", cluster_size, minimum=1)
    b, h, n_pages, p, d = keys.shape
    c = p // cluster_size
    if p % cluster_size or c & (c - 1):
        raise ValueError(
            f"the page size P={p} must be cluster_size ({cluster_size}) times a power of two"
        )
    if p > 1 << 15:
        raise ValueError(f"pages of at most 32768 positions are indexed, got P={p}")
    if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64):
        raise TypeError("rows must be an int32 or int64 tensor [B, NP] of page rows")
    if tuple(rows.shape) != (b, n_pages):
        raise ValueError(f"rows must be [B={b}, NP={n_pages}], got {shape_str(rows)}")
    check_bool_mask("active", active, (b,))
    check_float_tensor("centres", centres, ndim=4)
    check_float_tensor("radii", radii, ndim=4)
    if not isinstance(perm, torch.Tensor) or perm.dtype != torch.int16 or perm.ndim != 3:
        raise TypeError(f"perm must be an int16 tensor [R, Hkv, P], got {shape_str(perm)}")
    r = perm.shape[0]
    if tuple(perm.shape) != (r, h, p):
        raise ValueError(f"perm must be [R, Hkv={h}, P={p}], got {shape_str(perm)}")
    if tuple(centres.shape) != (r, h, c, d):
        raise ValueError(
            f"centres must be [R={r}, Hkv={h}, C={c}, D={d}], got {shape_str(centres)}"
        )
    s = radii.shape[-1]
    if tuple(radii.shape[:3]) != (r, h, c) or s < 1 or d % s or radii.dtype != torch.float32:
        raise ValueError(
            f"radii must be float32 [R={r}, Hkv={h}, C={c}, S] with S dividing D={d}, got "
            f"{shape_str(radii)} {radii.dtype}"
        )
    if keys.stride(-1) != 1 or any(t.stride(-1) != 1 for t in (perm, centres, radii)):
        raise ValueError("keys, perm, centres and radii must have a contiguous last dim")
    check_device(
        ("keys", "rows", "active", "perm", "centres", "radii"),
        (keys, rows, active, perm, centres, radii),
    )
    path = louver_path(keys.device, keys.dtype)
    announce("index_pages", path, keys.device)
    if path.startswith("triton"):
        from prhs_kernels.louver.triton import index_pages_triton

        index_pages_triton(
            keys, rows, active, perm, centres, radii, cluster_size, RADIUS_SLACK, POWER_ITERATIONS
        )
        return
    index_pages_reference(
        keys, rows, active, perm, centres, radii, cluster_size, clusters=balanced_clusters
    )
