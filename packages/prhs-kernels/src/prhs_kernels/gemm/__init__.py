"""Decode-size linear layers: ``y = x Wᵀ (+ b)`` for a few rows of ``x``, as one weight stream.

A decode step's projections multiply a handful of rows (one per sequence) by each weight: the
weight's bytes are the whole cost. :func:`decode_linear` runs them through a Triton kernel that
reads each weight row once, with no split of the reduction (so no second launch), on CUDA for
fp16/bf16 inputs of at most :data:`MAX_ROWS` rows (:mod:`prhs_kernels.gemm.triton`); any other
input -- more rows, float32, a CPU tensor (``TRITON_INTERPRET=1`` aside), a weight whose rows
are not contiguous, ``PRHS_KERNELS=torch`` -- goes to ``torch.nn.functional.linear``. The choice
is a function of the device, dtype and shapes only, made before anything runs.

The Triton path is the custom op ``torch.ops.prhs.decode_linear`` (``torch.library``), so a
``torch.compile``'d model calls it as one opaque op, and a CUDA graph captures it as one launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prhs_core.checks import check_float_tensor
from prhs_kernels.paths import announce, kernel_path

__all__ = ["MAX_ROWS", "decode_linear", "decode_linear_path", "decode_linear_reference"]

MAX_ROWS = 16
"""The most rows (``x.numel() // K``) the Triton path takes."""


def decode_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x Wᵀ + b`` accumulated in float32, in ``x``'s dtype: what the kernel computes."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


@torch.library.custom_op("prhs::decode_linear", mutates_args=())
def _decode_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from prhs_kernels.gemm.triton import decode_linear_triton

    return decode_linear_triton(x, weight, bias)


@_decode_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def decode_linear_path(rows: int, weight: torch.Tensor) -> str:
    """The path :func:`decode_linear` takes for ``rows`` rows of input to ``weight``:
    ``"triton"``, ``"triton-interpreter"`` or ``"torch"``."""
    path = kernel_path(weight.device, weight.dtype)
    if path != "torch" and (rows > MAX_ROWS or weight.stride(-1) != 1):
        return "torch"
    return path


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float_tensor("x", x, min_ndim=1)
    check_float_tensor("weight", weight, ndim=2)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim ({x.shape[-1]}) must equal weight's columns [N, K] "
            f"(K = {weight.shape[1]})"
        )
    if bias is not None:
        check_float_tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must be [N] = [{weight.shape[0]}], got {list(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{name} must match x's dtype and device ({x.dtype}, {x.device}), got "
                f"{t.dtype}, {t.device}"
            )


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]ᵀ (+ bias [N])`` -> ``[..., N]``, as ``F.linear`` computes it
    (float32 accumulation, the output in ``x``'s dtype); the Triton weight stream where
    :func:`decode_linear_path` says so."""
    _check(x, weight, bias)
    k = weight.shape[1]
    rows = x.numel() // k if k else 0
    path = decode_linear_path(rows, weight)
    if path == "torch" or rows == 0:
        return F.linear(x, weight, bias)
    announce("decode_linear", path, x.device)
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _decode_linear_op(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
