"""``psaw``: Progressive Sliding Attention Window, PrHS's prefill selector on the depth axis.

In layer ``ℓ > ℓ_s`` prompt row ``t`` attends to ``sink ∪ [P_ℓ(t), t]`` with
``P_ℓ(t) = ⌊(1 − φ^{α(ℓ−ℓ_s)/(N−ℓ_s)})·t⌋``; layers up to ``ℓ_s`` are dense. Decode is dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from prhs_core.checks import check_int
from prhs_core.protocols import PrefillLayerPlan
from prhs_core.registry import selectors
from prhs_selectors.dense import Dense
from prhs_selectors.prefill import check_fraction, check_positive, depth_fraction

__all__ = ["PSAW", "PSAWConfig"]


@dataclass(frozen=True)
class PSAWConfig:
    """PSAW hyperparameters.

    Parameters
    ----------
    phi:
        ``φ`` in ``(0, 1)`` (0.5): the deepest layer's rows start at ``(1 − φ)·t``.
    alpha:
        ``α > 0`` (1): how fast the window narrows with depth.
    start_layer:
        ``ℓ_s`` (``N/2`` when ``None``): layers up to it are dense.
    n_sink:
        Sink positions every row keeps (4; 0 is the formula as published).
    """

    phi: float = 0.5
    alpha: float = 1.0
    start_layer: int | None = None
    n_sink: int = 4

    def __post_init__(self) -> None:
        check_fraction("phi", self.phi)
        check_positive("alpha", self.alpha)
        if self.start_layer is not None:
            check_int("start_layer", self.start_layer, minimum=0)
        check_int("n_sink", self.n_sink, minimum=0)


def psaw_plan(
    layer: int, num_layers: int, *, phi: float, alpha: float, start_layer: int | None, n_sink: int
) -> PrefillLayerPlan:
    """PSAW's plan of ``layer``: window fraction ``1 − φ^{α(ℓ−ℓ_s)/(N−ℓ_s)}`` and sinks."""
    frac = depth_fraction(phi, alpha, layer, num_layers, start_layer)
    if frac == 0.0:
        return PrefillLayerPlan(layer)
    return PrefillLayerPlan(layer, window_fraction=frac, n_sink=n_sink)


@selectors.register(
    "psaw", config=PSAWConfig, summary="PrHS depth axis: progressive prefill window"
)
class PSAW(Dense):
    """Progressive Sliding Attention Window (Gao et al., arXiv:2602.08329): a per-row prefill
    window that narrows with depth. Decode is dense."""

    name = "psaw"
    config_type = PSAWConfig
    config: PSAWConfig

    def plan_prefill(self, layer: int, num_layers: int) -> PrefillLayerPlan:
        c = self.config
        return psaw_plan(
            layer, num_layers, phi=c.phi, alpha=c.alpha, start_layer=c.start_layer, n_sink=c.n_sink
        )
