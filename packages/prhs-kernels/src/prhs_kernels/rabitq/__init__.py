"""RaBitQ for keys: 1-bit codes packed eight to a byte, a 4-bit query, an unbiased estimator.

:func:`quantize_keys` turns keys into codes and one float per key; :func:`estimate_inner`
estimates the query–key inner products from them (:mod:`.reference` states the maths).
:func:`rabitq_logits` estimates the logit of every cached position from one layer's side-cache
fields, read at each position's KV location. Its path (:func:`rabitq_path`): ``"triton"`` on
CUDA for fp16/bf16 caches (one launch, a binary × 4-bit ``tl.dot`` per tile of keys, ``D/8 + 8``
bytes read per key, :mod:`.triton`), ``"triton-interpreter"`` on the CPU under
``TRITON_INTERPRET=1``, else ``"torch"`` (codes gathered and unpacked a chunk at a time).
:func:`quantize_keys` is torch, with its bit packing a Numba kernel on the CPU (:mod:`.numba`,
chosen by :func:`~prhs_kernels.paths.numba_path`; ``PRHS_KERNELS=torch`` keeps the reference's).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from prhs_core.checks import check_device, check_float_tensor, check_int, shape_str
from prhs_core.layout import KVLayout
from prhs_kernels.paths import announce, kernel_path, numba_path
from prhs_kernels.rabitq.reference import (
    estimate_inner,
    estimate_logits,
    pack_bits,
    quantize_keys_reference,
    quantize_query,
    query_codes,
    rabitq_logits_reference,
    random_rotation,
    unpack_signs,
)
from prhs_kernels.score import check_query

__all__ = [
    "estimate_inner",
    "estimate_logits",
    "pack_bits",
    "quantize_keys",
    "quantize_query",
    "query_codes",
    "rabitq_logits",
    "rabitq_logits_reference",
    "rabitq_path",
    "random_rotation",
    "unpack_signs",
]


@functools.cache
def _numba() -> ModuleType:
    """The Numba kernel, imported and compiled at its first use."""
    from prhs_kernels.rabitq import numba as kernels

    kernels.warm_up()
    return kernels


def quantize_keys(
    keys: torch.Tensor, centroid: torch.Tensor, rotation: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., D/8] uint8, factor [...] float32)`` of ``keys [..., D]`` around
    ``centroid`` (broadcast) under the orthogonal ``rotation [D, D]``; ``D`` a multiple of 8.
    On the CPU the bits are packed by a Numba kernel (the reference's bytes, 10-100× faster
    than its int32 products: half of the whole quantisation at 8 KV heads of D 128)."""
    check_float_tensor("keys", keys, min_ndim=1)
    d = keys.shape[-1]
    if d % 8:
        raise ValueError(
            f"RaBitQ packs 8 bits a byte: the head dim must be a multiple of 8, got {d}"
        )
    if tuple(rotation.shape) != (d, d):
        raise ValueError(f"rotation must be [D, D] = [{d}, {d}], got {list(rotation.shape)}")
    if numba_path(keys.device):
        announce("quantize_keys", "numba", keys.device)
        return quantize_keys_reference(keys, centroid, rotation, pack=_numba().pack_bits_numba)
    return quantize_keys_reference(keys, centroid, rotation)


def rabitq_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path :func:`rabitq_logits` takes for a cache of ``dtype`` on ``device``."""
    return kernel_path(device, dtype)


def rabitq_logits(
    query: torch.Tensor,
    kv: KVLayout,
    codes: torch.Tensor,
    factor: torch.Tensor,
    cqk: torch.Tensor,
    ck: torch.Tensor,
    cq: torch.Tensor,
    rotation: torch.Tensor,
    dither: torch.Tensor,
    scaling: float,
    *,
    row_stride: int,
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 estimated logits ``s·⟨q, k⟩`` of every position ``t < T =
    kv.max_len`` (``-inf`` past each sequence's end), from one layer's side-cache fields read at
    each position's KV location (row ``b · row_stride + t`` of a contiguous cache, the token's
    slot of a paged one).

    ``query [B, Hq, D]`` in the cache dtype; ``codes [R, Hkv, D/8]`` uint8, ``factor`` and
    ``cqk`` ``[R, Hkv]`` float32 (strided views such as ``side["rq_codes"][:, row]`` are read in
    place); the centroids ``ck``, ``cq`` ``[B, Hkv, D]`` float32; ``rotation [D, D]`` and
    ``dither [D]`` float32. What a position's row holds before its key is quantised is read
    like any other estimate: mask such positions after. See
    :func:`.reference.estimate_logits` for the estimator.
    """
    check_query(query, kv)
    b, _, d = query.shape
    h = kv.num_kv_heads
    if d % 8:
        raise ValueError(
            f"RaBitQ packs 8 bits a byte: the head dim must be a multiple of 8, got {d}"
        )
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor [R, Hkv, D/8], got {type(codes).__name__}")
    rows = codes.shape[0] if codes.ndim == 3 else -1
    if codes.ndim != 3 or tuple(codes.shape[1:]) != (h, d // 8) or rows < 1:
        raise ValueError(f"codes must be [R, Hkv={h}, D/8={d // 8}], got {shape_str(codes)}")
    if codes.stride(-1) != 1:
        raise ValueError("codes must have a contiguous last dim")
    for name, x in (("factor", factor), ("cqk", cqk)):
        check_float_tensor(name, x, ndim=2)
        if tuple(x.shape) != (rows, h) or x.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 [R={rows}, Hkv={h}], got {x.dtype} {shape_str(x)}"
            )
    for name, x in (("ck", ck), ("cq", cq)):
        check_float_tensor(name, x, ndim=3)
        if tuple(x.shape) != (b, h, d) or x.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 [B={b}, Hkv={h}, D={d}], got {x.dtype} {shape_str(x)}"
            )
    if tuple(rotation.shape) != (d, d) or tuple(dither.shape) != (d,):
        raise ValueError(
            f"rotation must be [D, D] and dither [D] with D={d}, got {shape_str(rotation)} and "
            f"{shape_str(dither)}"
        )
    check_int("row_stride", row_stride, minimum=1)
    check_device(
        ("query", "codes", "factor", "cqk", "ck", "cq", "rotation", "dither"),
        (query, codes, factor, cqk, ck, cq, rotation, dither),
    )
    path = rabitq_path(query.device, kv.dtype)
    announce("rabitq_logits", path, query.device)
    args = (query, kv, codes, factor, cqk, ck, cq, rotation.float(), dither.float(), scaling)
    if path.startswith("triton"):
        from prhs_kernels.rabitq.triton import rabitq_logits_triton

        return rabitq_logits_triton(*args, row_stride)
    return rabitq_logits_reference(*args, row_stride)
