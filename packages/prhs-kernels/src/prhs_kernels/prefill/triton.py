"""Triton kernel of PSAW prefill attention (flash-attention style, one launch).

Program ``(b·Hq + h, m)`` takes ``BLOCK_M`` query rows of one head and runs an online softmax
over two key ranges only: the sinks below the tile's smallest window start, and the tile's
windows up to its last row (``[⌊f·t_first⌋, t_last]``). Keys between the sinks and a window are
never loaded, so a deep layer with a narrow window reads a fraction of the causal triangle.
Left padding (``start``) and a cached prefix (``Tq < Tk``) shift logical positions; a GQA group's
heads read their KV head's rows. Float32 accumulation; the output in the query's dtype plus
the float32 log-sum-exp.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting

__all__ = ["psaw_prefill_attention_triton"]


def _psaw_kernel(
    Q,
    K,
    V,
    START,
    OUT,
    LSE,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_ot,
    tq,
    tk,
    window_fraction,
    n_sink,
    scaling,
    HQ: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr,
    WINDOWED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    m_blk = tl.program_id(1)
    b = pid // HQ
    h = pid % HQ
    hk = h // G
    start = 0
    if HAS_START:
        start = tl.load(START + b)
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    t = tk - tq + rows - start  # logical positions (negative: padding)
    row_ok = (rows < tq) & (t >= 0)
    if WINDOWED:
        lo = tl.floor(window_fraction * t.to(tl.float64)).to(tl.int32)
    else:
        lo = tl.zeros([BLOCK_M], tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + b.to(tl.int64) * stride_qb + h * stride_qh + rows[:, None] * stride_qt
    q = tl.load(q_ptr + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk * stride_vh

    # The tile's key ranges, in logical positions: sinks [0, a_end), windows [lo_min, t_max].
    t_first = tl.maximum(tk - tq + m_blk * BLOCK_M - start, 0)
    t_max = tl.minimum(tk - tq + m_blk * BLOCK_M + BLOCK_M - 1, tk - 1) - start
    lo_min = 0
    if WINDOWED:
        lo_min = tl.floor(window_fraction * t_first.to(tl.float64)).to(tl.int32)
    a_end = tl.minimum(n_sink, lo_min)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for part in tl.static_range(2):
        if part == 0:
            j_lo = 0
            j_hi = a_end
        else:
            j_lo = lo_min
            j_hi = t_max + 1
        for j0 in range(j_lo, j_hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)  # logical key positions
            j_ok = j < j_hi
            s_idx = (j + start).to(tl.int64)
            k_mask = j_ok[:, None] & (offs_d[None, :] < D)
            k = tl.load(
                k_base + s_idx[:, None] * stride_kt + offs_d[None, :], mask=k_mask, other=0.0
            )
            if UPCAST:  # the interpreter multiplies bf16 as integers: exact float32 instead
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            allowed = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= t[:, None])
            if WINDOWED:
                allowed = allowed & ((j[None, :] >= lo[:, None]) | (j[None, :] < n_sink))
            qk = tl.where(allowed, qk * scaling, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_mask = j_ok[:, None] & (offs_dv[None, :] < DV)
            v = tl.load(
                v_base + s_idx[:, None] * stride_vt + offs_dv[None, :], mask=v_mask, other=0.0
            )
            if UPCAST:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o_ptr = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_ot
    tl.store(o_ptr + offs_dv[None, :], out.to(OUT.dtype.element_ty),
             mask=(rows[:, None] < tq) & (offs_dv[None, :] < DV))  # fmt: skip
    lse_ptr = LSE + (b.to(tl.int64) * HQ + h) * tq + rows
    tl.store(lse_ptr, lse, mask=rows < tq)


@functools.cache
def _kernel(interpret: bool) -> object:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_psaw_kernel)


def psaw_prefill_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor | None,
    window_fraction: float,
    n_sink: int,
    scaling: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher's Triton path (inputs checked): ``(out [B, Hq, Tq, Dv], lse [B, Hq, Tq])``."""
    b, hq, tq, d = query.shape
    hkv, tk, dv = key.shape[1], key.shape[2], value.shape[-1]
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"the Triton path needs {name}'s last dim contiguous")
    given = out
    if out is None or out.stride(-1) != 1:
        out = torch.empty(b, hq, tq, dv, dtype=query.dtype, device=query.device)
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=query.device)
    block_m = 16 if interpreting() else 64
    kernel = _kernel(interpreting())
    kernel[(b * hq, triton.cdiv(tq, block_m))](
        query, key, value, start if start is not None else lse, out, lse,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        tq, tk, float(window_fraction), n_sink, float(scaling),
        HQ=hq, G=hq // hkv, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=block_m, BLOCK_N=64,
        HAS_START=start is not None, WINDOWED=window_fraction > 0.0, UPCAST=interpreting(),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if given is not None and given is not out:
        given.copy_(out)
        out = given
    return out, lse
