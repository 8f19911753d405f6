"""Torch reference of PSAW prefill attention: causal attention where query row ``t`` (a logical
position) reads keys ``[⌊f·t⌋, t]`` plus the first ``n_sink`` positions.

Readable and exact (float32): the Triton kernel of :mod:`prhs_kernels.prefill.triton` is tested
against it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["psaw_allowed", "psaw_prefill_attention_chunked", "psaw_prefill_attention_reference"]


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


def psaw_prefill_attention_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor | None,
    window_fraction: float,
    n_sink: int,
    scaling: float,
    chunk: int = 512,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`psaw_prefill_attention_reference`'s result, ``chunk`` query rows at a time over
    only the keys those rows may read (the sinks below the chunk's smallest window start, and
    the windows up to its last row), so its work follows the kept part of the square, not the
    square. The torch path of :func:`prhs_kernels.prefill.psaw_prefill_attention`; the host
    reads ``start`` (a prefill's metadata, not a decode step's). With ``with_lse=False`` each
    chunk goes through SDPA with its boolean mask (torch's fused CPU kernel; float32 inside,
    ``lse`` ``None``); otherwise through float32 einsums that also give ``lse``."""
    b, hq, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    g = hq // hkv
    dev = query.device
    out = torch.zeros(b, hq, tq, value.shape[-1], dtype=query.dtype, device=dev)
    lse = torch.full((b, hq, tq), -math.inf, dtype=torch.float32, device=dev) if with_lse else None
    starts = [0] * b if start is None else [int(s) for s in start.tolist()]
    for bi, s0 in enumerate(starts):
        first = max(tk - tq, s0)  # storage index of the first query row that is not padding
        for r0 in range(first - (tk - tq), tq, chunk):
            r1 = min(r0 + chunk, tq)
            t0, t1 = tk - tq + r0 - s0, tk - tq + r1 - 1 - s0  # logical positions of the rows
            lo_min = math.floor(window_fraction * t0) if window_fraction > 0.0 else 0
            sinks = torch.arange(min(n_sink, lo_min), device=dev)
            keys = torch.cat([sinks, torch.arange(lo_min, t1 + 1, device=dev)])
            qpos = torch.arange(t0, t1 + 1, device=dev)
            ok = psaw_allowed(qpos, keys, window_fraction, n_sink)  # [rows, keys]
            idx = keys + s0
            if lse is None:
                out[bi, :, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
                    query[bi : bi + 1, :, r0:r1],
                    key[bi : bi + 1][:, :, idx],
                    value[bi : bi + 1][:, :, idx],
                    attn_mask=ok,
                    scale=scaling,
                    enable_gqa=g > 1,
                )[0]
                continue
            k = key[bi][:, idx].float().repeat_interleave(g, dim=0)  # [Hq, n, D]
            v = value[bi][:, idx].float().repeat_interleave(g, dim=0)
            logits = torch.einsum("hqd,hkd->hqk", query[bi, :, r0:r1].float(), k) * scaling
            logits = logits.masked_fill(~ok, -math.inf)
            lse_c = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - lse_c.unsqueeze(-1))  # every row reads at least itself
            out[bi, :, r0:r1] = torch.einsum("hqk,hkd->hqd", p, v).to(query.dtype)
            lse[bi, :, r0:r1] = lse_c
    return out, lse
