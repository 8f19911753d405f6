"""``etf``: Early Token Freezing, PrHS's prefill selector on the layer axis.

In layer ``ℓ ≥ ℓ_s`` the rows ``[n_sink, E_ℓ)``, ``E_ℓ = ⌊(1 − ψ^{γ(ℓ−ℓ_s)/(N−ℓ_s)})·L⌋`` of a
prompt of ``L`` tokens, are frozen: those rows keep their hidden state; their keys/values are
still computed so later rows can attend to them. The first ``n_sink`` rows (the attention
sinks) stay live; ``n_sink = 0`` is the formula as published. Decode is dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from prhs_core.checks import check_int
from prhs_core.protocols import PrefillLayerPlan
from prhs_core.registry import selectors
from prhs_selectors.dense import Dense
from prhs_selectors.prefill import check_fraction, check_positive, depth_fraction

__all__ = ["ETF", "ETFConfig"]


@dataclass(frozen=True)
class ETFConfig:
    """ETF hyperparameters.

    Parameters
    ----------
    psi:
        ``ψ`` in ``(0, 1)`` (0.7): the deepest layer freezes ``(1 − ψ)·L`` rows.
    gamma:
        ``γ > 0`` (1): how fast the frozen prefix grows with depth.
    start_layer:
        ``ℓ_s`` (``N/2`` when ``None``).
    n_sink:
        The first rows, never frozen (4): every later row attends to these sinks, so a stale
        sink moves every row's attention. ``0`` freezes from row 0, as published.
    """

    psi: float = 0.7
    gamma: float = 1.0
    start_layer: int | None = None
    n_sink: int = 4

    def __post_init__(self) -> None:
        check_fraction("psi", self.psi)
        check_positive("gamma", self.gamma)
        check_int("n_sink", self.n_sink, minimum=0)
        if self.start_layer is not None:
            check_int("start_layer", self.start_layer, minimum=0)


@selectors.register("etf", config=ETFConfig, summary="PrHS layer axis: freeze early prompt rows")
class ETF(Dense):
    """Early Token Freezing (Gao et al., arXiv:2602.08329): deeper layers stop updating a
    growing prefix of the prompt. Decode is dense."""

    name = "etf"
    config_type = ETFConfig
    config: ETFConfig

    def plan_prefill(self, layer: int, num_layers: int) -> PrefillLayerPlan:
        c = self.config
        frac = depth_fraction(c.psi, c.gamma, layer, num_layers, c.start_layer)
        return PrefillLayerPlan(layer, n_sink=c.n_sink, frozen_fraction=frac)
