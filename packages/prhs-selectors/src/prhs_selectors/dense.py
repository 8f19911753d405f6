"""``dense``: no selection; every cached position is read (the accuracy reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.layout import KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_selectors.base import BaseSelector

__all__ = ["Dense", "DenseConfig"]


@dataclass(frozen=True)
class DenseConfig:
    """Dense attention has no hyperparameters."""


@selectors.register("dense", config=DenseConfig, summary="dense attention (no selection)")
class Dense(BaseSelector):
    """Dense attention: ``select`` returns ``None``, which every prhs kernel reads as "every
    cached position". Never a retrieval; no proxy bytes."""

    name = "dense"
    config_type = DenseConfig

    def selection_width(self) -> int:
        return 0

    def finds_nonfinite_queries(self) -> bool:
        # Nothing is chosen, so nothing is skipped: a non-finite query is not counted (dense
        # attention returns its non-finite output), and a step runs no check for it -- a
        # decode step of the dense baseline is attention alone.
        return True

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor | None,
    ) -> Selection | None:
        self.record(plan, layer, kv, None, None, None)
        return None
