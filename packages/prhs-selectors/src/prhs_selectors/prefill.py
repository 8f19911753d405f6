"""``psaw`` and ``etf``: PrHS's prefill selectors on the depth and layer axes (SPEC.md §3).

Both leave the first ``ℓ_s`` layers dense and grow their saving with depth; neither changes
decode (their decode selection is dense).

- PSAW (progressive sliding attention window): in layer ``ℓ ≥ ℓ_s`` prompt row ``t`` attends to
  ``sink ∪ [P_ℓ(t), t]``, ``P_ℓ(t) = ⌊(1 − φ^{α(ℓ−ℓ_s)/(N−ℓ_s)})·t⌋``.
- ETF (early token freezing): in layer ``ℓ ≥ ℓ_s`` the prefix ``[0, E_ℓ)``,
  ``E_ℓ = ⌊(1 − ψ^{γ(ℓ−ℓ_s)/(N−ℓ_s)})·L⌋``, is frozen: those rows keep their hidden state;
  their keys/values are still computed so later rows can attend to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prhs_core._checks import check_int
from prhs_core.config import SelectorConfig
from prhs_core.protocols import PrefillLayerPlan
from prhs_core.registry import selectors
from prhs_selectors.dense import Dense

__all__ = [
    "ETF",
    "PSAW",
    "ETFConfig",
    "PSAWConfig",
    "check_plan_args",
    "etf_frozen_prefix",
    "psaw_window_start",
    "resolve_start_layer",
]


def _check_fraction(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie in (0, 1), got {value}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite float, got {value}")


def check_plan_args(layer: int, num_layers: int, prompt_len: int) -> None:
    """Validate the arguments of a ``plan_prefill`` call."""
    check_int("num_layers", num_layers, minimum=1)
    check_int("layer", layer, minimum=0)
    check_int("prompt_len", prompt_len, minimum=0)
    if layer >= num_layers:
        raise ValueError(f"layer {layer} is out of range for {num_layers} layers")


def resolve_start_layer(start_layer: int | None, num_layers: int) -> int:
    """``ℓ_s``: the configured start layer, or ``N // 2``; must lie in ``[0, N)``."""
    ls = num_layers // 2 if start_layer is None else start_layer
    if not 0 <= ls < num_layers:
        raise ValueError(f"start_layer must lie in [0, {num_layers}), got {ls}")
    return ls


def _depth_fraction(base: float, power: float, layer: int, start: int, num_layers: int) -> float:
    """``1 − base^{power·(ℓ−ℓ_s)/(N−ℓ_s)}`` (0 below ``ℓ_s``)."""
    if layer < start:
        return 0.0
    return 1.0 - base ** (power * (layer - start) / (num_layers - start))


def psaw_window_start(
    layer: int, num_layers: int, prompt_len: int, *, phi: float, alpha: float, start: int
) -> torch.Tensor:
    """``[L]`` int64 ``P_ℓ(t)`` for rows ``t = 0..L−1``."""
    frac = _depth_fraction(phi, alpha, layer, start, num_layers)
    t = torch.arange(prompt_len, dtype=torch.float64)
    return torch.floor(frac * t).to(torch.long)


def etf_frozen_prefix(
    layer: int, num_layers: int, prompt_len: int, *, psi: float, gamma: float, start: int
) -> int:
    """``E_ℓ``, the number of frozen prompt rows at ``layer``."""
    return math.floor(_depth_fraction(psi, gamma, layer, start, num_layers) * prompt_len)


@dataclass(frozen=True)
class PSAWConfig(SelectorConfig):
    """PSAW hyperparameters: ``phi`` (φ, 0.5), ``alpha`` (α, 1), ``start_layer`` (ℓ_s, ``N/2``
    when ``None``) and ``n_sink`` (4; 0 is the published formula). Decode options are unused."""

    phi: float = 0.5
    alpha: float = 1.0
    start_layer: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction("phi", self.phi)
        _check_positive("alpha", self.alpha)
        if self.start_layer is not None:
            check_int("start_layer", self.start_layer, minimum=0)


@dataclass(frozen=True)
class ETFConfig(SelectorConfig):
    """ETF hyperparameters: ``psi`` (ψ, 0.7), ``gamma`` (γ, 1), ``start_layer`` (ℓ_s, ``N/2``
    when ``None``). Decode options are unused."""

    psi: float = 0.7
    gamma: float = 1.0
    start_layer: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction("psi", self.psi)
        _check_positive("gamma", self.gamma)
        if self.start_layer is not None:
            check_int("start_layer", self.start_layer, minimum=0)


@selectors.register(
    "psaw", config=PSAWConfig, summary="PrHS depth axis: progressive prefill window"
)
class PSAW(Dense):
    """Progressive Sliding Attention Window (Gao et al., arXiv:2602.08329): a per-row prefill
    window that narrows with depth. Decode is dense."""

    name = "psaw"
    config_type = PSAWConfig
    config: PSAWConfig

    def plan_prefill(self, layer: int, num_layers: int, prompt_len: int) -> PrefillLayerPlan:
        check_plan_args(layer, num_layers, prompt_len)
        c = self.config
        start = resolve_start_layer(c.start_layer, num_layers)
        if layer <= start:
            return PrefillLayerPlan(layer, prompt_len)
        lo = psaw_window_start(layer, num_layers, prompt_len, phi=c.phi, alpha=c.alpha, start=start)
        return PrefillLayerPlan(layer, prompt_len, n_sink=c.n_sink, window_start=lo)


@selectors.register("etf", config=ETFConfig, summary="PrHS layer axis: freeze early prompt rows")
class ETF(Dense):
    """Early Token Freezing (Gao et al., arXiv:2602.08329): deeper layers stop updating a
    growing prefix of the prompt. Decode is dense."""

    name = "etf"
    config_type = ETFConfig
    config: ETFConfig

    def plan_prefill(self, layer: int, num_layers: int, prompt_len: int) -> PrefillLayerPlan:
        check_plan_args(layer, num_layers, prompt_len)
        c = self.config
        start = resolve_start_layer(c.start_layer, num_layers)
        e = etf_frozen_prefix(layer, num_layers, prompt_len, psi=c.psi, gamma=c.gamma, start=start)
        return PrefillLayerPlan(layer, prompt_len, frozen_prefix=e)
