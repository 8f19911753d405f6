"""Torch reference of block reductions over aligned blocks of ``s`` positions."""

from __future__ import annotations

import torch

__all__ = ["block_reduce_reference"]

_FILL = {"max": float("-inf"), "min": float("inf"), "sum": 0.0, "any": False}


def block_reduce_reference(x: torch.Tensor, s: int, op: str) -> torch.Tensor:
    """``[..., ceil(T/s)]``: ``op`` (``max``, ``min``, ``sum`` or ``any``) over each aligned block
    of ``s`` entries of the last dim of ``x [..., T]``; a short last block is padded with the
    op's identity."""
    t = x.shape[-1]
    nb = -(-t // s)
    if nb * s != t:
        pad = torch.full((*x.shape[:-1], nb * s - t), _FILL[op], dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=-1)
    x = x.view(*x.shape[:-1], nb, s)
    if op == "max":
        return x.amax(-1)
    if op == "min":
        return x.amin(-1)
    if op == "sum":
        return x.sum(-1)
    return x.any(-1)
