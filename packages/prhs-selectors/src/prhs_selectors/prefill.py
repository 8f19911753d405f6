"""The depth schedule PSAW and ETF share: a fraction that grows from 0 at layer ``ℓ_s``.

``f(ℓ) = 1 − base^{power·(ℓ−ℓ_s)/(N−ℓ_s)}`` for ``ℓ ≥ ℓ_s`` (0 below): PSAW's window start
fraction (base ``φ``, power ``α``) and ETF's frozen fraction (base ``ψ``, power ``γ``).
"""

from __future__ import annotations

import math

from prhs_core.checks import check_int

__all__ = ["check_fraction", "check_positive", "depth_fraction", "resolve_start_layer"]


def check_fraction(name: str, value: object) -> None:
    """Raise unless ``value`` is a float in ``(0, 1)``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie in (0, 1), got {value}")


def check_positive(name: str, value: object) -> None:
    """Raise unless ``value`` is a positive finite float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite float, got {value}")


def resolve_start_layer(start_layer: int | None, num_layers: int) -> int:
    """``ℓ_s``: the configured start layer, or ``N // 2``; must lie in ``[0, N)``."""
    ls = num_layers // 2 if start_layer is None else start_layer
    if not 0 <= ls < num_layers:
        raise ValueError(f"start_layer must lie in [0, {num_layers}), got {ls}")
    return ls


def depth_fraction(
    base: float, power: float, layer: int, num_layers: int, start_layer: int | None
) -> float:
    """``1 − base^{power·(ℓ−ℓ_s)/(N−ℓ_s)}`` (0 below ``ℓ_s``), after checking the layer."""
    check_int("num_layers", num_layers, minimum=1)
    check_int("layer", layer, minimum=0)
    if layer >= num_layers:
        raise ValueError(f"layer {layer} is out of range for {num_layers} layers")
    start = resolve_start_layer(start_layer, num_layers)
    if layer < start:
        return 0.0
    return 1.0 - base ** (power * (layer - start) / (num_layers - start))
