"""Torch references of KV reads: locations and gathers (no value is changed).

Readable and exact: the fast paths are tested against them.
"""

from __future__ import annotations

import torch

from prhs_core.layout import ContiguousKV, KVLayout

__all__ = [
    "gather_kv_reference",
    "row_bounds_reference",
    "token_locations_reference",
    "valid_positions",
    "written_rows",
]


def valid_positions(kv: KVLayout, positions: torch.Tensor) -> torch.Tensor:
    """``positions`` (``[B, ...]``) that exist: ``0 <= p < seq_lens[b]``."""
    lens = kv.seq_lens.view(-1, *([1] * (positions.ndim - 1)))
    return (positions >= 0) & (positions < lens)


def token_locations_reference(
    kv: KVLayout, positions: torch.Tensor, row_stride: int
) -> torch.Tensor:
    """int64 KV location of each logical position ``[B, ...]``; ``-1`` where it does not exist.

    Contiguous: ``b * row_stride + p``. Paged: ``req_to_token[req_pool_indices[b], p]``.
    """
    ok = valid_positions(kv, positions)
    p = torch.where(ok, positions, 0).long()
    b = kv.seq_lens.shape[0]
    rows = torch.arange(b, device=p.device).view(-1, *([1] * (p.ndim - 1)))
    if isinstance(kv, ContiguousKV):
        loc = rows * row_stride + p
    else:
        req = kv.req_pool_indices.long().view(-1, *([1] * (p.ndim - 1)))
        loc = kv.req_to_token[req, p].long()
    return torch.where(ok, loc, -1)


def gather_kv_reference(
    kv: KVLayout, positions: torch.Tensor, *, values: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys (and values) at logical ``positions [B, Hkv, K]``, in the cache's dtype.

    Returns ``([B, Hkv, K, D], [B, Hkv, K, Dv] or None)``; entries whose position does not exist
    come back as zeros (whatever storage holds there is never used: ``where``, not a multiply).
    """
    ok = valid_positions(kv, positions)
    p = torch.where(ok, positions, 0).long()
    b, h, _ = p.shape
    bi = torch.arange(b, device=p.device).view(b, 1, 1)
    hi = torch.arange(h, device=p.device).view(1, h, 1)
    if isinstance(kv, ContiguousKV):
        if kv.start is not None:
            p = p + kv.start.view(b, 1, 1).long()
        # A row of length 0 may start at T_cap: keep its (unused) reads inside storage.
        p = p.clamp(0, max(kv.max_len - 1, 0))
        k = kv.k[bi, hi, p]
        v = kv.v[bi, hi, p] if values else None
    else:
        slot = kv.req_to_token[kv.req_pool_indices.long().view(b, 1, 1), p].long()
        slot = slot.clamp(0, kv.num_slots - 1)
        k = kv.k_pool[slot, hi]
        v = kv.v_pool[slot, hi] if values else None
    keep = ok.unsqueeze(-1)
    k = torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device))
    if v is not None:
        v = torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device))
    return k, v


def row_bounds_reference(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``(start [B], lens [B])`` of a ``[B, T]`` bool mask: each row's first ``True``
    column (0 for a row with none) and its count of ``True``."""
    lens = valid.sum(-1, dtype=torch.int32)
    # argmax of a bool row finds its first True (read as uint8 in place: argmax has no bool
    # kernel); a row with none: 0.
    start = valid.view(torch.uint8).argmax(-1).to(torch.int32)
    return start, lens


def written_rows(
    locations: torch.Tensor, key: torch.Tensor, columns: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(written [N] bool, rows [N, Hkv, D])``: which of a write's rows land somewhere, and
    their keys. A row is written where its location is not ``-1`` and, with ``columns`` (``key``
    then ``[N, Hkv, T, D]``, row ``i``'s key at column ``columns[i]``), its column lies in
    ``[0, T)``; the keys of the other rows are whatever the key holds (never used)."""
    written = locations >= 0
    if columns is None:
        return written, key
    t = key.shape[2]
    written = written & (columns >= 0) & (columns < t)
    col = columns.long().clamp(0, t - 1)
    return written, key[torch.arange(key.shape[0], device=key.device), :, col]
