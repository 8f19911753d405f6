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
from prhs_kernels.kv.reference import gather_kv_reference
from prhs_kernels.score.reference import nonfinite_rows

__all__ = [
    "anchor_union_reference",
    "block_eligible_reference",
    "cis_compose_reference",
    "cis_decide_reference",
    "cis_rescore_reference",
    "held_local_indices",
    "rescore_pool",
    "rescore_window_start",
    "rescore_write",
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


def anchor_union_reference(
    anchor_idx: torch.Tensor, anchor_cnt: torch.Tensor, m: int, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(union [..., M + 2·r·m] int32, count [...] int32)``: what every reuse of an anchor
    reads besides its windows, ``S_a ∪ dilate(S_a)`` (the first ``anchor_cnt`` entries of the
    list ``anchor_idx [..., M]`` and the ``±1 .. ±r`` neighbours of its first ``m``, none below
    0), ascending and distinct, ``-1`` past the count. Not cut at any sequence's end: a reuse
    keeps the entries below its own."""
    mm = anchor_idx.shape[-1]
    used = torch.arange(mm, device=anchor_idx.device) < anchor_cnt.unsqueeze(-1)
    cand = torch.cat(
        [torch.where(used, anchor_idx, -1), dilate_indices(anchor_idx, anchor_cnt, m, r)], -1
    ).long()
    big = torch.iinfo(torch.int64).max
    x = torch.sort(torch.where(cand >= 0, cand, big), dim=-1).values
    prev = torch.nn.functional.pad(x[..., :-1], (1, 0), value=-1)
    keep = (x != big) & (x != prev)
    x = torch.sort(torch.where(keep, x, big), dim=-1).values
    width = mm + 2 * r * m
    x = torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=big)[..., :width]
    union = torch.where(x == big, -1, x).to(torch.int32)
    return union, keep.sum(-1).to(torch.int32)


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
    anchor_union: torch.Tensor | None = None,
    anchor_union_cnt: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
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

    ``anchor_union [N, Hkv, M + 2·r·m]`` / ``anchor_union_cnt [N, Hkv]`` (int32, both or
    neither): a retrieving row also stores its reuses' ``S_a ∪ dilate(S_a)``
    (:func:`anchor_union_reference`), which the Triton kernel's reusing rows copy instead of
    sorting the candidates again; this reference reads it nowhere.

    ``rows [B, Hkv]`` (bool): only these rows' selections are written and only the retrieving
    ones among them become anchors; the other rows' entries are left as they were.
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
    rr = retrieve
    if rows is None:
        union_indices([sink, part, local], n_blocks, out_indices, out_counts)
    else:
        got_i, got_c = torch.empty_like(out_indices), torch.empty_like(out_counts)
        union_indices([sink, part, local], n_blocks, got_i, got_c)
        out_indices.copy_(torch.where(rows.unsqueeze(-1), got_i, out_indices))
        out_counts.copy_(torch.where(rows, got_c, out_counts))
        rr = retrieve & rows
    q = query.reshape(b, h, hq // h, d).float()
    anchor_q[slots] = torch.where(rr[..., None, None], q, anchor_q[slots])
    anchor_len[slots] = torch.where(rr, seq_lens.view(-1, 1), anchor_len[slots])
    anchor_idx[slots] = torch.where(rr.unsqueeze(-1), new, a_idx)
    anchor_cnt[slots] = torch.where(rr, new_cnt, a_cnt)
    anchor_log_delta[slots] = torch.where(rr, 0.0, anchor_log_delta[slots]).to(
        anchor_log_delta.dtype
    )
    if anchor_union is not None and anchor_union_cnt is not None:
        union, u_cnt = anchor_union_reference(new, new_cnt, m, r)
        anchor_union[slots] = torch.where(rr.unsqueeze(-1), union, anchor_union[slots])
        anchor_union_cnt[slots] = torch.where(rr, u_cnt, anchor_union_cnt[slots])


def rescore_pool(
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool [B, Hkv, M + R] int64, valid)``: each batch row's anchor pool, its list's first
    ``anchor_cnt`` entries then its next-best blocks (``-1``: none)."""
    m = anchor_idx.shape[-1]
    pool = torch.cat([anchor_idx[slots], anchor_next[slots]], -1).long()
    e = torch.arange(pool.shape[-1], device=pool.device)
    valid = (pool >= 0) & ((e >= m) | (e < anchor_cnt[slots].unsqueeze(-1)))
    return torch.where(valid, pool, -1), valid


def rescore_window_start(
    seq_lens: torch.Tensor, anchor_len: torch.Tensor, slots: torch.Tensor, n_local: int, hold: bool
) -> torch.Tensor:
    """``[B, Hkv]`` int64: where a reuse's local window starts (the anchor's start with
    ``hold``, else ``t − n_local``)."""
    t = seq_lens.long().view(-1, 1)
    if hold:
        return torch.clamp(torch.minimum(anchor_len[slots].long(), t) - n_local, min=0)
    return torch.clamp(t - n_local, min=0).expand(-1, anchor_len.shape[1])


def rescore_write(
    pool: torch.Tensor,
    chosen: torch.Tensor,
    reuse: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write the re-ranked pools of the ``reuse`` rows: ``chosen [B, Hkv, M]`` are the pool
    entries (indices into ``pool [B, Hkv, P]``, best first, ``-1`` for none) that become the
    list; the others, in pool order, the next blocks."""
    b, h, n_pool = pool.shape
    r = anchor_next.shape[-1]
    ok = chosen >= 0
    new_list = torch.where(ok, pool.gather(-1, chosen.long().clamp(min=0)), -1)
    mark = torch.zeros(b, h, n_pool + 1, dtype=torch.bool, device=pool.device)
    mark.scatter_(-1, torch.where(ok, chosen.long(), n_pool), True)
    rest = torch.sort(mark[..., :n_pool].to(torch.int8), dim=-1, stable=True).indices[..., :r]
    new_next = pool.gather(-1, rest)
    new_cnt = (new_list >= 0).sum(-1)
    rows = reuse.unsqueeze(-1)
    anchor_idx[slots] = torch.where(rows, new_list.to(anchor_idx.dtype), anchor_idx[slots])
    anchor_next[slots] = torch.where(rows, new_next.to(anchor_next.dtype), anchor_next[slots])
    anchor_cnt[slots] = torch.where(reuse, new_cnt.to(anchor_cnt.dtype), anchor_cnt[slots])


def cis_rescore_reference(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    reuse: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_size: int,
    n_sink: int,
    n_local: int,
    hold_local: bool,
    score: str = "mass",
) -> None:
    """Re-rank each ``reuse [B, Hkv]`` row's anchor pool at the current query, in place.

    A row's pool is its anchor's list (``anchor_idx [N, Hkv, M]``, the first ``anchor_cnt``
    entries) and the next-best blocks of the same retrieval (``anchor_next [N, Hkv, R]``,
    ``-1`` for none), rows by state slot (``slots [B]``). Each pool block is scored as a
    retrieval would score it, but only among the keys this step reads: every query head's
    probabilities are normalised over the pool's positions, the sink and the local window (held
    from the anchor's start with ``hold_local``), averaged over the group, and summed over the
    block (``score="mass"``) or maximised (``"max"``). The best ``M`` become the list (by score,
    largest first, ties toward the earlier pool entry; ``anchor_cnt`` their number) and the
    others, in pool order, the next blocks, so the pool itself never changes until the next
    retrieval. The other rows are left as they are."""
    b, hq, d = query.shape
    h = anchor_len.shape[1]
    g, s = hq // h, block_size
    m = anchor_idx.shape[-1]
    dev = query.device
    pool, valid = rescore_pool(anchor_idx, anchor_cnt, anchor_next, slots)
    t = kv.seq_lens.long().view(-1, 1, 1)  # [B, 1, 1]
    cand = pool.unsqueeze(-1) * s + torch.arange(s, device=dev)  # [B, H, P, s]
    cand_ok = valid.unsqueeze(-1) & (cand < t.unsqueeze(-1))
    cand = torch.where(cand_ok, cand, -1).flatten(2)
    start = rescore_window_start(kv.seq_lens, anchor_len, slots, n_local, hold_local)
    width = 2 * n_local if hold_local else n_local
    local = start.unsqueeze(-1) + torch.arange(width, device=dev)  # [B, H, wl]
    local = torch.where(local < t, local, -1)
    sink = torch.arange(n_sink, device=dev).view(1, 1, -1).expand(b, h, -1)
    sink = torch.where((sink < t) & (sink < start.unsqueeze(-1)), sink, -1)  # not twice
    positions = torch.cat([cand, sink, local], -1)  # [B, H, X]
    keys, _ = gather_kv_reference(kv, positions, values=False)
    q = query.reshape(b, h, g, d).float()
    logits = torch.einsum("bhgd,bhxd->bhgx", q, keys.float()) * scaling
    logits = logits.masked_fill((positions < 0).unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, -1, keepdim=True)
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)).nan_to_num(0.0)
    per_block = probs.mean(2)[..., : cand.shape[-1]].reshape(b, h, -1, s)
    block = per_block.amax(-1) if score == "max" and s > 1 else per_block.sum(-1)
    block = torch.where(valid, block.nan_to_num(-1.0), -1.0)
    order = torch.sort(block, dim=-1, descending=True, stable=True).indices[..., :m]
    chosen = torch.where(valid.gather(-1, order), order, -1)
    rescore_write(pool, chosen, reuse, anchor_idx, anchor_cnt, anchor_next, slots)
