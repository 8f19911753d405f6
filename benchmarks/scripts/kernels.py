"""prhs kernels on a GPU: correctness at real sizes, then the decode-step table of the kernels
issue. A benchmark, not a test: nothing here asserts a speed.

``check``
    The Triton paths against the torch references on the GPU, fresh random data each case,
    outputs poisoned with NaN first: sparse decode attention (dense, token and 8-block
    selections, counts 0 .. K_max, contiguous with left padding and paged with page size 1 and
    16, GQA 1/4/8, fp16 and bf16) and retrieval probabilities (every row, a random 10 % of rows).
    Relative errors against the float32 reference; NaN never passes.

``bench``
    For B in {1, 8, 16} x T in {2k, 16k, 64k} x Hq/Hkv in {32/32, 32/8}, D 128, bf16, budget
    1024 (one attention layer, every row of length T):

    - the measured copy bandwidth (a 4 GiB device-to-device copy: bytes read + written);
    - dense decode: SDPA flash, SDPA cuDNN and memory-efficient, and prhs's Triton kernel over
      every position; the fastest is "best dense";
    - FlexAttention with a BlockMask of 8 blocks of 128 per (sequence, head) (1024 positions);
    - the sparse kernel alone over 1024 positions (128 blocks of 8, and single positions, as
      CIS selects them), also timed back to back (``b2b_ms``: 8 launches in one graph, the
      kernel's time inside a step);
    - the retrieval alone (``retrieval_probs``) with every row retrieving, and with 10 %;
    - Quest's and CIS's whole step (select + attend, side-cache writes included), replayed from a
      CUDA graph over a 32-step trace of 4 layers (ms per layer), CIS at forced retrieval
      ratios ρ = 5, 10, 20 % and the ρ̂ of a real model run (``--real-rho``), with its byte
      floor.

    Each row prints ms (median of ``triton.testing.do_bench`` or of graph replays), the bytes it
    must read, TB/s achieved on them, and the speedup over the best dense.

``ranking``
    The rankings of a CIS step alone, graph-replayed, at B1·T16k, B16·T16k and B16·T64k (Hkv 8,
    budget 1024, ``rescore`` 2048): a seeded retrieval (``retrieval_pool``, a quarter of the rows
    retrieving, each seeded by a pool near its top ``m + r``; its kernels' eager times from the
    profiler beside it), a re-ranking's ranking and rewrite (``rescore_rank_write_triton``, the
    other rows), and ``topk_indices``' kernel; scores uniform in ``[0, 1)`` and log-normal.
    What the search for the ``k``-th key costs, apart from the step around it.

Usage, from the repository root with every package's ``src`` on ``PYTHONPATH``::

    python benchmarks/scripts/kernels.py check --out check.jsonl
    python benchmarks/scripts/kernels.py bench --out bench.jsonl
    python benchmarks/scripts/kernels.py ranking --out ranking.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Any

import torch

D = 128
DEV = "cuda"
DTYPE = torch.bfloat16
SCALING = D**-0.5
STEP_LAYERS = 4
BACK_TO_BACK = 8
"""Launches of the sparse kernel in one graph for its ``b2b_ms`` column, each over its own
random selection: the kernel's time in a step, without the host's submission of a lone graph
(6-8 µs of every single-op ``ms`` here). Caches that fit in L2 (B1 up to 16k) are read from it
after the first launch, so there it flatters."""
"""Layers per decode step in the whole-step rows: the host's per-step work (the plan's update,
the step's input copies) is shared by a step's layers, as in a model (32 layers or more; 4
here keep three copies of the B16·T64k caches within the GPU's memory)."""


def machine() -> dict[str, Any]:
    import triton

    commit = os.environ.get("PRHS_COMMIT", "")  # the tree sent, where git's metadata is stale
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True)
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def emit(out: Any, row: dict[str, Any]) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def bench_ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_ms(fn: Any) -> float:
    """Median ms of ``fn`` captured once in a CUDA graph and replayed (no host launch cost)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


# ---------------------------------------------------------------------------------------------
# caches
# ---------------------------------------------------------------------------------------------
def contiguous(b: int, hkv: int, t: int, lens: list[int], padded: bool, gen: torch.Generator):
    from prhs_core import ContiguousKV

    k = torch.randn(b, hkv, t, D, generator=gen, device=DEV).to(DTYPE)
    v = torch.randn(b, hkv, t, D, generator=gen, device=DEV).to(DTYPE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    start = None
    if padded:
        start = torch.tensor([t - n for n in lens], dtype=torch.int32, device=DEV)
    return ContiguousKV(k, v, seq, start)


def paged(kv: Any, page_size: int, gen: torch.Generator):
    """The same logical K/V as contiguous ``kv`` (``start=None``) in a shuffled paged pool."""
    from prhs_core import PagedKV

    b, hkv, t, _ = kv.k.shape
    pages = -(-t // page_size)
    n_pages = b * pages + 2
    perm = torch.randperm(n_pages, generator=gen, device=DEV)[: b * pages].view(b, pages)
    slots = (perm.unsqueeze(-1) * page_size + torch.arange(page_size, device=DEV)).flatten(1)
    slots = slots[:, :t].contiguous()  # [B, T]
    k_pool = torch.full((n_pages * page_size, hkv, D), float("nan"), device=DEV, dtype=DTYPE)
    v_pool = torch.full_like(k_pool, float("nan"))
    k_pool[slots.flatten()] = kv.k.transpose(1, 2).reshape(-1, hkv, D)
    v_pool[slots.flatten()] = kv.v.transpose(1, 2).reshape(-1, hkv, D)
    table = torch.zeros(b + 1, t + 5, dtype=torch.int32, device=DEV)
    table[1:, :t] = slots.to(torch.int32)
    req = torch.arange(1, b + 1, dtype=torch.int32, device=DEV)
    return PagedKV(k_pool, v_pool, table, req, kv.seq_lens, page_size, max_len_hint=t)


def block_selection(b: int, hkv: int, lens: list[int], n_blocks: int, s: int, gen: Any):
    """``n_blocks`` distinct random ``s``-blocks per row (ascending), counts ``n_blocks``."""
    from prhs_core import Selection

    idx = torch.empty(b, hkv, n_blocks, dtype=torch.int32, device=DEV)
    for i, n in enumerate(lens):
        nb = -(-n // s)
        keys = torch.rand(hkv, nb, generator=gen, device=DEV)
        top = keys.topk(min(n_blocks, nb), dim=-1).indices.sort(-1).values
        idx[i] = -1
        idx[i, :, : top.shape[-1]] = top.to(torch.int32)
    cnt = (idx >= 0).sum(-1).to(torch.int32)
    return Selection(idx, cnt, s)


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------
def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if torch.isnan(got).any() != torch.isnan(want).any():
        return math.inf
    ok = torch.isfinite(want)
    diff = (got.double() - want.double())[ok]
    return (diff.norm() / want.double()[ok].norm().clamp_min(1e-30)).item()


def check(out: Any, ops: tuple[str, ...] = ("sparse", "retrieval", "labels", "rabitq")) -> None:
    """The ops against their torch references at real sizes, on every layout: ``ops`` names
    which (sparse decode attention, retrieval probabilities, label scoring, RaBitQ logits)."""
    from prhs_core import Selection
    from prhs_kernels.score import (
        retrieval_probs,
        retrieval_probs_reference,
        score_keys_reference,
    )
    from prhs_kernels.sparse_decode import (
        sparse_decode_attention,
        sparse_decode_attention_reference,
        sparse_decode_path,
    )

    global DTYPE
    gen = torch.Generator(device=DEV).manual_seed(0)
    cases = [  # (lens, Hq, Hkv)
        ([20000, 16001, 1, 777], 32, 8),
        ([5000, 4093], 32, 32),
        ([9000, 64, 12345], 16, 2),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        DTYPE = dtype
        for lens, hq, hkv in cases:
            b, t = len(lens), max(lens)
            base = contiguous(b, hkv, t, lens, padded=False, gen=gen)
            layouts = {
                "contig-padded": contiguous(b, hkv, t, lens, padded=True, gen=gen),
                "contig": base,
                "paged1": paged(base, 1, gen),
                "paged16": paged(base, 16, gen),
            }
            # The padded layout holds other random data: compare each layout with its own ref.
            q = torch.randn(b, hq, D, generator=gen, device=DEV).to(dtype)
            sels: dict[str, Selection | None] = {
                "dense": None,
                "tokens-1024": block_selection(b, hkv, lens, 1024, 1, gen),
                "blocks8-128": block_selection(b, hkv, lens, 128, 8, gen),
            }
            ragged = block_selection(b, hkv, lens, 300, 8, gen)
            cnt = torch.randint(0, 301, (b, hkv), generator=gen, device=DEV, dtype=torch.int32)
            cnt.view(-1)[0] = 0
            sels["blocks8-ragged"] = Selection(ragged.indices, torch.minimum(cnt, ragged.counts), 8)
            for lname, kv in layouts.items():
                for sname, sel in sels.items() if "sparse" in ops else ():
                    o = torch.full((b, hq, D), float("nan"), device=DEV, dtype=dtype)
                    lse = torch.full((b, hq), float("nan"), device=DEV)
                    sparse_decode_attention(q, kv, sel, SCALING, out=o, lse=lse)
                    ro, rl = sparse_decode_attention_reference(q, kv, sel, SCALING)
                    emit(
                        out,
                        {
                            "part": "check",
                            "op": "sparse_decode_attention",
                            "path": sparse_decode_path(q.device, dtype),
                            "dtype": str(dtype),
                            "lens": lens,
                            "hq/hkv": f"{hq}/{hkv}",
                            "layout": lname,
                            "selection": sname,
                            "out_rel_err": rel_err(o, ro),
                            "lse_max_abs_err": (lse - rl)[torch.isfinite(rl)].abs().max().item(),
                            "lse_inf_equal": bool(torch.equal(torch.isinf(lse), torch.isinf(rl))),
                            "all_written": bool(not torch.isnan(o).any()),
                        },
                    )
                for frac in (1.0, 0.1) if "retrieval" in ops else ():
                    active = torch.rand(b, hkv, generator=gen, device=DEV) < frac
                    active.view(-1)[0] = True
                    p = torch.full((b, hkv, t), float("nan"), device=DEV)
                    retrieval_probs(q, kv, SCALING, active, out=p)
                    rp = retrieval_probs_reference(score_keys_reference(q, kv, SCALING), active)
                    emit(
                        out,
                        {
                            "part": "check",
                            "op": "retrieval_probs",
                            "dtype": str(dtype),
                            "lens": lens,
                            "hq/hkv": f"{hq}/{hkv}",
                            "layout": lname,
                            "active": frac,
                            "rel_err": rel_err(p, rp),
                            "max_abs_err": (p - rp).abs().max().item(),
                            "inactive_zero": bool((p[~active] == 0).all()),
                        },
                    )
                if "labels" in ops:
                    check_labels(out, q, kv, lens, lname, hq, hkv, dtype, gen)
                if "rabitq" in ops:
                    check_rabitq(out, q, kv, lens, lname, hq, hkv, dtype, gen)
            del layouts, base
            torch.cuda.empty_cache()
    DTYPE = torch.bfloat16


def check_rabitq(
    out: Any, q: Any, kv: Any, lens: list[int], lname: str, hq: int, hkv: int, dtype: Any, gen: Any
) -> None:
    """RaBitQ's logit estimates on their Triton path against the torch reference, over random
    side-cache fields read at each position's KV location."""
    from prhs_kernels.rabitq import (
        rabitq_logits,
        rabitq_logits_reference,
        rabitq_path,
        random_rotation,
    )

    b, t = len(lens), max(lens)
    row_stride = t + 7
    n_loc = b * row_stride if lname.startswith("contig") else kv.k_pool.shape[0]
    codes = torch.randint(0, 256, (n_loc + 1, hkv, D // 8), generator=gen, device=DEV)
    codes = codes.to(torch.uint8)
    factor = torch.rand(n_loc + 1, hkv, generator=gen, device=DEV)
    cqk = torch.randn(n_loc + 1, hkv, generator=gen, device=DEV)
    ck = torch.randn(b, hkv, D, generator=gen, device=DEV)
    cq = torch.randn(b, hkv, D, generator=gen, device=DEV)
    p, u = (x.to(DEV) for x in random_rotation(D, 1))
    args = (q, kv, codes, factor, cqk, ck, cq, p, u, SCALING)
    got = rabitq_logits(*args, row_stride=row_stride)
    want = rabitq_logits_reference(*args, row_stride)
    fin = torch.isfinite(want)
    emit(
        out,
        {
            "part": "check",
            "op": "rabitq_logits",
            "path": rabitq_path(q.device, dtype),
            "dtype": str(dtype),
            "lens": lens,
            "hq/hkv": f"{hq}/{hkv}",
            "layout": lname,
            "rel_err": rel_err(got[fin], want[fin]),
            "max_abs_err": (got[fin] - want[fin]).abs().max().item(),
            "inf_equal": bool(torch.equal(torch.isinf(got), torch.isinf(want))),
        },
    )


def check_labels(
    out: Any, q: Any, kv: Any, lens: list[int], lname: str, hq: int, hkv: int, dtype: Any, gen: Any
) -> None:
    """Double Sparsity's label scorer (16 label channels per row) on its Triton path against
    the torch reference, reading the channels from the key rows and from a label cache."""
    from prhs_kernels.kv import gather_kv, token_locations
    from prhs_kernels.labels import label_path, label_probs, label_probs_reference

    b, t, r = len(lens), max(lens), D // 8
    labels = torch.stack(
        [torch.randperm(D, generator=gen, device=DEV)[:r] for _ in range(b * hkv)]
    ).view(b, hkv, r)
    pos = torch.arange(t, device=DEV).view(1, -1).expand(b, -1)
    row_stride = t + 7
    loc = token_locations(kv, pos, row_stride)  # [B, T]
    n_loc = b * row_stride if lname.startswith("contig") else kv.k_pool.shape[0]
    cache = torch.full((n_loc + 1, hkv, r), float("nan"), device=DEV, dtype=dtype)
    keys, _ = gather_kv(kv, pos.unsqueeze(1).expand(b, hkv, t), values=False)  # [B, Hkv, T, D]
    lab_keys = keys.gather(-1, labels.unsqueeze(2).expand(b, hkv, t, r)).transpose(1, 2)
    ok = loc >= 0
    cache[loc[ok]] = lab_keys[ok]
    want = label_probs_reference(q, kv, labels, SCALING)
    for mode, kw in (("key rows", {}), ("label cache", {"cache": cache, "row_stride": row_stride})):
        got = label_probs(q, kv, labels, SCALING, **kw)
        emit(
            out,
            {
                "part": "check",
                "op": f"label_probs ({mode})",
                "path": label_path(q.device, dtype),
                "dtype": str(dtype),
                "lens": lens,
                "hq/hkv": f"{hq}/{hkv}",
                "layout": lname,
                "rel_err": rel_err(got, want),
                "max_abs_err": (got - want).abs().max().item(),
            },
        )


def check_topk(out: Any) -> None:
    """``top_blocks``' Triton kernel (active rows only) against ``torch.topk`` at real sizes."""
    from prhs_kernels.cis import top_blocks

    gen = torch.Generator(device=DEV).manual_seed(4)
    cases = ((128, 8192, 128), (512, 2048, 128), (8, 16384, 1024), (64, 300, 300),
             (128, 65536, 1024))  # fmt: skip
    for rows, n, k in cases:
        x = torch.rand(rows, n, generator=gen, device=DEV)
        x[x < 0.2] = float("-inf")
        active = torch.rand(rows, generator=gen, device=DEV) < 0.5
        idx, val = top_blocks(x, k, active, path="triton")
        ref_val, ref_idx = torch.topk(x, min(k, n), dim=-1)
        a = active
        emit(
            out,
            {
                "part": "check",
                "op": "top_blocks (Triton, active rows)",
                "rows": rows,
                "n": n,
                "k": k,
                "values_equal": bool(torch.equal(val[a], ref_val[a])),
                "index_sets_equal": bool(
                    torch.equal(idx[a].sort(-1).values, ref_idx[a].int().sort(-1).values)
                ),
                "inactive_marked": bool((idx[~a] == -1).all()),
            },
        )


def _scores_at(x: Any, idx: Any) -> Any:
    """``x [R, N]`` at ``idx [R, K]`` (0 where an index is ``-1``)."""
    return torch.where(idx >= 0, x.gather(-1, idx.long().clamp_min(0)), 0.0)


def _chosen(idx: Any, n: int) -> Any:
    """``[R, N]`` int32: how many times each position is in ``idx [R, K]`` (``-1``: none)."""
    m = torch.zeros(idx.shape[0], n + 1, dtype=torch.int32, device=idx.device)
    m.scatter_add_(-1, torch.where(idx >= 0, idx.long(), n), torch.ones_like(idx))
    return m[:, :n]


def check_topk_indices(out: Any) -> None:
    """``topk_indices``' Triton path (a program per row) against its reference (``torch.topk``)
    at real sizes: 128 rows of 4096 and 16 384 scores (10 % ``-inf``), an eligibility mask (a
    row with nothing eligible, one with fewer eligible entries than ``k``), ``k`` 64 and 1024,
    float32 and bf16. Equal counts, equal scores at the indices in order (NaN as ``-inf``),
    ``-1`` at the same places, and equal index sets (exactly, and beyond ties at each row's
    cut: bf16 scores tie often)."""
    from prhs_kernels.topk import topk_indices, topk_indices_reference, topk_path

    gen = torch.Generator(device=DEV).manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((4096, 64), (4096, 1024), (16384, 64), (16384, 1024)):
            rows = 128
            x = torch.rand(rows, n, generator=gen, device=DEV)
            x[x < 0.1] = float("-inf")
            x = x.to(dtype)
            ok = torch.rand(rows, n, generator=gen, device=DEV) < 0.8
            ok[0] = False
            ok[1, k // 2 :] = False
            idx, cnt = topk_indices(x, k, ok, path="triton")
            ref_idx, ref_cnt = topk_indices_reference(x, k, ok)
            xv = x.float()
            xv = torch.where(xv.isnan(), float("-inf"), xv)
            got, want = _chosen(idx, n), _chosen(ref_idx, n)
            last = (ref_cnt.long() - 1).clamp_min(0).unsqueeze(-1)
            cut = _scores_at(xv, ref_idx.gather(-1, last))  # each row's last score (0: none)
            differ = (got != want) & (xv != cut)
            emit(
                out,
                {
                    "part": "check",
                    "op": "topk_indices (Triton)",
                    "path": topk_path(x.device, dtype, n, "triton"),
                    "dtype": str(dtype),
                    "rows": rows,
                    "n": n,
                    "k": k,
                    "counts_equal": bool(torch.equal(cnt, ref_cnt)),
                    "values_equal": bool(torch.equal(_scores_at(xv, idx), _scores_at(xv, ref_idx))),
                    "minus_one_equal": bool(torch.equal(idx < 0, ref_idx < 0)),
                    "distinct_and_eligible": bool(
                        (got <= 1).all() and not (got.bool() & ~ok).any()
                    ),
                    "index_sets_equal": bool(torch.equal(got, want)),
                    "index_sets_equal_beyond_ties": bool(not differ.any()),
                },
            )


def check_retrieval_pool(out: Any) -> None:
    """CIS's retrieval with ``rescore`` (:func:`prhs_kernels.cis.retrieval_pool`) on its Triton
    path, seeded in place by the slots' pools (``anchor_idx``, ``anchor_next``: good seeds, the
    top ``m + r`` of a perturbed copy of the scores; poor ones, random ids; none), against the
    torch path at decode sizes: equal lists, values and next blocks, and how many rows the
    seed left to a whole-row ranking."""
    from prhs_kernels.cis import retrieval_pool
    from prhs_kernels.cis.triton import seeded_capacity
    from prhs_kernels.topk import seeded_candidates

    gen = torch.Generator(device=DEV).manual_seed(6)
    m, r = 1024, 2048
    for b, n in ((1, 16384), (16, 16384), (16, 65536)):
        h = 8
        x = torch.rand(b, h, n, generator=gen, device=DEV)
        x[..., :4] = float("-inf")  # the sink, as block scores have it
        retrieve = torch.rand(b, h, generator=gen, device=DEV) < 0.6
        slots = torch.randperm(2 * b, generator=gen, device=DEV)[:b]
        near = x + 0.02 * torch.rand(b, h, n, generator=gen, device=DEV)
        seed = torch.topk(near, m + r, dim=-1).indices.to(torch.int32)
        seed[0, 0] = torch.randperm(n, generator=gen, device=DEV)[: m + r].to(torch.int32)
        seed[-1, -1] = -1  # no pool yet
        anchor_idx = torch.full((2 * b, h, m), -1, dtype=torch.int32, device=DEV)
        nxt0 = torch.full((2 * b, h, r), -1, dtype=torch.int32, device=DEV)
        anchor_idx[slots], nxt0[slots] = seed[..., :m], seed[..., m:]
        got_next, want_next = nxt0.clone(), nxt0.clone()
        idx, val = retrieval_pool(x, m, r, retrieve, got_next, slots, anchor_idx=anchor_idx,
                                  path="triton")  # fmt: skip
        ref_idx, ref_val = retrieval_pool(x, m, r, retrieve, want_next, slots, path="torch")
        cap = seeded_capacity(n, m + r)
        *_, over = seeded_candidates(x, m + r, seed, capacity=cap, active=retrieve,
                                     path="triton")  # fmt: skip
        a = retrieve
        emit(
            out,
            {
                "part": "check",
                "op": "retrieval_pool (Triton, seeded in place by the slots' pools)",
                "batch": b,
                "n": n,
                "m": m,
                "r": r,
                "lists_equal": bool(torch.equal(idx[a], ref_idx[a])),
                "values_equal": bool(torch.equal(val[a], ref_val[a])),
                "next_equal": bool(torch.equal(got_next, want_next)),
                "rows_retrieving": int(a.sum()),
                "rows_ranked_whole": int(over.sum()),
            },
        )


def check_louver_index(out: Any) -> None:
    """Louver's index build (:func:`prhs_kernels.louver.index_pages`) on its Triton path against
    the torch reference at a decode step's size (B 16, Hkv 8, two pages of 256 keys, D 128): the
    share of pages clustered identically, the centres' and radii's differences, whether every
    member's logit stays under its written bound, that inactive sequences write nothing; and
    the op's time with every sequence active and with none (graph replay)."""
    from prhs_kernels.louver import (
        cluster_upper_bounds,
        index_pages,
        index_pages_reference,
        louver_path,
    )

    gen = torch.Generator(device=DEV).manual_seed(5)
    b, h, n_pages, p, d, s = 16, 8, 2, 256, D, 4
    r = b * n_pages + 1
    for dtype in (torch.bfloat16, torch.float16):
        keys = torch.randn(b, h, n_pages, p, d, generator=gen, device=DEV)
        keys = (keys + 3 * torch.randn(b, h, n_pages, 1, d, generator=gen, device=DEV)).to(dtype)
        rows = torch.randperm(r, generator=gen, device=DEV)[: b * n_pages].view(b, n_pages)
        active = torch.rand(b, generator=gen, device=DEV) < 0.75

        def fields(dt: torch.dtype = dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (
                torch.full((r, h, p), -7, dtype=torch.int16, device=DEV),
                torch.full((r, h, p // 4, d), 9.0, device=DEV).to(dt),
                torch.full((r, h, p // 4, s), 5.0, device=DEV),
            )

        got, want = fields(), fields()
        index_pages(keys, rows, active, *got)
        index_pages_reference(keys, rows, active, *want)
        on_rows = rows[active].reshape(-1)
        off = torch.ones(r, dtype=torch.bool, device=DEV)
        off[on_rows] = False
        same_pages = (got[0][on_rows] == want[0][on_rows]).all(-1).float().mean().item()
        cen_err = (got[1][on_rows].float() - want[1][on_rows].float()).abs().max().item()
        rad_rel = ((got[2][on_rows] - want[2][on_rows]).abs() / want[2][on_rows]).max().item()
        q = torch.randn(len(on_rows), h, 8, d, generator=gen, device=DEV) * 2
        kf = keys.float()[active].transpose(1, 2).reshape(-1, h, p, d)  # [(B NP), Hkv, P, D]
        order = got[0][on_rows].long()
        members = torch.gather(kf, 2, order.unsqueeze(-1).expand(-1, h, p, d))
        logits = torch.einsum(
            "nhgd,nhcmd->nhgcm", q.double(), members.view(-1, h, p // 4, 4, d).double()
        )
        ub = cluster_upper_bounds(q, got[1][on_rows], got[2][on_rows]).double()
        bounded = bool((ub.unsqueeze(-1) >= logits).all())
        untouched = bool((got[0][off] == -7).all() and (got[2][off] == 5.0).all())
        all_on = torch.ones(b, dtype=torch.bool, device=DEV)
        none_on = torch.zeros(b, dtype=torch.bool, device=DEV)
        times = {}
        for label, flags in (("all", all_on), ("none", none_on)):
            args = (keys, rows, flags)
            times[f"ms_{label}_active"] = graph_ms(lambda a=args, o=got: index_pages(*a, *o))
            times[f"ms_{label}_active_torch"] = graph_ms(
                lambda a=args, o=want: index_pages_reference(*a, *o)
            )
        emit(
            out,
            {
                "part": "check",
                "op": "louver index_pages: Triton vs torch",
                "path": louver_path(DEV, dtype),
                "dtype": str(dtype),
                "shape": [b, h, n_pages, p, d],
                "active": int(active.sum().item()),
                "equal_pages": same_pages,
                "max_centre_abs_err": cen_err,
                "max_radius_rel_err": rad_rel,
                "bounds_hold": bounded,
                "inactive_untouched": untouched,
                **times,
            },
        )


def code_rows(kv: Any, layers: int = 2, layer: int = 1, path: str = "torch") -> Any:
    """A contiguous cache's keys as code rows (:mod:`prhs_kernels.keycodes`), written by
    ``path``, in layer ``layer`` of a ``layers``-layer side-cache field (a strided view, as a
    selector keeps them)."""
    from prhs_kernels.keycodes import KeyCodes, code_bytes, write_key_codes
    from prhs_kernels.kv import token_locations

    b, hkv, t, d = kv.k.shape
    field = torch.zeros(b * t + 1, layers, hkv, code_bytes(d), dtype=torch.uint8, device=DEV)
    pos = torch.arange(t, device=DEV).view(1, -1).expand(b, -1)
    loc = token_locations(kv, pos, t).flatten()
    keys = kv.k.transpose(1, 2).reshape(-1, hkv, d)
    write_key_codes(field[:, layer], loc, keys, path=path)
    return KeyCodes(field[:, layer], t)


def check_codes(out: Any) -> None:
    """Key codes on the GPU: the Triton write's bytes against torch's, and the scores read from
    codes (retrieval probabilities, a re-ranking) by the Triton path against the torch path."""
    from prhs_kernels.cis import cis_rescore
    from prhs_kernels.score import retrieval_probs

    gen = torch.Generator(device=DEV).manual_seed(5)
    lens = [5000, 3001, 4096, 17]
    b, t, hq, hkv = len(lens), max(lens), 32, 8
    kv = contiguous(b, hkv, t, lens, padded=False, gen=gen)
    ref, got = code_rows(kv, path="torch"), code_rows(kv, path="triton")
    same = (ref.rows[:-1] == got.rows[:-1]).all(-1).float().mean().item()  # the last: scratch
    q = torch.randn(b, hq, D, generator=gen, device=DEV).to(DTYPE)
    active = torch.rand(b, hkv, generator=gen, device=DEV) < 0.5
    os.environ["PRHS_KERNELS"] = "torch"
    want = retrieval_probs(q, kv, SCALING, active, codes=ref)
    del os.environ["PRHS_KERNELS"]
    have = retrieval_probs(q, kv, SCALING, active, codes=ref)
    rel = ((have - want).norm() / want.norm()).item()
    m, r, n_slots = 64, 128, b
    perms = [torch.randperm(2000, generator=gen, device=DEV)[: m + r] for _ in range(b * hkv)]
    pools = torch.stack(perms).view(n_slots, hkv, m + r).int()
    alen = torch.full((n_slots, hkv), 10, dtype=torch.int32, device=DEV)
    slots = torch.arange(b, device=DEV)
    lists = []
    for path in ("torch", "triton"):
        idx, nxt = pools[..., :m].clone(), pools[..., m:].clone()
        cnt = torch.full((n_slots, hkv), m, dtype=torch.int32, device=DEV)
        cis_rescore(q, kv, SCALING, active, alen, idx, cnt, nxt, slots, block_size=1, n_sink=4,
                    n_local=32, hold_local=True, codes=ref, path=path)  # fmt: skip
        lists.append(idx)
    rows_same = (lists[0] == lists[1]).all(-1).float().mean().item()
    sets = [torch.sort(x, -1).values for x in lists]
    set_same = (sets[0] == sets[1]).all(-1).float().mean().item()
    emit(out, {"part": "check", "op": "key codes", "code_rows_equal": same,
               "retrieval_probs_rel_err": rel, "rescore_lists_equal": rows_same,
               "rescore_sets_equal": set_same})  # fmt: skip


def tune_codes(out: Any, b: int, t: int, hkv: int) -> None:
    """The retrieval's logits pass reading code rows (``retrieval_probs`` with ``codes``; a
    quarter of the rows retrieving): its launch parameters swept, and the same pass on the keys
    for comparison."""
    from prhs_kernels.keycodes import code_bytes
    from prhs_kernels.score import retrieval_probs
    from prhs_kernels.score import triton as sc_triton

    gen = torch.Generator(device=DEV).manual_seed(9)
    hq = 32
    kv = contiguous(b, hkv, t, [t] * b, padded=False, gen=gen)
    codes = code_rows(kv, path="triton")
    q = torch.randn(b, hq, D, generator=gen, device=DEV).to(DTYPE)
    n_act = max(1, round(0.24 * b * hkv))
    active = torch.zeros(b * hkv, dtype=torch.bool, device=DEV)
    active[:n_act] = True
    active = active[torch.randperm(b * hkv, generator=gen, device=DEV)].view(b, hkv)
    probs = torch.empty(b, hkv, t, device=DEV)
    saved = dict(sc_triton.TUNING)
    grid = [("codes", 512, 64, 8, 4, 3), ("codes", 512, 128, 8, 4, 3),
            ("codes", 1024, 128, 8, 4, 3), ("codes", 2048, 128, 8, 4, 3),
            ("codes", 1024, 128, 16, 4, 3), ("codes", 2048, 256, 8, 8, 3),
            ("keys", 512, 64, 8, 4, 3), ("keys", 1024, 128, 8, 4, 3)]  # fmt: skip
    for what, span, block_t, pps, warps, stages in grid:
        sc_triton.TUNING.update(span=span, block_t=block_t, programs_per_sm=pps,
                                num_warps=warps, num_stages=stages)  # fmt: skip
        c = codes if what == "codes" else None
        try:
            ms = graph_ms(lambda c=c: retrieval_probs(q, kv, SCALING, active, out=probs,
                                                      codes=c))  # fmt: skip
            per_key = code_bytes(D) if c is not None else D * 2
            r = {"ms": ms, "read TB/s": n_act * t * per_key / ms / 1e9}
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"[:200]}
        emit(out, {"part": "tune-codes", "B": b, "T": t, "Hkv": hkv, "read": what,
                   "active": n_act, **sc_triton.TUNING, **r})  # fmt: skip
    sc_triton.TUNING.clear()
    sc_triton.TUNING.update(saved)
    tune_rescore_codes(out, kv, codes, q, gen)


def tune_rescore_codes(out: Any, kv: Any, codes: Any, q: torch.Tensor, gen: Any) -> None:
    """A reuse's re-ranking (``cis_rescore``, budget 1024, a pool of 3072, three quarters of
    the rows reusing) from code rows and from the keys, over its tile and programs."""
    from prhs_kernels.cis import cis_rescore
    from prhs_kernels.cis import triton as cis_triton

    b, hkv, t, _ = kv.k.shape
    m, r = 1024, 2048
    perms = [torch.randperm(t - 64, generator=gen, device=DEV)[: m + r] for _ in range(b * hkv)]
    pools = torch.stack(perms).view(b, hkv, m + r).int()
    alen = torch.full((b, hkv), t - 8, dtype=torch.int32, device=DEV)
    slots = torch.arange(b, device=DEV)
    reuse = torch.rand(b, hkv, generator=gen, device=DEV) < 0.76
    saved = dict(cis_triton.TUNING)
    for what, tile, pps, stages in (("codes", 64, 8, 4), ("codes", 128, 8, 4),
                                    ("codes", 256, 8, 4), ("codes", 128, 8, 3),
                                    ("codes", 256, 8, 3), ("codes", 256, 4, 4),
                                    ("keys", 64, 8, 4), ("keys", 64, 8, 3)):  # fmt: skip
        key = "rescore_tile_codes" if what == "codes" else "rescore_tile"
        cis_triton.TUNING.update({key: tile, "rescore_programs_per_sm": pps,
                                  "rescore_stages": stages})  # fmt: skip
        c = codes if what == "codes" else None
        idx, nxt = pools[..., :m].clone(), pools[..., m:].clone()
        cnt = torch.full((b, hkv), m, dtype=torch.int32, device=DEV)

        def run(c: Any = c, idx: Any = idx, cnt: Any = cnt, nxt: Any = nxt) -> None:
            cis_rescore(q, kv, SCALING, reuse, alen, idx, cnt, nxt, slots, block_size=1,
                        n_sink=4, n_local=32, hold_local=True, codes=c, path="triton")  # fmt: skip

        try:
            r_ = {"ms": graph_ms(run)}
        except Exception as e:
            r_ = {"error": f"{type(e).__name__}: {e}"[:200]}
        emit(out, {"part": "tune-codes", "op": "rescore", "B": b, "T": t, "read": what,
                   "tile": tile, "programs_per_sm": pps, "stages": stages, **r_})  # fmt: skip
    cis_triton.TUNING.clear()
    cis_triton.TUNING.update(saved)


def check_selector_paths(out: Any, name: str, options: dict[str, Any]) -> None:
    """A selector's Triton step against its torch path on the same decode trace: the share of
    (step, layer, row, KV head) selections that are equal as sets, of equal retrieval decisions,
    and the attention outputs."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_step as ds

    from prhs_kernels import sparse_decode_attention, token_locations

    ds.HKV, ds.DEV = 8, DEV
    steps, layers = 12, 2
    lens = [3000, 5000, 777, 4096]
    runs = []
    for path in ("torch", "auto"):
        os.environ["PRHS_KERNELS"] = path
        w = ds.Workload(len(lens), lens, layers=layers, steps=steps, drift=0.03, seed=21)
        st = ds.NewStep(name, options, w, w.batch, stats=True)
        masks, outs, retrieved = [], [], []
        for t in range(steps):
            st.load(t)
            plan = st.plan
            pos = plan.seq_lens.long() - 1
            for layer in range(layers):
                w.k[layer][st.rows, :, pos] = st.nk[layer]
                w.v[layer][st.rows, :, pos] = st.nv[layer]
                kv = st._contiguous(w.k[layer], w.v[layer], plan.seq_lens)
                loc = token_locations(kv, pos.view(-1, 1), st.state.row_stride).view(-1)
                st.sel.write_kv(st.state, layer, loc, st.nk[layer], st.nv[layer])
                sel = st.sel.select(plan, layer, st.q[layer], kv, st.state)
                masks.append(sel.to_mask(plan.seq_lens, kv.max_len).clone())
                retrieved.append(plan.stats.retrieved.clone())
                o, _ = sparse_decode_attention(st.q[layer], kv, sel, plan.scaling)
                outs.append(o.float())
        runs.append((masks, outs, retrieved, st.sel.kernel_path(DEV, DTYPE)))
        del os.environ["PRHS_KERNELS"]
    (m0, o0, r0, p0), (m1, o1, r1, p1) = runs
    same = torch.stack([(a == b).all(-1) for a, b in zip(m0, m1, strict=True)]).float().mean()
    # Near-ties of scores computed in another order can swap a few positions at the budget's
    # edge: the share of positions both paths read (|A ∩ B| / |A ∪ B|, per row, mean).
    jac = torch.stack(
        [(a & b).sum(-1) / (a | b).sum(-1).clamp(min=1) for a, b in zip(m0, m1, strict=True)]
    ).float().mean()
    same_dec = torch.stack([a == b for a, b in zip(r0, r1, strict=True)]).float().mean()
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(o1, o0, strict=True))
    emit(
        out,
        {
            "part": "check",
            "op": f"{name} step: Triton vs torch path",
            "options": options,
            "paths": [p0, p1],
            "steps": steps,
            "layers": layers,
            "equal_selections": same.item(),
            "mean_jaccard": jac.item(),
            "equal_decisions": same_dec.item(),
            "retrieval_ratio": torch.stack(r1).float().mean().item(),
            "max_out_rel_diff": err,
        },
    )


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write)."""
    n = 1 << 31
    x = torch.empty(n, dtype=torch.int16, device=DEV).random_()
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * (1 << 32) / (ms * 1e-3)


def dense_variants(q: torch.Tensor, kv: Any) -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from prhs_kernels import sparse_decode_attention

    q4 = q.unsqueeze(2)
    fns: dict[str, Any] = {}
    for name, backend in (
        ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def fn(backend: Any = backend) -> Any:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, kv.k, kv.v, enable_gqa=True)

        fns[name] = fn
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=DEV)
    fns["prhs-triton-dense"] = lambda: sparse_decode_attention(q, kv, None, SCALING, out=o, lse=lse)
    return fns


_FLEX: list[Any] = []


def _compiled_flex(fn: Any) -> Any:
    """One compiled FlexAttention for every shape (it recompiles per shape as it needs)."""
    if not _FLEX:
        _FLEX.append(torch.compile(fn))
    return _FLEX[0]


def flex_fn(q: torch.Tensor, kv: Any, hq: int, n_blocks: int, gen: Any) -> Any:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, hkv, t, _ = kv.k.shape
    nb = t // 128
    keys = torch.rand(b, hkv, nb, generator=gen, device=DEV)
    # Every block id in each row, the selected ones first (in order): FlexAttention's layout.
    order = keys.argsort(dim=-1, descending=True)
    n = min(n_blocks, nb)
    order[..., :n] = order[..., :n].sort(-1).values
    g = hq // hkv
    idx = order.to(torch.int32).repeat_interleave(g, dim=1).unsqueeze(2).contiguous()
    num = torch.full((b, hq, 1), n, dtype=torch.int32, device=DEV)
    mask = BlockMask.from_kv_blocks(
        num, idx, BLOCK_SIZE=(128, 128), seq_lengths=(1, t), compute_q_blocks=False
    )
    flex = _compiled_flex(flex_attention)
    q4 = q.unsqueeze(2)
    return lambda: flex(q4, kv.k, kv.v, block_mask=mask, enable_gqa=True, scale=SCALING)


def bench(
    out: Any,
    shapes: list[tuple[int, int, int]],
    budget: int,
    real_rho: float,
    step_shapes: set[tuple[int, int, int]],
    rhos: list[float | None] | None = None,
    dense_only: bool = False,
    quest: bool = True,
) -> None:
    import decode_step as ds  # on sys.path: main() put this folder there

    bw = copy_bandwidth()
    emit(out, {"part": "bench", "op": "copy", "TB/s": bw / 1e12})
    gen = torch.Generator(device=DEV).manual_seed(1)
    hq = 32
    for b, t, hkv in shapes:
        shape = {"B": b, "T": t, "Hq": hq, "Hkv": hkv}
        rows = kernel_rows(
            b, t, hq, hkv, budget, gen, flex=(b, t, hkv) in step_shapes, dense_only=dense_only
        )
        best_row = min(
            (r for r in rows if "ms" in r and r["op"].startswith("dense")), key=lambda r: r["ms"]
        )
        best = best_row["ms"]
        for r in rows:
            if "ms" in r:
                r["vs_best_dense"] = best / r["ms"]
            emit(out, {"part": "bench", **shape, "best_dense": best_row["op"], **r})
        torch.cuda.empty_cache()
        if (b, t, hkv) not in step_shapes:
            continue
        cis_rhos = [None, 0.05, 0.10, 0.20] if rhos is None else rhos
        runs = (("quest", [None]),) if quest else ()
        for name, name_rhos in (*runs, ("cis", [*cis_rhos, real_rho])):
            for rho in name_rhos:
                try:
                    r = step_bench(name, b, t, hkv, budget, rho, bw)
                except Exception as e:
                    r = {"error": f"{type(e).__name__}: {e}"[:400]}
                if "ms" in r:
                    r["vs_best_dense"] = best / r["ms"]
                opts = ds.CIS_OPTIONS if name == "cis" else {}
                emit(out, {"part": "bench", **shape, "op": f"{name} step", "rho": rho,
                           "jump_cos": ds.JUMP_COS, "options": opts, **r})  # fmt: skip
                torch.cuda.empty_cache()


def kernel_rows(
    b: int, t: int, hq: int, hkv: int, budget: int, gen: Any, flex: bool, dense_only: bool = False
) -> list[dict[str, Any]]:
    """The kernel-level rows of one shape: dense variants, sparse kernel, FlexAttention,
    retrieval (``dense_only``: the dense variants alone, the baseline of the step rows)."""
    from prhs_kernels.score import retrieval_probs
    from prhs_kernels.sparse_decode import sparse_decode_attention

    lens = [t] * b
    kv = contiguous(b, hkv, t, lens, padded=False, gen=gen)
    q = torch.randn(b, hq, D, generator=gen, device=DEV).to(DTYPE)
    kv_row = D * 2 * 2  # bytes of one K and V row
    dense_bytes = b * hkv * t * kv_row
    rows: list[dict[str, Any]] = []

    def row(op: str, fn: Any, nbytes: float) -> None:
        """``ms``: replayed from a CUDA graph (as a serving step runs); ``eager_ms``: launched
        from Python each time (host cost included)."""
        try:
            fn()
            eager = bench_ms(fn)
            ms = graph_ms(fn)
            r = {"op": op, "ms": ms, "eager_ms": eager, "bytes": nbytes, "TB/s": nbytes / ms / 1e9}
            rows.append(r)
        except Exception as e:  # reported: every variant gets its row
            rows.append({"op": op, "error": f"{type(e).__name__}: {e}"[:300]})

    for name, fn in dense_variants(q, kv).items():
        row(f"dense {name}", fn, dense_bytes)
    if dense_only:
        return rows
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, device=DEV)
    sel_bytes = b * hkv * budget * kv_row
    for s, label in ((8, "1024 = 128 blocks of 8"), (1, "1024 single positions")):
        sels = [block_selection(b, hkv, lens, budget // s, s, gen) for _ in range(BACK_TO_BACK)]
        row(
            f"sparse kernel ({label})",
            lambda sel=sels[0]: sparse_decode_attention(q, kv, sel, SCALING, out=o, lse=lse),
            sel_bytes,
        )
        if "ms" in rows[-1]:

            def burst(sels: list[Any] = sels) -> None:
                for one in sels:
                    sparse_decode_attention(q, kv, one, SCALING, out=o, lse=lse)

            b2b = graph_ms(burst) / BACK_TO_BACK
            rows[-1].update(b2b_ms=b2b, **{"b2b_TB/s": sel_bytes / b2b / 1e9})
    if flex and t % 128 == 0:
        try:
            row(
                "FlexAttention BlockMask (8 x 128)",
                flex_fn(q, kv, hq, budget // 128, gen),
                sel_bytes,
            )
        except Exception as e:
            rows.append({"op": "FlexAttention BlockMask (8 x 128)", "error": str(e)[:300]})
    probs = torch.empty(b, hkv, t, device=DEV)
    g = hq // hkv
    for frac in (1.0, 0.1):
        n_act = max(1, round(frac * b * hkv))
        active = torch.zeros(b * hkv, dtype=torch.bool, device=DEV)
        active[:n_act] = True
        active = active[torch.randperm(b * hkv, generator=gen, device=DEV)].view(b, hkv)
        nbytes = n_act * t * D * 2 + n_act * t * 4 * (2 * g + 1)
        row(
            f"retrieval ({frac:.0%} of rows)",
            lambda active=active: retrieval_probs(q, kv, SCALING, active, out=probs),
            nbytes,
        )
    return rows


def tune(out: Any, b: int, t: int, hkv: int, budget: int) -> None:
    """The sparse kernel's launch parameters at one shape (graph-replayed ms of each)."""
    from prhs_kernels.sparse_decode import sparse_decode_attention
    from prhs_kernels.sparse_decode import triton as sd_triton

    gen = torch.Generator(device=DEV).manual_seed(3)
    hq = 32
    lens = [t] * b
    kv = contiguous(b, hkv, t, lens, padded=False, gen=gen)
    q = torch.randn(b, hq, D, generator=gen, device=DEV).to(DTYPE)
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, device=DEV)
    saved = dict(sd_triton.TUNING)
    nbytes = b * hkv * budget * D * 4
    for s in (8,):
        sel = block_selection(b, hkv, lens, budget // s, s, gen)
        for block_n, warps, stages, waves in (
            (64, 4, 2, 4), (16, 2, 2, 8), (32, 2, 2, 16), (64, 2, 2, 8), (32, 4, 2, 16),
            (16, 4, 2, 16), (64, 8, 2, 4),
        ):  # fmt: skip
            sd_triton.TUNING.update(
                block_n=block_n, num_warps=warps, num_stages=stages, waves=waves
            )
            try:
                ms = graph_ms(
                    lambda sel=sel: sparse_decode_attention(q, kv, sel, SCALING, out=o, lse=lse)
                )
                r = {"ms": ms, "TB/s": nbytes / ms / 1e9}
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"[:200]}
            emit(out, {"part": "tune", "B": b, "T": t, "Hkv": hkv, "s": s, **sd_triton.TUNING, **r})
    sd_triton.TUNING.clear()
    sd_triton.TUNING.update(saved)
    if b > 1:
        tune_retrieval(out, kv, q, b, t, hkv, gen)


def tune_retrieval(out: Any, kv: Any, q: torch.Tensor, b: int, t: int, hkv: int, gen: Any) -> None:
    """The retrieval's launch parameters (graph-replayed ms), every row and 10 % retrieving."""
    from prhs_kernels.score import retrieval_probs
    from prhs_kernels.score import triton as sc_triton

    saved = dict(sc_triton.TUNING)
    probs = torch.empty(b, hkv, t, device=DEV)
    for frac in (1.0, 0.1):
        n_act = max(1, round(frac * b * hkv))
        active = torch.zeros(b * hkv, dtype=torch.bool, device=DEV)
        active[:n_act] = True
        active = active[torch.randperm(b * hkv, generator=gen, device=DEV)].view(b, hkv)
        nbytes = n_act * t * D * 2
        for span, block_t, pps, warps, stages in (
            (1024, 64, 4, 4, 3), (256, 64, 4, 4, 3), (512, 64, 8, 4, 3), (256, 64, 8, 4, 3),
            (1024, 128, 4, 8, 3), (512, 128, 8, 8, 3), (256, 64, 16, 4, 2), (1024, 64, 8, 4, 4),
            (256, 128, 8, 4, 3), (2048, 64, 4, 4, 3),
        ):  # fmt: skip
            sc_triton.TUNING.update(
                span=span, block_t=block_t, programs_per_sm=pps, num_warps=warps, num_stages=stages
            )
            try:
                ms = graph_ms(
                    lambda active=active: retrieval_probs(q, kv, SCALING, active, out=probs)
                )
                r = {"ms": ms, "K TB/s": nbytes / ms / 1e9}
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"[:200]}
            emit(out, {"part": "tune-retrieval", "B": b, "T": t, "Hkv": hkv, "active": frac,
                       **sc_triton.TUNING, **r})  # fmt: skip
    sc_triton.TUNING.clear()
    sc_triton.TUNING.update(saved)


def step_bench(
    name: str, b: int, t: int, hkv: int, budget: int, rho: float | None, bw: float
) -> dict[str, Any]:
    """One selector's whole step (K/V + side-cache write, select, attend) over a 32-step trace
    of ``STEP_LAYERS`` layers, replayed from a CUDA graph; ms per layer. ``rho``: the fraction
    of (sequence, KV head) query groups that jump to a fresh query each step (the others keep
    theirs, so CIS reuses); ``None``: queries drift slowly."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_step as ds

    ds.HKV, ds.DEV = hkv, DEV
    steps = 32
    lens = [t - steps - 8] * b
    layers = STEP_LAYERS
    w = ds.Workload(b, lens, layers=layers, steps=steps, drift=0.02, seed=11)
    if rho is not None:
        ds.force_jumps(w, rho)
    opts = ds.selector_options(name, budget)
    if name == "quest":
        opts["dense_layers"] = 0
    r = ds.bench_new(name, w, steps, 5, budget, opts)
    sel_bytes = r["avg_selected"] * b * hkv * D * 4 if r.get("avg_selected") else math.nan
    ret = (r.get("retrieval_ratio") or 0.0) / 100 * b * hkv * t * D * 2
    floor_ms = (sel_bytes + ret) / bw * 1e3
    return {
        **r,
        "rho_measured": r.get("retrieval_ratio"),
        "floor_ms": floor_ms,
        "vs_floor": r["ms"] / floor_ms if floor_ms == floor_ms else None,
    }


def ranking(out: Any) -> None:
    """The ``ranking`` part (module docstring): µs per call, graph-replayed."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from prhs_kernels.cis import retrieval_pool
    from prhs_kernels.cis import triton as cis_triton
    from prhs_kernels.topk import triton as topk_triton

    gen = torch.Generator(device=DEV).manual_seed(3)
    m, r, h = 1024, 2048, 8

    def scores(b: int, n: int, kind: str) -> torch.Tensor:
        x = torch.rand(b, h, n, generator=gen, device=DEV)
        if kind == "lognormal":
            x = torch.exp(2 * torch.randn(b, h, n, generator=gen, device=DEV))
        x[..., :4] = float("-inf")  # the sink, as block scores have it
        return x

    for kind in ("uniform", "lognormal"):
        for b, n in ((1, 16384), (16, 16384), (16, 65536)):
            x = scores(b, n, kind)
            retrieve = torch.rand(b, h, generator=gen, device=DEV) < 0.25
            retrieve[0, 0] = True
            slots = torch.arange(b, device=DEV, dtype=torch.int32)
            near = x * (1 + 0.05 * torch.rand(b, h, n, generator=gen, device=DEV))
            seed = torch.topk(near, m + r, dim=-1).indices.to(torch.int32)
            a_idx, a_next = seed[..., :m].contiguous(), seed[..., m:].contiguous()

            def pool(x=x, retrieve=retrieve, a_next=a_next, slots=slots, a_idx=a_idx):
                retrieval_pool(x, m, r, retrieve, a_next, slots, anchor_idx=a_idx, path="triton")

            pool()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    pool()
                torch.cuda.synchronize()
            kernels = {
                e.key[:40]: round(e.device_time_total / 20, 2)
                for e in prof.key_averages()
                if e.device_time_total > 0
            }
            emit(out, {"part": "ranking", "op": "retrieval_pool", "scores": kind, "B": b,
                       "n": n, "rows": int(retrieve.sum()), "us": 1e3 * graph_ms(pool),
                       "eager_kernels_us": kernels})  # fmt: skip
            p_scores = scores(b, m + r, kind)
            reuse = ~retrieve
            cnt = torch.full((b, h), m, dtype=torch.int32, device=DEV)

            def rescore(p_scores=p_scores, reuse=reuse, cnt=cnt, a_idx=a_idx, a_next=a_next,
                        slots=slots):  # fmt: skip
                cis_triton.rescore_rank_write_triton(p_scores, reuse, a_idx, cnt, a_next, slots)

            us = 1e3 * graph_ms(rescore)
            emit(out, {"part": "ranking", "op": "rescore_rank_write", "scores": kind, "B": b,
                       "pool": m + r, "rows": int(reuse.sum()), "us": us})  # fmt: skip
    for rows, n, k in ((128, 16384, 1024), (8, 16384, 1024), (128, 4096, 64)):
        x = torch.rand(rows, n, generator=gen, device=DEV)
        us = 1e3 * graph_ms(lambda x=x, k=k: topk_triton.topk_indices_triton(x, k))
        emit(out, {"part": "ranking", "op": "topk_indices", "rows": rows, "n": n, "k": k,
                   "us": us})  # fmt: skip


def table(paths: list[str]) -> None:
    """A markdown table of ``bench`` rows (and a summary of ``check`` rows) from JSONL files."""
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    checks = [r for r in rows if r.get("part") == "check"]
    if checks:
        worst_attn = max(
            (r["out_rel_err"] for r in checks if r.get("op") == "sparse_decode_attention"),
            default=None,
        )
        worst_ret = max(
            (r["rel_err"] for r in checks if r.get("op") == "retrieval_probs"), default=None
        )
        bad = [
            r
            for r in checks
            if r.get("all_written") is False
            or r.get("lse_inf_equal") is False
            or r.get("inactive_zero") is False
        ]
        print(
            f"check: {len(checks)} cases; worst attention rel err {worst_attn}; "
            f"worst retrieval rel err {worst_ret}; cases with unwritten/inf mismatch: {len(bad)}"
        )
    for r in rows:
        if r.get("part") == "tune-retrieval":
            print(
                "tune-retrieval",
                {
                    k: r.get(k)
                    for k in (
                        "B",
                        "T",
                        "Hkv",
                        "active",
                        "span",
                        "block_t",
                        "programs_per_sm",
                        "num_warps",
                        "num_stages",
                        "ms",
                        "K TB/s",
                    )
                },
            )
        if r.get("part") == "tune-codes" or r.get("op") == "key codes":
            print(r.get("part"), {k: v for k, v in r.items() if k not in ("part",)})
        if r.get("part") == "tune":
            print(
                "tune",
                {
                    k: r.get(k)
                    for k in (
                        "B",
                        "T",
                        "Hkv",
                        "s",
                        "block_n",
                        "num_warps",
                        "num_stages",
                        "waves",
                        "ms",
                        "TB/s",
                        "error",
                    )
                },
            )
    print("| B | T | Hq/Hkv | op | ms | TB/s | x best dense | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("part") != "bench" or "B" not in r:
            if r.get("op") == "copy":
                print(f"copy bandwidth: {r['TB/s']:.2f} TB/s")
            continue
        note = r.get("error", "")
        if r.get("rho_measured") is not None:
            note = (
                f"rho {r.get('rho')} (jump cos {r.get('jump_cos', 0.0)}) measured "
                f"{r['rho_measured']:.1f} %, floor "
                f"{r['floor_ms']:.4f} ms (x{r['vs_floor']:.2f}), eager {r['eager_ms']:.3f}"
            )
            if r.get("gpu_busy") is not None:
                note += f", GPU busy {100 * r['gpu_busy']:.0f} %"
        if r.get("b2b_ms") is not None:
            note = f"back to back {r['b2b_ms']:.4f} ms ({r['b2b_TB/s']:.2f} TB/s)"
        ms = f"{r['ms']:.4f}" if "ms" in r else "-"
        tbs = f"{r['TB/s']:.2f}" if "TB/s" in r else "-"
        vs = f"{r['vs_best_dense']:.2f}" if "vs_best_dense" in r else "-"
        print(
            f"| {r['B']} | {r['T']} | {r['Hq']}/{r['Hkv']} | {r['op']} | {ms} | {tbs} | {vs} "
            f"| {note} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "part",
        choices=["check", "check-proxies", "bench", "ranking", "tune", "tune-codes", "table"],
    )
    p.add_argument("files", nargs="*", help="table: JSONL files")
    p.add_argument("--out", default=None)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--lengths", default="2,16,64", help="T in units of 1024")
    p.add_argument("--kv-heads", default="32,8")
    p.add_argument(
        "--real-rho",
        type=float,
        default=0.29,
        help="ρ̂ of a real model run (CIS's default tau='auto' on SmolLM2 and Qwen2.5 at 4k: "
        "29-31 %%, benchmarks/results/2026-11-30-tau-auto)",
    )
    p.add_argument(
        "--rhos",
        default=None,
        help="bench: the forced retrieval ratios of CIS's step rows besides --real-rho, comma "
        "separated ('drift': queries drift slowly, none forced; '' for none; default "
        "drift,0.05,0.1,0.2)",
    )
    p.add_argument(
        "--jump-cos",
        type=float,
        default=0.0,
        help="bench: cosine of a forced jump's query with the one it leaves (0: a fresh query; "
        "decode_step.JUMP_COS)",
    )
    p.add_argument(
        "--dense-only",
        action="store_true",
        help="bench: of the kernel rows, the dense ones only (the step rows' baseline)",
    )
    p.add_argument("--no-quest", action="store_true", help="bench: no step rows of Quest")
    p.add_argument(
        "--check-selectors",
        default=None,
        help="check: only these selectors' Triton-vs-torch step checks (comma separated names "
        "of the check list: cis, cis-1, cis-exact, cis-exact-8, quest, double_sparsity, rabitq, "
        "compkv, louver), then the kernel checks",
    )
    p.add_argument(
        "--cis",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="bench: a CIS option for the whole-step rows, e.g. block_size=1 (repeatable)",
    )
    p.add_argument(
        "--step-shapes",
        default="1x16x8,16x16x8,16x64x8",
        help="BxTkxHkv shapes that also get FlexAttention and the whole-step (graph) rows",
    )
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_step as ds

    ds.parse_cis_options(a.cis)
    ds.JUMP_COS = a.jump_cos
    if a.part == "table":
        table(a.files)
        return 0
    out = open(a.out, "a") if a.out else None
    emit(out, {"part": "machine", **machine()})
    if a.part == "check":
        checks = {
            "cis": ("cis", {"budget": 256, "block_size": 8}),
            "cis-1": ("cis", {"budget": 256, "block_size": 1}),
            "cis-exact": ("cis", {"budget": 256, "block_size": 1, "scorer": "exact"}),
            "cis-exact-8": ("cis", {"budget": 256, "block_size": 8, "scorer": "exact"}),
            "quest": ("quest", {"budget": 256, "dense_layers": 0}),
            "double_sparsity": ("double_sparsity", {"budget": 256, "channels": ds.label_table(2)}),
            "rabitq": ("rabitq", {"budget": 256, "dense_layers": 0}),
            "compkv": ("compkv", {"budget": 256}),
            "louver": ("louver", {"budget": 1024}),
        }
        only = a.check_selectors.split(",") if a.check_selectors else list(checks)
        unknown = sorted(set(only) - set(checks))
        if unknown:
            p.error(f"--check-selectors: unknown {unknown}; known: {sorted(checks)}")
        if a.check_selectors is None:
            check_topk(out)
            check_topk_indices(out)
        for key in only:
            check_selector_paths(out, *checks[key])
        if a.check_selectors is None or "louver" in only:
            check_louver_index(out)
        check_retrieval_pool(out)
        check_codes(out)
        check(out)
    elif a.part == "check-proxies":
        for name in ("double_sparsity", "hshare"):
            check_selector_paths(out, name, {"budget": 256, "channels": ds.label_table(2)})
        check_selector_paths(out, "double_sparsity", {"budget": 256})
        check_selector_paths(out, "rabitq", {"budget": 256, "dense_layers": 0})
        check_selector_paths(out, "compkv", {"budget": 256})
        check_selector_paths(out, "louver", {"budget": 1024})
        check_louver_index(out)
        check(out, ("labels", "rabitq"))
    elif a.part == "ranking":
        ranking(out)
    elif a.part == "tune-codes":
        for item in a.step_shapes.split(","):
            b, t, h = item.split("x")
            tune_codes(out, int(b), int(t) * 1024, int(h))
    elif a.part == "tune":
        for item in a.step_shapes.split(","):
            b, t, h = item.split("x")
            tune(out, int(b), int(t) * 1024, int(h), a.budget)
    else:
        shapes = [
            (int(b), int(t) * 1024, int(h))
            for h in a.kv_heads.split(",")
            for b in a.batches.split(",")
            for t in a.lengths.split(",")
        ]
        step_shapes = set()
        for item in a.step_shapes.split(","):
            b, t, h = item.split("x")
            step_shapes.add((int(b), int(t) * 1024, int(h)))
        rhos = None
        if a.rhos is not None:
            rhos = [None if x == "drift" else float(x) for x in a.rhos.split(",") if x]
        bench(out, shapes, a.budget, a.real_rho, step_shapes, rhos, a.dense_only, not a.no_quest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
