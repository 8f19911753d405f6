"""Triton kernels of a retrieval's scores: the group-mean attention probability of every cached
position, computed only for the (sequence, KV head) rows that retrieve this step.

Two launches (rows are cut into spans of ``TUNING["span"]`` positions):

1. ``_logits_kernel``, a persistent grid of a few programs per multiprocessor looping over the
   work items (active row, span): each program ranks the active rows by a prefix sum of their
   flags, so the work is spread over the whole GPU however few rows retrieve, and no key of an
   inactive row is read. An item reads its span's keys once (in
   place, contiguous or through the request-to-token table), scores them for the ``g`` query
   heads of the group in one ``tl.dot``, and writes the float32 logits and the span's running
   max and sum.
2. ``_probs_kernel``, grid ``(B * Hkv, spans)``: merges the spans' (max, sum) into each query
   head's log-sum-exp and writes ``mean_g exp(logit - lse_g)`` for its span; inactive rows get
   0.

In block mode (``retrieval_block_lse_triton``, CIS's retrieval by block mass) the first pass
writes, instead of each position's logits, each block's log-sum-exp of them (``LSE_BS``
positions a block): a block's attention mass is then ``exp(block_lse - lse)`` per query head,
and the ``T``-long logits never reach memory.

So the keys are read only for the rows that retrieve (one retrieving head does not make the batch
score the whole cache), with no host read of the flags.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_core.layout import KVLayout
from prhs_kernels.keycodes import KeyCodes
from prhs_kernels.keycodes.triton import code_query, code_scores, row_alignment
from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait
from prhs_kernels.sparse_decode.triton import _multiprocessors, key_args

__all__ = [
    "TUNING",
    "block_lse_fits",
    "retrieval_block_lse_triton",
    "retrieval_logits_triton",
    "retrieval_probs_triton",
]

TUNING = {
    "span": 512,
    "block_t": 64,
    "block_t_codes": 128,
    "programs_per_sm": 8,
    "num_warps": 4,
    "num_stages": 3,
}
"""Launch parameters of the logits pass: positions per work item (a multiple of the tiles),
positions per tile reading keys and reading code rows, persistent programs per multiprocessor,
warps, pipelining depth. On an H100 (a quarter of the rows retrieving), code rows in tiles of
128 rather than 64: B1·T16k 18.8 µs against 19.2, B16·T16k 57 against 61, B16·T64k 166 against
179 (the pass with its probabilities); the keys gained nothing from 128 (226 against 232 µs at
B16·T64k in spans of 1024, 76 against 71 at B16·T16k).
Module-level so that ``benchmarks/scripts/kernels.py tune`` can sweep them on a GPU."""


def _logits_kernel(
    Q,
    K,
    ACTIVE,
    LENS,
    START,
    REQ2TOK,
    REQIDX,
    LOGITS,
    SM,
    SL,
    LAB,
    stride_lb,
    stride_lh,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_rt,
    stride_out,
    scaling,
    t_max,
    n_rows,
    n_spans,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPAN: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    Q_LABELS: tl.constexpr,
    K_LABELS: tl.constexpr,
    LSE_BS: tl.constexpr,
    CODES: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    ALIGN: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    # A persistent grid over the work items (active row, span). Every program ranks the active
    # rows itself (a prefix sum of the flags), so no program is spent on a row that does not
    # retrieve and no launch is spent listing them. LSE_BS > 0: instead of the logits, each
    # block of LSE_BS positions' log-sum-exp of them (LOGITS then [rows * G, stride_out], a
    # block's column its id), what a block's attention mass needs once the row's lse is known.
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    if HAS_ACTIVE:
        offs_r = tl.arange(0, BLOCK_R)
        flags = tl.load(ACTIVE + offs_r, mask=offs_r < n_rows, other=0) != 0
        rank = tl.cumsum(flags.to(tl.int32), 0) - 1
        n_work = tl.sum(flags.to(tl.int32), 0) * n_spans
    else:
        n_work = n_rows * n_spans
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        span = w % n_spans
        if HAS_ACTIVE:  # the (w // n_spans)-th active row
            pid = tl.sum(tl.where(flags & (rank == w // n_spans), offs_r, 0), 0)
        else:
            pid = w // n_spans
        b = pid // HKV
        h = pid % HKV
        seq_len = tl.load(LENS + b)
        lo = span * SPAN
        hi = tl.minimum(lo + SPAN, t_max)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        # Channels: 0..D-1, or (label scoring) the D channel ids of this row's KV head; the
        # query is read at them, and so are the keys unless K holds only those channels.
        if Q_LABELS:
            chan = tl.load(LAB + b * stride_lb + h * stride_lh + offs_d, mask=d_ok, other=0)
            chan = chan.to(tl.int64)
        else:
            chan = offs_d
        q_ptr = (
            Q + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + chan[None, :]
        )
        q = tl.load(q_ptr, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if CODES:  # K holds code rows (prhs_kernels.keycodes): the query's two halves
            q_base = Q + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh
            q_lo, q_hi, q_sum, offs_c, c_ok = code_query(q_base, g_ok, D, BLOCK_DH)
        if PAGED:
            req = tl.load(REQIDX + b).to(tl.int64)
        if HAS_START:
            start = tl.load(START + b).to(tl.int64)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        row = pid.to(tl.int64) * G + offs_g  # [BLOCK_G] rows of LOGITS [B * Hkv * G, t_max]
        # tl.range with a stage count: every load of the loop is pipelined (asynchronous copies
        # STAGES - 1 tiles ahead), the code rows' minimum and step too, which a plain range
        # leaves as a load each tile waits for.
        for t0 in tl.range(lo, hi, BLOCK_T, num_stages=STAGES):
            pos = t0 + tl.arange(0, BLOCK_T)
            in_range = pos < hi
            ok = in_range & (pos < seq_len)
            pos64 = pos.to(tl.int64)
            if PAGED:
                slot = tl.load(REQ2TOK + req * stride_rt + pos64, mask=ok, other=0).to(tl.int64)
                k_row = slot * stride_kt + h * stride_kh
            else:
                t = pos64
                if HAS_START:
                    t = pos64 + start
                k_row = b.to(tl.int64) * stride_kb + h * stride_kh + t * stride_kt
            if CODES:
                qk = code_scores(q_lo, q_hi, q_sum, K, k_row, ok, offs_c, c_ok, D // 2, ALIGN,
                                 UPCAST)  # fmt: skip
            else:
                k_mask = ok[:, None] & d_ok[None, :]
                if K_LABELS:
                    k = tl.load(K + k_row[:, None] + chan[None, :], mask=k_mask, other=0.0)
                else:
                    k = tl.load(K + k_row[:, None] + offs_d[None, :], mask=k_mask, other=0.0)
                if UPCAST:  # the interpreter multiplies bf16 as integers: exact float32 instead
                    qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(k))
            qk = tl.where(ok[None, :], qk * scaling, float("-inf"))
            if LSE_BS > 0:
                # Spans and tiles start on block boundaries (LSE_BS divides BLOCK_T).
                per: tl.constexpr = BLOCK_T // LSE_BS
                blk = tl.reshape(qk, (BLOCK_G, per, LSE_BS))
                b_max = tl.max(blk, 2)
                b_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
                b_lse = b_safe + tl.log(tl.sum(tl.exp(blk - b_safe[:, :, None]), 2))
                j = t0 // LSE_BS + tl.arange(0, per)
                out_ptr = LOGITS + row[:, None] * stride_out + j[None, :]
                tl.store(out_ptr, b_lse, mask=g_ok[:, None] & (j * LSE_BS < hi)[None, :])
            else:
                out_ptr = LOGITS + row[:, None] * stride_out + pos64[None, :]
                tl.store(out_ptr, qk, mask=g_ok[:, None] & in_range[None, :])
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(qk - m_safe[:, None]), 1)
            m_i = m_new
        stat = (pid.to(tl.int64) * n_spans + span) * BLOCK_G + offs_g
        tl.store(SM + stat, m_i)
        tl.store(SL + stat, l_i)


def _probs_kernel(
    ACTIVE,
    LOGITS,
    SM,
    SL,
    PROBS,
    stride_pb,
    stride_ph,
    t_max,
    n_spans,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    G_POW: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPAN: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    span = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    lo = span * SPAN
    hi = tl.minimum(lo + SPAN, t_max)
    out_base = PROBS + b.to(tl.int64) * stride_pb + h * stride_ph
    active = True
    if HAS_ACTIVE:
        active = tl.load(ACTIVE + pid) != 0
    if active:
        offs_s = tl.arange(0, BLOCK_S)
        offs_g = tl.arange(0, G_POW)  # the statistics' rows are BLOCK_G apart
        s_ok = offs_s < n_spans
        stat = (pid.to(tl.int64) * n_spans + offs_s)[:, None] * BLOCK_G + offs_g[None, :]
        m = tl.load(SM + stat, mask=s_ok[:, None], other=float("-inf"))  # [BLOCK_S, G_POW]
        l_s = tl.load(SL + stat, mask=s_ok[:, None], other=0.0)
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        total = tl.sum(l_s * tl.exp(m - m_safe[None, :]), 0)
        lse = m_safe + tl.log(total)  # [G_POW]
        g_ok = offs_g < G
        row = pid.to(tl.int64) * G + offs_g
        for t0 in range(lo, hi, BLOCK_T):
            pos = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            in_range = pos < hi
            lg = tl.load(
                LOGITS + row[:, None] * t_max + pos[None, :],
                mask=g_ok[:, None] & in_range[None, :],
                other=float("-inf"),
            )
            p = tl.sum(tl.where(g_ok[:, None], tl.exp(lg - lse[:, None]), 0.0), 0) / G
            tl.store(out_base + pos, p, mask=in_range)
    else:
        for t0 in range(lo, hi, BLOCK_T):
            pos = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            tl.store(out_base + pos, tl.zeros([BLOCK_T], tl.float32), mask=pos < hi)


@functools.cache
def _kernels(interpret: bool) -> tuple[object, object]:
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_logits_kernel), triton.jit(_probs_kernel)


def retrieval_logits_triton(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    active: torch.Tensor | None,
    *,
    labels: torch.Tensor | None = None,
    key_cache: tuple[torch.Tensor, int] | None = None,
    codes: KeyCodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """The first pass: ``(logits [B * Hkv * g, T], span max, span sum, spans, BLOCK_G, span
    length)``; rows not ``active`` are left unwritten. ``codes``: score the keys' code rows
    (:mod:`prhs_kernels.keycodes`) instead of the keys.

    ``labels [B, Hkv, r]`` (integer channel ids): score only those channels of the query and
    of each key. ``key_cache = (cache [R, Hkv, r], row_stride)``: read the keys' label channels
    from ``cache`` (row ``b * row_stride + t`` of a contiguous cache, the token's slot of a
    paged one) instead of the key rows; needs ``labels``."""
    return _logits_pass(query, kv, scaling, active, labels, key_cache, 0, codes)


def retrieval_block_lse_triton(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    active: torch.Tensor,
    block_size: int,
    codes: KeyCodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The first pass writing, instead of the logits, each block's log-sum-exp of them:
    ``(block lse [B * Hkv * g, NB_pad] (columns past NB unwritten, NB_pad a multiple of 16),
    span max, span sum, spans, BLOCK_G)``; rows not ``active`` are left unwritten. A block's
    attention mass for query head ``i`` is then ``exp(block_lse - lse_i)``, ``lse_i`` merged
    from the span statistics: what :func:`prhs_kernels.cis.retrieval_compose`'s top-k scores
    from, without the ``T``-long logits ever reaching memory. ``block_size`` must be a power of
    two of at most ``TUNING["block_t"]`` (:func:`block_lse_fits`). ``codes``: from the keys'
    code rows."""
    if not block_lse_fits(block_size):
        raise ValueError(
            f"block_size must be a power of two of at most {TUNING['block_t']}, got {block_size}"
        )
    out, sm, sl, n_spans, block_g, _ = _logits_pass(query, kv, scaling, active, None, None,
                                                    block_size, codes)  # fmt: skip
    return out, sm, sl, n_spans, block_g


def block_lse_fits(block_size: int) -> bool:
    """Whether :func:`retrieval_block_lse_triton` takes blocks of ``block_size`` positions: a
    power of two that divides a tile (``TUNING["block_t"]``, which divides a span)."""
    return 1 <= block_size <= TUNING["block_t"] and not block_size & (block_size - 1)


def _logits_pass(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    active: torch.Tensor | None,
    labels: torch.Tensor | None,
    key_cache: tuple[torch.Tensor, int] | None,
    lse_bs: int,
    codes: KeyCodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    b, hq, d = query.shape
    hkv = kv.num_kv_heads
    g = hq // hkv
    t_max = kv.max_len
    dev = query.device
    if query.stride(-1) != 1:
        query = query.contiguous()
    span = TUNING["span"]
    block_t = TUNING["block_t_codes"] if codes is not None else TUNING["block_t"]
    n_spans = max(1, -(-t_max // span))
    block_g = max(16, triton.next_power_of_2(g))
    if lse_bs:  # a row per query head, a column per block (a multiple of 16: aligned rows)
        cols = -(-max(-(-t_max // lse_bs), 1) // 16) * 16
    else:
        cols = max(t_max, 1)
    logits = torch.empty(b * hkv * g, cols, dtype=torch.float32, device=dev)
    sm = torch.empty(b * hkv, n_spans, block_g, dtype=torch.float32, device=dev)
    sl = torch.empty_like(sm)
    has_active = active is not None
    flags = active.reshape(-1).view(torch.int8) if active is not None else kv.seq_lens
    k, (skb, skh, skt), req2tok, reqidx, stride_rt, start, has_start, paged = key_args(kv)
    if labels is not None:
        d = labels.shape[-1]
        lab, slb, slh = labels, labels.stride(0), labels.stride(1)
        if labels.stride(-1) != 1:
            lab = labels.contiguous()
            slb, slh = lab.stride(0), lab.stride(1)
    else:
        lab, slb, slh = kv.seq_lens, 0, 0  # unused
    if codes is not None:  # read like a key cache, one code row per location
        key_cache = (codes.rows, codes.row_stride)
    if key_cache is not None:
        k, row_stride = key_cache
        skt, skh = k.stride(0), k.stride(1)
        skb = row_stride * skt  # contiguous: row b * row_stride + t (no start offset)
        has_start = False
        start = kv.seq_lens
    if k.stride(-1) != 1:
        raise ValueError("the Triton path needs a cache whose last dim is contiguous")
    logits_kernel, _ = _kernels(interpreting())
    programs = min(b * hkv * n_spans, TUNING["programs_per_sm"] * _multiprocessors(dev))
    logits_kernel[(programs,)](
        query, k, flags, kv.seq_lens, start, req2tok, reqidx, logits, sm, sl, lab, slb, slh,
        query.stride(0), query.stride(1), skb, skh, skt, stride_rt, cols,
        float(scaling), t_max, b * hkv, n_spans,
        HKV=hkv, G=g, BLOCK_G=block_g, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_T=block_t, SPAN=span, PAGED=paged, HAS_START=has_start, HAS_ACTIVE=has_active,
        BLOCK_R=max(2, triton.next_power_of_2(b * hkv)), UPCAST=interpreting(),
        Q_LABELS=labels is not None, K_LABELS=labels is not None and key_cache is None,
        LSE_BS=lse_bs, CODES=codes is not None, BLOCK_DH=max(16, triton.next_power_of_2(d // 2)),
        ALIGN=row_alignment(codes.rows) if codes is not None else 1, STAGES=TUNING["num_stages"],
        **pdl_args(dev, "score"), num_warps=TUNING["num_warps"],
        num_stages=TUNING["num_stages"],
    )  # fmt: skip
    return logits, sm, sl, n_spans, block_g, span


def retrieval_probs_triton(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    active: torch.Tensor | None,
    out: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    key_cache: tuple[torch.Tensor, int] | None = None,
    codes: KeyCodes | None = None,
) -> torch.Tensor:
    """The launcher's Triton path (inputs checked): ``[B, Hkv, T]`` float32. ``labels``,
    ``key_cache`` and ``codes`` as :func:`retrieval_logits_triton`."""
    b, hq, _ = query.shape
    hkv = kv.num_kv_heads
    g = hq // hkv
    t_max = kv.max_len
    given = out
    if out is None or out.stride(-1) != 1:
        out = torch.empty(b, hkv, t_max, dtype=torch.float32, device=query.device)
    logits, sm, sl, n_spans, block_g, span = retrieval_logits_triton(
        query, kv, scaling, active, labels=labels, key_cache=key_cache, codes=codes
    )
    flags = active.reshape(-1).view(torch.uint8) if active is not None else kv.seq_lens
    _, probs_kernel = _kernels(interpreting())
    probs_kernel[(b * hkv, n_spans)](
        flags, logits, sm, sl, out, out.stride(0), out.stride(1), t_max, n_spans,
        HKV=hkv, G=g, BLOCK_G=block_g, G_POW=max(2, triton.next_power_of_2(g)),
        BLOCK_S=max(2, triton.next_power_of_2(n_spans)), BLOCK_T=min(256, span),
        SPAN=span, HAS_ACTIVE=active is not None, **pdl_args(query.device, "score"), num_warps=4,
    )  # fmt: skip
    if given is not None and given is not out:
        given.copy_(out)
        out = given
    return out
