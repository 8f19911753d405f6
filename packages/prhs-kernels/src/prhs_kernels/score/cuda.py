"""CUDA path of exact scoring for half-precision caches: one batched matmul that reads K in the
cache dtype and accumulates (and returns) float32, with no float32 copy of the keys.

Tested against :func:`prhs_kernels.score.reference.score_keys_reference` on the GPU. Retrieval
on the Triton path uses :func:`prhs_kernels.score.retrieval_probs` instead (the retrieving rows
only); ``score_keys`` still serves the certified quantities and the metrics.
"""

from __future__ import annotations

import functools

import torch

from prhs_core.layout import ContiguousKV, KVLayout

__all__ = ["bmm_out_dtype_available", "score_keys_bmm", "supports_bmm"]


@functools.cache
def bmm_out_dtype_available(device_type: str) -> bool:
    """Whether this torch has ``bmm(..., out_dtype=float32)`` for bf16 on ``device_type``
    (asked once, on a tiny product: metadata only, no host read)."""
    try:
        a = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device_type)
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def supports_bmm(query: torch.Tensor, kv: KVLayout, dtype: torch.dtype) -> bool:
    """Whether :func:`score_keys_bmm` applies: a contiguous, unpadded half-precision cache on
    CUDA, float32 accumulation, and a torch with ``bmm(..., out_dtype=)``."""
    return (
        query.device.type == "cuda"
        and bmm_out_dtype_available("cuda")
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
    logits = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    logits = logits.view(b, h, g, t) * scaling
    pos = torch.arange(t, device=logits.device, dtype=torch.int32).view(1, 1, 1, -1)
    return logits.masked_fill(pos >= kv.seq_lens.view(-1, 1, 1, 1), float("-inf"))
