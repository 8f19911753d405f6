"""CUDA path of exact scoring for half-precision caches: one batched matmul that reads K in the
cache dtype and accumulates (and returns) float32, with no float32 copy of the keys.

Tested against :func:`prhs_kernels.score.reference.score_keys_reference` on the GPU; the fused
Triton retrieval (scoring only the heads that retrieve, with top-k) replaces it.
"""

from __future__ import annotations

import torch

from prhs_core.layout import ContiguousKV, KVLayout
from prhs_kernels.score.reference import score_keys_reference

__all__ = ["score_keys_bmm", "supports_bmm"]


def supports_bmm(query: torch.Tensor, kv: KVLayout, dtype: torch.dtype) -> bool:
    """Whether :func:`score_keys_bmm` applies: a contiguous, unpadded half-precision cache on
    CUDA, float32 accumulation."""
    return (
        query.device.type == "cuda"
        and dtype == torch.float32
        and kv.dtype in (torch.float16, torch.bfloat16)
        and isinstance(kv, ContiguousKV)
        and kv.start is None
    )


def score_keys_bmm(query: torch.Tensor, kv: ContiguousKV, scaling: float) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 logits (``-inf`` past each end), as the reference computes them
    but in one ``bmm(..., out_dtype=float32)``."""
    b, hq, d = query.shape
    h = kv.num_kv_heads
    g = hq // h
    t = kv.max_len
    q = query.reshape(b * h, g, d)
    k = kv.k.reshape(b * h, t, d)
    try:
        logits = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # a torch without out_dtype: the reference
        return score_keys_reference(query, kv, scaling)
    logits = logits.view(b, h, g, t) * scaling
    pos = torch.arange(t, device=logits.device, dtype=torch.int32).view(1, 1, 1, -1)
    return logits.masked_fill(pos >= kv.seq_lens.view(-1, 1, 1, 1), float("-inf"))
