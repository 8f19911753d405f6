"""The sparse decode kernel's ``merge_last`` threshold on a GPU: at each shape, the merge by a
second launch (``merge_last`` 0) against the row's last slice merging (a threshold above the
shape's slice count), each checked against the float32 reference, then timed back to back
(8 launches over distinct selections in one CUDA graph, median of ``triton.testing.do_bench``).
A benchmark, not a test: nothing here asserts a speed.

Shapes: Hq 32, D 128, bf16, T 16k, 1024 positions a row as 128 blocks of 8 (CIS-8), at
(B, Hkv) in {(1, 32), (1, 8), (8, 32), (16, 8)} (16, 16, 2 and 4 slices a row on an H200).

Usage, from the repository root with every package's ``src`` on ``PYTHONPATH``::

    python benchmarks/scripts/merge_last_probe.py --out merge-last.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as K

SHAPES = [(1, 32), (1, 8), (8, 32), (16, 8)]
LAUNCHES = 8


def main() -> None:
    from prhs_kernels.sparse_decode import (
        sparse_decode_attention,
        sparse_decode_attention_reference,
    )
    from prhs_kernels.sparse_decode import triton as sd

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--t", type=int, default=16384)
    a = ap.parse_args()
    out = open(a.out, "a") if a.out else None
    K.emit(out, {"part": "machine", **K.machine(), "probe": "merge_last"})
    gen = torch.Generator(device=K.DEV).manual_seed(0)
    saved = dict(sd.TUNING)
    hq, t, s, budget = 32, a.t, 8, 1024
    for b, hkv in SHAPES:
        lens = [t] * b
        kv = K.contiguous(b, hkv, t, lens, padded=False, gen=gen)
        q = torch.randn(b, hq, K.D, generator=gen, device=K.DEV).to(K.DTYPE)
        sels = [K.block_selection(b, hkv, lens, budget // s, s, gen) for _ in range(LAUNCHES)]
        o = torch.empty_like(q)
        lse = torch.empty(b, hq, device=K.DEV)
        want_o, want_l = sparse_decode_attention_reference(q, kv, sels[0], K.SCALING)
        splits = sd.num_splits(b * hkv, budget, q.device)
        for threshold in (0, 1 << 10):
            sd.TUNING["merge_last"] = threshold
            o.fill_(float("nan"))
            sparse_decode_attention(q, kv, sels[0], K.SCALING, out=o, lse=lse)
            row = {"part": "probe", "B": b, "Hkv": hkv, "s": s, "splits": splits,
                   "merge": "launch" if threshold == 0 else "last slice",
                   "rel_err": K.rel_err(o.float(), want_o.float()),
                   "lse_err": float((lse - want_l).abs().max())}  # fmt: skip

            def burst(sels=sels, args=(q, kv, o, lse)) -> None:
                for one in sels:
                    sparse_decode_attention(args[0], args[1], one, K.SCALING, out=args[2],
                                            lse=args[3])  # fmt: skip

            row["b2b_us"] = 1e3 * K.graph_ms(burst) / LAUNCHES
            K.emit(out, row)
            print(f"B{b} Hkv{hkv} ({splits} slices) merge by {row['merge']}: "
                  f"{row['b2b_us']:.1f} us, rel err {row['rel_err']:.1e}")  # fmt: skip
        torch.cuda.empty_cache()
    sd.TUNING.clear()
    sd.TUNING.update(saved)


if __name__ == "__main__":
    main()
