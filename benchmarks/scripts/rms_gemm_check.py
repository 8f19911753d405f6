"""The decode GEMM with the input RMS norm in it (``decode_linear_rms``) on the GPU: the q|k|v
projections of the Llama shapes over a folded weight, against the float32 layer (rms_norm,
then the projection), and timed as a CUDA graph of 16 calls over distinct weights (more bytes
than L2 holds) beside the plain GEMM of the same weight and the plain GEMM after torch's norm.

    python benchmarks/scripts/rms_gemm_check.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from skinny_gemm_probe import CALLS, graph_ms  # this folder: run as a script

from prhs_kernels.gemm import decode_linear, decode_linear_rms, fold_norm_weight


def main() -> None:
    dev = torch.device("cuda")
    eps = 1e-5
    for name, n in (("llama2-7b q|k|v", 12288), ("llama3-8b q|k|v", 6144)):
        k = 4096
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(CALLS)]
        g = (1 + 0.2 * torch.randn(k, device=dev)).to(torch.bfloat16)
        folded = [fold_norm_weight(w, g) for w in ws]
        for m in (1, 8, 16):
            x = (2 * torch.randn(m, k, device=dev)).to(torch.bfloat16)
            want = F.linear(F.rms_norm(x.float(), (k,), g.float(), eps), ws[0].float())
            got = decode_linear_rms(x, folded[0], eps=eps).float()
            row = {"gemm": name, "M": m, "N": n, "K": k,
                   "rel_err": float((got - want).norm() / want.norm())}  # fmt: skip

            def rms(i, x=x, folded=folded):
                decode_linear_rms(x, folded[i], eps=eps)

            def plain(i, x=x, ws=ws):
                decode_linear(x, ws[i])

            def norm_then(i, x=x, ws=ws, g=g, k=k):
                decode_linear(F.rms_norm(x, (k,), g, eps), ws[i])

            for label, fn in (("rms", rms), ("plain", plain), ("norm_then_plain", norm_then)):
                row[f"us_{label}"] = round(graph_ms(fn) * 1e3, 2)
            print(row, flush=True)


if __name__ == "__main__":
    main()
