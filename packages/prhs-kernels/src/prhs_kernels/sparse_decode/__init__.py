"""Sparse decode attention: each (sequence, KV head) reads only its selected positions.

The launcher :func:`sparse_decode_attention` checks its inputs and dispatches by device: on CUDA
with a half-precision cache, two ``bmm`` with float32 accumulation (:mod:`.cuda`); elsewhere the
float32 torch reference. The Triton and Numba kernels come next, tested against the same
reference.
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_shape
from prhs_core.layout import KVLayout
from prhs_core.selection import Selection
from prhs_kernels.score import check_query
from prhs_kernels.sparse_decode.cuda import sparse_decode_attention_bmm, supports_bmm
from prhs_kernels.sparse_decode.reference import (
    dense_positions,
    sparse_decode_attention_reference,
)

__all__ = ["dense_positions", "sparse_decode_attention", "sparse_decode_attention_reference"]


def sparse_decode_attention(
    query: torch.Tensor,
    kv: KVLayout,
    selection: Selection | None,
    scaling: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, Dv], lse [B, Hq])`` of decode attention restricted to ``selection``
    (``None``: every cached position). Entries past a row's count, and positions past a
    sequence's end, are not read. ``out`` / ``lse`` are written in place when given.

    Raises ``TypeError`` / ``ValueError`` when the query, cache and selection disagree (shapes,
    dtypes, devices).
    """
    check_query(query, kv)
    if selection is not None:
        if not isinstance(selection, Selection):
            raise TypeError(
                f"selection must be a Selection or None, got {type(selection).__name__}"
            )
        check_shape(
            "selection.indices",
            selection.indices,
            (kv.batch_size, kv.num_kv_heads, None),
            "[B, Hkv, K_max]",
        )
    b, hq, _ = query.shape
    if out is not None:
        check_shape("out", out, (b, hq, kv.value_dim), "[B, Hq, Dv]")
    if lse is not None:
        check_shape("lse", lse, (b, hq), "[B, Hq]")
    if supports_bmm(query, kv):
        o, s = sparse_decode_attention_bmm(query, kv, selection, scaling)
    else:
        o, s = sparse_decode_attention_reference(query, kv, selection, scaling)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(s)
        s = lse
    return o, s
