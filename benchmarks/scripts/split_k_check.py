"""The decode GEMM's split of K on the GPU: the o projection of the Llama shapes (it splits),
against the float32 reference and against itself unsplit (same numbers to float32 rounding),
and both timed as a CUDA graph of 16 calls over distinct weights (more bytes than L2 holds).

    python benchmarks/scripts/split_k_check.py
"""

from __future__ import annotations

import torch
from skinny_gemm_probe import CALLS, graph_ms  # this folder: run as a script

from prhs_kernels.gemm import decode_linear_reference
from prhs_kernels.gemm import triton as gt


def main() -> None:
    dev = torch.device("cuda")
    for m in (1, 8, 16):
        n, k = 4096, 4096  # the o projection of both Llama shapes
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(CALLS)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        g = torch.randn(n, device=dev, dtype=torch.bfloat16)
        row = {"M": m, "N": n, "K": k}
        outs = {}
        for split in (True, False):
            gt.TUNING["split_k"] = split
            bn, bk = gt.plan(n, k)[:2]
            row[f"splits_{split}"] = gt.split_k(-(-n // bn), k, bk, dev)
            y, hg, ps = gt.decode_linear_triton(x, ws[0], None, residual=r, norm_weight=g)
            outs[split] = (y, hg, ps)

            def call(i, x=x, ws=ws, r=r, g=g):
                gt.decode_linear_triton(x, ws[i], None, residual=r, norm_weight=g)

            ms = graph_ms(call)
            row[f"us_{split}"] = round(ms * 1e3, 2)
        gt.TUNING["split_k"] = True
        ref = decode_linear_reference(x, ws[0], None, r).float()
        row["rel_err"] = float((outs[True][0].float() - ref).norm() / ref.norm())
        row["vs_unsplit"] = max(float((a.float() - b.float()).abs().max())
                                for a, b in zip(outs[True], outs[False], strict=True))  # fmt: skip
        print(row, flush=True)


if __name__ == "__main__":
    main()
