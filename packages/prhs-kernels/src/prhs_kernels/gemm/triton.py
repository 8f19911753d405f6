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

__all__ = ["decode_linear_triton", "plan", "plan_swiglu"]


def _decode_linear_kernel(
    X,
    W,
    B,
    Y,
    R,
    G,
    HG,
    PS,
    PSI,
    M,
    N,
    K,
    NP,
    eps,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    stride_hm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_OUT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # SWIGLU: the weight is [gate; up] (2N rows); this program also streams the up rows of its
    # columns, into a second accumulator.
    u_ptr = W + (offs_n[:, None] + N).to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptr = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # xᵀ: [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # The loop only loads and multiplies: a tile changed on its way to the MMA would go through
    # registers and back to shared memory, serialising the weight stream.
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w_ok = n_ok[:, None]
            x = tl.load(x_ptr + k0, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            w_ok = n_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=w_ok, other=0.0)
        if SWIGLU:
            wu = tl.load(u_ptr + k0, mask=w_ok, other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 as integers: exact float32 instead
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
            if SWIGLU:
                acc_u += tl.dot(wu.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
            if SWIGLU:
                acc_u = tl.dot(wu, x, acc_u)
    if ROW_SCALE:  # an RMS norm's 1 / rms of each input row, from partial sums of its squares
        offs_p = tl.arange(0, BLOCK_P)
        part = tl.load(PSI + offs_p[:, None] * M + offs_m[None, :],
                       mask=(offs_p[:, None] < NP) & m_ok[None, :], other=0.0)  # fmt: skip
        scale = tl.rsqrt(tl.sum(part, axis=0) / K + eps)
        acc = acc * scale[None, :]
        acc_u = acc_u * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if SWIGLU:
            acc_u += tl.load(B + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_u
    out_ok = n_ok[:, None] & m_ok[None, :]
    if RESIDUAL:
        r_ptr = R + offs_m[None, :] * stride_rm + offs_n[:, None]
        acc += tl.load(r_ptr, mask=out_ok, other=0.0).to(tl.float32)
    out = acc.to(Y.dtype.element_ty)
    y_ptr = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptr, out, mask=out_ok)
    if NORM_OUT:  # the next RMS norm's input: h ⊙ weight, and this stripe's sum of h² per row
        h = tl.where(out_ok, out.to(tl.float32), 0.0)
        g = tl.load(G + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        hg_ptr = HG + offs_m[None, :] * stride_hm + offs_n[:, None]
        tl.store(hg_ptr, (h * g[:, None]).to(Y.dtype.element_ty), mask=out_ok)
        tl.store(PS + pid * M + offs_m, tl.sum(h * h, axis=0), mask=m_ok)


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


def plan_swiglu(n: int, k: int) -> tuple[int, int, int, int]:
    """:func:`plan` of a SwiGLU GEMM whose output has ``N`` columns (its weight ``[2N, K]``):
    each program streams ``BLOCK_N`` gate rows and the ``BLOCK_N`` up rows of the same columns,
    so a stripe of ``BLOCK_N`` is as many weight bytes as one of ``2·BLOCK_N`` of the plain
    kernel. ``(64, 128, 4, 3)`` was the fastest of a sweep on the H200 at both Llama shapes'
    gate|up (within 1.5 % of the plain kernel over the same ``[2N, K]`` weight)."""
    del n, k
    return 64, 128, 4, 3


def decode_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    launch: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    swiglu: bool = False,
    sumsq: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The launcher (inputs already checked): ``x [M, K]`` (last dim contiguous, ``M ≤
    MAX_ROWS``), ``weight [N, K]`` contiguous rows, ``bias [N]`` or None; returns ``(y, hg,
    partial sums)``: ``y [M, N]``, new or written into ``out`` (contiguous rows), and the
    other two None unless ``norm_weight`` is given. ``launch`` overrides :func:`plan` /
    :func:`plan_swiglu` (for the probes that chose them).

    Epilogues, on the float32 accumulator: ``sumsq [P, M]`` (float32) -- scale each row by
    ``1 / sqrt(Σ_p sumsq / K + eps)``; ``swiglu`` -- the weight is ``[gate; up]`` (``2N'``
    rows) and ``y = silu(gate) * up`` is ``[M, N']``; ``residual [M, N]`` -- added; and
    ``norm_weight [N]`` -- also write ``hg = y ⊙ norm_weight`` ``[M, N]`` and the sums of ``y²``
    over each program's columns, ``[cdiv(N, BLOCK_N), M]`` float32 (the next RMS norm's
    input and its partial sums, for a ``sumsq`` GEMM)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch or (plan_swiglu(n, k) if swiglu else plan(n, k))
    grid = triton.cdiv(n, block_n)
    hg = ps = None
    if norm_weight is not None:
        hg = torch.empty_like(y)
        ps = torch.empty(grid, m, dtype=torch.float32, device=x.device)
    dummy = weight
    n_parts = sumsq.shape[0] if sumsq is not None else 1
    _kernel(interpreting())[(grid,)](
        x, weight, bias if bias is not None else dummy, y,
        residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, hg if hg is not None else dummy,
        ps if ps is not None else dummy, sumsq if sumsq is not None else dummy,
        m, n, k, n_parts, float(eps),
        x.stride(0), weight.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0, hg.stride(0) if hg is not None else 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_P=triton.next_power_of_2(n_parts), EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, ROW_SCALE=sumsq is not None,
        RESIDUAL=residual is not None, NORM_OUT=norm_weight is not None, UPCAST=interpreting(),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y, hg, ps
