"""CIS's reuse threshold calibrated on the prompt itself (``tau="auto"``).

One cosine threshold does not suit every model, layer or head: at ``τ = 0.72`` SmolLM2 retrieves
at about 28 % of its decisions and Qwen2.5-0.5B at 12 %, where it keeps far less attention mass.
The last ``W`` queries of a prompt are decoding queries in all but name: each sees the keys before
it, and consecutive ones are as alike as consecutive decode queries. So at prefill, per layer,
:func:`replay_curves` scores those ``W`` queries against the prompt's keys and replays the CIS
anchor process over them at every threshold of a grid, recording for every KV head what each
threshold would cost (``β``, the mass the oracle of the same size keeps minus the mass kept) and
how often it would retrieve (``ρ̂``). Once every layer is seen, :func:`choose_tau` picks one
threshold per (layer, KV head): the one minimising ``β + λ·ρ̂``, with ``λ`` bisected so that the
mean ``ρ̂`` over the model's rows meets a target. Rows where reuse costs little get a low
threshold; rows whose queries drift get a high one.

The replay is CIS's own process in plain torch, measured with the selection meter's definitions:
a retrieval reads the top ``k`` positions (``k/s`` blocks) outside the sink and local windows,
plus the windows; a reuse reads the anchor's set, its dilation, the sink and the local window
(held from the anchor's start with ``hold_local``). The first query has no anchor (it retrieves
at every threshold) and is left out of both figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["TAU_GRID", "Replay", "ReplayConfig", "choose_tau", "replay_curves"]

#: The thresholds a calibration chooses from (1.01: always retrieve).
TAU_GRID = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.975, 1.01)

NEG = -1.0  # below every probability: marks an ineligible position in a top-k


@dataclass(frozen=True)
class ReplayConfig:
    """The CIS hyperparameters a replay follows (see :class:`prhs_selectors.cis.CISConfig`)."""

    budget: int
    n_sink: int
    n_local: int
    block_size: int
    block_score: str
    n_den: int
    r: int
    hold_local: bool
    rescore_blocks: int = 0
    """Next-best blocks of the last query's retrieval to return (:attr:`Replay.last_next`);
    the replay itself does not re-rank (its reuses read the anchor's list)."""

    def min_prompt_len(self, queries: int) -> int:
        """The shortest prompt whose first replayed query already drops positions: shorter
        ones say nothing about reuse (every set holds everything), so they are not
        calibrated."""
        return queries + self.n_sink + self.n_local + self.budget + self.block_size


class Replay(NamedTuple):
    """What :func:`replay_curves` measured on one prompt."""

    beta: torch.Tensor
    """``[Hkv, K]`` float32: the mean ``β`` at each threshold."""
    rho: torch.Tensor
    """``[Hkv, K]`` float32: the retrieval ratio at each threshold."""
    last_top: torch.Tensor
    """``[Hkv, k/s]`` int64: the last query's retrieval, blocks by score, largest first (``-1``
    past the eligible ones): the anchor a decode step can reuse."""
    last_next: torch.Tensor
    """``[Hkv, R]`` int64: the blocks ranked after those (``ReplayConfig.rescore_blocks``;
    ``-1`` past the eligible ones), for a ``rescore`` anchor's pool."""


def _token_mask(blocks: torch.Tensor, s: int, n: int) -> torch.Tensor:
    """``[..., NB]`` block mask to ``[..., n]`` positions."""
    return blocks if s == 1 else blocks.repeat_interleave(s, dim=-1)[..., :n]


def _marks(ids: torch.Tensor, ok: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., width]`` bool: ``True`` at ``ids`` where ``ok``."""
    out = torch.zeros(*ids.shape[:-1], width + 1, dtype=torch.bool, device=ids.device)
    out.scatter_(-1, torch.where(ok, ids, width), True)
    return out[..., :width]


def replay_curves(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    config: ReplayConfig,
    taus: torch.Tensor,
) -> Replay:
    """The mean ``β`` and the retrieval ratio of CIS at each threshold of ``taus [K]``,
    replayed over one prompt's last ``W`` queries, and the last query's retrieval.

    ``queries [W, Hq, D]`` are the queries (after RoPE) of positions ``n − W .. n − 1`` of a
    prompt whose keys are ``keys [Hkv, n, D]``; query ``i`` sees positions ``< n − W + i + 1``.
    The means run over queries ``1 .. W − 1``.
    """
    w, hq, d = queries.shape
    h, n, _ = keys.shape
    if w < 2:
        raise ValueError(f"a replay needs at least 2 queries, got {w}")
    g = hq // h
    c = config
    s = c.block_size
    dev = keys.device
    q = queries.float().reshape(w, h, g, d)
    ln = torch.arange(n - w + 1, n + 1, device=dev)  # [W] positions each query sees
    pos = torch.arange(n, device=dev)
    visible = pos.view(1, -1) < ln.view(-1, 1)  # [W, n]
    z = torch.einsum("whgd,htd->whgt", q, keys.float()) * scaling
    z.masked_fill_(~visible.view(w, 1, 1, n), -math.inf)
    gm = torch.softmax(z, -1).mean(2)  # [W, H, n] group-mean probabilities
    del z

    # Retrieval: the top k/s blocks outside the blocks holding a sink or local position.
    nb = -(-n // s)
    lo_local = (ln - c.n_local).clamp(min=0)  # [W]
    blk = torch.arange(nb, device=dev).view(1, -1)
    sink_blocks = -(-min(c.n_sink, n) // s)
    eligible = (blk >= sink_blocks) & (blk < (lo_local // s).view(-1, 1))  # [W, NB]
    gm_pad = torch.nn.functional.pad(gm, (0, nb * s - n)).view(w, h, nb, s)
    score = gm_pad.amax(-1) if c.block_score == "max" and s > 1 else gm_pad.sum(-1)
    score = score.masked_fill(~eligible.unsqueeze(1), NEG)
    top = score.topk(min(c.budget // s, nb), dim=-1)  # sorted, largest first
    new_b = _marks(top.indices, top.values > NEG, nb)  # [W, H, NB]
    m = (c.budget // s) // c.n_den
    more_b = torch.zeros_like(new_b)
    if c.r > 0 and m > 0:
        one_side = torch.arange(1, c.r + 1, device=dev)
        offs = torch.cat([one_side, -one_side])
        cand = top.indices[..., :m, None] + offs  # [W, H, m, 2r]
        vis_b = (-(-ln // s)).view(w, 1, 1, 1)  # blocks holding a visible position
        ok = (top.values[..., :m, None] > NEG) & (cand >= 0) & (cand < vis_b)
        more_b = _marks(cand.flatten(2), ok.flatten(2), nb)
    sink = (pos < c.n_sink).view(1, 1, n)
    local = (pos.view(1, -1) >= lo_local.view(-1, 1)) & visible  # [W, n]
    new = _token_mask(new_b, s, n) & visible.unsqueeze(1)
    anchor = (_token_mask(new_b | more_b, s, n) & visible.unsqueeze(1)) | sink  # [W, H, n]
    read_ret = new | sink | local.unsqueeze(1)

    ranked = gm.sort(-1, descending=True).values.cumsum(-1)  # [W, H, n] the oracle's mass

    def star(step_first: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
        idx = (size - 1).clamp(0, n - 1).unsqueeze(-1)
        return torch.gather(step_first, -1, idx).squeeze(-1)

    size_ret = read_ret.sum(-1)
    beta_ret = (star(ranked, size_ret) - (gm * read_ret).sum(-1)).clamp_min(0)  # [W, H]

    # Reuse at step j of the anchor made at step a (a < j <= a + n_local): it reads
    # anchor(a) ∪ [lo, ln_j), lo = ln_a − n_local (held) or ln_j − n_local (sliding).
    af = anchor.float()
    kept_anchor = torch.einsum("ahn,jhn->ajh", af, gm)  # [W(a), W(j), H]
    n_anchor = anchor.sum(-1)  # [W(a), H]
    if c.hold_local:
        lo = lo_local  # by anchor
        cs = torch.nn.functional.pad(gm.cumsum(-1), (1, 0))  # [W, H, n + 1]
        tail = cs[..., -1].unsqueeze(0) - cs[:, :, lo].permute(2, 0, 1)  # [a, j, H]
        high = anchor & (pos.view(1, 1, -1) >= lo.view(-1, 1, 1))
        overlap = torch.einsum("ahn,jhn->ajh", high.float(), gm)
        in_range = high.sum(-1).unsqueeze(1)  # [a, 1, H]
        span = ln.view(1, -1, 1) - lo.view(-1, 1, 1)  # [a, j, 1]
    else:
        tail = (gm * local.unsqueeze(1)).sum(-1).unsqueeze(0)  # [1, j, H]
        overlap = torch.einsum("ahn,jhn->ajh", af, gm * local.unsqueeze(1))
        ca = torch.nn.functional.pad(anchor.cumsum(-1), (1, 0))  # [a, H, n + 1]
        in_range = (ca[:, :, ln] - ca[:, :, lo_local]).permute(0, 2, 1)  # [a, j, H]
        span = (ln - lo_local).view(1, -1, 1)
    kept = kept_anchor + tail - overlap
    size = n_anchor.unsqueeze(1) + span - in_range  # [a, j, H]
    star_reuse = torch.gather(
        ranked.unsqueeze(0).expand(w, w, h, n), -1, (size - 1).clamp(0, n - 1).unsqueeze(-1)
    ).squeeze(-1)
    beta_reuse = (star_reuse - kept).clamp_min(0)  # [a, j, H]

    qn = q.reshape(w, h, g * d)
    qn = qn / qn.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    cos = torch.einsum("ahx,jhx->ajh", qn, qn)  # [a, j, H]

    # The replay at every threshold at once, with no loop over steps: from an anchor made at
    # step a, the next retrieval is the first later step whose cosine with it is below τ or
    # that is more than n_local steps on; the retrieval steps are the chain of such jumps
    # from step 0 (found by pointer doubling).
    k = taus.numel()
    steps = torch.arange(w, device=dev)
    later = steps.view(1, -1) > steps.view(-1, 1)  # [a, j]
    aged = (steps.view(1, -1) - steps.view(-1, 1)) > c.n_local
    thr = taus.to(dev, torch.float32).view(-1, 1, 1, 1)
    stop = later & (aged | (cos.permute(2, 0, 1).unsqueeze(0) < thr))  # [K, H, a, j]
    stop = torch.cat([stop, torch.ones_like(stop[..., :1])], -1)  # column w: never
    nxt = stop.to(torch.uint8).argmax(-1)  # [K, H, a]: the first stop (argmax: the first max)
    jump = torch.cat([nxt, torch.full_like(nxt[..., :1], w)], -1)  # [K, H, w + 1]
    nodes = torch.arange(w + 1, device=dev)
    reach = (nodes == 0).expand(k, h, -1)  # reached from step 0 in fewer than 2^i jumps
    for _ in range(math.ceil(math.log2(w + 1))):
        landed = (reach.unsqueeze(-1) & (jump.unsqueeze(-1) == nodes)).any(-2)
        reach = reach | landed
        jump = jump.gather(-1, jump)
    retrieves = reach[..., :w]  # [K, H, W]
    reuses = later & (steps.view(1, 1, 1, -1) < nxt.unsqueeze(-1))  # [K, H, a, j]: j reuses a
    reuse_beta = (reuses * beta_reuse.permute(2, 0, 1).unsqueeze(0)).sum(-1)  # [K, H, a]
    counted = steps >= 1  # the first query has no anchor at any threshold: left out
    beta_sum = (retrieves * (reuse_beta + beta_ret.t().unsqueeze(0) * counted)).sum(-1)
    ret_sum = (retrieves & counted).sum(-1)
    m_width = c.budget // s
    last_all = score[-1].topk(min(m_width + c.rescore_blocks, nb), dim=-1)
    last = torch.where(last_all.values > NEG, last_all.indices, -1)
    last = torch.nn.functional.pad(last, (0, m_width + c.rescore_blocks - last.shape[-1]), value=-1)
    return Replay(
        (beta_sum / (w - 1)).t().contiguous(),
        (ret_sum.float() / (w - 1)).t().contiguous(),
        last[..., :m_width].contiguous(),
        last[..., m_width:].contiguous(),
    )


def choose_tau(
    beta: torch.Tensor,
    rho: torch.Tensor,
    taus: torch.Tensor,
    target_rho: float,
    fallback: float,
    steps: int = 512,
) -> torch.Tensor:
    """``[B, R]`` float32: a threshold per row (a (layer, KV head)) of each of ``B`` prompts.

    ``beta [B, R, K]`` and ``rho [B, R, K]`` are each row's curves over ``taus [K]`` (rows
    with a negative value were not calibrated and get ``fallback``). Per prompt, every row
    takes the threshold minimising ``β + λ·ρ̂``, with ``λ`` the smallest value in ``[0, 10]``
    (to about 5e-5 of it) whose mean ``ρ̂`` over the calibrated rows is at most ``target_rho``
    (10, if none is).
    """
    valid = (beta >= 0).all(-1) & (rho >= 0).all(-1)  # [B, R]; also False where NaN
    b = torch.where(valid.unsqueeze(-1), beta, 0.0)
    r = torch.where(valid.unsqueeze(-1), rho, 0.0)
    n_valid = valid.sum(-1, keepdim=True).clamp(min=1)

    # Every λ of a grid at once (no host read, few launches); the mean ρ̂ of the picks falls as
    # λ grows, so the first λ that meets the target is the smallest. A second grid inside the
    # bracket that first λ closes refines it (to about 5e-5 of its value).
    def first_ok(lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B], picks [B, Λ, R])`` of each prompt's first λ (``lam [B, Λ]``)."""
        n_lam = lam.shape[1]
        pick = (b.unsqueeze(1) + lam.view(*lam.shape, 1, 1) * r.unsqueeze(1)).argmin(-1)
        got = torch.gather(r.unsqueeze(1).expand(-1, n_lam, -1, -1), -1, pick.unsqueeze(-1))
        mean = (got.squeeze(-1) * valid.unsqueeze(1)).sum(-1) / n_valid  # [B, Λ]
        ok = mean <= target_rho
        return torch.where(ok.any(-1), ok.to(torch.uint8).argmax(-1), n_lam - 1), pick

    coarse = torch.logspace(-5, 1, steps, device=beta.device)
    coarse[0] = 0.0
    coarse = coarse.expand(beta.shape[0], -1)
    i, _ = first_ok(coarse)
    hi = coarse.gather(1, i.view(-1, 1))
    lo = coarse.gather(1, (i - 1).clamp(min=0).view(-1, 1))
    fine = lo + (hi - lo) * torch.linspace(0, 1, steps, device=beta.device).view(1, -1)
    j, pick = first_ok(fine)
    idx = j.view(-1, 1, 1).expand(-1, 1, pick.shape[-1])
    chosen = taus.to(beta.device, torch.float32)[pick.gather(1, idx).squeeze(1)]
    return torch.where(valid, chosen, torch.full_like(chosen, fallback))
