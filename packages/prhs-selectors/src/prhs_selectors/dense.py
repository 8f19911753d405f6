"""``dense``: no selection; every cached position is read (the accuracy reference)."""

from __future__ import annotations

import torch

from prhs_core.config import SelectorConfig
from prhs_core.protocols import DecodeStep
from prhs_core.registry import selectors
from prhs_core.selection import Selection, StepStats
from prhs_core.state import SequenceStatePool
from prhs_selectors.base import BaseSelector

__all__ = ["Dense"]


@selectors.register("dense", config=SelectorConfig, summary="dense attention (no selection)")
class Dense(BaseSelector):
    """Dense attention: the selection is every cached position.

    ``budget``, ``n_sink``, ``n_local`` and ``block_size`` are accepted (so every selector takes
    the same options) and ignored.
    """

    name = "dense"

    def select_step(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        b, hkv = step.cache.batch_size, step.cache.num_kv_heads
        dev = step.query.device
        num = step.cache.seq_lens.view(-1, 1).expand(b, hkv).to(torch.long)
        stats = StepStats(torch.zeros(b, hkv, dtype=torch.bool, device=dev), num.to(dev))
        return Selection(None, 1, stats)
