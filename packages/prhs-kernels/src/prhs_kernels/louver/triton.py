"""Triton kernel of Louver's cluster scan: every cluster's logit upper bound against the group's
thresholds, reading one layer's index in place.

Grid ``(B * Hkv, ceil(NP·C / BLOCK_C))``: a program takes ``BLOCK_C`` clusters of one
(sequence, KV head), finds each one's page row, reads its centre (``D`` values, the cache dtype)
and its ``S`` radii once, and for each of the group's ``g`` query heads computes
``s·Σ_s (q_s·c_s + ‖q_s‖·ρ_s) − threshold`` in float32; it writes the largest over the group.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting

__all__ = ["cluster_scores_triton"]

BLOCK_C = 32


def _kernel(
    Q,
    CEN,
    RAD,
    ROWS,
    THR,
    OUT,
    stride_qb,
    stride_qh,
    stride_cr,
    stride_ch,
    stride_cc,
    stride_rr,
    stride_rh,
    stride_rc,
    stride_pb,
    n_pages,
    scaling,
    HKV: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    n_total = n_pages * C
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < n_total
    page = offs // C
    j = offs % C
    row = tl.load(ROWS + b.to(tl.int64) * stride_pb + page, mask=ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    d_ok = offs_d < D
    s_ok = offs_s < S
    base_c = CEN + row * stride_cr + h * stride_ch + j.to(tl.int64) * stride_cc
    cen = tl.load(base_c[:, None] + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    cen = cen.to(tl.float32)
    base_r = RAD + row * stride_rr + h * stride_rh + j.to(tl.int64) * stride_rc
    rad = tl.load(base_r[:, None] + offs_s[None, :], mask=ok[:, None] & s_ok[None, :], other=0.0)
    rad = rad.to(tl.float32)
    # Subspace s holds channels [s·D/S, (s+1)·D/S).
    in_sub = (offs_s[:, None] == (offs_d // (D // S))[None, :]) & d_ok[None, :]
    best = tl.full([BLOCK_C], float("-inf"), tl.float32)
    q_base = Q + b.to(tl.int64) * stride_qb + (h * G) * stride_qh
    for gi in tl.static_range(G):
        q = tl.load(q_base + gi * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        qn = tl.sqrt(tl.sum(tl.where(in_sub, (q * q)[None, :], 0.0), 1))  # [BLOCK_S]
        dot = tl.sum(cen * q[None, :], 1)
        ub = (dot + tl.sum(rad * qn[None, :], 1)) * scaling
        thr = tl.load(THR + (pid * G + gi))
        best = tl.maximum(best, ub - thr)
    tl.store(OUT + pid.to(tl.int64) * n_total + offs, best, mask=ok)


@functools.cache
def _compiled(interpret: bool) -> object:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_kernel)


def cluster_scores_triton(
    query: torch.Tensor,
    centres: torch.Tensor,
    radii: torch.Tensor,
    rows: torch.Tensor,
    threshold: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """The launcher's Triton path (inputs checked): ``[B, Hkv, NP·C]`` float32."""
    b, hq, d = query.shape
    h, c, s = centres.shape[1], centres.shape[2], radii.shape[3]
    g = hq // h
    n_pages = rows.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    thr = threshold.float().contiguous()
    out = torch.empty(b, h, max(n_pages * c, 1), dtype=torch.float32, device=query.device)
    kernel = _compiled(interpreting())
    grid = (b * h, max(1, triton.cdiv(n_pages * c, BLOCK_C)))
    kernel[grid](
        query, centres, radii, rows, thr, out,
        query.stride(0), query.stride(1), centres.stride(0), centres.stride(1), centres.stride(2),
        radii.stride(0), radii.stride(1), radii.stride(2), rows.stride(0), n_pages,
        float(scaling), HKV=h, G=g, C=c, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        S=s, BLOCK_S=max(2, triton.next_power_of_2(s)), BLOCK_C=BLOCK_C, num_warps=4,
    )  # fmt: skip
    return out[..., : n_pages * c]
