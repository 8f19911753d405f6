"""``streaming``: StreamingLLM's attention sinks plus a recent window, nothing else."""

from __future__ import annotations

import torch

from prhs_core.config import SelectorConfig
from prhs_core.layout import KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_selectors.base import BaseSelector

__all__ = ["Streaming"]


@selectors.register(
    "streaming", config=SelectorConfig, summary="attention sinks + recent window (StreamingLLM)"
)
class Streaming(BaseSelector):
    """StreamingLLM: the first ``n_sink`` positions and a window of the most recent ones.

    Xiao, Tian, Chen, Han and Lewis, "Efficient Streaming Language Models with Attention
    Sinks", ICLR 2024 (arXiv:2309.17453, 2023).

    To compare at equal budget, the method spends its budget ``k`` on recency: the recent window
    is ``n_local + k`` positions, so a step reads the ``n_sink`` sinks and the last
    ``n_local + k`` positions, as many as a top-k selector with the same
    :class:`~prhs_core.config.SelectorConfig` reads at most.

    With ``block_size = s > 1`` it works in aligned blocks: the blocks that cover the sink and
    local windows, plus the ``max(1, k // s)`` most recent blocks before the local window (the
    blocks a top-k by recency would choose).

    The selection depends only on the sequence lengths: no key, query or proxy is read, every
    KV head gets the same positions, a step is never a retrieval and its proxy bytes are 0.
    """

    name = "streaming"

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + self.budget_blocks() + max(wl, 1)

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,
    ) -> Selection | None:
        c, s = self.config, self.block_size
        lens = kv.seq_lens.view(-1, 1).long()
        row_blocks = (lens + s - 1) // s
        local_start = torch.clamp(lens - c.n_local, min=0) // s if c.n_local > 0 else row_blocks
        recent_start = local_start - self.budget_blocks()
        _, wl = self.window_widths()
        j = torch.arange(self.budget_blocks() + max(wl, 1), device=lens.device).view(1, -1)
        recent = recent_start + j
        recent = torch.where(recent >= 0, recent, -1)  # the union drops ids >= row_blocks
        sel = self.compose(plan, kv, recent)
        self.record(plan, layer, kv, sel, None, None)
        return sel
