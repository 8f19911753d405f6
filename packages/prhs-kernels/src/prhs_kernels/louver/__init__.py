"""Louver's cluster index: balanced clusters of keys, per-subspace centres and radii, and the
upper bound of every logit of a cluster (:mod:`.reference` states the construction and the
bound).

:func:`cluster_scores` is the scan a selection makes: for every cluster of every (sequence, KV
head), the largest over the group's query heads of its scaled bound minus that head's
threshold, from one layer's index read at each page's row. Its path (:func:`louver_path`):
``"triton"`` on CUDA for fp16/bf16 caches (one launch reading each centre and its radii once,
float32 products, :mod:`.triton`), ``"triton-interpreter"`` on the CPU under
``TRITON_INTERPRET=1``, else ``"torch"`` (the rows gathered). Building the index (clustering)
stays a torch op.
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_device, check_float_tensor, shape_str
from prhs_kernels.louver.reference import (
    RADIUS_SLACK,
    balanced_clusters,
    cluster_bounds,
    cluster_scores_reference,
    cluster_upper_bounds,
)
from prhs_kernels.paths import announce, kernel_path

__all__ = [
    "RADIUS_SLACK",
    "balanced_clusters",
    "cluster_bounds",
    "cluster_scores",
    "cluster_scores_reference",
    "cluster_upper_bounds",
    "louver_path",
]


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
