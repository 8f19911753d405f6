"""Torch references of the CIS step's ops (paper mode): the reuse decision, a retrieval's block
scores, and the composition of the selection with the anchors' update.

Readable and exact: the Triton kernels of :mod:`prhs_kernels.cis.triton` are tested against
them, and the ``cis`` selector runs them wherever the kernels do not apply. Dilation and the
union go through the compose launchers, so on the CPU they take their Numba kernels (exactly the
compose references' results).
"""

from __future__ import annotations

import torch

from prhs_core.layout import KVLayout
from prhs_kernels.blocks.reference import block_reduce_reference
from prhs_kernels.compose import dilate_indices, union_indices
from prhs_kernels.compose.reference import window_indices_reference, window_widths
from prhs_kernels.score.reference import nonfinite_rows

__all__ = [
    "block_eligible_reference",
    "cis_compose_reference",
    "cis_decide_reference",
    "held_local_indices",
    "retrieval_block_scores_reference",
    "window_block_mask_reference",
]


def cis_decide_reference(
    query: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    tau: float | torch.Tensor,
    n_local: int,
    nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(retrieve, bad)``, ``[B, Hkv]`` bool each. ``bad``: the group's queries hold a NaN or an
    infinity (counted into ``nonfinite``, a one-element int64 tensor, when given); such a row
    neither reuses nor retrieves. Otherwise a row reuses its anchor (row ``slots[b]`` of
    ``anchor_q [N, Hkv, g, D]`` / ``anchor_len [N, Hkv]``) iff the anchor exists, is at most
    ``n_local`` positions old, and the cosine of the group's concatenated queries with the
    anchor's is at least ``tau`` (a float; ``[Hkv]``: one threshold per KV head; ``[N, Hkv]``:
    one per (slot, KV head)), and retrieves if not."""
    b, hq, d = query.shape
    h = anchor_len.shape[1]
    bad = nonfinite_rows(query, h)
    if nonfinite is not None:
        nonfinite.add_(bad.sum())
    q = query.reshape(b, h, hq // h * d).float()
    qa = anchor_q[slots].reshape(b, h, -1)
    ta = anchor_len[slots]
    lens = seq_lens.view(-1, 1)
    reuse = (ta > 0) & (lens - ta <= n_local) & (lens >= ta)
    thr = tau
    if isinstance(tau, torch.Tensor):
        thr = tau[slots] if tau.ndim == 2 else tau.view(1, -1)
    reuse &= torch.nn.functional.cosine_similarity(q, qa, dim=-1) >= thr
    return ~reuse & ~bad, bad


def window_block_mask_reference(
    seq_lens: torch.Tensor, n_blocks: int, block_size: int, n_sink: int, n_local: int
) -> torch.Tensor:
    """``[B, NB]`` bool: blocks holding a sink or local position."""
    sink, local = window_indices_reference(seq_lens, n_sink, n_local, block_size)
    ids = torch.cat([sink, local], dim=-1).long()  # -1: no block
    window = torch.zeros(ids.shape[0], n_blocks + 1, dtype=torch.bool, device=ids.device)
    window.scatter_(-1, torch.where(ids >= 0, ids.clamp(max=n_blocks), n_blocks), True)
    return window[:, :n_blocks]


def block_eligible_reference(
    seq_lens: torch.Tensor, n_blocks: int, block_size: int, n_sink: int, n_local: int
) -> torch.Tensor:
    """``[B, NB]`` bool: blocks that exist and hold no sink or local position."""
    s = block_size
    j = torch.arange(n_blocks, device=seq_lens.device).view(1, -1)
    exists = j < ((seq_lens.long() + s - 1) // s).view(-1, 1)
    return exists & ~window_block_mask_reference(seq_lens, n_blocks, s, n_sink, n_local)


def retrieval_block_scores_reference(
    probs: torch.Tensor,
    kv: KVLayout,
    block_size: int,
    n_sink: int,
    n_local: int,
    active: torch.Tensor | None,
    score: str = "max",
) -> torch.Tensor:
    """``[B, Hkv, NB]`` float32: the largest group probability (``score="max"``) or the summed
    group probability (``"mass"``) of each ``block_size``-block of ``probs [B, Hkv, T]``
    (:func:`prhs_kernels.score.retrieval_probs`), ``-inf`` for blocks that do not exist or hold
    a sink or local position, and on rows that are not ``active``."""
    op = "max" if score == "max" else "sum"
    scores = block_reduce_reference(probs, block_size, op) if block_size > 1 else probs
    ok = block_eligible_reference(kv.seq_lens, scores.shape[-1], block_size, n_sink, n_local)
    ok = ok.unsqueeze(1)
    if active is not None:
        ok = ok & active.unsqueeze(-1)
    return scores.masked_fill(~ok, float("-inf"))


def held_local_indices(
    local: torch.Tensor,
    seq_lens: torch.Tensor,
    anchor_len: torch.Tensor,
    reuse: torch.Tensor,
    n_local: int,
    s: int,
) -> torch.Tensor:
    """``[B, Hkv, wl']`` local block ids (``wl'`` of :func:`prhs_kernels.cis.cis_local_width`
    with ``hold_local``): from the anchor's window start (``anchor_len [B, Hkv]``, ``t_a``) on
    the ``reuse`` rows, the plain window (``local [B, wl]``) elsewhere; ``-1`` past the end."""
    if n_local == 0:
        return local
    wl2 = window_widths(0, 2 * n_local, s)[1]
    lens = seq_lens.long().view(-1, 1)
    start = torch.clamp(torch.minimum(anchor_len.long(), lens) - n_local, min=0)
    start = torch.where(reuse, start, torch.clamp(lens - n_local, min=0))
    ids = (start // s).unsqueeze(-1) + torch.arange(wl2, device=local.device)
    ok = (ids < ((lens + s - 1) // s).unsqueeze(-1)) & (lens > 0).unsqueeze(-1)
    return torch.where(ok, ids, -1).to(torch.int32)


def cis_compose_reference(
    query: torch.Tensor,
    retrieve: torch.Tensor,
    bad: torch.Tensor,
    new_idx: torch.Tensor,
    new_scores: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    hold_local: bool = False,
) -> None:
    """Write each row's selection and update the anchors of the rows that retrieve.

    A retrieving row reads ``sink ∪ S_new ∪ local``, where ``S_new`` is ``new_idx [B, Hkv, M]``
    (blocks by score, largest first) without the entries whose ``new_scores`` is ``-inf``; it
    becomes the anchor (query, length, list, count; ``log δ_a = 0``). A reusing row reads
    ``sink ∪ S_a ∪ dilate(S_a) ∪ local`` (the first ``m`` entries of the anchor's list dilated
    by ``±1 .. ±r``); a ``bad`` row its windows only. The union is written ascending and
    distinct into ``out_indices [B, Hkv, W]`` / ``out_counts [B, Hkv]``.

    With ``hold_local``, a reusing row's local window starts where its anchor's did,
    ``max(min(t_a, t) − n_local, 0)``, and runs to the end (``wl`` blocks at most, the width of
    :func:`prhs_kernels.cis.cis_local_width`): the anchor's list was chosen outside the anchor's
    window, so the positions that slide out of the window during the anchor's life stay read.
    """
    b, hq, d = query.shape
    h = anchor_len.shape[1]
    mm = anchor_idx.shape[-1]
    a_idx, a_cnt = anchor_idx[slots], anchor_cnt[slots]
    used = torch.arange(mm, device=a_idx.device) < a_cnt.unsqueeze(-1)
    reuse_part = torch.cat([torch.where(used, a_idx, -1), dilate_indices(a_idx, a_cnt, m, r)], -1)
    new_ok = new_scores > float("-inf")
    new_cnt = new_ok.sum(-1).to(torch.int32)
    new = torch.where(new_ok, new_idx, -1).to(torch.int32)
    new = torch.nn.functional.pad(new, (0, mm - new.shape[-1]), value=-1)  # M' <= M entries
    new_part = torch.nn.functional.pad(new, (0, reuse_part.shape[-1] - mm), value=-1)
    part = torch.where(retrieve.unsqueeze(-1), new_part, reuse_part)
    part = part.masked_fill(bad.unsqueeze(-1), -1)
    s = block_size
    sink, local = window_indices_reference(seq_lens, n_sink, n_local, s)
    n_blocks = (seq_lens + s - 1) // s
    if hold_local:
        local = held_local_indices(local, seq_lens, anchor_len[slots], ~retrieve & ~bad, n_local, s)
    union_indices([sink, part, local], n_blocks, out_indices, out_counts)
    q = query.reshape(b, h, hq // h, d).float()
    rr = retrieve
    anchor_q[slots] = torch.where(rr[..., None, None], q, anchor_q[slots])
    anchor_len[slots] = torch.where(rr, seq_lens.view(-1, 1), anchor_len[slots])
    anchor_idx[slots] = torch.where(rr.unsqueeze(-1), new, a_idx)
    anchor_cnt[slots] = torch.where(rr, new_cnt, a_cnt)
    anchor_log_delta[slots] = torch.where(rr, 0.0, anchor_log_delta[slots]).to(
        anchor_log_delta.dtype
    )
