"""Torch reference of Double Sparsity's proxy: logits from a few label channels of each key.

Keys are read a chunk of positions at a time in the cache's dtype; of each key row only the
``r`` label channels of its KV head are taken (from the key rows themselves, or from a label
cache that holds just those channels), and the product is accumulated in float32.
"""

from __future__ import annotations

import torch

from prhs_core.layout import KVLayout
from prhs_kernels.kv.reference import token_locations_reference
from prhs_kernels.score.reference import _key_chunk, chunk_len, retrieval_probs_reference

__all__ = ["label_logits_reference", "label_probs_reference"]


def _cache_chunk(
    kv: KVLayout, cache: torch.Tensor, row_stride: int, lo: int, hi: int
) -> torch.Tensor:
    """Label-cache rows of positions ``[lo, hi)``: ``[B, Hkv, hi - lo, r]``, 0 past each end."""
    pos = torch.arange(lo, hi, device=kv.seq_lens.device).view(1, -1).expand(kv.batch_size, -1)
    loc = token_locations_reference(kv, pos, row_stride)  # [B, n], -1 past the end
    rows = cache[loc.clamp_min(0)]  # [B, n, Hkv, r]
    zero = torch.zeros((), dtype=cache.dtype, device=cache.device)
    return torch.where((loc >= 0).view(*loc.shape, 1, 1), rows, zero).transpose(1, 2)


def label_logits_reference(
    query: torch.Tensor,
    kv: KVLayout,
    labels: torch.Tensor,
    scaling: float,
    cache: torch.Tensor | None = None,
    row_stride: int = 1,
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 ``scaling · Σ_{j ∈ labels} q_j·k_j`` of every position
    ``t < T = kv.max_len`` (``-inf`` past each sequence's end). ``query [B, Hq, D]``; ``labels
    [B, Hkv, r]`` int64 channel ids of each (sequence, KV head); query head ``h`` reads KV head
    ``h // g`` and that head's labels. With ``cache [R, Hkv, r]`` the keys' label channels are
    read from its row of each position's KV location (``row_stride`` as
    :func:`prhs_kernels.kv.token_locations`), not from the key rows."""
    b, hq, d = query.shape
    h = kv.num_kv_heads
    g = hq // h
    r = labels.shape[-1]
    t = kv.max_len
    q = query.reshape(b, h, g, d).float()
    q_lab = torch.gather(q, -1, labels.view(b, h, 1, r).expand(b, h, g, r))
    step = chunk_len(kv)
    parts = []
    for lo in range(0, t, step):
        hi = min(lo + step, t)
        if cache is None:
            k = _key_chunk(kv, lo, hi)  # [B, Hkv, n, D]
            k_lab = torch.gather(k, -1, labels.view(b, h, 1, r).expand(b, h, hi - lo, r))
        else:
            k_lab = _cache_chunk(kv, cache, row_stride, lo, hi)
        parts.append(torch.einsum("bhgr,bhtr->bhgt", q_lab, k_lab.float()))
    logits = (torch.cat(parts, -1) if len(parts) > 1 else parts[0]) * scaling
    pos = torch.arange(t, device=logits.device, dtype=torch.int32).view(1, 1, 1, -1)
    return logits.masked_fill(pos >= kv.seq_lens.view(-1, 1, 1, 1), float("-inf"))


def label_probs_reference(
    query: torch.Tensor,
    kv: KVLayout,
    labels: torch.Tensor,
    scaling: float,
    cache: torch.Tensor | None = None,
    row_stride: int = 1,
) -> torch.Tensor:
    """``[B, Hkv, T]`` float32 group-mean softmax of :func:`label_logits_reference`."""
    logits = label_logits_reference(query, kv, labels, scaling, cache, row_stride)
    return retrieval_probs_reference(logits, None)
