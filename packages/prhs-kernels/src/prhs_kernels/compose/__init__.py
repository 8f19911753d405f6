"""Building a selection: sink and local windows as block lists, dilation, and the union of
lists into one fixed-width, duplicate-free list written into a selection's buffers.

On the CPU, :func:`dilate_indices` and :func:`union_indices` run Numba kernels with the
references' exact outputs (:mod:`prhs_kernels.compose.numba`, chosen by
:func:`~prhs_kernels.paths.numba_path`; ``PRHS_KERNELS=torch`` keeps the references). The first
call compiles them (a few seconds), once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch

from prhs_core.checks import check_index_tensor, check_int, shape_str
from prhs_kernels.compose.reference import (
    dilate_indices_reference,
    union_indices_reference,
    window_indices_reference,
    window_widths,
)
from prhs_kernels.paths import announce, numba_path

__all__ = [
    "dilate_indices",
    "dilate_indices_reference",
    "union_indices",
    "union_indices_reference",
    "window_indices",
    "window_indices_reference",
    "window_widths",
]


@functools.cache
def _numba() -> ModuleType:
    """The Numba kernels, imported and compiled at their first use."""
    from prhs_kernels.compose import numba as kernels

    kernels.warm_up()
    return kernels


def window_indices(
    seq_lens: torch.Tensor, n_sink: int, n_local: int, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids of each sequence's sink and local windows: ``(sink [B, ws], local [B, wl])``
    int32, ``-1`` where a block does not exist (widths from :func:`window_widths`)."""
    check_index_tensor("seq_lens", seq_lens, ndim=1)
    check_int("n_sink", n_sink, minimum=0)
    check_int("n_local", n_local, minimum=0)
    check_int("s", s, minimum=1)
    return window_indices_reference(seq_lens, n_sink, n_local, s)


def dilate_indices(indices: torch.Tensor, counts: torch.Tensor, m: int, r: int) -> torch.Tensor:
    """``p ± j`` for ``1 <= j <= r`` around the first ``m`` entries of each list
    ``indices [..., M]`` (``counts [...]`` in use): ``[..., 2·r·m]`` int32, ``-1`` for none."""
    check_index_tensor("indices", indices)
    check_index_tensor("counts", counts, ndim=indices.ndim - 1)
    check_int("m", m, minimum=0)
    check_int("r", r, minimum=0)
    if numba_path(indices.device):
        announce("dilate_indices", "numba", indices.device)
        return _numba().dilate_indices_numba(indices, counts, m, r)
    return dilate_indices_reference(indices, counts, m, r)


def union_indices(
    parts: Sequence[torch.Tensor],
    limit: torch.Tensor,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
) -> None:
    """Write the union of ``parts`` (``[B, H, w]`` per head or ``[B, w]`` for every head, ``-1``
    for none), restricted to ids in ``[0, limit[b])``, into ``out_indices [B, H, K]`` (ascending,
    distinct, ``-1`` past the count) and ``out_counts [B, H]``."""
    if not parts:
        raise ValueError("union_indices needs at least one part")
    check_index_tensor("limit", limit, ndim=1)
    check_index_tensor("out_indices", out_indices, ndim=3)
    b, h, width = out_indices.shape
    for i, p in enumerate(parts):
        check_index_tensor(f"parts[{i}]", p)
        ok = (p.ndim == 3 and tuple(p.shape[:2]) == (b, h)) or (p.ndim == 2 and p.shape[0] == b)
        if not ok:
            raise ValueError(
                f"parts[{i}] must have shape [B={b}, H={h}, w] or [B={b}, w], got {shape_str(p)}"
            )
    if tuple(out_counts.shape) != (b, h):
        raise ValueError(f"out_counts must have shape [{b}, {h}], got {shape_str(out_counts)}")
    if numba_path(limit.device) and all(p.device == limit.device for p in parts):
        announce("union_indices", "numba", limit.device)
        idx, counts = _numba().union_indices_numba(parts, limit, width)
    else:
        idx, counts = union_indices_reference(parts, limit, width)
    out_indices.copy_(idx)
    out_counts.copy_(counts)
