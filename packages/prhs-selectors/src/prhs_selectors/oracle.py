"""``oracle``: exact top-k by true attention, plus the sink and local windows."""

from __future__ import annotations

import torch

from prhs_core.config import SelectorConfig
from prhs_core.protocols import DecodeStep
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SequenceStatePool
from prhs_selectors.base import BaseSelector, exact_group_scores, make_selection

__all__ = ["Oracle"]


@selectors.register(
    "oracle", config=SelectorConfig, summary="exact top-k of every step (upper bound)"
)
class Oracle(BaseSelector):
    """Oracle top-k: score every cached key exactly at every step and keep the ``k`` positions
    of largest group-mean probability (``k/s`` blocks by their max when ``s > 1``), plus the
    ``n_sink`` first and ``n_local`` last positions.

    The accuracy ceiling of any top-k selector at the same budget; it reads every key each step,
    so it saves nothing (every decision is a retrieval).
    """

    name = "oracle"

    def select_step(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        scores = exact_group_scores(step)
        mask = self.topk_with_windows(step, scores.probs)
        b, hkv = mask.shape[:2]
        return make_selection(
            mask,
            self.config.block_size,
            step.cache.seq_lens,
            retrieved=torch.ones(b, hkv, dtype=torch.bool, device=mask.device),
            proxy_bytes=self.retrieval_bytes(step).expand(b, hkv),
        )
