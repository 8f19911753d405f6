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

__all__ = ["cluster_scores_triton", "index_pages_triton"]

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


@triton.jit  # at import, unlike the kernels (a helper: interpreted tests import with the flag)
def _split_level(
    base,
    perm,
    stride_kr,
    offs_d,
    d_ok,
    P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LEVEL: tl.constexpr,
    ITERS: tl.constexpr,
):
    """One level of the tree: split each of the ``2^LEVEL`` groups of consecutive entries of
    ``perm [P]`` (rows of the page at ``base``) at the median of its principal axis."""
    G: tl.constexpr = 1 << LEVEL
    M: tl.constexpr = P >> LEVEL
    x = tl.load(
        base + perm[:, None].to(tl.int64) * stride_kr + offs_d[None, :],
        mask=d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # NaN and ±inf read as 0
    xg = tl.reshape(x, [G, M, BLOCK_D])
    centred = xg - (tl.sum(xg, 1) / M)[:, None, :]
    li = tl.arange(0, M)
    first = tl.sum(tl.where((li == 0)[None, :, None], centred, 0.0), 1)
    last = tl.sum(tl.where((li == M - 1)[None, :, None], centred, 0.0), 1)
    axis = tl.where(d_ok[None, :], first - last + 1e-6, 0.0)  # [G, BLOCK_D]
    for _ in tl.static_range(ITERS):
        proj = tl.sum(centred * axis[:, None, :], 2)  # [G, M]
        t = tl.sum(centred * proj[:, :, None], 1)  # [G, BLOCK_D]
        norm = tl.maximum(tl.sqrt(tl.sum(t * t, 1)), 1e-30)
        axis = t / norm[:, None]
    proj = tl.sum(centred * axis[:, None, :], 2)
    proj = tl.where(proj == 0.0, 0.0, proj)  # -0.0 ties +0.0, as in a float sort
    bits = proj.to(tl.int32, bitcast=True)
    okey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the float
    # A stable order: the projection, then the position within the group; the member rides
    # in the low 16 bits.
    key = (
        (okey.to(tl.int64) << 32)
        | (li[None, :].to(tl.int64) << 16)
        | tl.reshape(perm, [G, M]).to(tl.int64)
    )
    key = tl.sort(key, 1)
    return tl.reshape((key & 0xFFFF).to(tl.int32), [P])


def _index_kernel(
    K,
    ROWS,
    ACTIVE,
    PERM,
    CEN,
    RAD,
    stride_kb,
    stride_kh,
    stride_kp,
    stride_kr,
    stride_rb,
    stride_pr,
    stride_ph,
    stride_cr,
    stride_ch,
    stride_cc,
    stride_ar,
    stride_ah,
    stride_ac,
    radius_slack,
    NP,
    HKV: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CS: tl.constexpr,
    S: tl.constexpr,
    LEVELS: tl.constexpr,
    ITERS: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // (HKV * NP)
    h = (pid // NP) % HKV
    pg = pid % NP
    if tl.load(ACTIVE + b) != 0:
        base = K + b.to(tl.int64) * stride_kb + h * stride_kh + pg.to(tl.int64) * stride_kp
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        perm = tl.arange(0, P)
        for level in tl.static_range(LEVELS):
            perm = _split_level(base, perm, stride_kr, offs_d, d_ok, P, BLOCK_D, level, ITERS)
        C: tl.constexpr = P // CS
        x = tl.load(
            base + perm[:, None].to(tl.int64) * stride_kr + offs_d[None, :],
            mask=d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.where(tl.abs(x) < float("inf"), x, 0.0)
        members = tl.reshape(x, [C, CS, BLOCK_D])
        centre = (tl.sum(members, 1) / CS).to(CEN.dtype.element_ty)
        row = tl.load(ROWS + b.to(tl.int64) * stride_rb + pg).to(tl.int64)
        offs_c = tl.arange(0, C)
        cen_ptr = CEN + row * stride_cr + h * stride_ch
        tl.store(
            cen_ptr + offs_c[:, None].to(tl.int64) * stride_cc + offs_d[None, :],
            centre,
            mask=d_ok[None, :],
        )
        centre = centre.to(tl.float32)
        diff = members - centre[:, None, :]
        sq = diff * diff
        sub = offs_d // (D // S)
        rad_ptr = RAD + row * stride_ar + h * stride_ah + offs_c.to(tl.int64) * stride_ac
        for si in tl.static_range(S):
            in_s = ((sub == si) & d_ok)[None, None, :]
            radius = tl.max(tl.sqrt(tl.sum(tl.where(in_s, sq, 0.0), 2)), 1)  # [C]
            cn = tl.sqrt(tl.sum(tl.where((sub == si) & d_ok, centre * centre, 0.0), 1))
            tl.store(rad_ptr + si, radius * (1 + radius_slack) + radius_slack * cn)
        tl.store(
            PERM + row * stride_pr + h * stride_ph + tl.arange(0, P),
            perm.to(PERM.dtype.element_ty),
        )


@functools.cache
def _compiled_index(interpret: bool) -> object:
    del interpret  # part of the cache key, as for the scan
    return triton.jit(_index_kernel)


def index_pages_triton(
    keys: torch.Tensor,
    rows: torch.Tensor,
    active: torch.Tensor,
    perm: torch.Tensor,
    centres: torch.Tensor,
    radii: torch.Tensor,
    cluster_size: int,
    radius_slack: float,
    power_iterations: int,
) -> None:
    """The launcher's Triton path (inputs checked): one program per (sequence, KV head, page),
    nothing done for a sequence that is not active."""
    b, h, n_pages, p, d = keys.shape
    s = radii.shape[-1]
    if b * h * n_pages == 0:
        return
    kernel = _compiled_index(interpreting())
    levels = (p // cluster_size).bit_length() - 1
    block_d = max(16, triton.next_power_of_2(d))
    kernel[(b * h * n_pages,)](
        keys, rows, active, perm, centres, radii,
        keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3), rows.stride(0),
        perm.stride(0), perm.stride(1), centres.stride(0), centres.stride(1), centres.stride(2),
        radii.stride(0), radii.stride(1), radii.stride(2), float(radius_slack), n_pages,
        HKV=h, P=p, D=d, BLOCK_D=block_d, CS=cluster_size, S=s, LEVELS=levels,
        ITERS=power_iterations, num_warps=16 if p * block_d >= 16384 else 4,
    )  # fmt: skip
