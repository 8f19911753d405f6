"""Triton kernel of sparse decode attention: each selected K/V row is read once, in place.

One launch, or two when a row's list takes more than ``TUNING["merge_last"]`` slices:

1. ``_split_kernel``, grid ``(B * Hkv, S)``: program ``(b, h, j)`` takes the ``j``-th of ``S``
   nearly equal runs of tiles of row ``(b, h)``'s list (positions, or ``s``-block entries
   expanded to positions, or every position when dense), cut from the row's own count or
   length rather than from the list's width or the cache's capacity; it loads each listed K
   and V row straight from the cache (contiguous or through the request-to-token table, no
   gathered copy; a tile's V rows with its K rows, and the next tile's list entries a tile
   ahead) and runs an online softmax for *all*
   ``g = Hq / Hkv`` query heads of the group at once (one ``tl.dot`` of the ``[g, D]`` queries
   against ``[N, D]`` keys), so a row is read once per group, not once per query head. When the
   split count is 1 (enough (sequence, KV head) rows to fill the GPU, or lists of one tile) it
   writes the normalised output and ``lse`` itself. Otherwise it writes its unnormalised
   partial output, running max and sum in float32; up to ``merge_last`` slices, it then raises
   the row's arrival count (an int32 counter per row, released after the partials are stored)
   and the slice that arrives last merges the row (and sets the count back to 0).
2. ``_merge_kernel``, grid ``(B * Hq,)``, for more slices than that: merges the ``S`` partials
   by their log-sum-exp into the output (query dtype) and ``lse`` (float32), written in place
   into ``out=`` / ``lse=``.

``S`` (the split count) is a static function of the shapes and the GPU's multiprocessor count,
so a step keeps its launch shapes from one decode step to the next (CUDA-graph safe); a slice
with no tile of its row (a row of fewer tiles than slices) writes an empty partial. Nothing is
read on the host.

Semantics are the torch reference's: entries past a count, negative ids and positions past a
sequence's end are not read; a row with nothing to read gives ``out = 0`` and ``lse = -inf``; a
NaN in a selected key or value (or the query) reaches the output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.selection import Selection
from prhs_kernels.paths import interpreting
from prhs_kernels.pdl import pdl_args, pdl_wait

__all__ = ["num_splits", "sparse_decode_attention_triton"]

TUNING = {
    "block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 4, "merge_last": 4,
    "kv_evict_first": False,
}  # fmt: skip
"""Launch parameters: positions per tile of the inner loop, warps per program, software
pipelining depth, and programs per multiprocessor the split count aims at; ``merge_last``: up
to this many slices a row, the row's last slice to finish merges the row's partials itself
(counted in an int32 counter per row) instead of a second launch (0: always launch the merge).
On an H200, back to back, 128 blocks of 8 a row: B16·Hkv8 (4 slices) 26.6 → 25.5 µs, B8·Hkv32
(2 slices) 41.1 → 40.0; but B1·Hkv32 (16 slices) 12.8 → 15.4, one program's merge of 16 slices
in a row costing more than the launch it saves. ``kv_evict_first``: load K/V rows with the
``evict_first`` cache hint (no change measured in a whole step: Llama-2-7B B8·T4k 6.339 against
6.340 ms; off). Module-level so that ``benchmarks/scripts/kernels.py`` and
``benchmarks/scripts/tuning_ab_device.sh`` can sweep them; chosen there, on an H200."""


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _write_normalised(
    OUT, LSE, b, qh, g_ok, offs_dv, acc, l_i, m_i,
    stride_ob, stride_oh, stride_lb, stride_lh, DV: tl.constexpr,
):  # fmt: skip
    """A group's normalised output and ``lse`` from its running sum, max and accumulator
    (a row with nothing read: ``out = 0``, ``lse = -inf``), written into ``OUT`` / ``LSE``."""
    empty = l_i == 0.0
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, l_i)))
    out_ptr = OUT + b.to(tl.int64) * stride_ob + qh[:, None] * stride_oh + offs_dv[None, :]
    o_ok = g_ok[:, None] & (offs_dv[None, :] < DV)
    tl.store(out_ptr, o.to(OUT.dtype.element_ty), mask=o_ok)
    tl.store(LSE + b.to(tl.int64) * stride_lb + qh * stride_lh, lse, mask=g_ok)


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def _merge_head(
    PO, PM, PL, OUT, LSE, row, b, qh, n_splits,
    stride_ob, stride_oh, stride_lb, stride_lh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The merge kernel's work for one query head: its output and ``lse`` from its
    ``n_splits`` slices' partials (``row``: the head's index among the partials' rows), all
    loaded at once and written into ``OUT`` / ``LSE``. (The split kernel's last slice merges
    with a loop over slices instead: this helper unrolled over a group's heads there made a
    Llama-3-8B B16·T16k step 0.1 ms slower on an H200.)"""
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < n_splits
    base = row * n_splits + offs_s
    m = tl.load(PM + base, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(PL + base, mask=s_ok, other=0.0, cache_modifier=".cg")
    o = tl.load(
        PO + base[:, None] * DV + offs_dv[None, :],
        mask=s_ok[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
        cache_modifier=".cg",
    )
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok, tl.exp(m - m_safe), 0.0)
    total = tl.sum(l_s * w, 0)
    o = tl.sum(o * w[:, None], 0)
    empty = total == 0.0
    o = tl.where(empty, 0.0, o / tl.where(empty, 1.0, total))
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    out_ptr = OUT + b.to(tl.int64) * stride_ob + qh * stride_oh + offs_dv
    tl.store(out_ptr, o.to(OUT.dtype.element_ty), mask=offs_dv < DV)
    tl.store(LSE + b.to(tl.int64) * stride_lb + qh * stride_lh, lse)


def _split_kernel(
    Q,
    K,
    V,
    IDX,
    CNT,
    LENS,
    START,
    REQ2TOK,
    REQIDX,
    PO,
    PM,
    PL,
    OUT,
    LSE,
    ARRIVE,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ib,
    stride_ih,
    stride_rt,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    scaling,
    k_max,
    n_splits,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DENSE: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_START: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
    MERGE_LAST: tl.constexpr,
    KV_EVICT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    seq_len = tl.load(LENS + b)
    if DENSE:
        n_virt = seq_len
    else:
        cnt = tl.minimum(tl.maximum(tl.load(CNT + b * HKV + h), 0), k_max)
        n_virt = cnt * BS
    # The row's own tiles (not the list's width) are cut into n_splits nearly equal runs, so
    # a row shorter than its width keeps every slice busy and no slice reads more than
    # ceil(tiles / n_splits) tiles.
    n_tiles = (n_virt + BLOCK_N - 1) // BLOCK_N
    lo = (split * n_tiles // n_splits) * BLOCK_N
    hi = tl.minimum(((split + 1) * n_tiles // n_splits) * BLOCK_N, n_virt)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    g_ok = offs_g < G
    q_ptr = Q + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=g_ok[:, None] & (offs_d[None, :] < D), other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    if PAGED:
        req = tl.load(REQIDX + b).to(tl.int64)
    if HAS_START:
        start = tl.load(START + b).to(tl.int64)
    # The next tile's list entries are loaded a tile ahead, and each tile's V rows with its K
    # rows, so a tile waits on one round trip to memory rather than three in a row.
    if not DENSE:
        nxt = lo + tl.arange(0, BLOCK_N)
        ids_next = tl.load(
            IDX + b.to(tl.int64) * stride_ib + h * stride_ih + nxt // BS,
            mask=nxt < hi,
            other=-1,
        )
    for t0 in range(lo, hi, BLOCK_N):
        v_off = t0 + tl.arange(0, BLOCK_N)
        ok = v_off < hi
        if DENSE:
            pos = v_off.to(tl.int64)
        else:
            ids = ids_next
            nxt = v_off + BLOCK_N
            ids_next = tl.load(
                IDX + b.to(tl.int64) * stride_ib + h * stride_ih + nxt // BS,
                mask=nxt < hi,
                other=-1,
            )
            pos = ids.to(tl.int64) * BS + (v_off % BS)
            ok = ok & (ids >= 0)
        ok = ok & (pos < seq_len)
        if PAGED:
            slot = tl.load(REQ2TOK + req * stride_rt + pos, mask=ok, other=0).to(tl.int64)
            k_row = slot * stride_kt + h * stride_kh
            v_row = slot * stride_vt + h * stride_vh
        else:
            t = pos
            if HAS_START:
                t = pos + start
            k_row = b.to(tl.int64) * stride_kb + h * stride_kh + t * stride_kt
            v_row = b.to(tl.int64) * stride_vb + h * stride_vh + t * stride_vt
        k = tl.load(
            K + k_row[:, None] + offs_d[None, :],
            mask=ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
            eviction_policy=KV_EVICT,
        )
        v = tl.load(
            V + v_row[:, None] + offs_dv[None, :],
            mask=ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
            eviction_policy=KV_EVICT,
        )
        if UPCAST:  # the interpreter multiplies bf16 as integers: exact float32 instead
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scaling  # [BLOCK_G, BLOCK_N] float32
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    qh = h * G + offs_g
    if DIRECT:  # one slice per row: normalise and write the output here, as the merge would
        _write_normalised(OUT, LSE, b, qh, g_ok, offs_dv, acc, l_i, m_i,
                          stride_ob, stride_oh, stride_lb, stride_lh, DV)  # fmt: skip
    else:
        base = (b.to(tl.int64) * (HKV * G) + qh) * n_splits + split  # [BLOCK_G]
        tl.store(PM + base, m_i, mask=g_ok)
        tl.store(PL + base, l_i, mask=g_ok)
        tl.store(
            PO + base[:, None] * DV + offs_dv[None, :],
            acc,
            mask=g_ok[:, None] & (offs_dv[None, :] < DV),
        )
        if MERGE_LAST:
            # The row's last slice to finish merges all of them (no merge launch): every
            # thread's partials are stored before the count is raised (release), and read
            # back past L1 after it (acquire). The merger sets the count back to 0, so the
            # counters are zero between launches (and between CUDA-graph replays).
            tl.debug_barrier()
            arrived = tl.atomic_add(ARRIVE + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                tl.atomic_xchg(ARRIVE + pid, 0, sem="relaxed", scope="gpu")
                row0 = (b.to(tl.int64) * (HKV * G) + qh) * n_splits  # [BLOCK_G]
                m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
                l_all = tl.zeros([BLOCK_G], tl.float32)
                o_all = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
                for j in range(0, n_splits):
                    m_j = tl.load(PM + row0 + j, mask=g_ok, other=float("-inf"),
                                  cache_modifier=".cg")  # fmt: skip
                    l_j = tl.load(PL + row0 + j, mask=g_ok, other=0.0, cache_modifier=".cg")
                    o_j = tl.load(
                        PO + (row0 + j)[:, None] * DV + offs_dv[None, :],
                        mask=g_ok[:, None] & (offs_dv[None, :] < DV),
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    m_new = tl.maximum(m_all, m_j)
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    a_old = tl.exp(m_all - m_safe)
                    a_j = tl.exp(m_j - m_safe)
                    l_all = l_all * a_old + l_j * a_j
                    o_all = o_all * a_old[:, None] + o_j * a_j[:, None]
                    m_all = m_new
                _write_normalised(OUT, LSE, b, qh, g_ok, offs_dv, o_all, l_all, m_all,
                                  stride_ob, stride_oh, stride_lb, stride_lh, DV)  # fmt: skip


def _merge_kernel(
    PO,
    PM,
    PL,
    OUT,
    LSE,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    n_splits,
    HQ: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # before anything is read: see prhs_kernels.pdl
    pid = tl.program_id(0)
    _merge_head(PO, PM, PL, OUT, LSE, pid.to(tl.int64), pid // HQ, pid % HQ, n_splits,
                stride_ob, stride_oh, stride_lb, stride_lh, DV, BLOCK_DV, BLOCK_S)  # fmt: skip


@functools.cache
def _kernels(interpret: bool) -> tuple[object, object]:
    """The two kernels, jitted for the mode asked (the interpreter or the compiler)."""
    del interpret  # part of the cache key: triton.jit reads TRITON_INTERPRET when it wraps
    return triton.jit(_split_kernel), triton.jit(_merge_kernel)


_ARRIVALS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _arrivals(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, at least ``n``, that the split kernel's ``merge_last`` mode counts
    each row's finished slices in (and sets back to 0): one set per device and CUDA stream, so
    kernels that may run at once never share them. Grown (a fresh zeroed tensor, a power of two)
    when a launch has more rows than any before; the smaller one is kept alive, never freed, as
    a CUDA graph captured over it still uses it (freed, its memory could be handed to another
    tensor under the graph's feet). A function of shapes: nothing is read on the host."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _ARRIVALS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(triton.next_power_of_2(n), 1024), dtype=torch.int32, device=device)
        _ARRIVALS[key] = buf
    return buf


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def key_args(kv: KVLayout) -> tuple:
    """How a kernel finds a logical position's key row in either layout: ``(k, (skb, skh,
    skt), req_to_token, req_pool_indices, stride_rt, start, has_start, paged)``. Paged: row
    ``req_to_token[req, t]`` of ``k_pool``; contiguous: ``[b, h, t + start[b]]`` of ``k``. The
    tensors a layout does not use are ``seq_lens`` (never read by the kernel)."""
    if isinstance(kv, ContiguousKV):
        k = kv.k
        has_start = kv.start is not None
        start = kv.start if has_start else kv.seq_lens
        strides = (k.stride(0), k.stride(1), k.stride(2))
        return k, strides, kv.seq_lens, kv.seq_lens, 0, start, has_start, False
    k = kv.k_pool
    strides = (0, k.stride(1), k.stride(0))
    rt = kv.req_to_token
    return k, strides, rt, kv.req_pool_indices, rt.stride(0), kv.seq_lens, False, True


def num_splits(pairs: int, max_positions: int, device: torch.device) -> int:
    """Slices per (sequence, KV head) list: enough programs for ``TUNING["waves"]`` programs per
    multiprocessor, and no slice shorter than one tile. A function of shapes only."""
    tiles = max(1, -(-max_positions // TUNING["block_n"]))
    # Rounded down: a grid of just under a whole number of waves, not just over (a second,
    # nearly empty wave costs as much as the first: seen at B16·Hkv8, 640 programs, 1.2 waves).
    want = TUNING["waves"] * _multiprocessors(device) // max(pairs, 1)
    return max(1, min(tiles, want))


def _pow2(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(n))


def sparse_decode_attention_triton(
    query: torch.Tensor,
    kv: KVLayout,
    selection: Selection | None,
    scaling: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher's Triton path (inputs already checked): ``(out [B, Hq, Dv], lse [B, Hq])``,
    written into ``out`` / ``lse`` when given (any strides)."""
    b, hq, d = query.shape
    hkv = kv.num_kv_heads
    g = hq // hkv
    dv = kv.value_dim
    dev = query.device
    if query.stride(-1) != 1:
        query = query.contiguous()
    given_out = out
    if out is None or out.stride(-1) != 1:
        out = torch.empty(b, hq, dv, dtype=query.dtype, device=dev)
    if lse is None:
        lse = torch.empty(b, hq, dtype=torch.float32, device=dev)
    dense = selection is None
    if dense:
        bs, k_max = 1, 0
        max_positions = kv.max_len
        idx = cnt = kv.seq_lens  # unused
        stride_ib = stride_ih = 0
    else:
        bs, k_max = selection.block_size, selection.width
        max_positions = k_max * bs  # entries past a row's end still take their slots
        idx, cnt = selection.indices, selection.counts.contiguous()
        if idx.stride(-1) != 1:
            idx = idx.contiguous()
        stride_ib, stride_ih = idx.stride(0), idx.stride(1)
    n_split = num_splits(b * hkv, max_positions, dev)
    block_n = TUNING["block_n"]
    direct = n_split == 1  # the split kernel writes the output itself: no partials, no merge
    n_part = 0 if direct else n_split
    part_o = torch.empty(b, hq, n_part, dv, dtype=torch.float32, device=dev)
    part_m = torch.empty(b, hq, n_part, dtype=torch.float32, device=dev)
    part_l = torch.empty(b, hq, n_part, dtype=torch.float32, device=dev)

    k, (skb, skh, skt), req2tok, reqidx, stride_rt, start, has_start, paged = key_args(kv)
    v = kv.v_pool if paged else kv.v
    svb, svh, svt = (0, v.stride(1), v.stride(0)) if paged else v.stride()[:3]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the Triton path needs a cache whose last dim is contiguous")

    split_kernel, merge_kernel = _kernels(interpreting())
    block_d, block_dv = _pow2(d, 16), _pow2(dv, 16)
    merge_last = not direct and n_split <= TUNING["merge_last"]
    arrive = _arrivals(dev, b * hkv) if merge_last else cnt
    split_kernel[(b * hkv, n_split)](
        query, k, v, idx, cnt, kv.seq_lens, start, req2tok, reqidx,
        part_o, part_m, part_l, out, lse, arrive,
        query.stride(0), query.stride(1),
        skb, skh, skt, svb, svh, svt,
        stride_ib, stride_ih, stride_rt,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        float(scaling), k_max, n_split,
        HKV=hkv, G=g, BLOCK_G=_pow2(g, 16), D=d, BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv,
        BS=bs, BLOCK_N=block_n, DENSE=dense, PAGED=paged, HAS_START=has_start,
        UPCAST=interpreting(), DIRECT=direct, MERGE_LAST=merge_last,
        KV_EVICT="evict_first" if TUNING["kv_evict_first"] else "",
        **pdl_args(dev, "sparse"), num_warps=TUNING["num_warps"], num_stages=TUNING["num_stages"],
    )  # fmt: skip
    if not direct and not merge_last:
        merge_kernel[(b * hq,)](
            part_o, part_m, part_l, out, lse,
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), n_split,
            HQ=hq, DV=dv, BLOCK_DV=block_dv, BLOCK_S=_pow2(n_split, 2),
            **pdl_args(dev, "merge"), num_warps=4,
        )  # fmt: skip
    if given_out is not None and given_out is not out:
        given_out.copy_(out)
        out = given_out
    return out, lse
