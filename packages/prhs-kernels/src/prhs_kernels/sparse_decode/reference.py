"""Float32 torch reference of sparse decode attention over a selection (SPEC.md §5).

Readable and exact: the fast paths are tested against it.
"""

from __future__ import annotations

import torch

from prhs_core.cache import KVCacheView
from prhs_core.selection import Selection

__all__ = ["sparse_decode_attention_reference"]


def sparse_decode_attention_reference(
    query: torch.Tensor,
    cache: KVCacheView,
    selection: Selection,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode query per head over the selected positions only.

    Parameters
    ----------
    query:
        ``[B, Hq, D]``; query head ``h`` reads KV head ``h // (Hq / Hkv)``.
    cache:
        The layer's cache view.
    selection:
        Positions (or ``s``-blocks) per (sequence, KV head); dense reads every position.
    scaling:
        Logit scale.

    Returns
    -------
    out, lse:
        ``[B, Hq, Dv]`` in the query's dtype and ``[B, Hq]`` float32 log-sum-exp of the
        selected logits (``-inf`` and a zero output for a row that selects nothing).
    """
    b, hq, d = query.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    if selection.is_dense:
        t = torch.arange(cache.max_seq_len, device=query.device)
        pos = torch.where(t.view(1, 1, -1) < cache.seq_lens.view(-1, 1, 1), t, -1)
        pos = pos.expand(b, hkv, -1)
    else:
        pos = selection.positions(cache.seq_lens)
    k, v = cache.gather(pos)
    q = query.reshape(b, hkv, g, d).float()
    logits = torch.einsum("bhgd,bhpd->bhgp", q, k.float()) * scaling
    logits = logits.masked_fill((pos < 0).unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhgp,bhpd->bhgd", p, v.float())
    return out.reshape(b, hq, -1).to(query.dtype), lse.reshape(b, hq)
