"""Triton kernel of RaBitQ's logit estimates: every cached key's 1-bit code against the 4-bit
query, read in place from the side cache.

Grid ``(B * Hkv, ceil(T / BLOCK_T))``: a program takes ``BLOCK_T`` positions of one (sequence,
KV head), finds their KV locations (``b · row_stride + t``, or the request-to-token table of a
paged pool), reads each key's ``D/8`` code bytes, its factor and ``c_q·k``, expands the bits to
a ``[BLOCK_T, D]`` tile of 0/1 and multiplies it with the group's integer query codes in one
``tl.dot`` (half precision, exact: 0/1 times integers 0..15 summed in float32). From that
product ``⟨code, bits⟩`` and the popcount, ``⟨q̄, x̄⟩ = (2·(lo·popcount + scale·⟨code, bits⟩) −
Σq̄)/√D`` and the logit ``s·(factor·⟨q̄, x̄⟩ + q·c_k − c_q·c_k + c_q·k)`` (see
:func:`prhs_kernels.rabitq.reference.query_codes`). A step reads ``D/8 + 8`` bytes per key.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from prhs_core.layout import ContiguousKV, KVLayout
from prhs_kernels.paths import interpreting
from prhs_kernels.rabitq.reference import query_codes

__all__ = ["rabitq_logits_triton"]

BLOCK_T = 64


def _kernel(
    QC,
    QLO,
    QSC,
    QTOT,
    QCON,
    CODES,
    FACTOR,
    CQK,
    LENS,
    REQ2TOK,
    REQIDX,
    OUT,
    stride_cr,
    stride_ch,
    stride_fr,
    stride_fh,
    stride_xr,
    stride_xh,
    stride_rt,
    row_stride,
    scaling,
    inv_sqrt_d,
    t_max,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PAGED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < D
    qrow = b * (HKV * G) + h * G + offs_g  # [BLOCK_G] rows of the [B * Hq, ...] query inputs
    qc = tl.load(
        QC + qrow[:, None].to(tl.int64) * D + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    lo = tl.load(QLO + qrow, mask=g_ok, other=0.0)
    sc = tl.load(QSC + qrow, mask=g_ok, other=0.0)
    tot = tl.load(QTOT + qrow, mask=g_ok, other=0.0)
    con = tl.load(QCON + qrow, mask=g_ok, other=0.0)
    seq_len = tl.load(LENS + b)
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = pos < t_max
    ok = in_range & (pos < seq_len)
    pos64 = pos.to(tl.int64)
    if PAGED:
        req = tl.load(REQIDX + b).to(tl.int64)
        loc = tl.load(REQ2TOK + req * stride_rt + pos64, mask=ok, other=0).to(tl.int64)
    else:
        loc = b.to(tl.int64) * row_stride + pos64
    byte = tl.load(
        CODES + loc[:, None] * stride_cr + h * stride_ch + (offs_d // 8)[None, :],
        mask=ok[:, None] & d_ok[None, :],
        other=0,
    )
    bits = (byte.to(tl.int32) >> (offs_d % 8)[None, :]) & 1  # [BLOCK_T, BLOCK_D]
    if UPCAST:  # the interpreter: exact float32 products
        dot = tl.dot(bits.to(tl.float32), tl.trans(qc), input_precision="ieee")
    else:
        dot = tl.dot(bits.to(tl.float16), tl.trans(qc.to(tl.float16)))  # exact: 0/1 × 0..15
    pop = tl.sum(bits, 1).to(tl.float32)  # [BLOCK_T]
    fac = tl.load(FACTOR + loc * stride_fr + h * stride_fh, mask=ok, other=0.0)
    cqk = tl.load(CQK + loc * stride_xr + h * stride_xh, mask=ok, other=0.0)
    ip = (2.0 * (lo[None, :] * pop[:, None] + sc[None, :] * dot) - tot[None, :]) * inv_sqrt_d
    est = (fac[:, None] * ip + con[None, :] + cqk[:, None]) * scaling  # [BLOCK_T, BLOCK_G]
    est = tl.where(ok[:, None], est, float("-inf"))
    out = OUT + qrow[None, :].to(tl.int64) * t_max + pos64[:, None]
    tl.store(out, est, mask=in_range[:, None] & g_ok[None, :])


@functools.cache
def _compiled(interpret: bool) -> object:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_kernel)


def rabitq_logits_triton(
    query: torch.Tensor,
    kv: KVLayout,
    codes: torch.Tensor,
    factor: torch.Tensor,
    cqk: torch.Tensor,
    ck: torch.Tensor,
    cq: torch.Tensor,
    rotation: torch.Tensor,
    dither: torch.Tensor,
    scaling: float,
    row_stride: int,
) -> torch.Tensor:
    """The launcher's Triton path (inputs checked): ``[B, Hkv, g, T]`` float32."""
    b, hq, d = query.shape
    hkv = kv.num_kv_heads
    g = hq // hkv
    t_max = kv.max_len
    code, lo, scale, total, const = (
        x.contiguous() for x in query_codes(query, ck, cq, rotation, dither)
    )
    out = torch.empty(b, hkv, g, max(t_max, 1), dtype=torch.float32, device=query.device)
    if isinstance(kv, ContiguousKV):
        req2tok = reqidx = kv.seq_lens  # unused
        stride_rt, paged = 0, False
    else:
        req2tok, reqidx = kv.req_to_token, kv.req_pool_indices
        stride_rt, paged = kv.req_to_token.stride(0), True
    kernel = _compiled(interpreting())
    grid = (b * hkv, max(1, triton.cdiv(t_max, BLOCK_T)))
    kernel[grid](
        code, lo, scale, total, const, codes, factor, cqk, kv.seq_lens, req2tok, reqidx, out,
        codes.stride(0), codes.stride(1), factor.stride(0), factor.stride(1),
        cqk.stride(0), cqk.stride(1), stride_rt, row_stride, float(scaling),
        1.0 / math.sqrt(d), t_max,
        HKV=hkv, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_T=BLOCK_T, PAGED=paged,
        UPCAST=interpreting(), num_warps=4,
    )  # fmt: skip
    return out[..., :t_max]
