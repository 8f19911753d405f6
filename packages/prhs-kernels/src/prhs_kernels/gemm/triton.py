"""Triton kernel of a decode-size linear layer: ``y = x Wᵀ (+ b)`` for ``M ≤ 16`` rows of ``x``.

At a few rows a projection reads its weight once and does almost no arithmetic on it: its time
is the weight's bytes over the memory bandwidth. Grid ``(ceil(N / BLOCK_N),)``: program ``j``
streams the weight's rows ``[j·BLOCK_N, (j+1)·BLOCK_N)`` over the whole of ``K`` in tiles of
``BLOCK_K`` columns, software-pipelined ``num_stages`` deep, and multiplies each tile by every
row of ``x`` at once (one ``tl.dot`` of the ``[BLOCK_N, BLOCK_K]`` tile against ``xᵀ``, the
rows padded to 16), accumulating in float32. Every output is written once, by one program, so
there is no second reduction launch and no atomics on the outputs. With ``TUNING["split_k"]``
(off: timed, it does not pay), a weight of fewer stripes than the GPU has multiprocessors is
streamed by ``(stripe, slice of K)`` programs instead: each slice stores its float32 partial,
and the stripe's last slice to finish (counted in an int32 counter per stripe) sums them in
slice order and runs the epilogue (:func:`split_k`).

The launch plan is a function of ``(N, K)`` only (:func:`plan`), chosen on an H200 by
``benchmarks/scripts/skinny_gemm_probe.py`` over every projection of the Llama-2-7B and
Llama-3-8B decode steps at 8 and 16 rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from prhs_kernels.gemm import MAX_ROWS  # the rows the kernel takes: one padded MMA tile
from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait
from prhs_kernels.sparse_decode.triton import _arrivals, _multiprocessors

__all__ = [
    "TUNING",
    "TUNING_ROPE",
    "Rope",
    "decode_linear_triton",
    "plan",
    "plan_rope",
    "plan_swiglu",
    "split_k",
]

TUNING = {"split_k": False, "max_split": 4, "min_tiles": 4}
"""The split of ``K`` (:func:`split_k`): whether a weight with fewer row stripes than the GPU
has multiprocessors streams each stripe in slices of ``K`` (more programs at once, the last
slice of a stripe summing the partials), at most ``max_split`` slices of at least
``min_tiles`` tiles of ``BLOCK_K``. Off: on an H200 it does not pay (the o projection of the
Llama shapes 12.40 against 12.43 µs at one row, 12.57 against 12.36 at 8; whole steps within
0.2 %: ``benchmarks/scripts/split_k_check.py`` and the ``sk`` variant of
``benchmarks/scripts/tuning_ab_device.sh``). Module-level so that a
benchmark can sweep them."""


@triton.jit  # at import, unlike the kernel (a helper; interpreted tests import with the flag)
def _rope_epilogue(
    acc,
    offs_m,
    col,
    m_ok,
    head,
    Y,
    stride_ym,
    COS,
    SIN,
    stride_cm,
    stride_sm,
    KC,
    VC,
    POS,
    ARRIVE,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    cache_len,
    n_q_heads,
    n_kv_heads,
    HALF: tl.constexpr,
    ADVANCE: tl.constexpr,
):
    """A q|k|v GEMM's rotary embedding and cache write, on one program's ``[BLOCK_N, BLOCK_M]``
    accumulator: its first ``BLOCK_N/2`` rows are columns ``col + i`` of ``head`` (in its first
    half), the next their partners ``col + i + HALF``. Query and key heads are rotated
    (``rotate_half``: ``y₁ = a·cos₁ - b·sin₁``, ``y₂ = b·cos₂ + a·sin₂``, with each row's own
    cos/sin); query heads are stored into ``Y [M, Hq·D]``, key and value heads into the caches'
    ``[m, h, pos]`` rows (``pos`` read from ``POS``; nothing is written at or past
    ``cache_len``). With ``ADVANCE`` the last
    program to finish (an int32 arrival counter, set back to 0 by it) raises ``POS`` by one."""
    pos = tl.load(POS)
    HB: tl.constexpr = acc.shape[0] // 2
    # The two halves of the tile, [HB, BLOCK_M] each: a layout change in registers, once.
    acc, acc_u = tl.split(tl.permute(tl.reshape(acc, [2, HB, acc.shape[1]]), (1, 2, 0)))
    offs_d = col + tl.arange(0, HB)
    rot = head < n_q_heads + n_kv_heads
    cs_ok = m_ok[None, :] & rot
    c_row = COS + offs_m[None, :] * stride_cm
    s_row = SIN + offs_m[None, :] * stride_sm
    d1 = offs_d[:, None]
    cos1 = tl.load(c_row + d1, mask=cs_ok, other=1.0).to(tl.float32)
    sin1 = tl.load(s_row + d1, mask=cs_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(c_row + d1 + HALF, mask=cs_ok, other=1.0).to(tl.float32)
    sin2 = tl.load(s_row + d1 + HALF, mask=cs_ok, other=0.0).to(tl.float32)
    y1 = (acc * cos1 - acc_u * sin1).to(Y.dtype.element_ty)
    y2 = (acc_u * cos2 + acc * sin2).to(Y.dtype.element_ty)
    ok = m_ok[None, :] & (d1 >= 0)
    is_q = head < n_q_heads
    y_ptr = Y + offs_m[None, :] * stride_ym + head * (2 * HALF) + d1
    tl.store(y_ptr, y1, mask=ok & is_q)
    tl.store(y_ptr + HALF, y2, mask=ok & is_q)
    in_cache = pos < cache_len
    is_k = (head >= n_q_heads) & rot & in_cache
    k_ptr = (KC + offs_m[None, :].to(tl.int64) * stride_kb + (head - n_q_heads) * stride_kh
             + pos * stride_kt + d1)  # fmt: skip
    tl.store(k_ptr, y1, mask=ok & is_k)
    tl.store(k_ptr + HALF, y2, mask=ok & is_k)
    is_v = (head >= n_q_heads + n_kv_heads) & in_cache
    v_ptr = (VC + offs_m[None, :].to(tl.int64) * stride_vb
             + (head - n_q_heads - n_kv_heads) * stride_vh + pos * stride_vt + d1)  # fmt: skip
    tl.store(v_ptr, acc.to(VC.dtype.element_ty), mask=ok & is_v)
    tl.store(v_ptr + HALF, acc_u.to(VC.dtype.element_ty), mask=ok & is_v)
    if ADVANCE:
        # Every program read POS above before it arrives here: the barrier holds this one's
        # arrival until all its warps have (one warp's atomic orders only its own reads), so
        # the last program's write of POS + 1 cannot reach a warp still to read POS.
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVE, 1, sem="acq_rel", scope="gpu")
        last = arrived == tl.num_programs(0) - 1
        tl.atomic_xchg(ARRIVE, 0, sem="relaxed", scope="gpu", mask=last)
        tl.store(POS, pos + 1, mask=last)


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
    PART,
    ARRIVE,
    COS,
    SIN,
    KC,
    VC,
    POS,
    M,
    N,
    K,
    NP,
    eps,
    k_split,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    stride_hm,
    stride_cm,
    stride_sm,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    cache_len,
    n_q_heads,
    n_kv_heads,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    RMS_IN: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_OUT: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,
    ADVANCE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if ROPE:
        # Heads of 2·HALF columns (q, then k, then v). A program's BLOCK_N weight rows are
        # BLOCK_N/2 columns of one head's first half, then their partners HALF columns on (the
        # rotation's pairs), as one tile: the stream and its MMA are the plain kernel's.
        HB: tl.constexpr = BLOCK_N // 2
        per_head = HALF // HB
        head = pid // per_head
        col = (pid % per_head) * HB  # the first column, within the head
        r = tl.arange(0, BLOCK_N)
        offs_n = head * (2 * HALF) + col + (r % HB) + (r // HB) * HALF
    else:
        head = 0
        col = 0
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
    sq = tl.zeros([BLOCK_M], tl.float32)  # RMS_IN: each row's sum of x², from the tiles of x
    # The loop only loads and multiplies: a tile changed on its way to the MMA would go through
    # registers and back to shared memory, serialising the weight stream.
    # SPLIT_K > 1: this program streams columns [split·k_split, (split+1)·k_split) only.
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = split * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w_ok = n_ok[:, None]
            x = tl.load(x_ptr + k0, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < k_hi
            w_ok = n_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        w = tl.load(w_ptr + k0, mask=w_ok, other=0.0)
        if RMS_IN:  # x's tile, not the weight's: the weight stream is left as it is
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=0)
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
    if SPLIT_K > 1:
        # Each slice of K stores its float32 partial; the stripe's last slice to finish (an
        # int32 counter per stripe, raised after the partial is stored, set back to 0 by it)
        # sums all of them in slice order (deterministic) and runs the epilogue: no second
        # launch, no atomics on the outputs.
        n_stripes = tl.num_programs(0)
        tile = (offs_n - pid * BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        part = PART + (split * n_stripes + pid).to(tl.int64) * (BLOCK_N * BLOCK_M) + tile
        tl.store(part, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVE + pid, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        tl.atomic_xchg(ARRIVE + pid, 0, sem="relaxed", scope="gpu", mask=last)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for j in tl.static_range(SPLIT_K):
            acc += tl.load(
                PART + (j * n_stripes + pid).to(tl.int64) * (BLOCK_N * BLOCK_M) + tile,
                mask=last & (tile >= 0),
                other=0.0,
                cache_modifier=".cg",
            )
    if ROW_SCALE:  # an RMS norm's 1 / rms of each input row, from partial sums of its squares
        offs_p = tl.arange(0, BLOCK_P)
        sums = tl.load(PSI + offs_p[:, None] * M + offs_m[None, :],
                       mask=(offs_p[:, None] < NP) & m_ok[None, :], other=0.0)  # fmt: skip
        scale = tl.rsqrt(tl.sum(sums, axis=0) / K + eps)
        acc = acc * scale[None, :]
        acc_u = acc_u * scale[None, :]
    if RMS_IN:  # the RMS norm of x itself: its weight is folded into the weight's columns
        acc = acc * tl.rsqrt(sq / K + eps)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if SWIGLU:
            acc_u += tl.load(B + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_u
    if ROPE:
        _rope_epilogue(acc, offs_m, col, m_ok, head, Y, stride_ym,
                       COS, SIN, stride_cm, stride_sm, KC, VC, POS, ARRIVE, stride_kb,
                       stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, cache_len,
                       n_q_heads, n_kv_heads, HALF, ADVANCE)  # fmt: skip
    else:
        out_ok = n_ok[:, None] & m_ok[None, :]
        ps_ok = m_ok
        if SPLIT_K > 1:  # only the stripe's last slice writes the outputs
            out_ok = out_ok & last
            ps_ok = m_ok & last
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
            tl.store(PS + pid * M + offs_m, tl.sum(h * h, axis=0), mask=ps_ok)


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


def split_k(stripes: int, k: int, block_k: int, device: torch.device) -> int:
    """Slices of ``K`` per stripe: enough for about one program per multiprocessor
    (``stripes`` of them at 1), each slice at least ``TUNING["min_tiles"]`` tiles of
    ``block_k``; 1 with ``TUNING["split_k"]`` off. A function of shapes only: the o projection
    of the Llama shapes (64 stripes of 4096 columns) takes 2 on an H200's 132."""
    if not TUNING["split_k"]:
        return 1
    most = max(1, k // (block_k * TUNING["min_tiles"]))
    want = _multiprocessors(device) // max(stripes, 1)
    return max(1, min(want, most, TUNING["max_split"]))


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
    rms_in: bool = False,
    rope: Rope | None = None,
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
    input and its partial sums, for a ``sumsq`` GEMM); ``rms_in`` -- scale each row by ``1 /
    sqrt(mean(x²) + eps)`` of its own row of ``x``, summed from the tiles of ``x`` the loop
    loads (``x`` is an RMS norm's input, the norm's weight folded into ``weight``'s columns);
    ``rope`` -- ``weight`` is a q|k|v projection (heads of ``D`` columns: ``Hq`` of q, then
    ``Hkv`` of k and of v), the rotary embedding is applied to the q and k heads, the k and v
    heads are written into the caches at ``rope.position`` (:class:`Rope`), and ``y`` is the
    rotated query, ``[M, Hq·D]``."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if rope is not None:
        return _launch_rope(x, weight, bias, rope, eps, rms_in, launch, out), None, None
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch or (plan_swiglu(n, k) if swiglu else plan(n, k))
    grid = triton.cdiv(n, block_n)
    # SwiGLU's epilogue is not linear in the accumulators, and rms_in's scale needs all of a
    # row's x: their K is never split.
    splits = 1 if swiglu or rms_in else split_k(grid, k, block_k, x.device)
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)  # no slice left empty
    part = arrive = weight
    if splits > 1:
        part = torch.empty(splits * grid * block_n * MAX_ROWS, dtype=torch.float32,
                           device=x.device)  # fmt: skip
        # The sparse kernel's counters: kernels on one stream run one after the other and each
        # leaves them at 0, so they can share them.
        arrive = _arrivals(x.device, grid)
    hg = ps = None
    if norm_weight is not None:
        hg = torch.empty_like(y)
        ps = torch.empty(grid, m, dtype=torch.float32, device=x.device)
    dummy = weight
    n_parts = sumsq.shape[0] if sumsq is not None else 1
    _kernel(interpreting())[(grid, splits)](
        x, weight, bias if bias is not None else dummy, y,
        residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, hg if hg is not None else dummy,
        ps if ps is not None else dummy, sumsq if sumsq is not None else dummy, part, arrive,
        *(dummy,) * 4, arrive,  # no rotary embedding: its tables, caches and position
        m, n, k, n_parts, float(eps), k_split,
        x.stride(0), weight.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0, hg.stride(0) if hg is not None else 0,
        *(0,) * 11,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_P=triton.next_power_of_2(n_parts), EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, ROW_SCALE=sumsq is not None,
        RMS_IN=rms_in, RESIDUAL=residual is not None, NORM_OUT=norm_weight is not None,
        UPCAST=interpreting(), SPLIT_K=splits, ROPE=False, HALF=1, ADVANCE=False,
        **pdl_args(x.device, "gemm"), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y, hg, ps


class Rope(NamedTuple):
    """What a q|k|v GEMM's rotary epilogue takes (inputs already checked): ``cos``/``sin``
    ``[M, D]`` (any float dtype, unit stride along ``D``), the caches ``k_cache``/``v_cache``
    ``[M, Hkv, T, D]`` (unit stride along ``D``) and ``position``, a one-element int64 tensor:
    the cache row written; ``advance``: raise it by one."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    position: torch.Tensor
    advance: bool


def plan_rope(n: int, k: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` of a q|k|v GEMM with the rotary epilogue:
    :func:`plan`'s (or ``TUNING_ROPE["launch"]``'s, when set), each program's ``BLOCK_N`` rows
    half in a head's first half and half their partners in its second, ``BLOCK_N`` cut down
    until its half divides ``head_dim / 2``."""
    block_n, block_k, warps, stages = TUNING_ROPE["launch"] or plan(n, k)
    half = head_dim // 2
    while block_n > 2 and half % (block_n // 2):
        block_n //= 2
    return block_n, block_k, warps, stages


TUNING_ROPE: dict[str, tuple[int, int, int, int] | None] = {"launch": None}
"""The rotary q|k|v GEMM's launch, ``None`` for :func:`plan`'s (on an H200 the plain kernel's
64-row stripes: 128 rows a program -- a head's two halves in two accumulators -- ran the
Llama-3-8B q|k|v at 18.9-20.1 µs against 15.7-15.9 for the plain GEMM, and 32-row halves at
36-40, the MMA of a 32-row tile being Hopper's slow one). Module-level so that a probe can
sweep it."""


def _launch_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rope: Rope,
    eps: float,
    rms_in: bool,
    launch: tuple[int, int, int, int] | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    _, h_kv, t, d = rope.k_cache.shape
    h_q = n // d - 2 * h_kv
    y = out if out is not None else torch.empty(m, h_q * d, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch or plan_rope(n, k, d)
    grid = n // block_n
    arrive = _arrivals(x.device, 1)
    kc, vc = rope.k_cache, rope.v_cache
    dummy = weight
    _kernel(interpreting())[(grid, 1)](
        x, weight, bias if bias is not None else dummy, y, *(dummy,) * 5, dummy, arrive,
        rope.cos, rope.sin, kc, vc, rope.position,
        m, n, k, 1, float(eps), k,
        x.stride(0), weight.stride(0), y.stride(0), 0, 0,
        rope.cos.stride(0), rope.sin.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), t, h_q, h_kv,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_P=1,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, SWIGLU=False, ROW_SCALE=False,
        RMS_IN=rms_in, RESIDUAL=False, NORM_OUT=False, UPCAST=interpreting(), SPLIT_K=1,
        ROPE=True, HALF=d // 2, ADVANCE=rope.advance, **pdl_args(x.device, "gemm"),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
