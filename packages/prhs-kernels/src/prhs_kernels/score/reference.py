"""Torch reference of exact scoring: the logit of every cached key, reading K only.

Keys are read in the cache's dtype, a chunk of positions at a time (so no copy of the whole cache
is made), and converted to the accumulation dtype (float32, or float64 for certified quantities)
for the product.
"""

from __future__ import annotations

import torch

from prhs_core.layout import ContiguousKV, KVLayout
from prhs_kernels.kv.reference import gather_kv_reference

__all__ = [
    "chunk_len",
    "max_key_norm_reference",
    "nonfinite_rows",
    "retrieval_probs_reference",
    "score_keys_reference",
]

# Elements of keys one chunk may gather: bounds the scratch memory of a score to a few MB.
_CHUNK_ELEMENTS = 1 << 24


def chunk_len(kv: KVLayout) -> int:
    """Positions per chunk: a static function of the shapes."""
    per_pos = kv.batch_size * kv.num_kv_heads * kv.head_dim
    return max(256, _CHUNK_ELEMENTS // max(per_pos, 1))


def _key_chunk(kv: KVLayout, lo: int, hi: int) -> torch.Tensor:
    """Keys of positions ``[lo, hi)`` ``[B, Hkv, hi - lo, D]``, cache dtype, 0 past each end."""
    if isinstance(kv, ContiguousKV) and kv.start is None:
        k = kv.k[:, :, lo:hi]
        t = torch.arange(lo, hi, device=k.device, dtype=torch.int32).view(1, 1, -1, 1)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)  # on the device: graph-safe
        return torch.where(t < kv.seq_lens.view(-1, 1, 1, 1), k, zero)
    pos = torch.arange(lo, hi, device=kv.seq_lens.device).view(1, 1, -1)
    pos = pos.expand(kv.batch_size, kv.num_kv_heads, -1)
    return gather_kv_reference(kv, pos, values=False)[0]


def score_keys_reference(
    query: torch.Tensor, kv: KVLayout, scaling: float, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` logits ``scaling · q·k`` of every position ``t < T = kv.max_len``,
    ``-inf`` past each sequence's end. ``query [B, Hq, D]``; query head ``h`` reads KV head
    ``h // g``."""
    b, hq, d = query.shape
    h = kv.num_kv_heads
    g = hq // h
    t = kv.max_len
    q = query.reshape(b, h, g, d).to(dtype)
    step = chunk_len(kv)
    parts = []
    for lo in range(0, t, step):
        hi = min(lo + step, t)
        k = _key_chunk(kv, lo, hi).to(dtype)
        parts.append(torch.einsum("bhgd,bhtd->bhgt", q, k))
    logits = (torch.cat(parts, -1) if len(parts) > 1 else parts[0]) * scaling
    pos = torch.arange(t, device=logits.device, dtype=torch.int32).view(1, 1, 1, -1)
    return logits.masked_fill(pos >= kv.seq_lens.view(-1, 1, 1, 1), float("-inf"))


def max_key_norm_reference(kv: KVLayout) -> torch.Tensor:
    """``[B, Hkv]`` float32 ``max_t ‖k_t‖`` over each sequence's cached keys (0 when empty)."""
    t = kv.max_len
    step = chunk_len(kv)
    out = torch.zeros(kv.batch_size, kv.num_kv_heads, dtype=torch.float32, device=kv.device)
    for lo in range(0, t, step):
        k = _key_chunk(kv, lo, min(lo + step, t)).float()
        out = torch.maximum(out, k.norm(dim=-1).amax(-1))
    return out


def retrieval_probs_reference(logits: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
    """``[B, Hkv, T]``: the group-mean softmax of ``logits [B, Hkv, g, T]`` (float32), 0 on the
    rows where ``active [B, Hkv]`` is ``False``."""
    probs = torch.softmax(logits.float(), dim=-1).mean(2)
    if active is None:
        return probs
    return probs.masked_fill(~active.unsqueeze(-1), 0.0)


def nonfinite_rows(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hkv]`` bool: KV heads whose group of queries (``query [B, Hq, D]``) holds a NaN or
    an infinity."""
    b, hq, _ = query.shape
    bad = ~torch.isfinite(query).all(-1)  # [B, Hq]
    return bad.view(b, num_kv_heads, hq // num_kv_heads).any(-1)
