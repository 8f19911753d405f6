"""``quest``: query-aware page selection by an upper bound of every logit in a page."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core._checks import check_int
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.protocols import DecodeStep
from prhs_core.registry import selectors
from prhs_core.selection import Selection, StepStats
from prhs_core.state import SequenceStatePool
from prhs_selectors.base import BaseSelector, block_any, make_selection, topk_mask

__all__ = ["Quest", "QuestConfig", "page_bounds"]


@dataclass(frozen=True)
class QuestConfig(SelectorConfig):
    """Hyperparameters of :class:`Quest`.

    The shared fields are those of :class:`~prhs_core.config.SelectorConfig`; the budget ``k``
    buys ``max(1, k // page_size)`` pages, and ``block_size`` must be 1 or ``page_size`` (the
    selection always comes in pages).

    Parameters
    ----------
    page_size:
        Positions per page; selection and reading happen in aligned pages. Must be ``>= 1``.
    dense_layers:
        The first ``dense_layers`` layers are dense (Quest leaves the first two layers alone:
        their attention is not sparse). Must be ``>= 0``.
    """

    page_size: int = 16
    dense_layers: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("page_size", self.page_size, minimum=1)
        check_int("dense_layers", self.dense_layers, minimum=0)
        if self.block_size not in (1, self.page_size):
            raise ValueError(
                f"quest selects whole pages: block_size must be 1 or page_size "
                f"({self.page_size}), got block_size={self.block_size}"
            )


def page_bounds(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Quest's upper bound of every logit in each page, per query head.

    ``scaling · Σ_j max(q_j·max_j, q_j·min_j)``: each term bounds ``q_j·k_j`` for every key of
    the page, as ``k_j ∈ [min_j, max_j]``.

    Parameters
    ----------
    query:
        ``[B, Hkv, g, D]`` float32.
    kmin, kmax:
        ``[B, Hkv, P, D]`` float32 element-wise key minimum and maximum of each page (finite).
    scaling:
        Logit scale.

    Returns
    -------
    ``[B, Hkv, g, P]`` float32 bounds.
    """
    # q_j·max_j when q_j >= 0, q_j·min_j when q_j < 0: two matmuls instead of a [.., P, D] max.
    pos, neg = query.clamp(min=0), query.clamp(max=0)
    bound = torch.einsum("bhgd,bhpd->bhgp", pos, kmax) + torch.einsum("bhgd,bhpd->bhgp", neg, kmin)
    return bound * scaling


@selectors.register("quest", config=QuestConfig, summary="query-aware page bounds (Quest)")
class Quest(BaseSelector):
    """Quest: keep the pages whose logit upper bound, from per-page key min/max, is largest.

    Tang, Zhao, Zhu, Xiao, Kasikci and Han, "Quest: Query-Aware Sparsity for Efficient
    Long-Context LLM Inference", ICML 2024 (arXiv:2406.10774).

    Keys are grouped in aligned pages of ``page_size`` positions. Per (sequence, layer, KV head)
    the state keeps each page's element-wise key minimum and maximum, folded in incrementally:
    at each step the positions cached since the last step (the whole prompt at the first step,
    then one token) are merged into their pages. The page bound of query head ``q`` is
    ``Σ_j max(q_j·max_j, q_j·min_j)`` times the scaling, an upper bound of every logit in the
    page. Under GQA the group's bound is the **max** over its ``g`` query heads: it is then an
    upper bound of every logit of every head in the group, so a page some head would attend to
    strongly cannot be ranked low because the other heads would not.

    The selection is the pages covering the sink and local windows plus the top
    ``max(1, k // page_size)`` other pages by bound, returned as a block selection with
    ``block_size = page_size``. Layers ``< dense_layers`` are dense.

    Stats: never a retrieval. ``proxy_bytes`` is the metadata read: the min and max of every
    page of the sequence, ``n_pages · 2 · D · element_size`` per KV head (``element_size`` of
    the query, as Quest stores them in the cache dtype; prhs keeps them in float32, which holds
    bf16/fp16 keys exactly). Folding new keys into the pages is index maintenance, not counted
    (Quest builds its pages at prefill).
    """

    name = "quest"
    config_type = QuestConfig
    config: QuestConfig

    def init_fields(self, pool: SequenceStatePool, spec: AttentionSpec, max_seq_len: int) -> None:
        # Only the sparse layers keep pages: layer l uses row l - dense_layers.
        n_layers = max(spec.num_layers - self.config.dense_layers, 0)
        n_pages = -(-max_seq_len // self.config.page_size)
        shape = (n_layers, spec.num_kv_heads, n_pages, spec.head_dim)
        pool.add_field("quest_kmin", shape, torch.float32, float("inf"))
        pool.add_field("quest_kmax", shape, torch.float32, float("-inf"))
        pool.add_field("quest_pages_built", (n_layers,), torch.int64, 0)

    def select_step(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        c = self.config
        cache = step.cache
        b, hkv = cache.batch_size, cache.num_kv_heads
        lens = cache.seq_lens
        if step.layer < c.dense_layers:
            num = lens.view(-1, 1).expand(b, hkv).to(torch.long)
            stats = StepStats(torch.zeros(b, hkv, dtype=torch.bool, device=lens.device), num)
            return Selection(None, 1, stats)

        kmin, kmax = self._fold(step, state)  # [B, Hkv, n_pages, D]
        p = c.page_size
        n_pages = kmin.shape[2]
        row_pages = (lens + p - 1) // p
        page_valid = torch.arange(n_pages, device=lens.device).view(1, -1) < row_pages.view(-1, 1)
        pv = page_valid[:, None, :, None]
        q = step.query.reshape(b, hkv, step.group_size, -1).float()
        bound = page_bounds(q, torch.where(pv, kmin, 0.0), torch.where(pv, kmax, 0.0), step.scaling)
        bound = bound.amax(2)  # [B, Hkv, P]: the group's bound

        win = block_any(self.windows(step), p)  # [B, 1, P]
        valid = page_valid[:, None].expand(b, hkv, n_pages)
        picked = topk_mask(bound, max(1, c.budget // p), valid & ~win)
        mask = picked | (win & valid)
        meta = row_pages.view(-1, 1).to(torch.float64) * (2 * cache.head_dim)
        return make_selection(
            mask,
            p,
            lens,
            retrieved=torch.zeros(b, hkv, dtype=torch.bool, device=mask.device),
            proxy_bytes=(meta * step.query.element_size()).expand(b, hkv),
        )

    def _fold(
        self, step: DecodeStep, state: SequenceStatePool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge the positions ``[pages_built, seq_len)`` of each sequence into its pages and
        return the batch's page min/max ``[B, Hkv, ceil(T / page_size), D]``."""
        cache, p = step.cache, self.config.page_size
        row = step.layer - self.config.dense_layers
        slots = step.slots.to(state.device)
        lens = cache.seq_lens
        dev = lens.device
        n_pages = -(-cache.max_seq_len // p)
        kmin = state["quest_kmin"][slots, row, :, :n_pages].to(dev)
        kmax = state["quest_kmax"][slots, row, :, :n_pages].to(dev)
        built = state["quest_pages_built"][slots, row].to(dev)
        # A row whose cache is shorter than what was folded (never for a live sequence) folds
        # nothing; new positions run from `built` to `lens`, a different count per row.
        new = (lens - built).clamp(min=0)
        width = int(new.max()) if new.numel() else 0
        if width > 0:
            b, hkv = cache.batch_size, cache.num_kv_heads
            pos = built.view(-1, 1) + torch.arange(width, device=dev).view(1, -1)  # [B, W]
            ok = pos < lens.view(-1, 1)
            keys, _ = cache.gather(torch.where(ok, pos, -1)[:, None].expand(b, hkv, width))
            keys = keys.float()
            okd = ok[:, None, :, None]
            page = torch.where(ok, pos // p, 0)[:, None, :, None].expand_as(keys)
            kmin = kmin.scatter_reduce(2, page, torch.where(okd, keys, float("inf")), "amin")
            kmax = kmax.scatter_reduce(2, page, torch.where(okd, keys, float("-inf")), "amax")
            state["quest_kmin"][slots, row, :, :n_pages] = kmin.to(state.device)
            state["quest_kmax"][slots, row, :, :n_pages] = kmax.to(state.device)
            state["quest_pages_built"][slots, row] = torch.maximum(built, lens).to(state.device)
        return kmin, kmax
