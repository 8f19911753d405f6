"""The sparse decode kernel's launch plans on a GPU: each plan checked against the float32
reference, then timed (CUDA-graph replay, median of ``triton.testing.do_bench``) at every shape.
A benchmark, not a test: nothing here asserts a speed.

A plan is ``(block_n, num_warps, num_stages, waves)`` (a plan whose split count comes out at 1
writes the output from the split kernel, with no merge launch). The shipped plan (the first of
``--plans``) is also timed ``BACK_TO_BACK`` launches to a graph (``b2b_ms``; every plan with
``--b2b-all``, which then ranks the plans by it). Shapes: Hq 32, D 128, bf16, T 16k, 1024
positions per (sequence, KV head): B in {1, 4, 8, 16, 32} at Hkv 8 as single positions and as
128 blocks of 8; B 1 and 16 at Hkv 32 as single positions; single positions through a paged pool
of page size 1 (as SGLang's) at B 16 / Hkv 8; contiguous caches elsewhere. Bytes: the selected
K and V rows.

Usage, from the repository root with every package's ``src`` on ``PYTHONPATH``::

    python benchmarks/scripts/sparse_probe.py --out sparse-probe.jsonl

The merge by a launch against the last slice merging, at CIS-8's shapes (two runs)::

    python benchmarks/scripts/sparse_probe.py --shipped-only --merge-last 0 \
        --shapes 1:32:8:contig,1:8:8:contig,8:32:8:contig,16:8:8:contig --out launch.jsonl
    python benchmarks/scripts/sparse_probe.py --shipped-only --merge-last 1024 \
        --shapes 1:32:8:contig,1:8:8:contig,8:32:8:contig,16:8:8:contig --out last.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as K

PLANS = [
    (64, 4, 2, 4),  # the shipped plan
    (32, 4, 2, 8),
    (64, 8, 2, 4),
    (128, 4, 2, 2),
    (128, 8, 2, 2),
    (128, 8, 2, 1),
    (256, 8, 1, 1),
]
BACK_TO_BACK = 8
"""Launches of the shipped plan in one graph, each over its own random selection, for the
``b2b_ms`` column: the kernel's own time, without the host's submission of a lone graph (a
fixed 6-8 µs in ``ms``) and without an L2 warm from the launch before."""


def shapes() -> list[tuple[int, int, int, str]]:
    """(B, Hkv, s, layout)."""
    rows = [(b, 8, s, "contig") for b in (1, 4, 8, 16, 32) for s in (1, 8)]
    return [*rows, (1, 32, 1, "contig"), (16, 32, 1, "contig"), (16, 8, 1, "paged1")]


def main() -> None:
    from prhs_kernels.sparse_decode import (
        sparse_decode_attention,
        sparse_decode_attention_reference,
    )
    from prhs_kernels.sparse_decode import triton as sd

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--t", type=int, default=16384)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--max-s", type=float, default=420.0, help="stop timing after this long")
    ap.add_argument(
        "--shapes", default=None, metavar="B:HKV:S:LAYOUT[,...]",
        help="only these shapes (layout contig or paged1), e.g. 8:32:8:contig",
    )  # fmt: skip
    ap.add_argument("--shipped-only", action="store_true", help="time the shipped plan only")
    ap.add_argument(
        "--plans", default=None, metavar="N:W:S:WAVES[,...]",
        help="these plans (block_n:num_warps:num_stages:waves) instead of the list above",
    )  # fmt: skip
    ap.add_argument(
        "--b2b-all", action="store_true",
        help="time every plan back to back (not only the shipped one)",
    )  # fmt: skip
    ap.add_argument(
        "--merge-last", type=int, default=None, metavar="N",
        help="TUNING['merge_last'] for the run: up to N slices a row the last slice merges "
        "(0: always the merge launch); default the shipped value",
    )  # fmt: skip
    a = ap.parse_args()
    plans = PLANS[:1] if a.shipped_only else PLANS
    if a.plans:
        plans = [tuple(int(v) for v in item.split(":")) for item in a.plans.split(",")]
        if any(len(p) != 4 for p in plans):
            ap.error(f"--plans {a.plans!r}: each plan is block_n:num_warps:num_stages:waves")
    chosen = shapes()
    if a.shapes:
        chosen = []
        for item in a.shapes.split(","):
            b_, hkv_, s_, layout_ = item.split(":")
            if layout_ not in ("contig", "paged1"):
                ap.error(f"--shapes {item!r}: layout must be contig or paged1")
            chosen.append((int(b_), int(hkv_), int(s_), layout_))
    out = open(a.out, "a") if a.out else None
    K.emit(out, {"part": "machine", **K.machine(), "probe": "sparse"})
    t0 = time.time()
    gen = torch.Generator(device=K.DEV).manual_seed(0)
    saved = dict(sd.TUNING)
    if a.merge_last is not None:
        sd.TUNING["merge_last"] = a.merge_last
    hq, t = 32, a.t
    table: dict[tuple, dict[tuple, float]] = {}
    b2b_table: dict[tuple, float] = {}
    for b, hkv, s, layout in chosen:
        if time.time() - t0 > a.max_s:
            K.emit(out, {"part": "probe", "stopped": "time", "at": [b, hkv, s, layout]})
            break
        lens = [t] * b
        kv = K.contiguous(b, hkv, t, lens, padded=False, gen=gen)
        if layout == "paged1":
            kv = K.paged(kv, 1, gen)
        q = torch.randn(b, hq, K.D, generator=gen, device=K.DEV).to(K.DTYPE)
        sel = K.block_selection(b, hkv, lens, a.budget // s, s, gen)
        o = torch.empty_like(q)
        lse = torch.empty(b, hq, device=K.DEV)
        want_o, want_l = sparse_decode_attention_reference(q, kv, sel, K.SCALING)
        nbytes = b * hkv * a.budget * K.D * 2 * 2
        key = (b, hkv, s, layout)
        table[key] = {}
        for plan in plans:
            block_n, warps, stages, waves = plan
            sd.TUNING.update(block_n=block_n, num_warps=warps, num_stages=stages, waves=waves)
            row: dict[str, Any] = {"part": "probe", "B": b, "Hkv": hkv, "s": s, "layout": layout,
                                   "block_n": block_n, "num_warps": warps, "num_stages": stages,
                                   "waves": waves,
                                   "merge_last": sd.TUNING["merge_last"]}  # fmt: skip
            try:
                o.fill_(float("nan"))
                lse.fill_(float("nan"))
                sparse_decode_attention(q, kv, sel, K.SCALING, out=o, lse=lse)
                row["splits"] = sd.num_splits(b * hkv, a.budget, q.device)
                row["rel_err"] = K.rel_err(o.float(), want_o.float())
                row["lse_err"] = float((lse - want_l).abs().max())
                row["written"] = bool(torch.isfinite(o).all())
                args = (q, kv, sel, K.SCALING)
                ms = K.graph_ms(
                    lambda a=args, o=o, s=lse: sparse_decode_attention(*a, out=o, lse=s)
                )
                row.update(ms=ms, **{"TB/s": nbytes / ms / 1e9})
                table[key][plan] = ms
                if plan == plans[0] or a.b2b_all:
                    sels = [
                        K.block_selection(b, hkv, lens, a.budget // s, s, gen)
                        for _ in range(BACK_TO_BACK)
                    ]

                    def burst(sels: list[Any] = sels, a: tuple = (q, kv, o, lse)) -> None:
                        for one in sels:
                            sparse_decode_attention(a[0], a[1], one, K.SCALING, out=a[2], lse=a[3])

                    b2b = K.graph_ms(burst) / BACK_TO_BACK
                    row.update(b2b_ms=b2b, **{"b2b_TB/s": nbytes / b2b / 1e9})
                    if plan == plans[0]:
                        b2b_table[key] = b2b
                    if a.b2b_all:  # rank the plans by their own back-to-back time
                        table[key][plan] = b2b
            except Exception as e:  # every plan gets its row
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            K.emit(out, row)
        torch.cuda.empty_cache()
    sd.TUNING.clear()
    sd.TUNING.update(saved)
    # The short table: µs per shape for each plan, the best marked.
    how = "back to back" if a.b2b_all else "graph replay"
    print(f"\nµs ({how}); plans as (block_n, warps, stages, waves)")
    for key, cells in table.items():
        if not cells:
            continue
        best = min(cells, key=cells.get)
        base = cells.get(plans[0])
        nbytes = key[0] * key[1] * a.budget * K.D * 4
        b2b = b2b_table.get(key)
        print(
            f"B{key[0]} Hkv{key[1]} s{key[2]} {key[3]}: shipped {1e3 * base:.1f} "
            f"(back to back {1e3 * b2b:.1f}, {nbytes / b2b / 1e9:.2f} TB/s) | best "
            f"{1e3 * cells[best]:.1f} {best}"
            if base is not None and b2b is not None
            else f"{key}: {cells}"
        )
    agg = {p: sum(c.get(p, float("nan")) / min(c.values()) for c in table.values() if c)
           for p in plans}  # fmt: skip
    print("mean time over the best, per plan:")
    for p, v in sorted(agg.items(), key=lambda x: x[1]):
        print(f"  {p}: {v / max(1, len(table)):.3f}")


if __name__ == "__main__":
    main()
