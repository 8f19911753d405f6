"""``prhs`` (CPE): CIS at decode plus PSAW and ETF at prefill, the PrHS headline configuration."""

from __future__ import annotations

from dataclasses import dataclass

from prhs_core._checks import check_int
from prhs_core.protocols import PrefillLayerPlan
from prhs_core.registry import selectors
from prhs_selectors.cis import CIS, CISConfig
from prhs_selectors.prefill import (
    _check_fraction,
    _check_positive,
    check_plan_args,
    etf_frozen_prefix,
    psaw_window_start,
    resolve_start_layer,
)

__all__ = ["CPE", "CPEConfig"]


@dataclass(frozen=True)
class CPEConfig(CISConfig):
    """CIS's hyperparameters plus PSAW's (``phi``, ``alpha``) and ETF's (``psi``, ``gamma``),
    sharing one ``start_layer`` (``N/2`` when ``None``). ``use_psaw`` / ``use_etf`` switch the
    prefill parts off for ablations."""

    phi: float = 0.5
    alpha: float = 1.0
    psi: float = 0.7
    gamma: float = 1.0
    start_layer: int | None = None
    use_psaw: bool = True
    use_etf: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction("phi", self.phi)
        _check_positive("alpha", self.alpha)
        _check_fraction("psi", self.psi)
        _check_positive("gamma", self.gamma)
        if self.start_layer is not None:
            check_int("start_layer", self.start_layer, minimum=0)
        if not isinstance(self.use_psaw, bool) or not isinstance(self.use_etf, bool):
            raise TypeError("use_psaw and use_etf must be bools")


@selectors.register("prhs", config=CPEConfig, summary="PrHS CPE: CIS + PSAW + ETF")
class CPE(CIS):
    """CPE = CIS + PSAW + ETF (Gao et al., arXiv:2602.08329): CIS selects at decode; PSAW's
    window and ETF's frozen prefix restrict prefill in layers past ``start_layer``."""

    name = "prhs"
    config_type = CPEConfig
    config: CPEConfig

    def plan_prefill(self, layer: int, num_layers: int, prompt_len: int) -> PrefillLayerPlan:
        check_plan_args(layer, num_layers, prompt_len)
        c = self.config
        start = resolve_start_layer(c.start_layer, num_layers)
        lo = None
        if c.use_psaw and layer > start:
            lo = psaw_window_start(
                layer, num_layers, prompt_len, phi=c.phi, alpha=c.alpha, start=start
            )
        e = 0
        if c.use_etf:
            e = etf_frozen_prefix(
                layer, num_layers, prompt_len, psi=c.psi, gamma=c.gamma, start=start
            )
        return PrefillLayerPlan(
            layer, prompt_len, n_sink=c.n_sink, window_start=lo, frozen_prefix=e
        )
