"""Torch reference of PSAW prefill attention: causal attention where query row ``t`` (a logical
position) reads keys ``[⌊f·t⌋, t]`` plus the first ``n_sink`` positions.

Readable and exact (float32): the Triton kernel of :mod:`prhs_kernels.prefill.triton` is tested
against it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["psaw_allowed", "psaw_prefill_attention_reference"]


def psaw_allowed(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window_fraction: float, n_sink: int
) -> torch.Tensor:
    """``[..., Tq, Tk]`` bool: query logical position ``query_pos [..., Tq]`` may read key
    logical position ``key_pos [..., Tk]`` (both ``-1`` for padding, which reads and is read by
    nothing): ``0 <= k <= q`` and (``k >= ⌊f·q⌋`` or ``k < n_sink``), ``⌊f·q⌋`` in float64 as
    :meth:`prhs_core.protocols.PrefillLayerPlan.window_start` computes it."""
    q = query_pos.unsqueeze(-1)
    k = key_pos.unsqueeze(-2)
    lo = torch.floor(window_fraction * q.to(torch.float64)).to(torch.long)
    ok = (q >= 0) & (k >= 0) & (k <= q)
    if window_fraction > 0.0:
        ok &= (k >= lo) | (k < n_sink)
    return ok


def psaw_prefill_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor | None,
    window_fraction: float,
    n_sink: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, Tq, Dv], lse [B, Hq, Tq] float32)`` of PSAW prefill attention.

    ``query [B, Hq, Tq, D]`` holds the last ``Tq`` rows of the ``Tk`` stored in ``key`` /
    ``value [B, Hkv, Tk, D]`` (a chunk whose earlier rows are cached: ``Tq <= Tk``). Row ``b``'s
    logical position 0 sits at storage index ``start[b]`` (left padding; ``None``: 0), so query
    row ``r`` is logical position ``Tk - Tq + r - start[b]``. Query head ``h`` reads KV head
    ``h // (Hq / Hkv)``. Padding rows, and rows that read nothing, get 0 and ``lse = -inf``.
    """
    b, hq, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    g = hq // hkv
    dev = query.device
    s = torch.zeros(b, dtype=torch.long, device=dev) if start is None else start.long()
    kpos = torch.arange(tk, device=dev).view(1, -1) - s.view(-1, 1)  # [B, Tk]
    kpos = torch.where(kpos >= 0, kpos, -1)
    qpos = kpos[:, tk - tq :]
    ok = psaw_allowed(qpos, kpos, window_fraction, n_sink).unsqueeze(1)  # [B, 1, Tq, Tk]
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    logits = torch.einsum("bhqd,bhkd->bhqk", query.float(), k) * scaling
    logits = logits.masked_fill(~ok, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(logits - torch.where(empty, 0.0, lse).unsqueeze(-1)).masked_fill(~ok, 0.0)
    out = torch.einsum("bhqk,bhkd->bhqd", p, v)
    return out.to(query.dtype), lse
