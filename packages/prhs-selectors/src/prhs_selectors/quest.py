"""``quest``: query-aware page selection by an upper bound of every logit in a page."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.checks import check_int
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels.quest import page_bounds, quest_page_scores, quest_select
from prhs_kernels.score import nonfinite_rows
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

    def __init__(self, config: QuestConfig | None = None) -> None:
        super().__init__(config)
        self._rows_cache: dict[tuple, torch.Tensor] = {}

    @property
    def block_size(self) -> int:
        return self.config.page_size

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + self.budget_blocks() + wl

    def side_page_size(self) -> int:
        return self.config.page_size

    def finds_nonfinite_queries(self) -> bool:
        # On a Triton path both launches find the rows whose query is not finite (the
        # selection counts them); select_layer runs the separate check elsewhere.
        return True

    def uses_side_cache(self) -> bool:
        return True

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        # Only the sparse layers keep pages: layer l uses row l - dense_layers.
        n_layers = max(spec.num_layers - self.config.dense_layers, 0)
        shape = (n_layers, spec.num_kv_heads, spec.head_dim)
        assert state.side is not None
        state.side.add_page_field("quest_kmin", shape, kv_dtype, float("inf"))
        state.side.add_page_field("quest_kmax", shape, kv_dtype, float("-inf"))

    def counts_nonfinite_keys(self) -> bool:
        # The fold finds and counts the non-finite keys (in its one launch on a Triton path).
        return True

    def write_side(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        finite: torch.Tensor | None,
        *,
        columns: torch.Tensor | None = None,
    ) -> None:
        row = layer - self.config.dense_layers
        if row < 0:  # a dense layer keeps no pages (its keys are neither stored nor counted)
            return
        side = state.side
        assert side is not None
        fold_page_bounds(
            side, "quest_kmin", "quest_kmax", row, locations, key, finite, columns=columns,
            nonfinite=state.nonfinite if finite is None else None,
            path=self.kernel_path(key.device, key.dtype),
        )  # fmt: skip

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor | None,
    ) -> Selection | None:
        c = self.config
        path = self.kernel_path(query.device, kv.dtype)
        # On a Triton path a sparse layer's two launches find the bad rows and count them;
        # elsewhere (and on the dense layers) the separate check does, as for other selectors.
        found = path.startswith("triton") and layer >= c.dense_layers
        if bad is None and not found:
            bad = nonfinite_rows(query, kv.num_kv_heads)
            state.nonfinite.add_(bad.sum())
        if layer < c.dense_layers:
            self.record(plan, layer, kv, None, None, None)
            return None
        side = state.side
        assert side is not None
        p = c.page_size
        n_pages = -(-kv.max_len // p)
        row = layer - c.dense_layers
        scores = quest_page_scores(
            query,
            side["quest_kmin"][:, row],  # [pages + 1, Hkv, D], views read in place
            side["quest_kmax"][:, row],
            self._page_rows(kv, state, n_pages),  # [B, P]
            kv.seq_lens,
            bad,
            plan.scaling,
            page_size=p,
            n_sink=c.n_sink,
            n_local=c.n_local,
            path=path,
        )  # [B, Hkv, P]: the group's bound, -inf where no page may be picked
        sel = plan.selection
        quest_select(
            scores, kv.seq_lens, bad, self.budget_blocks(), page_size=p, n_sink=c.n_sink,
            n_local=c.n_local, out_indices=sel.indices, out_counts=sel.counts, query=query,
            nonfinite=state.nonfinite if bad is None else None, path=path,
        )  # fmt: skip
        meta = None
        if plan.stats is not None:
            elem = torch.empty((), dtype=kv.dtype).element_size()
            meta = self.num_blocks(kv).view(-1, 1).to(torch.float64) * (2 * kv.head_dim * elem)
        self.record(plan, layer, kv, sel, None, meta)
        return sel

    def _page_rows(self, kv: KVLayout, state: SelectorState, n_pages: int) -> torch.Tensor:
        """``[B, P]`` side-cache page row of each row's page ``j`` (read only where the page
        exists). A contiguous cache's are ``b · row_stride / page_size + j`` whatever the step:
        one strided view of a range, kept per shape, so that a step launches nothing for them;
        a paged pool's are looked up in its table (a gather and a division)."""
        p = self.config.page_size
        b = kv.batch_size
        dev = kv.seq_lens.device
        if isinstance(kv, ContiguousKV):
            per_row = state.row_stride // p  # rows start on a page of the side cache
            key = (dev, b, n_pages, per_row)
            rows = self._rows_cache.get(key)
            if rows is None:
                flat = torch.arange((b - 1) * per_row + n_pages, device=dev)
                rows = self._rows_cache[key] = flat.as_strided((b, n_pages), (per_row, 1))
            return rows
        # A paged pool: the slot of each page's first position, through the request's table
        # row (a Quest page is one run of slots), over the page size. Where a page does not
        # exist the entry is whatever the table holds: it is never read.
        assert isinstance(kv, PagedKV)
        first = kv.req_to_token[:, ::p][:, :n_pages]  # [R, P] views of the table
        return first[kv.req_pool_indices] // p  # int32 indices index as they are
