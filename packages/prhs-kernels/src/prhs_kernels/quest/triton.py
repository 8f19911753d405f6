"""Triton kernel of Quest's page scoring: one launch reads each eligible page's key minimum and
maximum once and writes the group's bound.

``_page_scores_kernel``, a flat grid of ``B * Hkv * ceil(P / BLOCK_P)`` programs (one axis:
the second and third of a CUDA grid stop at 65535): a program takes one (sequence, KV head) and
a span of ``BLOCK_P`` consecutive pages. It works out which of them Quest may pick (they exist,
hold no sink or local position, and the row is not ``bad``) and loads the side rows ``kmin`` /
``kmax`` of those pages only (``[BLOCK_P, D]`` in the cache dtype, read in place through the
page rows of ``pages``). For each of the group's ``g`` query heads (its query loaded as float32)
it sums ``max(q_j, 0)·max_j + min(q_j, 0)·min_j`` over ``j`` in float32; the score is the
largest bound over the group times the scaling, NaN when a head's bound is NaN (as ``amax``
propagates it), and ``-inf`` for the pages Quest may not pick.

Bytes read: per (sequence, KV head), ``2 · D · element_size`` per eligible page plus the page
rows (8 bytes a page, shared by the row's KV heads through the cache) and the group's queries;
windows, pages past the end and ``bad`` rows are not read. No tensor-core ``tl.dot`` (the
interpreter multiplies bf16 wrongly in it, and ``g`` is below its tile), no value is read on the
host and every shape is static, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting

__all__ = ["quest_page_scores_triton"]


def _page_scores_kernel(
    Q,
    KMIN,
    KMAX,
    PAGES,
    LENS,
    BAD,
    OUT,
    stride_qb,
    stride_qh,
    stride_lo_n,
    stride_lo_h,
    stride_hi_n,
    stride_hi_h,
    stride_pb,
    stride_pp,
    n_pages,
    n_spans,
    scaling,
    n_sink,
    n_local,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PS: tl.constexpr,
):
    prog = tl.program_id(0)
    pid = prog // n_spans  # the (sequence, KV head) row, b * HKV + h
    span = prog % n_spans
    b = pid // HKV
    h = pid % HKV
    seq = tl.load(LENS + b)
    bad = tl.load(BAD + pid) != 0
    # What Quest may pick: pages that exist, outside the sink and local windows, on good rows.
    nb_seq = (seq + PS - 1) // PS
    sink_end = (tl.minimum(seq, n_sink) + PS - 1) // PS
    local_first = tl.where(n_local > 0, tl.maximum(seq - n_local, 0) // PS, nb_seq)
    j = span * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = (j < n_pages) & (j < nb_seq) & (j >= sink_end) & (j < local_first) & (~bad)
    rows = tl.load(PAGES + b.to(tl.int64) * stride_pb + j * stride_pp, mask=ok, other=0)
    rows = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m2 = ok[:, None] & d_ok[None, :]
    lo_ptr = KMIN + rows[:, None] * stride_lo_n + h * stride_lo_h + offs_d[None, :]
    hi_ptr = KMAX + rows[:, None] * stride_hi_n + h * stride_hi_h + offs_d[None, :]
    lo = tl.load(lo_ptr, mask=m2, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    hi = tl.load(hi_ptr, mask=m2, other=0.0).to(tl.float32)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_P], tl.int1)
    q_row = Q + b.to(tl.int64) * stride_qb + (h * G) * stride_qh
    for gi in tl.static_range(G):
        q = tl.load(q_row + gi * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        pos = tl.where(q > 0.0, q, 0.0)
        neg = tl.where(q < 0.0, q, 0.0)
        bound = tl.sum(pos[None, :] * hi + neg[None, :] * lo, 1) * scaling
        nan = nan | (bound != bound)
        best = tl.maximum(best, bound)
    best = tl.where(nan, float("nan"), best)
    out = OUT + pid.to(tl.int64) * n_pages + j
    tl.store(out, tl.where(ok, best, float("-inf")), mask=j < n_pages)


@functools.cache
def _kernels(interpret: bool) -> object:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_page_scores_kernel)


def _pow2(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(n))


def quest_page_scores_triton(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    bad: torch.Tensor,
    scaling: float,
    page_size: int,
    n_sink: int,
    n_local: int,
) -> torch.Tensor:
    b, hq, d = query.shape
    h = kmin.shape[1]
    n_pages = pages.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if kmin.stride(-1) != 1:
        kmin = kmin.contiguous()
    if kmax.stride(-1) != 1:
        kmax = kmax.contiguous()
    scores = torch.empty(b, h, n_pages, dtype=torch.float32, device=query.device)
    if scores.numel() == 0:
        return scores
    block_d = _pow2(d, 16)
    # Two [BLOCK_P, BLOCK_D] float32 tiles of about 4096 values each per program.
    block_p = min(_pow2(n_pages, 1), max(1, 4096 // block_d))
    n_spans = triton.cdiv(n_pages, block_p)
    kernel = _kernels(interpreting())
    kernel[(b * h * n_spans,)](
        query, kmin, kmax, pages, seq_lens, bad.contiguous().view(torch.int8), scores,
        query.stride(0), query.stride(1),
        kmin.stride(0), kmin.stride(1), kmax.stride(0), kmax.stride(1),
        pages.stride(0), pages.stride(1),
        n_pages, n_spans, float(scaling), n_sink, n_local,
        HKV=h, G=hq // h, D=d, BLOCK_D=block_d, BLOCK_P=block_p, PS=page_size, num_warps=4,
    )  # fmt: skip
    return scores
