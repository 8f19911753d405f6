"""PSAW prefill attention: causal attention where prompt row ``t`` reads keys ``[⌊f·t⌋, t]``
plus the first ``n_sink`` positions (the per-layer window of
:class:`~prhs_core.protocols.PrefillLayerPlan`; ``f = 0`` is plain causal attention).

:func:`psaw_prefill_attention` checks its inputs and takes the path
:func:`~prhs_kernels.paths.kernel_path` names: the Triton kernel of :mod:`.triton` (CUDA,
fp16/bf16; the interpreter under ``TRITON_INTERPRET=1``), which never loads the keys between the
sinks and a row tile's windows, or, elsewhere, a float32 torch path that takes 256 query rows at
a time over the keys they may read (:func:`.reference.psaw_prefill_attention_chunked`), both
tested against the reference, which builds the whole mask.
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_device, check_float_tensor, check_int, shape_str
from prhs_kernels.paths import announce, kernel_path
from prhs_kernels.prefill.reference import (
    psaw_allowed,
    psaw_prefill_attention_chunked,
    psaw_prefill_attention_reference,
)

__all__ = [
    "psaw_allowed",
    "psaw_prefill_attention",
    "psaw_prefill_attention_chunked",
    "psaw_prefill_attention_reference",
]


def psaw_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    window_fraction: float,
    n_sink: int,
    scaling: float,
    start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [B, Hq, Tq, Dv], lse [B, Hq, Tq] float32)``: PSAW prefill attention of ``query
    [B, Hq, Tq, D]`` over ``key`` / ``value [B, Hkv, Tk, D]`` (``Tq <= Tk``: the query rows are
    the last ``Tq`` stored rows, the earlier ones a cached prefix). ``start [B]`` int: storage
    index of each row's logical position 0 (left padding; ``None``: 0). Padding rows and rows
    that read nothing get 0 and ``lse = -inf``. ``out`` is written in place when given.
    ``with_lse=False`` lets the torch path run each chunk through SDPA (faster on the CPU) and
    return ``None`` for ``lse``; the Triton path always returns it."""
    check_float_tensor("query", query, ndim=4)
    check_float_tensor("key", key, ndim=4)
    check_float_tensor("value", value, ndim=4)
    b, hq, tq, d = query.shape
    if key.shape[0] != b or key.shape[3] != d or key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"query [B, Hq, Tq, D] = {shape_str(query)}, key [B, Hkv, Tk, D] = {shape_str(key)} "
            f"and value [B, Hkv, Tk, Dv] = {shape_str(value)} disagree"
        )
    hkv, tk = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of the KV heads ({hkv})")
    if tq > tk:
        raise ValueError(f"query rows ({tq}) must not exceed the key rows ({tk})")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    check_device(("query", "key", "value"), (query, key, value))
    if not 0.0 <= window_fraction < 1.0:
        raise ValueError(f"window_fraction must lie in [0, 1), got {window_fraction}")
    check_int("n_sink", n_sink, minimum=0)
    if start is not None:
        if start.shape != (b,) or start.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"start must be a [B={b}] int32/int64 tensor, got {shape_str(start)}")
        check_device(("query", "start"), (query, start))
    if out is not None and tuple(out.shape) != (b, hq, tq, value.shape[-1]):
        raise ValueError(f"out must have shape [{b}, {hq}, {tq}, {value.shape[-1]}]")
    path = kernel_path(query.device, query.dtype)
    announce("psaw_prefill_attention", path, query.device)
    if path.startswith("triton"):
        from prhs_kernels.prefill.triton import psaw_prefill_attention_triton

        st = start.to(torch.int32) if start is not None else None
        return psaw_prefill_attention_triton(
            query, key, value, st, window_fraction, n_sink, scaling, out
        )
    o, lse = psaw_prefill_attention_chunked(
        query, key, value, start, window_fraction, n_sink, scaling, with_lse=with_lse
    )
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse
