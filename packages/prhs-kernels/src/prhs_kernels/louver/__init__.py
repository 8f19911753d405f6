"""Louver's cluster index: balanced clusters of keys, per-subspace centres and radii, and the
upper bound of every logit of a cluster (:mod:`.reference` states the construction and the
bound). The torch reference is the only path so far."""

from __future__ import annotations

from prhs_kernels.louver.reference import (
    RADIUS_SLACK,
    balanced_clusters,
    cluster_bounds,
    cluster_upper_bounds,
)

__all__ = ["RADIUS_SLACK", "balanced_clusters", "cluster_bounds", "cluster_upper_bounds"]
