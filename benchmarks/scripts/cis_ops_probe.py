"""Where a CIS step's retrieval time goes on a GPU: each op of a paper-mode retrieval, timed
alone (CUDA-graph replay, median of ``triton.testing.do_bench``) with a share of the rows
retrieving, and the top-k kernel at several warp counts. A benchmark: prints JSON lines.

    python benchmarks/scripts/cis_ops_probe.py --shapes 16x16,16x64,16x64+32 --active 0.1,0.03
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as kb

HQ, D, S, M = 32, 128, 8, 128


def probe(kv: Any, q: torch.Tensor, act: torch.Tensor) -> dict[str, Any]:
    from prhs_kernels.cis import retrieval_block_scores, top_blocks
    from prhs_kernels.cis import triton as cis_triton
    from prhs_kernels.score import triton as sc_triton

    b, h = act.shape
    t = kv.max_len
    n_act = int(act.sum())
    row: dict[str, Any] = {"B": b, "T": t, "Hkv": h, "rows": n_act}

    def scores_fn() -> torch.Tensor:
        return retrieval_block_scores(
            q, kv, kb.SCALING, act, block_size=S, n_sink=4, n_local=32, path="triton"
        )

    row["logits_ms"] = kb.graph_ms(
        lambda: sc_triton.retrieval_logits_triton(q, kv, kb.SCALING, act)
    )
    saved = dict(cis_triton.TUNING)
    for items in (256, 64, 16):  # work items per row (256 to 1024 positions each)
        cis_triton.TUNING["block_scores_items_per_row"] = items
        row[f"logits+block_scores_{items}_items_ms"] = kb.graph_ms(scores_fn)
    cis_triton.TUNING.update(saved)
    row["logits+block_scores_ms"] = kb.graph_ms(scores_fn)
    scores = scores_fn()
    row["topk_ms"] = kb.graph_ms(lambda: top_blocks(scores, M, act, path="triton"))
    row["key_bytes_floor_ms"] = n_act * t * D * 2 / 4.26e12 * 1e3
    # The one-pass kernel over the whole row at several warp counts (what the two-pass launcher
    # replaces for rows of more than TOPK_ONE_PASS blocks).
    nb = scores.shape[-1]
    *_, topk = cis_triton._kernels(False)
    idx = torch.empty(b, h, M, dtype=torch.int32, device="cuda")
    val = torch.empty(b, h, M, device="cuda")
    scratch = torch.empty(b * h, M, dtype=torch.int64, device="cuda")
    block = max(16, triton.next_power_of_2(nb))
    for warps in (4, 8, 16):

        def run(warps: int = warps) -> None:
            topk[(b * h, 1)](
                scores, scores, act.view(torch.int8), idx, val, scratch, nb, M, nb, 1,
                BLOCK=block, BLOCK_K=M, HAS_IDX=False, num_warps=warps,
            )  # fmt: skip

        row[f"topk_one_pass_w{warps}_ms"] = kb.graph_ms(run)
    return row


def main(argv: list[str] | None = None) -> int:
    from prhs_core import ContiguousKV

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="16x16,16x64")
    p.add_argument("--active", default="0.1,0.03")
    p.add_argument("--hkv", type=int, default=8)
    a = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in a.shapes.split(","):
        b, t_spec = shape.split("x")  # "16x64" or "16x64+32": T = 64 * 1024 (+ 32)
        kilo, _, extra = t_spec.partition("+")
        b, t = int(b), int(kilo) * 1024 + int(extra or 0)
        k = torch.randn(b, a.hkv, t, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        kv = ContiguousKV(k, k, torch.full((b,), t, dtype=torch.int32, device="cuda"))
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for frac in (float(x) for x in a.active.split(",")):
            n_act = max(1, round(frac * b * a.hkv))
            act = torch.zeros(b * a.hkv, dtype=torch.bool, device="cuda")
            act[:n_act] = True
            act = act[torch.randperm(b * a.hkv, generator=gen, device="cuda")].view(b, a.hkv)
            row = {"active": frac, **probe(kv, q, act)}
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
            )
        del k, kv
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
