"""Torch reference of CompKV's block statistics: per aligned block of keys, the estimated
softmax log-mass and logit variance from its key sum and sum of squares, and the compensation
output of the blocks left out, from their value sums -- all read from one layer's side-cache
fields through each block's page row.
"""

from __future__ import annotations

import torch

__all__ = ["block_compensation_reference", "block_estimates_reference", "block_validity"]


def block_validity(
    count: torch.Tensor, pages: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cnt [B, NB], valid [B, NB])``: each block's key count read at its page row (1 where the
    block is not valid) and whether it exists (starts before the row's end) and holds a key."""
    nb = pages.shape[1]
    first = torch.arange(nb, device=pages.device) * block_size
    exists = first.view(1, -1) < seq_lens.view(-1, 1)
    cnt = count[torch.where(exists, pages, 0)]
    valid = exists & (cnt > 0)
    return torch.where(valid, cnt, torch.ones_like(cnt)), valid


def block_estimates_reference(
    query: torch.Tensor,
    ksum: torch.Tensor,
    ksq: torch.Tensor,
    count: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_mass, log_var)``, each ``[B, Hkv, g, NB]`` float32, ``-inf`` where a block is not
    valid (:func:`block_validity`).

    ``query [B, Hq, D]``; one layer's fields ``ksum``, ``ksq`` ``[R, Hkv, D]`` float32 and
    ``count [R]``; ``pages [B, NB]`` the page row of block ``n`` (positions ``n·b ..``) of each
    row, read only where the block exists. ``log_mass = log|B| + s·q·μ_B`` and ``log_var =
    log(s²·Σ_j q_j²·σ²_{B,j})`` with ``μ_B``, ``σ²_B`` the block's key mean and per-channel
    variance."""
    b, hq, d = query.shape
    h = ksum.shape[1]
    cnt, valid = block_validity(count, pages, seq_lens, block_size)
    at = torch.where(valid, pages, 0)
    c = cnt.unsqueeze(-1).unsqueeze(-1)
    mu = ksum[at] / c  # [B, NB, Hkv, D]
    var = (ksq[at] / c - mu * mu).clamp_min(0.0)
    q = query.float().view(b, h, hq // h, d)
    mean_logit = torch.einsum("bhgd,bnhd->bhgn", q, mu) * scaling
    logit_var = torch.einsum("bhgd,bnhd->bhgn", q * q, var) * (scaling * scaling)
    ninf = torch.full((), float("-inf"), device=query.device)  # a fill: graph-capturable
    keep = valid.view(b, 1, 1, -1)
    log_mass = torch.where(keep, torch.log(cnt.view(b, 1, 1, -1)) + mean_logit, ninf)
    log_var = torch.where(keep, torch.log(logit_var), ninf)
    return log_mass, log_var


def block_compensation_reference(
    weight: torch.Tensor,
    vsum: torch.Tensor,
    count: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``[B, Hkv, g, Dv]`` float32 ``Σ_n weight[b, h, g, n]·v̄_n`` over the valid blocks, ``v̄_n``
    a block's value mean (its value sum ``vsum [R, Hkv, Dv]`` over its count); blocks that are
    not valid add nothing, whatever ``weight`` and their page rows hold."""
    cnt, valid = block_validity(count, pages, seq_lens, block_size)
    at = torch.where(valid, pages, 0)
    vbar = vsum[at] / cnt.unsqueeze(-1).unsqueeze(-1)  # [B, NB, Hkv, Dv]
    vbar = torch.where(valid.view(*valid.shape, 1, 1), vbar, torch.zeros((), device=vbar.device))
    w = torch.where(valid.view(valid.shape[0], 1, 1, -1), weight.float(), 0.0)
    return torch.einsum("bhgn,bnhd->bhgd", w, vbar)
