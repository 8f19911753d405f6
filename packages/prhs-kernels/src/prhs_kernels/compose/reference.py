"""Torch references of the list algebra a selection is built with: the sink and local windows
as block lists, dilation, and the union of lists into one fixed-width, duplicate-free list."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "dilate_indices_reference",
    "union_indices_reference",
    "window_indices_reference",
    "window_widths",
]


def window_widths(n_sink: int, n_local: int, s: int) -> tuple[int, int]:
    """Static widths of the sink and local block lists: ``ceil(n_sink/s)`` and
    ``ceil(n_local/s) + 1`` (an unaligned window straddles one more block), 0 for an empty
    window."""
    return -(-n_sink // s), (-(-n_local // s) + 1 if n_local > 0 else 0)


def window_indices_reference(
    seq_lens: torch.Tensor, n_sink: int, n_local: int, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sink [B, ws], local [B, wl])`` int32 block ids of the first ``n_sink`` and last
    ``n_local`` positions of each sequence; ``-1`` where a block does not exist."""
    ws, wl = window_widths(n_sink, n_local, s)
    lens = seq_lens.long().view(-1, 1)
    dev = seq_lens.device
    n_blocks = (lens + s - 1) // s
    sink_end = (torch.clamp(lens, max=n_sink) + s - 1) // s  # blocks holding sink positions
    j = torch.arange(ws, device=dev).view(1, -1)
    sink = torch.where(j < sink_end, j, -1)
    first = torch.clamp(lens - n_local, min=0) // s
    i = torch.arange(wl, device=dev).view(1, -1)
    local = first + i
    local = torch.where((local < n_blocks) & (lens > 0), local, -1)
    return sink.to(torch.int32), local.to(torch.int32)


def dilate_indices_reference(
    indices: torch.Tensor, counts: torch.Tensor, m: int, r: int
) -> torch.Tensor:
    """``[..., 2·r·m]`` int32: ``p ± j`` (``1 <= j <= r``) for the first ``min(m, count)`` entries
    ``p`` of each list (a list ordered by score, so they are its top ``m``); ``-1`` for entries
    that do not exist or fall below 0. Entries past a sequence's end are left to the union."""
    if m <= 0 or r <= 0:
        return indices.new_full((*indices.shape[:-1], 0), -1)
    mm = min(m, indices.shape[-1])
    top = indices[..., :mm].long()
    ok = (torch.arange(mm, device=indices.device) < counts.unsqueeze(-1)) & (top >= 0)
    up = torch.arange(1, r + 1, device=indices.device)
    offs = torch.cat([up, -up])
    nb = (top.unsqueeze(-1) + offs).flatten(-2)  # [..., mm * 2r]
    nb = torch.where(ok.repeat_interleave(2 * r, dim=-1) & (nb >= 0), nb, -1)
    if mm < m:
        nb = torch.nn.functional.pad(nb, (0, 2 * r * (m - mm)), value=-1)
    return nb.to(torch.int32)


def union_indices_reference(
    parts: Sequence[torch.Tensor], limit: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of ``parts`` (each ``[B, H, w_i]``, or ``[B, w_i]`` shared by every head;
    ``-1`` for no entry), keeping ids in ``[0, limit[b])``: ``(indices [B, H, width],
    counts [B, H])`` int32, ascending, distinct, ``-1`` past the count (a count above ``width``
    keeps the ``width`` smallest ids)."""
    b = limit.shape[0]
    h = max((p.shape[1] for p in parts if p.ndim == 3), default=1)
    cat = torch.cat([(p if p.ndim == 3 else p.unsqueeze(1)).expand(b, h, -1) for p in parts], -1)
    big = 1 << 62  # above every id; exact as the float ``pad`` takes (int64 max is not)
    x = cat.long()
    x = torch.where((x >= 0) & (x < limit.long().view(b, 1, 1)), x, big)
    x = torch.sort(x, dim=-1).values
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[..., 1:] = x[..., 1:] == x[..., :-1]
    x = torch.sort(torch.where(dup, big, x), dim=-1).values
    counts = (x < big).sum(-1).clamp(max=width).to(torch.int32)
    if x.shape[-1] < width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=big)
    x = x[..., :width]
    return torch.where(x < big, x, -1).to(torch.int32), counts
