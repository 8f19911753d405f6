"""``streaming``: StreamingLLM's attention sinks plus a recent window, nothing else."""

from __future__ import annotations

import torch

from prhs_core.config import SelectorConfig
from prhs_core.protocols import DecodeStep
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SequenceStatePool
from prhs_selectors.base import BaseSelector, make_selection

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

    With ``block_size = s > 1`` it works in aligned blocks as :class:`BaseSelector` does: the
    blocks that cover the sink and local windows, plus the ``max(1, k // s)`` most recent blocks
    before the local window (the blocks a top-k by recency would choose).

    The selection depends only on the sequence lengths: no key, query or proxy is read, every
    KV head gets the same positions, a step is never a retrieval and its proxy bytes are 0.
    """

    name = "streaming"

    def select_step(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        c = self.config
        s = c.block_size
        lens = step.cache.seq_lens.view(-1, 1)  # [B, 1]
        n_blocks = -(-step.cache.max_seq_len // s)
        block = torch.arange(n_blocks, device=lens.device).view(1, -1)
        row_blocks = (lens + s - 1) // s  # blocks of each sequence
        sink_end = -(-c.n_sink // s)  # blocks [0, sink_end) hold the sinks
        # First block of the local window (none when n_local == 0), then the budget before it.
        local_start = (lens - c.n_local).clamp(min=0) // s if c.n_local > 0 else row_blocks
        recent_start = local_start - self.budget_blocks()
        mask = ((block < sink_end) | (block >= recent_start)) & (block < row_blocks)  # [B, nb]
        b, hkv = step.cache.batch_size, step.cache.num_kv_heads
        mask = mask[:, None].expand(b, hkv, n_blocks)
        return make_selection(
            mask,
            s,
            step.cache.seq_lens,
            retrieved=torch.zeros(b, hkv, dtype=torch.bool, device=mask.device),
            proxy_bytes=torch.zeros(b, hkv, dtype=torch.float64, device=mask.device),
        )
