"""PSAW prefill attention on a GPU: the Triton kernel against the float32 reference at a real
size, then its time against SDPA (flash, causal) and SDPA with PSAW's boolean mask.

Usage (packages' ``src`` on ``PYTHONPATH``): ``python benchmarks/scripts/psaw_prefill.py``.
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

from prhs_core.protocols import PrefillLayerPlan
from prhs_kernels.prefill import psaw_prefill_attention, psaw_prefill_attention_reference


def main() -> int:
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    # Correctness: B 2, Hq 32 / Hkv 8, 3000 rows (left padding of 100 on row 1), and a chunk.
    for b, tq, tk, f, ns, pad in ((2, 3000, 3000, 0.5, 4, 100), (1, 1000, 4000, 0.8, 4, 0)):
        q = torch.randn(b, 32, tq, 128, generator=g, device=dev).to(dt)
        k = torch.randn(b, 8, tk, 128, generator=g, device=dev).to(dt)
        v = torch.randn(b, 8, tk, 128, generator=g, device=dev).to(dt)
        start = torch.tensor([0, pad][:b], dtype=torch.int32, device=dev) if pad else None
        out, lse = psaw_prefill_attention(q, k, v, window_fraction=f, n_sink=ns, scaling=128**-0.5,
                                          start=start)  # fmt: skip
        ro, rl = psaw_prefill_attention_reference(q, k, v, start, f, ns, 128**-0.5)
        err = ((out.float() - ro.float()).norm() / ro.float().norm()).item()
        fin = torch.isfinite(rl)
        rows.append({"check": [b, tq, tk, f, ns, pad], "out_rel_err": err,
                     "lse_max_abs_err": (lse - rl)[fin].abs().max().item(),
                     "inf_equal": bool(torch.equal(fin, torch.isfinite(lse)))})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del ro, rl
        torch.cuda.empty_cache()
    # Timing: B 1, T 16k, Hq 32 / Hkv 8, f in {0 (causal), 0.5, 0.9}, 4 sinks.
    t = 16384
    q = torch.randn(1, 32, t, 128, generator=g, device=dev).to(dt)
    k = torch.randn(1, 8, t, 128, generator=g, device=dev).to(dt)
    v = torch.randn(1, 8, t, 128, generator=g, device=dev).to(dt)
    F = torch.nn.functional
    causal = triton.testing.do_bench(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        return_mode="median",
    )
    rows.append({"op": "sdpa causal (flash)", "T": t, "ms": causal})
    print(json.dumps(rows[-1]), flush=True)
    for f in (0.0, 0.5, 0.9):
        ms = triton.testing.do_bench(
            lambda f=f: psaw_prefill_attention(
                q, k, v, window_fraction=f, n_sink=4, scaling=128**-0.5
            ),
            return_mode="median",
        )
        mask = PrefillLayerPlan(0, window_fraction=f, n_sink=4).attention_mask(t, dev)
        masked = triton.testing.do_bench(
            lambda mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True
            ),
            return_mode="median",
        )
        kept = mask.float().mean().item()
        rows.append({"op": "psaw", "T": t, "f": f, "ms": ms, "sdpa_masked_ms": masked,
                     "kept_fraction_of_square": kept, "vs_causal_flash": causal / ms})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
