"""CIS's re-ranking of a reuse's pool (``prhs_kernels.cis.cis_rescore``) on a GPU: the Triton
path against the torch reference at a decode step's size (equal lists, counts and next blocks),
and both timed (CUDA-graph replay), the Triton path also by part (the scores' two launches,
the top-k, the rewrite); ``--sweep`` times the scores over the launch parameters
(``TUNING["rescore_programs_per_sm"]``, ``["rescore_tile"]``). A benchmark, not a test: nothing
here asserts a speed.

Usage, from the repository root with every package's ``src`` on ``PYTHONPATH``::

    python benchmarks/scripts/rescore_probe.py [--sweep] --out rescore-probe.jsonl
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as K


def main() -> None:
    from prhs_kernels.cis import cis_rescore
    from prhs_kernels.cis import triton as T

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    out = open(a.out, "a") if a.out else None
    K.emit(out, {"part": "machine", **K.machine(), "probe": "rescore"})
    gen = torch.Generator(device=K.DEV).manual_seed(0)
    hq = 32
    shapes = ((16, 16, 8, 1024, 2048), (16, 64, 8, 1024, 2048), (1, 16, 8, 1024, 2048),
              (16, 16, 8, 1024, 1024), (16, 16, 8, 512, 1024), (1, 16, 8, 512, 1024))  # fmt: skip
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
        # The Triton path by part, on a fresh pool.
        idx, nxt = pools[..., :m].clone(), pools[..., m:].clone()
        cnt = torch.full((n_slots, hkv), m, dtype=torch.int32, device=K.DEV)
        fields = (anchor_len, idx, cnt, nxt, slots)
        sargs = (q, kv, K.SCALING, reuse, *fields, 1, 4, 32, True, "mass")
        scores = T.rescore_scores_triton(*sargs)
        chosen, val = T.top_blocks_triton(scores, m, reuse)
        parts = {
            "scores_ms": K.graph_ms(partial(T.rescore_scores_triton, *sargs)),
            "topk_ms": K.graph_ms(partial(T.top_blocks_triton, scores, m, reuse)),
            "write_ms": K.graph_ms(
                partial(T.rescore_write_triton, chosen, val, reuse, idx, cnt, nxt, slots)
            ),
        }
        same = [torch.equal(x, y) for x, y in zip(res["torch"], res["triton"], strict=True)]
        as_set = torch.equal(res["torch"][0].sort(-1).values, res["triton"][0].sort(-1).values)
        nbytes = b * hkv * (m + r + 4 + 64) * K.D * 2
        row = {"part": "probe", "B": b, "T": t, "Hkv": hkv, "M": m, "R": r,
               "equal_list_cnt_next": same, "equal_list_as_set": as_set,
               "torch_ms": res["torch_ms"], "triton_ms": res["triton_ms"], **parts,
               "splits": T.rescore_splits(b * hkv, m + r, T._rescore_block_e(1), q.device)[1],
               "key_bytes": nbytes, "triton_TB/s": nbytes / res["triton_ms"] / 1e9,
               "scores_TB/s": nbytes / parts["scores_ms"] / 1e9}  # fmt: skip
        K.emit(out, row)
        if a.sweep and (b, t_k, m, r) in ((16, 16, 1024, 2048), (1, 16, 1024, 2048)):
            saved = dict(T.TUNING)
            for per_sm in (1, 2, 4, 8, 16):
                for tile in (32, 64, 128):
                    T.TUNING.update(rescore_programs_per_sm=per_sm, rescore_tile=tile)
                    try:
                        ms = K.graph_ms(partial(T.rescore_scores_triton, *sargs))
                        K.emit(out, {"part": "sweep", "B": b, "T": t, "M": m, "R": r,
                                     "programs_per_sm": per_sm, "tile": tile,
                                     "scores_ms": ms})  # fmt: skip
                    except Exception as e:  # a launch that does not fit: say so
                        K.emit(out, {"part": "sweep", "B": b, "per_sm": per_sm, "tile": tile,
                                     "error": f"{type(e).__name__}: {e}"[:200]})  # fmt: skip
            T.TUNING.clear()
            T.TUNING.update(saved)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
