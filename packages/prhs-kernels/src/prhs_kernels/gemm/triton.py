"""Triton kernel of a decode-size linear layer: ``y = x Wᵀ (+ b)`` for ``M ≤ 16`` rows of ``x``.

At a few rows a projection reads its weight once and does almost no arithmetic on it: its time
is the weight's bytes over the memory bandwidth. Grid ``(ceil(N / BLOCK_N),)``: program ``j``
streams the weight's rows ``[j·BLOCK_N, (j+1)·BLOCK_N)`` over the whole of ``K`` in tiles of
``BLOCK_K`` columns, software-pipelined ``num_stages`` deep, and multiplies each tile by every
row of ``x`` at once (one ``tl.dot`` of the ``[BLOCK_N, BLOCK_K]`` tile against ``xᵀ``, the
rows padded to 16), accumulating in float32. No split of ``K``: every output is written once,
by one program, so there is no second reduction launch and no atomics.

The launch plan is a function of ``(N, K)`` only (:func:`plan`), chosen on an H200 by
``benchmarks/scripts/skinny_gemm_probe.py`` over every projection of the Llama-2-7B and
Llama-3-8B decode steps at 8 and 16 rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_kernels.gemm import MAX_ROWS  # the rows the kernel takes: one padded MMA tile
from prhs_kernels.paths import interpreting

__all__ = ["decode_linear_triton", "plan"]


def _decode_linear_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptr = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # xᵀ: [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr + k0, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k0, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 as integers: exact float32 instead
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptr = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@functools.cache
def _kernel(interpret: bool) -> object:
    """The kernel, jitted for the mode asked (the interpreter or the compiler)."""
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_decode_linear_kernel)


def plan(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for a weight of ``N`` rows and ``K``
    columns: long rows (``K ≥ 8192``, the MLPs' down projections) in 32-row stripes of
    256-column tiles; the others in 64-row stripes of 128 columns, pipelined deeper where
    there are fewer stripes to keep the multiprocessors busy."""
    if k >= 8192:
        return 32, 256, 4, 6
    if n <= 8192:
        return 64, 128, 4, 6
    return 64, 128, 4, 4 if n <= 16384 or n > 24576 else 3


def decode_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    launch: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The launcher (inputs already checked): ``x [M, K]`` (last dim contiguous, ``M ≤
    MAX_ROWS``), ``weight [N, K]`` contiguous rows, ``bias [N]`` or None; ``[M, N]``, new or
    written into ``out`` (contiguous rows). ``launch`` overrides :func:`plan` (for the probe
    that chose it)."""
    m, k = x.shape
    n = weight.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch or plan(n, k)
    _kernel(interpreting())[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, UPCAST=interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
