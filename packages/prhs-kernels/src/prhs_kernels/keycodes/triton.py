"""Triton kernels of compressed keys: the write of a step's code rows, and the tile estimate the
scoring kernels inline.

- ``_write_kernel``, a program per written row: reads the row's ``[Hkv, D]`` key (in place in a
  cache with ``columns``), finds whether it is finite (counting it when not), and writes each
  head's code row -- ``D/2`` bytes of nibbles, the float32 minimum and step, zeros to 16 bytes.
- :func:`code_query` and :func:`code_scores`, ``triton.jit`` helpers inlined into the
  retrieval's logits pass (:mod:`prhs_kernels.score.triton`) and CIS's re-ranking
  (:mod:`prhs_kernels.cis.triton`):
  ``q · k̂`` of a tile of keys from their code rows, as two ``tl.dot`` of the query halves with
  the low and high nibbles (as ``1 + c/16``, exact in half precision, made by setting mantissa
  bits rather than by converting) and one multiply-add with each key's minimum and
  step.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait

__all__ = ["code_query", "code_scores", "row_alignment", "write_key_codes_triton"]


def row_alignment(rows: torch.Tensor) -> int:
    """The largest power of two, at most 16, that every code row's byte offset in ``rows [R,
    Hkv, code_bytes(D)]`` (uint8, a strided view) is a multiple of: the scorers' load width
    (16 for a side-cache field, whose rows are a multiple of 16 bytes)."""
    align = math.gcd(rows.stride(0), rows.stride(1), rows.data_ptr() % 16 or 16, 16)
    return 1 << (align.bit_length() - 1)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def code_query(q_base, g_ok, D: tl.constexpr, BLOCK_DH: tl.constexpr):
    """What :func:`code_scores` takes of a query group: ``(q_lo, q_hi, q_sum, offs_c, c_ok)``,
    its channels ``[0, D/2)`` and ``[D/2, D)`` (``[G, BLOCK_DH]``, read at ``q_base [G, 1]``,
    the rows' pointers; rows not ``g_ok`` read 0), the float32 sum of each row's channels, and
    the byte lanes with which are below ``D/2``."""
    offs_c = tl.arange(0, BLOCK_DH)
    c_ok = offs_c < D // 2
    mask = g_ok[:, None] & c_ok[None, :]
    q_lo = tl.load(q_base + offs_c[None, :], mask=mask, other=0.0)
    q_hi = tl.load(q_base + D // 2 + offs_c[None, :], mask=mask, other=0.0)
    q_sum = tl.sum(q_lo.to(tl.float32), 1) + tl.sum(q_hi.to(tl.float32), 1)
    return q_lo, q_hi, q_sum, offs_c, c_ok


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def code_scores(q_lo, q_hi, q_sum, CODES, row, ok, offs_c, c_ok, DH: tl.constexpr,
                ALIGN: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """``[G, N]`` float32 ``q · k̂`` of the ``N`` keys whose code rows start at byte offsets
    ``row [N]`` of ``CODES`` (``ok [N]``: rows to read; the others score 0). ``q_lo`` /
    ``q_hi`` ``[G, BLOCK_DH]``: the query's channels ``[0, DH)`` and ``[DH, 2·DH)``;
    ``q_sum [G]`` float32: the sum of its channels; ``offs_c`` / ``c_ok``: the ``BLOCK_DH``
    byte lanes and which are below ``DH``; ``ALIGN``: a power of two every row offset is a
    multiple of (:func:`row_alignment`), so that the rows are read ``ALIGN`` bytes a load."""
    row = tl.multiple_of(row, ALIGN)
    byte = tl.load(CODES + row[:, None] + offs_c[None, :], mask=ok[:, None] & c_ok[None, :],
                   other=0)  # fmt: skip
    # Each nibble c becomes the half-precision number 1 + c/16 by writing it into the top four
    # mantissa bits of 1.0 -- integer ops instead of an integer-to-float conversion and a
    # narrowing, quarter-rate instructions that bounded the pass -- and
    # Σ q·c = 16 · (Σ q·(1 + c/16) − Σ q) after the dot (exact products; the subtraction loses
    # no more than the two sums' rounding).
    lo4 = (byte & 15).to(tl.int16)
    hi4 = (byte >> 4).to(tl.int16)
    if q_lo.dtype == tl.float16:
        lo = ((lo4 << 6) | 0x3C00).to(tl.float16, bitcast=True)
        hi = ((hi4 << 6) | 0x3C00).to(tl.float16, bitcast=True)
    else:
        lo = ((lo4 << 3) | 0x3F80).to(tl.bfloat16, bitcast=True)
        hi = ((hi4 << 3) | 0x3F80).to(tl.bfloat16, bitcast=True)
    if UPCAST:  # the interpreter multiplies half precision as integers: exact float32 instead
        dot = tl.dot(q_lo.to(tl.float32), tl.trans(lo.to(tl.float32)), input_precision="ieee")
        dot += tl.dot(q_hi.to(tl.float32), tl.trans(hi.to(tl.float32)), input_precision="ieee")
    else:
        dot = tl.dot(q_lo, tl.trans(lo))
        dot += tl.dot(q_hi, tl.trans(hi))
    dot = (dot - q_sum[:, None]) * 16.0
    prm = (CODES + row + DH).to(tl.pointer_type(tl.float32))
    kmin = tl.load(prm, mask=ok, other=0.0)
    step = tl.load(prm + 1, mask=ok, other=0.0)
    return step[None, :] * dot + q_sum[:, None] * kmin[None, :]


def _write_kernel(
    CODES,
    LOC,
    KEY,
    COL,
    NONFINITE,
    CENTER,
    n_cols,
    stride_kn,
    stride_kh,
    stride_kt,
    stride_cr,
    stride_ch,
    scratch,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    HAS_COL: tl.constexpr,
    COUNT: tl.constexpr,
    HAS_CENTER: tl.constexpr,
    PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    i = tl.program_id(0)  # the write's row
    DH: tl.constexpr = D // 2
    loc = tl.load(LOC + i).to(tl.int64)
    col = 0
    if HAS_COL:
        col = tl.load(COL + i).to(tl.int64)
        loc = tl.where((col >= 0) & (col < n_cols), loc, -1)
        col = tl.where(loc >= 0, col, 0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DH)
    m2 = (offs_h[:, None] < HKV) & (offs_c[None, :] < DH)
    base = KEY + i.to(tl.int64) * stride_kn + col * stride_kt  # int64: a cache passes 2^31
    kh = offs_h[:, None] * stride_kh + offs_c[None, :]
    x_lo = tl.load(base + kh, mask=m2 & (loc >= 0), other=0.0).to(tl.float32)
    x_hi = tl.load(base + kh + DH, mask=m2 & (loc >= 0), other=0.0).to(tl.float32)
    bad_lo = ~((x_lo == x_lo) & (tl.abs(x_lo) < float("inf")))
    bad_hi = ~((x_hi == x_hi) & (tl.abs(x_hi) < float("inf")))
    n_bad = tl.sum(tl.sum((m2 & (bad_lo | bad_hi)).to(tl.int32), 1), 0)
    fin = n_bad == 0
    if COUNT:  # only the (rare) non-finite rows touch the counter
        out = (loc >= 0) & ~fin
        tl.atomic_add(NONFINITE, out.to(tl.int64), mask=out)
    if HAS_CENTER:  # [Hkv, D] float32, contiguous
        cen = CENTER + offs_h[:, None] * D + offs_c[None, :]
        x_lo = x_lo - tl.load(cen, mask=m2, other=0.0)
        x_hi = x_hi - tl.load(cen + DH, mask=m2, other=0.0)
    x_lo = tl.where(fin, x_lo, 0.0)
    x_hi = tl.where(fin, x_hi, 0.0)
    big = float("inf")
    lo = tl.minimum(tl.min(tl.where(m2, x_lo, big), 1), tl.min(tl.where(m2, x_hi, big), 1))
    hi = tl.maximum(tl.max(tl.where(m2, x_lo, -big), 1), tl.max(tl.where(m2, x_hi, -big), 1))
    # Divisions rounded as IEEE (and torch) round them, so the codes equal the reference's.
    step = tl.math.div_rn(hi - lo, tl.full(hi.shape, 15.0, tl.float32))
    safe = tl.broadcast_to(tl.where(step > 0, step, 1.0)[:, None], x_lo.shape)
    c_lo = tl.floor(tl.math.div_rn(x_lo - lo[:, None], safe) + 0.5)
    c_hi = tl.floor(tl.math.div_rn(x_hi - lo[:, None], safe) + 0.5)
    c_lo = tl.minimum(tl.maximum(c_lo, 0.0), 15.0).to(tl.int32)
    c_hi = tl.minimum(tl.maximum(c_hi, 0.0), 15.0).to(tl.int32)
    c_lo = tl.where(step[:, None] > 0, c_lo, 0)
    c_hi = tl.where(step[:, None] > 0, c_hi, 0)
    packed = (c_lo | (c_hi << 4)).to(tl.uint8)
    at = tl.where(loc >= 0, loc, scratch)
    row = CODES + at * stride_cr + offs_h * stride_ch  # [BLOCK_H]
    tl.store(row[:, None] + offs_c[None, :], packed, mask=m2)
    prm = (row + DH).to(tl.pointer_type(tl.float32))
    h_ok = offs_h < HKV
    tl.store(prm, lo, mask=h_ok)
    tl.store(prm + 1, step, mask=h_ok)
    if PAD > 0:  # the zeros that round the row up to 16 bytes
        offs_z = tl.arange(0, 16)
        z_ptr = row[:, None] + DH + 8 + offs_z[None, :]
        z_ok = h_ok[:, None] & (offs_z < PAD)[None, :]
        tl.store(z_ptr, tl.zeros([BLOCK_H, 16], tl.uint8), mask=z_ok)


@functools.cache
def _kernels(interpret: bool) -> object:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_write_kernel)


def _pow2(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(n))


def write_key_codes_triton(
    codes: torch.Tensor,
    locations: torch.Tensor,
    key: torch.Tensor,
    columns: torch.Tensor | None,
    nonfinite: torch.Tensor | None,
    center: torch.Tensor | None = None,
) -> None:
    """One launch, a program per written row (arguments checked by
    :func:`prhs_kernels.keycodes.write_key_codes`)."""
    n = locations.shape[0]
    if n == 0:
        return
    h, d = key.shape[1], key.shape[-1]
    if key.stride(-1) != 1:
        key = key.contiguous()
    if columns is None:
        strides, n_cols = (key.stride(0), key.stride(1), 0), 1
    else:
        strides, n_cols = (key.stride(0), key.stride(1), key.stride(2)), key.shape[2]
    kernel = _kernels(interpreting())
    kernel[(n,)](
        codes, locations, key, columns if columns is not None else locations,
        nonfinite if nonfinite is not None else locations,
        center.contiguous() if center is not None else locations, n_cols, *strides,
        codes.stride(0), codes.stride(1), codes.shape[0] - 1,
        HKV=h, D=d, BLOCK_H=_pow2(h, 1), BLOCK_DH=_pow2(d // 2, 16),
        HAS_COL=columns is not None, COUNT=nonfinite is not None, HAS_CENTER=center is not None,
        PAD=codes.shape[-1] - d // 2 - 8, **pdl_args(key.device, "score"), num_warps=4,
    )  # fmt: skip
