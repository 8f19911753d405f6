"""Weight-streaming GEMMs at decode batch sizes: ``F.linear`` (cuBLAS) on the Llama-2-7B and
Llama-3-8B projection shapes, separate and fused (q/k/v, gate/up), in TB/s of weights read.

    python benchmarks/scripts/skinny_gemm_bench.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from prhs_kernels.timing import median_ms

SHAPES = {  # name: (N, K)
    "llama2 q|k|v|o": (4096, 4096),
    "llama2 qkv fused": (12288, 4096),
    "llama2 gate|up": (11008, 4096),
    "llama2 gate+up fused": (22016, 4096),
    "llama2 down": (4096, 11008),
    "llama3 q|o": (4096, 4096),
    "llama3 k|v": (1024, 4096),
    "llama3 qkv fused": (6144, 4096),
    "llama3 gate|up": (14336, 4096),
    "llama3 gate+up fused": (28672, 4096),
    "llama3 down": (4096, 14336),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in map(int, a.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = median_ms(lambda: F.linear(x, w), warmup_ms=25, rep_ms=100)
            tbps = w.numel() * 2 / (ms / 1e3) / 1e12
            rows.append({"shape": name, "N": n, "K": k, "M": m, "us": ms * 1e3, "TBps": tbps})
            print(f"{name:22s} M={m:3d}  {ms * 1e3:8.1f} us  {tbps:5.2f} TB/s")
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    (a.out / "skinny-gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
