"""KV reads through either layout: the KV location of a logical position, gathers, and each
row's cached run.

:func:`token_locations` maps logical positions to the physical KV locations that side caches
are indexed by (:mod:`prhs_core.layout`); :func:`gather_kv` reads keys and values at logical
positions in the cache's dtype; :func:`row_bounds` finds each row's cached run in a validity
mask (one Triton launch on CUDA). All are static-shape and read no device value on the host.
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_index_tensor, check_int, shape_str
from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_kernels.kv.reference import (
    gather_kv_reference,
    row_bounds_reference,
    token_locations_reference,
    valid_positions,
)
from prhs_kernels.paths import announce, kernel_path

__all__ = [
    "gather_kv",
    "gather_kv_reference",
    "row_bounds",
    "row_bounds_reference",
    "token_locations",
    "token_locations_reference",
    "valid_positions",
]


def _check_layout(kv: object) -> None:
    if not isinstance(kv, ContiguousKV | PagedKV):
        raise TypeError(f"kv must be a ContiguousKV or a PagedKV, got {type(kv).__name__}")


def token_locations(kv: KVLayout, positions: torch.Tensor, row_stride: int) -> torch.Tensor:
    """int64 ``[B, ...]`` KV location of each logical position of ``positions [B, ...]``
    (``-1`` where the position does not exist). ``row_stride`` is the side cache's
    (:attr:`prhs_core.state.SelectorState.row_stride`); paged layouts ignore it."""
    _check_layout(kv)
    check_index_tensor("positions", positions)
    check_int("row_stride", row_stride, minimum=1)
    if positions.ndim < 1 or positions.shape[0] != kv.batch_size:
        raise ValueError(
            f"positions must have shape [B={kv.batch_size}, ...], got {shape_str(positions)}"
        )
    return token_locations_reference(kv, positions, row_stride)


def gather_kv(
    kv: KVLayout, positions: torch.Tensor, *, values: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys ``[B, Hkv, K, D]`` (and values ``[B, Hkv, K, Dv]`` unless ``values=False``) at
    logical ``positions [B, Hkv, K]``, in the cache dtype; zeros where a position does not
    exist."""
    _check_layout(kv)
    check_index_tensor("positions", positions, ndim=3)
    if tuple(positions.shape[:2]) != (kv.batch_size, kv.num_kv_heads):
        raise ValueError(
            f"positions must have shape [B={kv.batch_size}, Hkv={kv.num_kv_heads}, K], "
            f"got {shape_str(positions)}"
        )
    return gather_kv_reference(kv, positions, values=values)


def row_bounds(valid: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 ``(start [B], lens [B])`` of a ``[B, T]`` bool validity mask (any strides: a view
    of a ``[B, 1, Tq, T]`` attention mask will do): each row's first valid column (0 for a row
    with none) and its number of valid columns -- a row's cached run when its valid columns
    are contiguous (not checked here: nothing is read on the host). The path follows the
    cache's dtype as every decode op's does (:func:`~prhs_kernels.paths.kernel_path`): one
    Triton launch (:mod:`prhs_kernels.kv.triton`) for a half-precision cache on CUDA, the
    torch reference (two reductions, two casts) otherwise."""
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.ndim != 2:
        got = shape_str(valid) if isinstance(valid, torch.Tensor) else type(valid).__name__
        kind = f" {valid.dtype}" if isinstance(valid, torch.Tensor) else ""
        raise ValueError(f"valid must be a [B, T] bool tensor, got{kind} {got}")
    path = kernel_path(valid.device, cache_dtype)
    if path == "torch" or valid.shape[1] == 0:
        return row_bounds_reference(valid)
    announce("row_bounds", path, valid.device)
    from prhs_kernels.kv.triton import row_bounds_triton

    return row_bounds_triton(valid)
