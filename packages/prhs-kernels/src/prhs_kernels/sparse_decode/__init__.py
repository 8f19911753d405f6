"""Sparse decode attention: each (sequence, KV head) reads only its selected positions.

The launcher :func:`sparse_decode_attention` checks its inputs and takes the path
:func:`sparse_decode_path` names:

- ``"triton"``: on CUDA with an fp16/bf16 cache, the split-K kernel of :mod:`.triton` (each
  selected row read once per GQA group, in place, float32 accumulation, log-sum-exp merge);
- ``"bmm"``: on CUDA when Triton is missing or ``PRHS_KERNELS=torch``: a gather and two ``bmm``
  with float32 accumulation (:mod:`.cuda`);
- ``"torch"``: elsewhere, the float32 torch reference (on the CPU it is also the fastest: a
  gather and two ``einsum``);
- ``"triton-interpreter"``: the Triton kernel on the CPU under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_shape
from prhs_core.layout import KVLayout
from prhs_core.selection import Selection
from prhs_kernels.paths import HALF_DTYPES, announce, kernel_path
from prhs_kernels.score import check_query
from prhs_kernels.score.cuda import bmm_out_dtype_available
from prhs_kernels.sparse_decode.cuda import sparse_decode_attention_bmm
from prhs_kernels.sparse_decode.reference import (
    dense_positions,
    merge_compensation,
    sparse_decode_attention_reference,
)

__all__ = [
    "dense_positions",
    "merge_compensation",
    "sparse_decode_attention",
    "sparse_decode_attention_reference",
    "sparse_decode_path",
]


def sparse_decode_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path :func:`sparse_decode_attention` takes on ``device`` for a cache of ``dtype``:
    ``"triton"``, ``"triton-interpreter"``, ``"bmm"`` or ``"torch"``."""
    path = kernel_path(device, dtype)
    cuda = torch.device(device).type == "cuda"
    if path == "torch" and cuda and dtype in HALF_DTYPES and bmm_out_dtype_available("cuda"):
        return "bmm"
    return path


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
    sequence's end, are not read. ``out`` / ``lse`` are written in place when given. A
    selection carrying a :class:`~prhs_core.selection.Compensation` (CompKV) has it merged in
    (:func:`~prhs_kernels.sparse_decode.reference.merge_compensation`): ``lse`` is then the
    log-mass of the selected positions and the compensation together.

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
    comp = selection.compensation if selection is not None else None
    if comp is not None:
        check_shape("compensation.out", comp.out, (b, hq, kv.value_dim), "[B, Hq, Dv]")
        if comp.out.device != query.device and "meta" not in (
            comp.out.device.type,
            query.device.type,
        ):
            raise ValueError(
                f"the compensation is on {comp.out.device} but the query on {query.device}"
            )
    path = sparse_decode_path(query.device, kv.dtype)
    announce("sparse_decode_attention", path, query.device)
    if path.startswith("triton"):
        from prhs_kernels.sparse_decode.triton import sparse_decode_attention_triton

        o, s = sparse_decode_attention_triton(query, kv, selection, scaling, out, lse)
        if comp is None:
            return o, s
        o2, s2 = merge_compensation(o, s, comp)
        o.copy_(o2)
        s.copy_(s2)
        return o, s
    if path == "bmm":
        o, s = sparse_decode_attention_bmm(query, kv, selection, scaling)
    else:
        o, s = sparse_decode_attention_reference(query, kv, selection, scaling)
    if comp is not None:
        o, s = merge_compensation(o, s, comp)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(s)
        s = lse
    return o, s
