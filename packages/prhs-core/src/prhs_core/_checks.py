"""Input checks shared by prhs-core: each raises with what was wrong and what was expected.

Every public entry point validates before it mutates or computes, so bad input changes no state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_bool_mask",
    "check_float_tensor",
    "check_index_tensor",
    "check_int",
    "check_probability",
    "check_same_shape",
]


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) that is ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_probability(name: str, value: float | torch.Tensor) -> None:
    """Raise unless ``value`` (a float or a tensor) lies in ``[0, 1]`` and is not NaN."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return
        bad = torch.isnan(value) | (value < 0) | (value > 1)
        if bool(bad.any()):
            worst = value[bad].flatten()[0].item()
            raise ValueError(f"{name} must lie in [0, 1], got a value of {worst}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_float_tensor(name: str, t: object, *, ndim: int | None = None, min_ndim: int = 0) -> None:
    """Raise unless ``t`` is a floating-point tensor with the given number of dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {_shape(t)}")
    if t.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {_shape(t)}")


def check_bool_mask(name: str, t: object, shape: Sequence[int]) -> None:
    """Raise unless ``t`` is a ``torch.bool`` tensor of exactly ``shape``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a torch.bool mask, got dtype {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        expected = "[" + ", ".join(str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {_shape(t)}")


def check_index_tensor(name: str, t: object, *, ndim: int | None = None) -> None:
    """Raise unless ``t`` is an integer tensor with ``ndim`` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {_shape(t)}")


def check_same_shape(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Raise unless every tensor has the same shape as the first."""
    first = tuple(tensors[0].shape)
    for n, t in zip(names[1:], tensors[1:], strict=True):
        if tuple(t.shape) != first:
            raise ValueError(
                f"{n} must have the same shape as {names[0]} {_shape(tensors[0])}, got {_shape(t)}"
            )
