"""CIS's re-ranking of a reuse's pool (``prhs_kernels.cis.cis_rescore``) on a GPU: the Triton
path against the torch reference at a decode step's size (equal lists, counts and next blocks),
and both timed (CUDA-graph replay). A benchmark, not a test: nothing here asserts a speed.

Usage, from the repository root with every package's ``src`` on ``PYTHONPATH``::

    python benchmarks/scripts/rescore_probe.py --out rescore-probe.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as K


def main() -> None:
    from prhs_kernels.cis import cis_rescore

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = open(a.out, "a") if a.out else None
    K.emit(out, {"part": "machine", **K.machine(), "probe": "rescore"})
    gen = torch.Generator(device=K.DEV).manual_seed(0)
    hq = 32
    shapes = ((16, 16, 8, 1024, 2048), (16, 64, 8, 1024, 2048), (1, 16, 8, 1024, 2048),
              (16, 16, 8, 1024, 1024))  # fmt: skip
    kw = dict(block_size=1, n_sink=4, n_local=32, hold_local=True)
    for b, t_k, hkv, m, r in shapes:
        t = t_k * 1024
        kv = K.contiguous(b, hkv, t, [t] * b, padded=False, gen=gen)
        q = torch.randn(b, hq, K.D, generator=gen, device=K.DEV).to(K.DTYPE)
        n_slots = b + 1
        slots = torch.arange(b, device=K.DEV)
        reuse = torch.rand(b, hkv, generator=gen, device=K.DEV) < 0.8
        anchor_len = torch.full((n_slots, hkv), t - 16, dtype=torch.int32, device=K.DEV)
        keys = torch.rand(n_slots * hkv, t - 64, generator=gen, device=K.DEV)
        pools = keys.topk(m + r, dim=-1).indices.to(torch.int32).view(n_slots, hkv, m + r)
        res = {}
        for path in ("torch", "triton"):
            idx, nxt = pools[..., :m].clone(), pools[..., m:].clone()
            cnt = torch.full((n_slots, hkv), m, dtype=torch.int32, device=K.DEV)
            fields = (idx, cnt, nxt)
            args = (q, kv, K.SCALING, reuse, anchor_len, idx, cnt, nxt, slots)
            cis_rescore(*args, **kw, path=path)
            res[path] = [f.clone() for f in fields]
            res[path + "_ms"] = K.graph_ms(
                lambda a=args, p=path, kw=kw: cis_rescore(*a, **kw, path=p)
            )
        same = [torch.equal(x, y) for x, y in zip(res["torch"], res["triton"], strict=True)]
        nbytes = b * hkv * (m + r + 4 + 64) * K.D * 2
        row = {"part": "probe", "B": b, "T": t, "Hkv": hkv, "M": m, "R": r,
               "equal_list_cnt_next": same, "torch_ms": res["torch_ms"],
               "triton_ms": res["triton_ms"], "key_bytes": nbytes,
               "triton_TB/s": nbytes / res["triton_ms"] / 1e9}  # fmt: skip
        K.emit(out, row)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
