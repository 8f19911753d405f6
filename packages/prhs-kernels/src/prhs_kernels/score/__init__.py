"""Exact scoring of every cached key (what a retrieval reads): K only, in the cache dtype, with
float32 (or float64) accumulation, static shapes ``[B, Hkv, g, kv.max_len]``.

Paths: the torch reference everywhere (keys converted a chunk at a time); on CUDA, a contiguous
half-precision cache is scored by one ``bmm`` with float32 output (:mod:`.cuda`).
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_device, check_float_tensor, shape_str
from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_kernels.score.cuda import score_keys_bmm, supports_bmm
from prhs_kernels.score.reference import (
    chunk_len,
    max_key_norm_reference,
    score_keys_reference,
)

__all__ = [
    "check_query",
    "chunk_len",
    "max_key_norm",
    "max_key_norm_reference",
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
