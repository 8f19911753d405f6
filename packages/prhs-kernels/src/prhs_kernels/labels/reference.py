"""Torch reference of Double Sparsity's proxy: logits from a few label channels of each key.

Keys are read a chunk of positions at a time in the cache's dtype; of each key row only the
``r`` label channels of its KV head are taken, and the product is accumulated in float32.
"""

from __future__ import annotations

import torch

from prhs_core.layout import KVLayout
from prhs_kernels.score.reference import _key_chunk, chunk_len

__all__ = ["label_logits_reference"]


def label_logits_reference(
    query: torch.Tensor, kv: KVLayout, labels: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 ``scaling · Σ_{j ∈ labels} q_j·k_j`` of every position
    ``t < T = kv.max_len`` (``-inf`` past each sequence's end). ``query [B, Hq, D]``; ``labels
    [B, Hkv, r]`` int64 channel ids of each (sequence, KV head); query head ``h`` reads KV head
    ``h // g`` and that head's labels."""
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
        k = _key_chunk(kv, lo, hi)  # [B, Hkv, n, D]
        k_lab = torch.gather(k, -1, labels.view(b, h, 1, r).expand(b, h, hi - lo, r)).float()
        parts.append(torch.einsum("bhgr,bhtr->bhgt", q_lab, k_lab))
    logits = (torch.cat(parts, -1) if len(parts) > 1 else parts[0]) * scaling
    pos = torch.arange(t, device=logits.device, dtype=torch.int32).view(1, 1, 1, -1)
    return logits.masked_fill(pos >= kv.seq_lens.view(-1, 1, 1, 1), float("-inf"))
