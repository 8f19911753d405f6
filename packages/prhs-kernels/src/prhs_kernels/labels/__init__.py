"""Double Sparsity's proxy: approximate logits from ``r`` label channels of every cached key.

:func:`label_logits` reads, of each key row, only the channels its KV head's labels name, and
multiplies them with the same channels of the query. The torch reference is the only path for
now: it gathers the label channels a chunk of positions at a time (static shapes, no host read).
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_device, check_index_tensor, shape_str
from prhs_core.layout import KVLayout
from prhs_kernels.labels.reference import label_logits_reference
from prhs_kernels.paths import announce
from prhs_kernels.score import check_query

__all__ = ["label_logits", "label_logits_reference"]


def label_logits(
    query: torch.Tensor, kv: KVLayout, labels: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 logits ``scaling · Σ_{j ∈ L} q_j·k_j`` over the label channels
    ``L`` of each (sequence, KV head), for every position ``t < T = kv.max_len`` (``-inf`` past
    each sequence's end).

    ``query [B, Hq, D]`` in the cache dtype; ``labels [B, Hkv, r]`` integer channel ids in
    ``[0, D)`` (``1 <= r <= D``), on the query's device. Ids are not range-checked on the device
    (that would be a host read): an id outside ``[0, D)`` raises in the gather.
    """
    check_query(query, kv)
    check_index_tensor("labels", labels, ndim=3)
    b, h, d = query.shape[0], kv.num_kv_heads, kv.head_dim
    if tuple(labels.shape[:2]) != (b, h) or not 1 <= labels.shape[2] <= d:
        raise ValueError(
            f"labels must be [B={b}, Hkv={h}, r] with 1 <= r <= D={d}, got {shape_str(labels)}"
        )
    check_device(("query", "labels"), (query, labels))
    announce("label_logits", "torch", query.device)
    return label_logits_reference(query, kv, labels.long(), scaling)
