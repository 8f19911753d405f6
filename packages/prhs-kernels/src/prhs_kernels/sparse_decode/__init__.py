"""Sparse decode attention: each (sequence, KV head) reads only its selected positions.

The launcher :func:`sparse_decode_attention` checks its inputs and dispatches by device; today
it runs the float32 torch reference everywhere (the Triton and Numba paths come next, tested
against the same reference).
"""

from __future__ import annotations

import torch

from prhs_core.cache import KVCacheView
from prhs_core.protocols import DecodeStep
from prhs_core.selection import Selection
from prhs_kernels.sparse_decode.reference import sparse_decode_attention_reference

__all__ = ["sparse_decode_attention", "sparse_decode_attention_reference"]


def sparse_decode_attention(
    query: torch.Tensor,
    cache: KVCacheView,
    selection: Selection,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, Dv], lse [B, Hq])`` of decode attention restricted to ``selection``.

    Raises ``ValueError`` when the shapes of the query, cache and selection disagree.
    """
    # DecodeStep validates query against the cache (batch, head_dim, GQA multiple, scaling).
    DecodeStep(0, query, cache, torch.zeros(query.shape[0], dtype=torch.long), scaling)
    if selection.indices is not None and tuple(selection.indices.shape[:2]) != (
        cache.batch_size,
        cache.num_kv_heads,
    ):
        raise ValueError(
            f"selection.indices must have shape [B={cache.batch_size}, "
            f"Hkv={cache.num_kv_heads}, K], got {list(selection.indices.shape)}"
        )
    return sparse_decode_attention_reference(query, cache, selection, scaling)
