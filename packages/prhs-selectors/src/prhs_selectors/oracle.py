"""``oracle``: exact top-k by true attention, plus the sink and local windows."""

from __future__ import annotations

import torch

from prhs_core.config import SelectorConfig
from prhs_core.layout import KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_selectors.base import BaseSelector

__all__ = ["Oracle"]


@selectors.register(
    "oracle", config=SelectorConfig, summary="exact top-k of every step (upper bound)"
)
class Oracle(BaseSelector):
    """Oracle top-k: score every cached key exactly at every step and keep the ``k`` positions
    of largest group-mean probability (``k/s`` blocks by their max when ``s > 1``) outside the
    windows, plus the ``n_sink`` first and ``n_local`` last positions.

    The accuracy ceiling of any top-k selector at the same budget; it reads every key each step,
    so it saves nothing (every decision is a retrieval).
    """

    name = "oracle"

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + self.budget_blocks() + wl

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,
    ) -> Selection | None:
        probs = self.exact_probs(plan, query, kv)
        idx, _, _ = self.topk_blocks(kv, probs, self.budget_blocks(), bad)
        sel = self.compose(plan, kv, idx)
        self.record(plan, layer, kv, sel, ~bad, self.retrieval_bytes(kv))
        return sel
