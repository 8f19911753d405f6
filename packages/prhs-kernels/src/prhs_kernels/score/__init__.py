"""Exact scoring of every cached key (what a retrieval reads): K only, in the cache dtype, with
float32 (or float64) accumulation, static shapes ``[B, Hkv, g, kv.max_len]``.

:func:`score_keys` paths: the torch reference everywhere (keys converted a chunk at a time); on
CUDA, a contiguous half-precision cache is scored by one ``bmm`` with float32 output
(:mod:`.cuda`).

:func:`retrieval_probs` is what a retrieval ranks positions by: the group-mean attention
probability of every position, for the rows that retrieve only. Its Triton path (:mod:`.triton`)
reads no key of a row that does not retrieve; the torch path scores every row and zeroes the
others. :func:`retrieval_path` names the path.
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_bool_mask, check_device, check_float_tensor, shape_str
from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_kernels.keycodes import KeyCodes, check_key_codes, code_key_layout
from prhs_kernels.paths import announce, kernel_path
from prhs_kernels.score.cuda import score_keys_bmm, supports_bmm
from prhs_kernels.score.reference import (
    chunk_len,
    max_key_norm_reference,
    nonfinite_rows,
    retrieval_probs_reference,
    score_keys_reference,
)

__all__ = [
    "check_query",
    "chunk_len",
    "max_key_norm",
    "max_key_norm_reference",
    "nonfinite_rows",
    "retrieval_path",
    "retrieval_probs",
    "retrieval_probs_reference",
    "score_keys",
    "score_keys_bmm",
    "score_keys_reference",
]


def check_query(query: object, kv: KVLayout) -> None:
    """Raise unless ``query`` is ``[B, Hq, D]`` of the cache's dtype, batch, head size and device,
    with ``Hq`` a multiple of ``Hkv``."""
    if not isinstance(kv, ContiguousKV | PagedKV):
        raise TypeError(f"kv must be a ContiguousKV or a PagedKV, got {type(kv).__name__}")
    check_float_tensor("query", query, ndim=3)
    assert isinstance(query, torch.Tensor)
    b, hq, d = query.shape
    if b != kv.batch_size or d != kv.head_dim:
        raise ValueError(
            f"query [B, Hq, D] = {shape_str(query)} does not match the cache "
            f"(B={kv.batch_size}, D={kv.head_dim})"
        )
    if hq % kv.num_kv_heads:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of the cache's KV heads ({kv.num_kv_heads})"
        )
    if query.dtype != kv.dtype:
        raise TypeError(
            f"query dtype {query.dtype} differs from the cache dtype {kv.dtype}; "
            "cast the query to the cache dtype"
        )
    storage = kv.k if isinstance(kv, ContiguousKV) else kv.k_pool
    check_device(("query", "the cache"), (query, storage))


def score_keys(
    query: torch.Tensor, kv: KVLayout, scaling: float, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` logits of every position ``t < T = kv.max_len`` for ``query
    [B, Hq, D]``, ``-inf`` past each sequence's end; accumulated in ``dtype``."""
    check_query(query, kv)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    if supports_bmm(query, kv, dtype):
        assert isinstance(kv, ContiguousKV)
        return score_keys_bmm(query, kv, scaling)
    return score_keys_reference(query, kv, scaling, dtype=dtype)


def max_key_norm(kv: KVLayout) -> torch.Tensor:
    """``[B, Hkv]`` float32 largest key norm of each sequence."""
    if not isinstance(kv, ContiguousKV | PagedKV):
        raise TypeError(f"kv must be a ContiguousKV or a PagedKV, got {type(kv).__name__}")
    return max_key_norm_reference(kv)


def retrieval_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path :func:`retrieval_probs` takes: ``"triton"``, ``"triton-interpreter"`` or
    ``"torch"`` (which scores through :func:`score_keys`, so by ``bmm`` on CUDA)."""
    return kernel_path(device, dtype)


def retrieval_probs(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    active: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    codes: KeyCodes | None = None,
) -> torch.Tensor:
    """``[B, Hkv, T]`` float32 group-mean attention probability of every position
    ``t < T = kv.max_len`` (0 past each sequence's end) for ``query [B, Hq, D]``: the mean over
    the ``g`` query heads of a KV head of their softmax over the whole cache.

    ``active [B, Hkv]`` bool: the rows to score (``None``: all); the other rows are set to 0 and,
    on the Triton path, none of their keys is read. ``out`` is written in place when given.
    ``codes``: score the keys' code rows (:class:`prhs_kernels.keycodes.KeyCodes`, 4-bit keys)
    instead of the keys; the torch path scores their dequantised keys in float32.
    """
    check_query(query, kv)
    b, h, t = kv.batch_size, kv.num_kv_heads, kv.max_len
    if codes is not None:
        check_key_codes(kv, codes)
    if active is not None:
        check_bool_mask("active", active, (b, h))
        check_device(("query", "active"), (query, active))
    if out is not None:
        if out.dtype != torch.float32 or tuple(out.shape) != (b, h, t):
            raise ValueError(
                f"out must be a float32 [B={b}, Hkv={h}, T={t}] tensor, got {out.dtype} "
                f"{shape_str(out)}"
            )
        check_device(("query", "out"), (query, out))
    path = retrieval_path(query.device, kv.dtype)
    announce("retrieval_probs", path, query.device)
    if path.startswith("triton"):
        from prhs_kernels.score.triton import retrieval_probs_triton

        return retrieval_probs_triton(query, kv, scaling, active, out, codes=codes)
    if codes is not None:
        logits = score_keys(query.float(), code_key_layout(kv, codes), scaling)
    else:
        logits = score_keys(query, kv, scaling)
    probs = retrieval_probs_reference(logits, active)
    if out is not None:
        out.copy_(probs)
        return out
    return probs
