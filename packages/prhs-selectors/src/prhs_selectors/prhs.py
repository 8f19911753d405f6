"""``prhs``: PrHS's headline configuration (CPE) -- CIS at decode plus PSAW and ETF at prefill."""

from __future__ import annotations

from dataclasses import dataclass

from prhs_core.checks import check_int
from prhs_core.protocols import PrefillLayerPlan
from prhs_core.registry import selectors
from prhs_selectors.cis import CIS, CISConfig
from prhs_selectors.prefill import check_fraction, check_layer, check_positive, depth_fraction
from prhs_selectors.psaw import psaw_plan

__all__ = ["PrHS", "PrHSConfig"]


@dataclass(frozen=True)
class PrHSConfig(CISConfig):
    """CIS's hyperparameters plus PSAW's (``phi``, ``alpha``) and ETF's (``psi``, ``gamma``),
    sharing one ``start_layer`` (``N/2`` when ``None``) and CIS's ``n_sink``. ``use_psaw`` /
    ``use_etf`` switch the prefill parts on: both are off by default, so the default ``prhs``
    is CIS after a dense prefill. ETF raised perplexity by more than it saved in prefill FLOPs
    on every model measured; PSAW's windows lost answers the same decode finds after a dense
    prefill at 1/32 of the context (see the PSAW and ETF docs pages)."""

    phi: float = 0.5
    alpha: float = 1.0
    psi: float = 0.7
    gamma: float = 1.0
    start_layer: int | None = None
    use_psaw: bool = False
    use_etf: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction("phi", self.phi)
        check_positive("alpha", self.alpha)
        check_fraction("psi", self.psi)
        check_positive("gamma", self.gamma)
        if self.start_layer is not None:
            check_int("start_layer", self.start_layer, minimum=0)
        if not isinstance(self.use_psaw, bool) or not isinstance(self.use_etf, bool):
            raise TypeError("use_psaw and use_etf must be bools")


@selectors.register(
    "prhs", config=PrHSConfig, summary="PrHS CPE: CIS (+ PSAW: use_psaw, + ETF: use_etf)"
)
class PrHS(CIS):
    """PrHS's CPE = CIS + PSAW + ETF (Gao et al., arXiv:2602.08329), PSAW and ETF off by
    default: CIS selects at decode; with ``use_psaw`` PSAW's window, and with ``use_etf`` ETF's
    frozen prefix, restrict prefill in layers past ``start_layer``."""

    name = "prhs"
    config_type = PrHSConfig
    config: PrHSConfig

    def plan_prefill(self, layer: int, num_layers: int) -> PrefillLayerPlan:
        c = self.config
        check_layer(layer, num_layers, c.start_layer)  # whether or not a prefill part is on
        plan = PrefillLayerPlan(layer)
        if c.use_psaw:
            plan = psaw_plan(
                layer,
                num_layers,
                phi=c.phi,
                alpha=c.alpha,
                start_layer=c.start_layer,
                n_sink=c.n_sink,
            )
        frozen = 0.0
        if c.use_etf:
            frozen = depth_fraction(c.psi, c.gamma, layer, num_layers, c.start_layer)
        # The sinks PSAW keeps visible are the rows ETF keeps live (CIS's n_sink for both).
        return PrefillLayerPlan(
            layer,
            window_fraction=plan.window_fraction,
            n_sink=c.n_sink,
            frozen_fraction=frozen,
        )
