"""Does prefetching a decode GEMM's weight into L2 during a chain of small kernels pay? (H200)

A decode step's layer runs, between its q|k|v GEMM and its o GEMM, a chain of small
latency-bound kernels (rotary, cache write, CIS's decide / logits / block scores / top-k /
compose) while the memory bus idles, then the sparse attention streams the selected K/V, then
the o GEMM streams its weight (33.5 MB at Llama shapes: L2 is 50 MB). This times that pattern as
a CUDA graph over 16 "layers" (distinct weights and K/V, more bytes than L2):

    [prefetch(W_i)] -> chain of CHAIN tiny kernels -> stream(KV_i) -> o GEMM(x, W_i)

with the prefetch off / per-line (``prefetch.global.L2``, ± ``evict_last``) / bulk
(``cp.async.bulk.prefetch.L2``, ± an ``evict_last`` policy), the K/V stream ± ``evict_first``,
and K/V sizes of a Llama-2 B8·T16k layer, a Llama-3 B16 one and none (B1-like). Also the
prefetch + chain alone (does the prefetch kernel hold the stream?).

    python benchmarks/scripts/l2_prefetch_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from prhs_kernels.gemm.triton import decode_linear_triton
from prhs_kernels.timing import median_ms

LAYERS = 16


@triton.jit
def _prefetch_lines(P, n_lines, BLOCK: tl.constexpr, PER: tl.constexpr, EVICT_LAST: tl.constexpr):
    pid = tl.program_id(0)
    for i in tl.static_range(PER):
        line = (pid * PER + i) * BLOCK + tl.arange(0, BLOCK)
        line = tl.minimum(line, n_lines - 1).to(tl.int64)
        ptr = P + line * 128
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l",
                                      [ptr], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l",
                                      [ptr], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _prefetch_bulk(P, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                   EVICT_LAST: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    c = pid * BLOCK + tl.arange(0, BLOCK)
    c = tl.minimum(c, n_chunks - 1).to(tl.int64)
    ptr = P + c * CHUNK
    size = tl.full([BLOCK], CHUNK, tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; } // $0",
            "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                                  [ptr, size], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _tiny(X, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs) + 1.0)


@triton.jit
def _stream(X, OUT, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, EVICT_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = (pid * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            x = tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(X + offs, mask=offs < n, other=0.0)
        acc += x.to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


def prefetch(w: torch.Tensor, kind: str) -> None:
    p = w.view(torch.uint8).view(-1)
    if kind.startswith("lines"):
        n_lines = p.numel() // 128
        block, per = 1024, 4
        grid = triton.cdiv(n_lines, block * per)
        _prefetch_lines[(grid,)](p, n_lines, BLOCK=block, PER=per,
                                 EVICT_LAST=kind.endswith("last"), num_warps=4)  # fmt: skip
    else:
        chunk = int(kind.split(":")[1]) if ":" in kind else 16384
        n_chunks = p.numel() // chunk
        block = 128
        grid = triton.cdiv(n_chunks, block)
        _prefetch_bulk[(grid,)](p, n_chunks, CHUNK=chunk, BLOCK=block,
                                EVICT_LAST="last" in kind, num_warps=4)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--chain", type=int, default=6)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    n = k = 4096
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(a.rows, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(a.rows, n, device="cuda", dtype=torch.bfloat16)
    tiny = torch.zeros(128, device="cuda")
    sink = torch.zeros(4096, device="cuda")
    kv_sizes = {"kv134MB": 134 << 20, "kv67MB": 67 << 20, "kv0": 0}
    kvs = {name: [torch.randn(b // 2, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
           for name, b in kv_sizes.items() if b}  # fmt: skip
    ref = x.float() @ ws[0].float().T
    got = decode_linear_triton(x, ws[0], None, out=y)[0]
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()

    def layer(i, pf, kv, evict_first, gemm=True, chain=True):
        if pf != "none":
            prefetch(ws[i], pf)
        if chain:
            for _ in range(a.chain):
                _tiny[(1,)](tiny, BLOCK=128, num_warps=1)
        if kv != "kv0":
            buf = kvs[kv][i]
            block, iters = 2048, 16
            grid = triton.cdiv(buf.numel(), block * iters)
            _stream[(grid,)](buf, sink, buf.numel(), BLOCK=block, ITERS=iters,
                             EVICT_FIRST=evict_first, num_warps=8)  # fmt: skip
        if gemm:
            decode_linear_triton(x, ws[i], None, out=y)

    def graph_us(**kw) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(LAYERS):
                layer(i, **kw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(LAYERS):
                layer(i, **kw)
        return median_ms(g.replay, warmup_ms=10, rep_ms=80) / LAYERS * 1e3

    rows = []
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "rows": a.rows, "chain": a.chain,
            "gemm_rel_err": err}  # fmt: skip
    print(meta, flush=True)
    prefetches = ["none", "lines", "lines-last", "bulk", "bulk-last", "bulk-last:65536"]
    # The parts alone.
    for pf in prefetches:
        us = graph_us(pf=pf, kv="kv0", evict_first=False, gemm=False)
        rows.append({"case": "prefetch+chain", "prefetch": pf, "us": us})
        print(f"prefetch+chain {pf:16s} {us:7.2f} us", flush=True)
    for pf in ("none", "lines-last", "bulk-last"):
        us = graph_us(pf=pf, kv="kv0", evict_first=False, chain=False)
        rows.append({"case": "prefetch+gemm", "prefetch": pf, "us": us})
        print(f"prefetch+gemm  {pf:16s} {us:7.2f} us", flush=True)
    for kv in kv_sizes:
        for ef in (False, True) if kv != "kv0" else (False,):
            us = graph_us(pf="none", kv=kv, evict_first=ef, gemm=False)
            rows.append({"case": "chain+kv", "kv": kv, "evict_first": ef, "us": us})
            print(f"chain+kv       {kv:8s} ef={ef:d}       {us:7.2f} us", flush=True)
            for pf in prefetches:
                us = graph_us(pf=pf, kv=kv, evict_first=ef)
                rows.append({"case": "layer", "prefetch": pf, "kv": kv, "evict_first": ef,
                             "us": us})  # fmt: skip
                print(f"layer {kv:8s} ef={ef:d} {pf:16s} {us:7.2f} us", flush=True)
            (a.out / "l2-prefetch-probe.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
