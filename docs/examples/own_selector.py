"""A selector of your own: ``topdims``, top-k by keys scored on a few query dimensions.

At each decode step, every query head keeps the ``rank`` dimensions of its query with the
largest magnitude and scores every cached key on those dimensions only. The ``budget`` positions
of largest group-mean probability under these approximate scores are read, beside the sink and
local windows. (The idea of SparQ Attention, Ribar et al., arXiv:2312.04985; this torch version
still reads whole keys, where a kernel would read only the ``rank`` chosen columns.)

With ``rank >= head_dim`` the scores are exact and the selection is ``oracle``'s.

The docs' "Write your own selector" guide includes this file, and
``packages/prhs-eval/tests/test_guide.py`` tests it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.checks import check_int
from prhs_core.config import SelectorConfig
from prhs_core.layout import KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels import score_keys
from prhs_selectors.base import BaseSelector, group_probs


@dataclass(frozen=True)
class TopDimsConfig(SelectorConfig):
    """The shared options (``budget``, ``n_sink``, ``n_local``, ``block_size``) and ``rank``."""

    rank: int = 16
    """Query dimensions each query head scores keys on."""

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the shared fields
        check_int("rank", self.rank, minimum=1)


class TopDims(BaseSelector):
    """Top-k by keys scored on the ``rank`` largest-magnitude dimensions of the query."""

    name = "topdims"
    config_type = TopDimsConfig

    def selection_width(self) -> int:
        # Static: the sink blocks, the budget's blocks and the local blocks, at most.
        ws, wl = self.window_widths()
        return ws + self.budget_blocks() + wl

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,  # [B, Hq, D], already checked by BaseSelector.select
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,  # [B, Hkv] bool: rows with a non-finite query (skip them)
    ) -> Selection | None:
        d = query.shape[-1]
        r = min(self.config.rank, d)
        # Keep each query head's r largest-magnitude dimensions; zero the others.
        top = query.abs().topk(r, dim=-1).indices
        keep = torch.zeros_like(query, dtype=torch.bool).scatter_(-1, top, True)
        partial = torch.where(keep, query, torch.zeros_like(query))
        # Approximate logits of every cached key, [B, Hkv, g, T], then group-mean probabilities.
        probs = group_probs(score_keys(partial, kv, plan.scaling))
        # The best budget_blocks() blocks outside the windows (bad rows take none) ...
        idx, _, _ = self.topk_blocks(kv, probs, self.budget_blocks(), bad)
        # ... written into the plan's buffers together with the sink and local windows.
        selection = self.compose(plan, kv, idx)
        # Statistics: no full retrieval; the proxy read is min(g * r, D) columns of every key.
        g = query.shape[1] // kv.num_kv_heads
        elem = torch.empty((), dtype=kv.dtype).element_size()
        proxy = kv.seq_lens.view(-1, 1).to(torch.float64) * (min(g * r, d) * elem)
        self.record(plan, layer, kv, selection, None, proxy)
        return selection


# Importing this module registers the selector under its name.
selectors.register(
    "topdims",
    TopDims,
    config=TopDimsConfig,
    summary="top-k by keys scored on the query's largest dimensions",
)
