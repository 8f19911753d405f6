"""``h2o``: heavy hitters by accumulated attention mass plus a recent window; eviction is final."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels.kv import gather_kv, token_locations
from prhs_kernels.topk import topk_indices
from prhs_selectors.base import BaseSelector

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

    State: per KV location (a side cache that follows the KV pool) and layer and KV head, the
    accumulated attention mass ``A_i`` of the key and whether it has been evicted, reset when
    the host writes a new key there; per request and layer, whether it has been seeded. At each
    step, with ``t`` cached positions:

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
    retrieval); its seeded mass stands for the step's own contribution (step 3 is skipped). The
    plan says on the host whether a sequence was created since the last step
    (:attr:`~prhs_core.plan.DecodePlan.seeding`): steps without a new sequence skip the scoring.

    GQA: one decision per KV head, on the group-mean mass. ``block_size`` must be 1. Stats:
    ``retrieved`` on seeding steps only; ``proxy_bytes`` is the accumulated-score row read,
    ``4·t`` bytes per KV head (float32), plus every key's bytes on a seeding step.
    """

    name = "h2o"
    config_type = H2OConfig
    config: H2OConfig
    state_per_location = True  # accumulated attention of the request holding the slot

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + wl + self.config.n_recent + self.config.n_heavy

    def uses_side_cache(self) -> bool:
        return True

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        assert state.side is not None
        shape = (spec.num_layers, spec.num_kv_heads)
        state.side.add_field("h2o_mass", shape, torch.float32, 0.0)
        state.side.add_field("h2o_evicted", shape, torch.bool, False)
        state.pool.add_field("h2o_seeded", (spec.num_layers,), torch.bool, False)

    def write_side(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        finite: torch.Tensor,
    ) -> None:
        side = state.side
        assert side is not None
        rows = side.rows_of(locations)
        # index_fill_ takes its value as a scalar (an assignment would copy a CPU tensor, which
        # a CUDA graph cannot capture).
        side["h2o_mass"][:, layer].index_fill_(0, rows, 0.0)
        side["h2o_evicted"][:, layer].index_fill_(0, rows, False)

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,
    ) -> Selection | None:
        c = self.config
        side = state.side
        assert side is not None
        b, hkv, t = kv.batch_size, kv.num_kv_heads, kv.max_len
        lens = kv.seq_lens.view(-1, 1).long()
        dev = lens.device
        pos = torch.arange(t, device=dev).view(1, -1)
        rows = side.rows_of(token_locations(kv, pos.expand(b, -1), state.row_stride))  # [B, T]
        stored = side["h2o_mass"][:, layer][rows].transpose(1, 2)  # [B, Hkv, T]
        mass = stored
        evicted = side["h2o_evicted"][:, layer][rows].transpose(1, 2)
        valid = (pos < lens).unsqueeze(1)  # [B, 1, T]
        seeded = state.pool["h2o_seeded"][:, layer][plan.slots]  # [B]
        seed = (~seeded).view(-1, 1, 1)
        retrieved = torch.zeros(b, 1, dtype=torch.bool, device=dev)
        proxy = lens.to(torch.float64) * 4.0
        if plan.seeding:  # a host flag: some sequence may be at its first decode step
            probs = self.exact_probs(plan, query, kv)
            mass = torch.where(seed & valid, probs, mass)
            retrieved = ~seeded.view(-1, 1)
            proxy = proxy + torch.where(retrieved, self.retrieval_bytes(kv), 0.0)

        # Sink, local and recent windows, then the heavy hitters among the rest.
        recent_lo = lens - c.n_local - c.n_recent
        recent = recent_lo + torch.arange(c.n_recent, device=dev).view(1, -1)
        recent = torch.where((recent >= 0) & (recent >= c.n_sink), recent, -1)
        kept = ((pos < c.n_sink) | (pos >= recent_lo)) & (pos < lens)  # [B, T]
        eligible = valid & ~evicted & ~kept.unsqueeze(1) & ~bad.unsqueeze(-1)
        heavy, _ = topk_indices(mass, c.n_heavy, eligible)
        sel = self.compose(plan, kv, recent, heavy)
        selected = sel.to_mask(kv.seq_lens, t)
        new_evicted = evicted | (valid & ~selected)

        # The step's attention over the selected set (group mean of the selected softmax).
        idx = torch.where(sel.entry_mask(), sel.indices, -1)
        keys, _ = gather_kv(kv, idx, values=False)
        q = query.reshape(b, hkv, query.shape[1] // hkv, -1).float()
        logits = torch.einsum("bhgd,bhkd->bhgk", q, keys.float()) * plan.scaling
        logits = logits.masked_fill((idx < 0)[:, :, None], float("-inf"))
        gained = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(2)  # [B, Hkv, K]
        seeded_now = seed if plan.seeding else torch.zeros_like(seed)
        gained = gained.masked_fill(seeded_now | (idx < 0), 0.0)
        scatter_at = torch.where(idx >= 0, idx.long(), t)
        padded = torch.nn.functional.pad(mass, (0, 1))
        new_mass = padded.scatter_add(-1, scatter_at, gained)[..., :t]

        keep_old = bad.unsqueeze(-1)  # skipped rows leave their state as it was
        side["h2o_mass"][:, layer][rows] = torch.where(keep_old, stored, new_mass).transpose(1, 2)
        side["h2o_evicted"][:, layer][rows] = torch.where(keep_old, evicted, new_evicted).transpose(
            1, 2
        )
        state.pool["h2o_seeded"][:, layer][plan.slots] = seeded | ~bad.all(-1)
        self.record(plan, layer, kv, sel, retrieved, proxy)
        return sel
