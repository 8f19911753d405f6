"""``quest``: query-aware page selection by an upper bound of every logit in a page."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.checks import check_int
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels.kv import token_locations
from prhs_kernels.quest import page_bounds, quest_page_scores
from prhs_kernels.topk import topk_indices
from prhs_selectors.base import BaseSelector, fold_page_bounds

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


@selectors.register("quest", config=QuestConfig, summary="query-aware page bounds (Quest)")
class Quest(BaseSelector):
    """Quest: keep the pages whose logit upper bound, from per-page key min/max, is largest.

    Tang, Zhao, Zhu, Xiao, Kasikci and Han, "Quest: Query-Aware Sparsity for Efficient
    Long-Context LLM Inference", ICML 2024 (arXiv:2406.10774).

    Keys are grouped in aligned pages of ``page_size`` positions. Each page's element-wise key
    minimum and maximum live in a side cache indexed by the page's KV location, in the cache
    dtype (exact: a min or max of cached values is a cached value), written by
    :meth:`write_kv` whenever the host writes K/V: a page's first token resets it, later tokens
    fold in. The page bound of query head ``q`` is ``Σ_j max(q_j·max_j, q_j·min_j)`` times the
    scaling, an upper bound of every logit in the page. Under GQA the group's bound is the
    **max** over its ``g`` query heads: it is then an upper bound of every logit of every head
    in the group, so a page some head would attend to strongly cannot be ranked low because the
    other heads would not.

    The selection is the pages covering the sink and local windows plus the top
    ``max(1, k // page_size)`` other pages by bound, as a block selection with
    ``block_size = page_size``. Layers ``< dense_layers`` are dense (``None``). The scores come
    from :func:`prhs_kernels.quest.quest_page_scores` on the path :meth:`kernel_path` names: one
    Triton launch for fp16 / bf16 caches on CUDA, which reads each eligible page's minimum and
    maximum once; its torch reference elsewhere.

    A paged KV pool must use pages of a multiple of ``page_size`` slots, so that a Quest page is
    one run of slots. Stats: never a retrieval. ``proxy_bytes`` is the metadata read: the min
    and max of every page of the sequence, ``n_pages · 2 · D · element_size`` per KV head.
    """

    name = "quest"
    config_type = QuestConfig
    config: QuestConfig

    @property
    def block_size(self) -> int:
        return self.config.page_size

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + self.budget_blocks() + wl

    def side_page_size(self) -> int:
        return self.config.page_size

    def uses_side_cache(self) -> bool:
        return True

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        # Only the sparse layers keep pages: layer l uses row l - dense_layers.
        n_layers = max(spec.num_layers - self.config.dense_layers, 0)
        shape = (n_layers, spec.num_kv_heads, spec.head_dim)
        assert state.side is not None
        state.side.add_page_field("quest_kmin", shape, kv_dtype, float("inf"))
        state.side.add_page_field("quest_kmax", shape, kv_dtype, float("-inf"))

    def write_side(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        finite: torch.Tensor,
    ) -> None:
        row = layer - self.config.dense_layers
        if row < 0:
            return
        side = state.side
        assert side is not None
        fold_page_bounds(side, "quest_kmin", "quest_kmax", row, locations, key, finite)

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
        if layer < c.dense_layers:
            self.record(plan, layer, kv, None, None, None)
            return None
        side = state.side
        assert side is not None
        p = c.page_size
        b = kv.batch_size
        n_pages = -(-kv.max_len // p)
        first_pos = torch.arange(n_pages, device=kv.seq_lens.device) * p
        loc = token_locations(kv, first_pos.view(1, -1).expand(b, -1), state.row_stride)
        row = layer - c.dense_layers
        scores = quest_page_scores(
            query,
            side["quest_kmin"][:, row],  # [pages + 1, Hkv, D], views read in place
            side["quest_kmax"][:, row],
            side.pages_of(loc),  # [B, P]
            kv.seq_lens,
            bad,
            plan.scaling,
            page_size=p,
            n_sink=c.n_sink,
            n_local=c.n_local,
            path=self.kernel_path(query.device, kv.dtype),
        )  # [B, Hkv, P]: the group's bound, -inf where no page may be picked
        # Top-k takes the mask too: an eligible page whose bound is NaN or -inf still counts.
        eligible = (self.block_eligible(kv, n_pages).unsqueeze(1) & ~bad.unsqueeze(-1)).expand_as(
            scores
        )
        idx, _ = topk_indices(scores, self.budget_blocks(), eligible)
        sel = self.compose(plan, kv, idx)
        elem = torch.empty((), dtype=kv.dtype).element_size()
        meta = self.num_blocks(kv).view(-1, 1).to(torch.float64) * (2 * kv.head_dim * elem)
        self.record(plan, layer, kv, sel, None, meta)
        return sel
