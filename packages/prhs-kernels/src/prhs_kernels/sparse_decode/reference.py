"""Float32 torch reference of sparse decode attention over a selection.

Readable and exact: the fast paths are tested against it.
"""

from __future__ import annotations

import torch

from prhs_core.layout import KVLayout
from prhs_core.selection import Compensation, Selection
from prhs_kernels.kv.reference import gather_kv_reference

__all__ = ["dense_positions", "sparse_decode_attention_reference"]


def dense_positions(kv: KVLayout) -> torch.Tensor:
    """``[B, Hkv, T]`` every position ``t < kv.max_len`` (``-1`` past each end)."""
    t = torch.arange(kv.max_len, device=kv.seq_lens.device)
    pos = torch.where(t.view(1, 1, -1) < kv.seq_lens.view(-1, 1, 1), t, -1)
    return pos.expand(kv.batch_size, kv.num_kv_heads, -1)


def sparse_decode_attention_reference(
    query: torch.Tensor, kv: KVLayout, selection: Selection | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode query per head over the selected positions only.

    Parameters
    ----------
    query:
        ``[B, Hq, D]``; query head ``h`` reads KV head ``h // (Hq / Hkv)``.
    kv:
        The layer's cache.
    selection:
        Positions (or ``s``-blocks) per (sequence, KV head); ``None`` reads every position.
    scaling:
        Logit scale.

    Returns
    -------
    out, lse:
        ``[B, Hq, Dv]`` in the query's dtype and ``[B, Hq]`` float32 log-sum-exp of the selected
        logits. A row that selects nothing gets a zero output and ``lse = -inf``; a non-finite
        query or selected key or value gives a non-finite output (never hidden).
    """
    b, hq, d = query.shape
    hkv = kv.num_kv_heads
    g = hq // hkv
    pos = dense_positions(kv) if selection is None else selection.positions(kv.seq_lens)
    k, v = gather_kv_reference(kv, pos)
    assert v is not None
    q = query.reshape(b, hkv, g, d).float()
    logits = torch.einsum("bhgd,bhpd->bhgp", q, k.float()) * scaling
    unused = (pos < 0).unsqueeze(2)
    logits = logits.masked_fill(unused, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    empty = unused.all(-1)  # [B, Hkv, 1]
    p = torch.exp(logits - torch.where(empty, 0.0, lse).unsqueeze(-1))
    p = p.masked_fill(unused, 0.0)
    out = torch.einsum("bhgp,bhpd->bhgd", p, v.float())
    return out.reshape(b, hq, -1).to(query.dtype), lse.reshape(b, hq)


def merge_compensation(
    out: torch.Tensor, lse: torch.Tensor, compensation: Compensation
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a :class:`~prhs_core.selection.Compensation` to attention over the selected positions
    (``out [B, Hq, Dv]``, ``lse [B, Hq]``) through their log-sum-exp: ``(out', lse')`` with
    ``out' = (e^{lse} out + e^{c} o_c) / (e^{lse} + e^{c})``, ``lse' = log(e^{lse} + e^{c})``,
    in float32, ``out'`` in ``out``'s dtype. A side with log-mass ``-inf`` adds nothing."""
    c = compensation.lse
    m = torch.maximum(lse, c)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ws = torch.exp(lse - m)
    wc = torch.exp(c - m)
    total = ws + wc
    merged = ws.unsqueeze(-1) * out.float() + wc.unsqueeze(-1) * compensation.out
    merged = merged / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return merged.to(out.dtype), m + torch.log(total)
