"""Triton kernels of CompKV's block statistics, reading one layer's side-cache fields in place
through each block's page row (no gathered copy of the fields):

- ``_estimates_kernel``, grid ``(B * Hkv, ceil(NB / BLOCK_N))``: a tile of blocks' key sums,
  sums of squares and counts, their means and variances, and for each of the group's ``g``
  query heads ``log|B| + s·q·μ`` and ``log(s²·Σ q²·σ²)`` (float32 products and sums: no
  reduced-precision ``tl.dot``, so the ranking matches the reference's).
- ``_compensation_kernel``, grid ``(B * Hkv, ceil(NB / SPLIT))``: each program walks ``SPLIT``
  blocks and accumulates ``Σ_n w[g, n]·v̄_n`` for the group, reading each valid block's value
  sum once; the splits' partial sums are added after.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting

__all__ = ["block_compensation_triton", "block_estimates_triton"]

BLOCK_N = 32
SPLIT = 256  # blocks per program of the compensation (a partial sum each, added after)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _blocks(PAGES, COUNT, b, offs_n, nb, seq_len, stride_pb, stride_c, block_size):
    """Page rows, counts (1 where not valid) and validity of a tile of blocks."""
    n_ok = offs_n < nb
    exists = n_ok & (offs_n * block_size < seq_len)
    page = tl.load(PAGES + b.to(tl.int64) * stride_pb + offs_n, mask=exists, other=0).to(tl.int64)
    cnt = tl.load(COUNT + page * stride_c, mask=exists, other=0.0)
    valid = exists & (cnt > 0)
    return page, tl.where(valid, cnt, 1.0), valid


def _estimates_kernel(
    Q,
    KSUM,
    KSQ,
    COUNT,
    PAGES,
    LENS,
    LOG_MASS,
    LOG_VAR,
    stride_qb,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_sr,
    stride_sh,
    stride_c,
    stride_pb,
    nb,
    block_size,
    scaling,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    seq_len = tl.load(LENS + b)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    page, cnt, valid = _blocks(
        PAGES, COUNT, b, offs_n, nb, seq_len, stride_pb, stride_c, block_size
    )
    m2 = valid[:, None] & d_ok[None, :]
    ks = tl.load(
        KSUM + page[:, None] * stride_kr + h * stride_kh + offs_d[None, :], mask=m2, other=0.0
    )
    kq = tl.load(
        KSQ + page[:, None] * stride_sr + h * stride_sh + offs_d[None, :], mask=m2, other=0.0
    )
    mu = ks / cnt[:, None]
    var = tl.maximum(kq / cnt[:, None] - mu * mu, 0.0)
    log_cnt = tl.log(cnt)
    n_ok = offs_n < nb
    q_base = Q + b.to(tl.int64) * stride_qb + (h * G) * stride_qh
    for gi in tl.static_range(G):  # exact float32 products, one query head at a time
        q = tl.load(q_base + gi * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        mean = tl.sum(mu * q[None, :], 1) * scaling  # [BLOCK_N]
        lvar = tl.sum(var * (q * q)[None, :], 1) * (scaling * scaling)
        row = (pid.to(tl.int64) * G + gi) * nb + offs_n
        tl.store(LOG_MASS + row, tl.where(valid, log_cnt + mean, float("-inf")), mask=n_ok)
        tl.store(LOG_VAR + row, tl.where(valid, tl.log(lvar), float("-inf")), mask=n_ok)


def _compensation_kernel(
    W,
    VSUM,
    COUNT,
    PAGES,
    LENS,
    OUT,
    stride_vr,
    stride_vh,
    stride_c,
    stride_pb,
    nb,
    block_size,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program (row, split): blocks [split * SPLIT, (split + 1) * SPLIT); a partial sum per split.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    seq_len = tl.load(LENS + b)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    w_base = W + pid.to(tl.int64) * G * nb
    for n0 in range(split * SPLIT, tl.minimum((split + 1) * SPLIT, nb), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        page, cnt, valid = _blocks(
            PAGES, COUNT, b, offs_n, nb, seq_len, stride_pb, stride_c, block_size
        )
        vs = tl.load(
            VSUM + page[:, None] * stride_vr + h * stride_vh + offs_d[None, :],
            mask=valid[:, None] & d_ok[None, :],
            other=0.0,
        )
        vbar = vs / cnt[:, None]  # [BLOCK_N, BLOCK_D]
        for gi in tl.static_range(G):  # exact float32 products, one query head at a time
            w = tl.load(w_base + gi * nb + offs_n, mask=valid, other=0.0)
            part = tl.sum(w[:, None] * vbar, 0)  # [BLOCK_D]
            acc = tl.where(offs_g[:, None] == gi, acc + part[None, :], acc)
    rows = (split * tl.num_programs(0) + pid).to(tl.int64) * G + offs_g
    out = OUT + rows[:, None] * D + offs_d[None, :]
    tl.store(out, acc, mask=(offs_g < G)[:, None] & d_ok[None, :])


@functools.cache
def _compiled(interpret: bool) -> tuple[object, object]:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_estimates_kernel), triton.jit(_compensation_kernel)


def _meta(g: int, d: int) -> dict[str, int]:
    return {
        "G": g,
        "BLOCK_G": max(16, triton.next_power_of_2(g)),
        "D": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "BLOCK_N": BLOCK_N,
    }


def block_estimates_triton(
    query: torch.Tensor,
    ksum: torch.Tensor,
    ksq: torch.Tensor,
    count: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher's Triton path (inputs checked): ``(log_mass, log_var)`` ``[B, Hkv, g, NB]``."""
    b, hq, d = query.shape
    h = ksum.shape[1]
    g = hq // h
    nb = pages.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    log_mass = torch.empty(b, h, g, max(nb, 1), dtype=torch.float32, device=query.device)
    log_var = torch.empty_like(log_mass)
    kernel, _ = _compiled(interpreting())
    grid = (b * h, max(1, triton.cdiv(nb, BLOCK_N)))
    kernel[grid](
        query, ksum, ksq, count, pages, seq_lens, log_mass, log_var,
        query.stride(0), query.stride(1), ksum.stride(0), ksum.stride(1),
        ksq.stride(0), ksq.stride(1), count.stride(0), pages.stride(0),
        nb, block_size, float(scaling), HKV=h, **_meta(g, d), num_warps=4,
    )  # fmt: skip
    return log_mass[..., :nb], log_var[..., :nb]


def block_compensation_triton(
    weight: torch.Tensor,
    vsum: torch.Tensor,
    count: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """The launcher's Triton path (inputs checked): ``[B, Hkv, g, Dv]`` float32."""
    b, h, g, nb = weight.shape
    dv = vsum.shape[-1]
    weight = weight.float().contiguous()
    splits = max(1, triton.cdiv(nb, SPLIT))
    part = torch.empty(splits, b, h, g, dv, dtype=torch.float32, device=weight.device)
    _, kernel = _compiled(interpreting())
    kernel[(b * h, splits)](
        weight, vsum, count, pages, seq_lens, part,
        vsum.stride(0), vsum.stride(1), count.stride(0), pages.stride(0), nb, block_size,
        HKV=h, **_meta(g, dv), SPLIT=SPLIT, num_warps=4,
    )  # fmt: skip
    return part.sum(0) if splits > 1 else part[0]
