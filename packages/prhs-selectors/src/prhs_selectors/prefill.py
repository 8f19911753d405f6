"""The depth schedule PSAW and ETF share: a fraction that grows from 0 at layer ``ℓ_s``.

``f(ℓ) = 1 − base^{power·(ℓ−ℓ_s)/(N−ℓ_s)}`` for ``ℓ ≥ ℓ_s`` (0 below): PSAW's window start
fraction (base ``φ``, power ``α``) and ETF's frozen fraction (base ``ψ``, power ``γ``).

:func:`prefill_flops` counts what a prefill plan saves: the decoder layers' multiply-adds of one
prompt, planned and dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from prhs_core.checks import check_int
from prhs_core.protocols import PrefillPlanner

__all__ = [
    "DecoderDims",
    "check_fraction",
    "check_layer",
    "check_positive",
    "depth_fraction",
    "prefill_flops",
    "resolve_start_layer",
]


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


def check_layer(layer: int, num_layers: int, start_layer: int | None) -> int:
    """Raise unless ``layer`` is one of ``num_layers`` and ``start_layer`` resolves inside
    them; return ``ℓ_s``."""
    check_int("num_layers", num_layers, minimum=1)
    check_int("layer", layer, minimum=0)
    if layer >= num_layers:
        raise ValueError(f"layer {layer} is out of range for {num_layers} layers")
    return resolve_start_layer(start_layer, num_layers)


def depth_fraction(
    base: float, power: float, layer: int, num_layers: int, start_layer: int | None
) -> float:
    """``1 − base^{power·(ℓ−ℓ_s)/(N−ℓ_s)}`` (0 below ``ℓ_s``), after checking the layer."""
    start = check_layer(layer, num_layers, start_layer)
    if layer < start:
        return 0.0
    return 1.0 - base ** (power * (layer - start) / (num_layers - start))


@dataclass(frozen=True)
class DecoderDims:
    """What a decoder layer's FLOPs depend on: ``hidden`` size, MLP ``intermediate`` size (a
    gated MLP: three matrices), query and KV heads and ``head_dim``."""

    num_layers: int
    hidden: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "intermediate", "num_q_heads", "num_kv_heads",
                     "head_dim"):  # fmt: skip
            check_int(name, getattr(self, name), minimum=1)

    @classmethod
    def from_config(cls, config: Any) -> DecoderDims:
        """From a transformers config (Llama, Qwen2, Gemma3: ``hidden_size``,
        ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``)."""
        config = getattr(config, "text_config", config)
        hq = config.num_attention_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // hq
        return cls(
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            num_q_heads=hq,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or hq,
            head_dim=d,
        )


def prefill_flops(planner: Any, dims: DecoderDims, prompt_len: int) -> tuple[float, float]:
    """``(planned, dense)``: FLOPs (2 per multiply-add) of the decoder layers of one prefill of
    ``prompt_len`` tokens, under ``planner``'s plans (a
    :class:`~prhs_core.protocols.PrefillPlanner`; anything else prefills densely) and dense.

    Per layer and row: the K/V projections always; the Q and output projections, the gated MLP
    (three ``hidden × intermediate`` matrices) and the attention (``QKᵀ`` and ``PV`` over the
    keys the row sees) unless ETF freezes the row (:meth:`~prhs_core.protocols.PrefillLayerPlan.
    frozen_rows`); PSAW's rows see ``[P(t), t]`` and the sinks. Embeddings, norms, the LM head
    and softmax are left out (the same in both)."""
    n = check_int("prompt_len", prompt_len, minimum=0)
    hq, hkv, d, hid = dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.hidden
    kv_proj = 2.0 * hid * 2 * hkv * d
    rest = 2.0 * (hid * hq * d + hq * d * hid + 3 * hid * dims.intermediate)
    attn = 2.0 * 2 * hq * d  # per key a row sees
    t = torch.arange(n, dtype=torch.float64)
    dense_layer = n * (kv_proj + rest) + attn * float((t + 1).sum())
    if not isinstance(planner, PrefillPlanner):
        return dims.num_layers * dense_layer, dims.num_layers * dense_layer
    planned = 0.0
    for layer in range(dims.num_layers):
        plan = planner.plan_prefill(layer, dims.num_layers)
        seen = t + 1
        if plan.window_fraction > 0.0:
            lo = plan.window_start(n).double()
            seen = (t - lo + 1) + torch.clamp(lo, max=float(plan.n_sink))
        a, e = plan.frozen_rows(n)
        live = torch.ones(n, dtype=torch.float64)
        live[a:e] = 0.0
        planned += n * kv_proj + float((live * (rest + attn * seen)).sum())
    return planned, dims.num_layers * dense_layer
