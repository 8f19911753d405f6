"""Input checks: each raises with what was wrong and what was expected.

Every public entry point of prhs validates before it mutates or computes, so bad input changes
no state. These helpers are public so that selectors written outside prhs give the same errors.

Two kinds of check:

- *shape checks* (dtype, number of dimensions, sizes) read only metadata: they are free and run
  on every call, the decode path included;
- *value checks* (:func:`check_values_finite`, :func:`check_in_range`) read device values on
  the host. They are for set-up and for a plan's ``checked`` mode (tests, CPU runs); the decode
  path of a captured CUDA graph never calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_bool_mask",
    "check_counter",
    "check_device",
    "check_flag",
    "check_float_tensor",
    "check_in_range",
    "check_index_tensor",
    "check_int",
    "check_probability",
    "check_same_shape",
    "check_shape",
    "check_values_finite",
    "shape_str",
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


def shape_str(t: torch.Tensor | Sequence[int]) -> str:
    """``[2, 3, 4]``: a shape as the error messages print it."""
    dims = t.shape if isinstance(t, torch.Tensor) else t
    return "[" + ", ".join(str(s) for s in dims) + "]"


def check_float_tensor(name: str, t: object, *, ndim: int | None = None, min_ndim: int = 0) -> None:
    """Raise unless ``t`` is a floating-point tensor with the given number of dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {shape_str(t)}")
    if t.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimensions, got shape {shape_str(t)}"
        )


def check_bool_mask(name: str, t: object, shape: Sequence[int]) -> None:
    """Raise unless ``t`` is a ``torch.bool`` tensor of exactly ``shape``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be a torch.bool mask, got dtype {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        expected = "[" + ", ".join(str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {shape_str(t)}")


def _check_one_element(
    name: str, t: object, dtype: torch.dtype, what: str, device: torch.device | None, hint: str
) -> None:
    ok = isinstance(t, torch.Tensor) and t.dtype == dtype and t.numel() == 1
    if ok and (device is None or t.device == device):
        return
    where = f" on {device}" if device is not None else ""
    if isinstance(t, torch.Tensor):
        got = f"{t.dtype} of shape {shape_str(t)} on {t.device}"
    else:
        got = type(t).__name__
    raise ValueError(f"{name} must be a one-element {what} tensor{where}{hint}, got {got}")


def check_flag(name: str, t: object, device: torch.device | None = None, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``t`` is a one-element ``torch.bool`` tensor (on ``device``,
    when given); ``hint`` ends the message (where such a flag comes from)."""
    _check_one_element(name, t, torch.bool, "bool", device, hint)


def check_counter(name: str, t: object, device: torch.device | None = None, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``t`` is a one-element ``torch.int64`` tensor (on ``device``,
    when given), a counter kernels add to; ``hint`` ends the message (where it comes from)."""
    _check_one_element(name, t, torch.int64, "int64", device, hint)


def check_index_tensor(name: str, t: object, *, ndim: int | None = None) -> None:
    """Raise unless ``t`` is an integer tensor with ``ndim`` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {shape_str(t)}")


def check_same_shape(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Raise unless every tensor has the same shape as the first."""
    first = tuple(tensors[0].shape)
    for n, t in zip(names[1:], tensors[1:], strict=True):
        if tuple(t.shape) != first:
            raise ValueError(
                f"{n} must have the same shape as {names[0]} {shape_str(tensors[0])}, "
                f"got {shape_str(t)}"
            )


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], what: str) -> None:
    """Raise unless ``t.shape`` matches ``expected`` (``None`` matches any size).

    ``what`` names the dimensions for the message, e.g. ``"[B, Hkv, K]"``.
    """
    ok = t.ndim == len(expected) and all(
        e is None or s == e for s, e in zip(t.shape, expected, strict=True)
    )
    if not ok:
        want = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{name} must have shape {what} = [{want}], got {shape_str(t)}")


def check_device(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Raise unless every tensor is on the device of the first (``meta`` matches anything)."""
    first = tensors[0].device
    for n, t in zip(names[1:], tensors[1:], strict=True):
        if t.device != first and "meta" not in (t.device.type, first.type):
            raise ValueError(
                f"{n} is on {t.device} but {names[0]} is on {first}; move them to one device"
            )


def check_values_finite(name: str, t: torch.Tensor, *, where: str = "") -> None:
    """Raise if ``t`` holds a NaN or an infinity (reads values on the host: set-up and checked
    mode only). The message gives the first offending index."""
    if t.device.type == "meta" or t.numel() == 0:
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"{name} holds a non-finite value ({t[first].item()}) at index {list(first)}{where}; "
            "prhs never stores non-finite inputs in its state"
        )


def check_in_range(
    name: str, t: torch.Tensor, low: int | torch.Tensor, high: int | torch.Tensor, what: str
) -> None:
    """Raise unless ``low <= t <= high`` element-wise (reads values on the host: set-up and
    checked mode only). ``what`` says what the bounds are, for the message."""
    if t.device.type == "meta" or t.numel() == 0:
        return
    bad = (t < low) | (t > high)
    if bool(bad.any()):
        i = tuple(int(x) for x in torch.nonzero(bad)[0].tolist())
        lo = low[i].item() if isinstance(low, torch.Tensor) and low.ndim else low
        hi = high[i].item() if isinstance(high, torch.Tensor) and high.ndim else high
        raise ValueError(
            f"{name}{list(i)} = {t[i].item()} is out of range: {what} ([{int(lo)}, {int(hi)}])"
        )
