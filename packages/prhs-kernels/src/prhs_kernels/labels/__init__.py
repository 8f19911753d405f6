"""Double Sparsity's proxy: approximate logits from ``r`` label channels of every cached key.

- :func:`label_logits` -- the proxy logits ``[B, Hkv, g, T]`` (torch reference).
- :func:`label_probs` -- what Double Sparsity and HShare rank positions by: the group-mean
  softmax of the proxy logits, ``[B, Hkv, T]``.

The label channels of each key are read from the key rows themselves, or from a *label cache*
(``cache [R, Hkv, r]``, one row per KV location holding only the ``r`` label channels, the
paper's contiguous copy): then a step reads ``r`` elements per key, not ``D``.

:func:`label_probs`'s path (:func:`prhs_kernels.paths.kernel_path`): ``"triton"`` on CUDA for
fp16/bf16 caches (the retrieval scorer of :mod:`prhs_kernels.score` reading only the label
channels: one persistent launch for the logits and one for the probabilities),
``"triton-interpreter"`` on the CPU under ``TRITON_INTERPRET=1``, else ``"torch"``, which
gathers the label channels a chunk of positions at a time (static shapes, no host read).
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_device, check_index_tensor, check_int, shape_str
from prhs_core.layout import KVLayout
from prhs_kernels.labels.reference import label_logits_reference, label_probs_reference
from prhs_kernels.paths import announce, kernel_path
from prhs_kernels.score import check_query

__all__ = [
    "label_logits",
    "label_logits_reference",
    "label_path",
    "label_probs",
    "label_probs_reference",
]


def _check_labels(query: torch.Tensor, kv: KVLayout, labels: object) -> None:
    check_query(query, kv)
    check_index_tensor("labels", labels, ndim=3)
    assert isinstance(labels, torch.Tensor)
    b, h, d = query.shape[0], kv.num_kv_heads, kv.head_dim
    if tuple(labels.shape[:2]) != (b, h) or not 1 <= labels.shape[2] <= d:
        raise ValueError(
            f"labels must be [B={b}, Hkv={h}, r] with 1 <= r <= D={d}, got {shape_str(labels)}"
        )
    check_device(("query", "labels"), (query, labels))


def _check_cache(
    query: torch.Tensor, kv: KVLayout, labels: torch.Tensor, cache: object, row_stride: int
) -> None:
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache must be a tensor [R, Hkv, r], got {type(cache).__name__}")
    h, r = kv.num_kv_heads, labels.shape[-1]
    if cache.ndim != 3 or tuple(cache.shape[1:]) != (h, r) or cache.shape[0] < 1:
        raise ValueError(
            f"cache must be [R, Hkv={h}, r={r}] (one row per KV location), got {shape_str(cache)}"
        )
    if cache.dtype != kv.dtype:
        raise TypeError(f"cache dtype {cache.dtype} differs from the KV cache's {kv.dtype}")
    if cache.stride(-1) != 1:
        raise ValueError("cache must have a contiguous last dim (e.g. side[f][:, layer])")
    check_int("row_stride", row_stride, minimum=1)
    check_device(("query", "cache"), (query, cache))


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
    _check_labels(query, kv, labels)
    announce("label_logits", "torch", query.device)
    return label_logits_reference(query, kv, labels.long(), scaling)


def label_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path :func:`label_probs` takes: ``"triton"``, ``"triton-interpreter"`` or
    ``"torch"``."""
    return kernel_path(device, dtype)


def label_probs(
    query: torch.Tensor,
    kv: KVLayout,
    labels: torch.Tensor,
    scaling: float,
    *,
    cache: torch.Tensor | None = None,
    row_stride: int = 1,
) -> torch.Tensor:
    """``[B, Hkv, T]`` float32: the mean over the ``g`` query heads of each KV head of their
    softmax over the label logits of :func:`label_logits` (0 past each sequence's end).

    ``cache [R, Hkv, r]`` (optional, the cache dtype): the label channels of every KV location,
    row ``b · row_stride + t`` of position ``t`` of row ``b`` in a contiguous layout, the
    token's slot in a paged one (:func:`prhs_kernels.kv.token_locations`); its channel ``j``
    holds key channel ``labels[b, h, j]``. Given, no key row is read. Channel ids are not
    range-checked on the device (a host read): keep them in ``[0, D)``.
    """
    _check_labels(query, kv, labels)
    if cache is not None:
        _check_cache(query, kv, labels, cache, row_stride)
    path = label_path(query.device, kv.dtype)
    announce("label_probs", path, query.device)
    if path.startswith("triton"):
        from prhs_kernels.score.triton import retrieval_probs_triton

        key_cache = None if cache is None else (cache, row_stride)
        return retrieval_probs_triton(query, kv, scaling, None, labels=labels, key_cache=key_cache)
    return label_probs_reference(query, kv, labels.long(), scaling, cache, row_stride)
