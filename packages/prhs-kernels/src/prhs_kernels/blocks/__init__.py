"""Block reductions (max, min, sum, any) over aligned blocks of ``s`` positions."""

from __future__ import annotations

import torch

from prhs_core.checks import check_int
from prhs_kernels.blocks.reference import block_reduce_reference

__all__ = ["BLOCK_OPS", "block_reduce", "block_reduce_reference"]

BLOCK_OPS = ("max", "min", "sum", "any")


def block_reduce(x: torch.Tensor, s: int, op: str) -> torch.Tensor:
    """``[..., ceil(T/s)]``: ``op`` over each aligned block of ``s`` entries of ``x [..., T]``
    (``any`` takes a bool tensor, the others a floating one)."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        raise TypeError("x must be a tensor with at least one dimension")
    check_int("s", s, minimum=1)
    if op not in BLOCK_OPS:
        raise ValueError(f"op must be one of {BLOCK_OPS}, got {op!r}")
    if (op == "any") != (x.dtype == torch.bool):
        raise TypeError(f"block_reduce(op={op!r}) got a {x.dtype} tensor")
    if s == 1:
        return x
    return block_reduce_reference(x, s, op)
