"""Triton kernel of :func:`prhs_kernels.kv.row_bounds`: each row's first valid column and its
count of valid columns, from a ``[B, T]`` validity mask, in one launch (one program a row,
``BLOCK`` columns a tile), both int32 -- what a decode step's attention takes as each row's
``(start, seq_lens)``. The torch path is two reductions and two casts (four launches)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait

__all__ = ["row_bounds_triton"]

BLOCK = 1024
"""Columns a program reads a tile (a power of two; 8 warps from 4096 up). Module-level so that a
benchmark can sweep it: a row of 32k columns is 32 dependent tiles at the default."""


def _row_bounds_kernel(
    M, START, LENS, T, stride_b, stride_t, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    big = 2147483647
    count = tl.zeros([BLOCK], tl.int32)
    first = tl.full([BLOCK], big, tl.int32)
    row = M + b.to(tl.int64) * stride_b
    for t0 in range(0, T, BLOCK):
        t = t0 + offs
        v = tl.load(row + t.to(tl.int64) * stride_t, mask=t < T, other=0) != 0
        count += v.to(tl.int32)
        first = tl.minimum(first, tl.where(v, t, big))
    n = tl.sum(count, 0)
    tl.store(LENS + b, n)
    tl.store(START + b, tl.where(n > 0, tl.min(first, 0), 0))


@functools.cache
def _kernel(interpret: bool) -> object:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_row_bounds_kernel)


def row_bounds_triton(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher (input checked): ``valid [B, T]`` bool, any strides."""
    b, t = valid.shape
    start = torch.empty(b, dtype=torch.int32, device=valid.device)
    lens = torch.empty(b, dtype=torch.int32, device=valid.device)
    if b == 0:
        return start, lens
    raw = valid.view(torch.uint8)  # same strides: a view, not a copy
    _kernel(interpreting())[(b,)](
        raw, start, lens, t, raw.stride(0), raw.stride(1), BLOCK=BLOCK,
        **pdl_args(valid.device, "rows"), num_warps=4 if BLOCK < 4096 else 8,
    )  # fmt: skip
    return start, lens
