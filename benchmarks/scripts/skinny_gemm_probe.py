"""Decode-size GEMMs on the GPU: prhs's weight stream (:mod:`prhs_kernels.gemm`) against
``F.linear`` (cuBLAS) on every projection of the Llama-2-7B / Llama-3-8B decode steps.

For each shape and row count: the shipped plan, every plan of a sweep (``--sweep``: how the
shipped ones were chosen), and cuBLAS, each checked against the float32 reference and timed as a
CUDA graph of 16 calls over distinct weight copies (more bytes than L2 holds), so a figure is a
kernel's cost inside a step, not a lone launch's; TB/s on the weight's bytes.

    python benchmarks/scripts/skinny_gemm_probe.py [--sweep] --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from prhs_kernels.gemm import decode_linear_reference
from prhs_kernels.gemm.triton import decode_linear_triton, plan
from prhs_kernels.timing import median_ms

SHAPES = {  # name: (N, K)
    "llama2 o (q|k|v)": (4096, 4096),
    "llama2 qkv fused": (12288, 4096),
    "llama2 gate+up fused": (22016, 4096),
    "llama2 down": (4096, 11008),
    "llama2 lm head": (32000, 4096),
    "llama3 qkv fused": (6144, 4096),
    "llama3 gate+up fused": (28672, 4096),
    "llama3 down": (4096, 14336),
    "llama3 lm head": (128256, 4096),
}
SWEEP = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6)))
CALLS = 16


def graph_ms(fn) -> float:
    """Median ms of one call, from a CUDA graph of ``CALLS`` of them (``fn(i)``: call i)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(CALLS):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i)
    return median_ms(g.replay, warmup_ms=10, rep_ms=60) / CALLS


def measure(name, n, k, m, ws, x, y, launch):
    """One plan's row (``launch`` None: cuBLAS), or its error (a plan past shared memory)."""
    ref = decode_linear_reference(x, ws[0])
    label = "cublas" if launch is None else list(launch)

    def call(i):
        if launch is None:
            return F.linear(x, ws[i % len(ws)])
        return decode_linear_triton(x, ws[i % len(ws)], None, launch, out=y)

    try:
        got = call(0)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ms = graph_ms(call)
    except Exception as exc:  # a sweep plan that does not fit (shared memory)
        return {"shape": name, "M": m, "plan": label, "error": str(exc)[:120]}
    nbytes = n * k * 2
    return {"shape": name, "N": n, "K": k, "M": m, "plan": label, "us": ms * 1e3,
            "TBps": nbytes / (ms / 1e3) / 1e12, "rel_err": err}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="every plan of the sweep too")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}  # fmt: skip
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in map(int, a.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            shipped = measure(name, n, k, m, ws, x, y, plan(n, k)) | {"shipped": True}
            cub = measure(name, n, k, m, ws, x, y, None)
            rows += [shipped, cub]
            if a.sweep:
                rows += [measure(name, n, k, m, ws, x, y, p) for p in SWEEP]
            print(f"{name:22s} M={m:3d} cuBLAS {cub['us']:7.1f} us {cub['TBps']:5.2f} TB/s | "
                  f"prhs {shipped['plan']} {shipped['us']:7.1f} us {shipped['TBps']:5.2f} TB/s "
                  f"err {shipped['rel_err']:.1e}", flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()
        # Written after each shape: a run cut short keeps what it measured.
        (a.out / "skinny-gemm-probe.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
