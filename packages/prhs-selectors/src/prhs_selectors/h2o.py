"""``h2o``: heavy hitters by accumulated attention mass plus a recent window; eviction is final."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.protocols import DecodeStep
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SequenceStatePool
from prhs_selectors.base import (
    BaseSelector,
    exact_group_scores,
    make_selection,
    topk_mask,
    window_mask,
)

__all__ = ["H2O", "H2OConfig"]


def _check_ratio(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float in (0, 1], got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{name} must lie in (0, 1], got {value}")


@dataclass(frozen=True)
class H2OConfig(SelectorConfig):
    """Hyperparameters of :class:`H2O`.

    The shared fields are those of :class:`~prhs_core.config.SelectorConfig`; ``block_size``
    must be 1 (H2O evicts single tokens).

    Parameters
    ----------
    heavy_ratio, recent_ratio:
        The budget ``k`` is split between heavy hitters and recent positions in the proportion
        ``heavy_ratio : recent_ratio``: ``n_heavy = round(k · heavy / (heavy + recent))``
        (Python's ``round``), ``n_recent = k − n_heavy``. H2O states both as fractions of the
        cache (0.1 each by default, so the default split is half and half). Each must lie in
        ``(0, 1]``.
    """

    heavy_ratio: float = 0.1
    recent_ratio: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_ratio("heavy_ratio", self.heavy_ratio)
        _check_ratio("recent_ratio", self.recent_ratio)
        if self.block_size != 1:
            raise ValueError(
                f"h2o supports only block_size=1 (it evicts single tokens), got "
                f"block_size={self.block_size}"
            )

    @property
    def n_heavy(self) -> int:
        """Heavy-hitter positions per step."""
        share = self.heavy_ratio / (self.heavy_ratio + self.recent_ratio)
        return round(self.budget * share)

    @property
    def n_recent(self) -> int:
        """Recent positions per step, beyond the local window."""
        return self.budget - self.n_heavy


@selectors.register(
    "h2o", config=H2OConfig, summary="heavy hitters + recent window, permanent eviction (H2O)"
)
class H2O(BaseSelector):
    """Heavy-Hitter Oracle: keep the positions that have drawn the most attention so far.

    Zhang, Sheng, Zhou, Chen, Zheng, Cai, Song, Tian, Ré, Barrett, Wang and Chen,
    "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    NeurIPS 2023 (arXiv:2306.14048).

    State per (sequence, layer, KV head): the accumulated attention mass ``A_i`` of every
    position and whether it has been evicted. At each step, with ``t`` cached positions:

    1. the selection is the sink and local windows, the ``n_recent`` most recent positions
       before the local window, and the ``n_heavy`` non-evicted positions of largest ``A_i``
       among the rest;
    2. every other position (all older than the recent window) is evicted **for good**: it is
       never selected again, whatever its mass or its logit later;
    3. the step's attention over the selected set is added to ``A``: the group mean over the
       ``g`` query heads of the softmax of the selected logits only (what the sparse step
       attends to; logits are computed at the selected positions only).

    H2O accumulates attention over the prompt during prefill; prhs sees no prefill attention,
    so at a sequence's first decode step on a layer ``A`` is seeded with the group-mean
    attention of that step's query over every cached key. That step scores every key (a
    retrieval); its seeded mass stands for the step's own contribution (step 3 is skipped).
    Without a prefill the prompt's evictions all happen at that first step, and from then on
    one position leaves the recent window per step and at most one is evicted.

    GQA: one decision per KV head, on the group-mean mass (SPEC.md §1). ``block_size`` must be
    1. Stats: ``retrieved`` on seeding steps only; ``proxy_bytes`` is the accumulated-score row
    read, ``4·t`` bytes per KV head (float32), plus every key's bytes on a seeding step.
    """

    name = "h2o"
    config_type = H2OConfig
    config: H2OConfig

    def init_fields(self, pool: SequenceStatePool, spec: AttentionSpec, max_seq_len: int) -> None:
        shape = (spec.num_layers, spec.num_kv_heads, max_seq_len)
        pool.add_field("h2o_mass", shape, torch.float32, 0.0)
        pool.add_field("h2o_evicted", shape, torch.bool, False)
        pool.add_field("h2o_initialised", (spec.num_layers,), torch.bool, False)

    def select_step(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        c = self.config
        cache = step.cache
        layer, slots = step.layer, step.slots.to(state.device)
        b, hkv, t = cache.batch_size, cache.num_kv_heads, cache.max_seq_len
        lens = cache.seq_lens
        dev = lens.device

        mass = state["h2o_mass"][slots, layer, :, :t].to(dev)  # [B, Hkv, T]
        evicted = state["h2o_evicted"][slots, layer, :, :t].to(dev)
        seed = ~state["h2o_initialised"][slots, layer].to(dev)  # [B]
        valid = cache.valid_mask()[:, None]  # [B, 1, T]
        if bool(seed.any()):
            probs = exact_group_scores(step).probs
            mass = torch.where(seed.view(-1, 1, 1) & valid, probs, mass)

        win = window_mask(lens, t, c.n_sink, c.n_local)[:, None]
        recent = window_mask(lens, t, c.n_sink, c.n_local + c.n_recent)[:, None] & ~win
        kept = (win | recent).expand(b, hkv, t)
        heavy = topk_mask(mass, c.n_heavy, valid & ~evicted & ~kept)
        selected = kept | heavy
        evicted = evicted | (valid & ~selected)

        # The step's attention over the selected set (group mean of the selected softmax).
        idx = Selection.from_mask(selected).indices  # [B, Hkv, K], -1 padded
        keys, _ = cache.gather(idx)
        q = step.query.reshape(b, hkv, step.group_size, -1).float()
        logits = torch.einsum("bhgd,bhkd->bhgk", q, keys.float()) * step.scaling
        logits = logits.masked_fill((idx < 0)[:, :, None], float("-inf"))
        gained = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(2)  # [B, Hkv, K]
        gained = gained.masked_fill(seed.view(-1, 1, 1) | (idx < 0), 0.0)
        mass = mass.scatter_add(-1, idx.clamp(min=0), gained)

        state["h2o_mass"][slots, layer, :, :t] = mass.to(state.device)
        state["h2o_evicted"][slots, layer, :, :t] = evicted.to(state.device)
        state["h2o_initialised"][slots, layer] = True

        row_bytes = lens.view(-1, 1).to(torch.float64) * 4.0
        proxy = row_bytes + torch.where(seed.view(-1, 1), self.retrieval_bytes(step), 0.0)
        return make_selection(
            selected,
            1,
            lens,
            retrieved=seed.view(-1, 1).expand(b, hkv),
            proxy_bytes=proxy.expand(b, hkv),
        )
