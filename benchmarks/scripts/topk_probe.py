"""The CIS step's top-k and compose kernels on a GPU, alone, over their launch parameters:
the top-k's one-pass limit, first-pass chunk and search bits a round, the compose's warps.
Rows are B·Hkv = 128, a share of them active; each result is checked against ``torch.topk``
(values, index sets). A benchmark: prints JSON lines; times are CUDA-graph replays (median of
``triton.testing.do_bench``).

    python benchmarks/scripts/topk_probe.py --out topk.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as kb

ROWS = 128


def scores(n: int, frac: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-like scores (a softmax of logits of spread 2, some blocks ``-inf``) and the
    active rows."""
    x = torch.softmax(2.0 * torch.randn(ROWS, n, generator=gen, device="cuda"), -1)
    x[:, :4] = float("-inf")  # sink and local positions are not ranked
    x[:, -64:] = float("-inf")
    act = torch.zeros(ROWS, dtype=torch.bool, device="cuda")
    act[: max(1, round(frac * ROWS))] = True
    return x, act[torch.randperm(ROWS, generator=gen, device="cuda")]


def topk(
    out: Any,
    cases: list[tuple[int, int]],
    fracs: list[float],
    bits: list[int],
    segments: list[int],
    plans: bool,
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (n, k), frac in itertools.product(cases, fracs):
        topk_case(out, n, k, frac, gen, bits, segments, plans)


def topk_case(
    out: Any,
    n: int,
    k: int,
    frac: float,
    gen: torch.Generator,
    bits: list[int],
    segments: list[int],
    plans: bool,
) -> None:
    from prhs_kernels.cis import top_blocks
    from prhs_kernels.cis import triton as ct

    saved = (ct.TOPK_ONE_PASS, ct.TOPK_CHUNK)
    x, act = scores(n, frac, gen)
    ref = torch.topk(x, k, dim=-1)
    base = {"n": n, "k": k, "active": frac}
    emit(out, {**base, "op": "torch.topk (all rows)",
               "ms": kb.graph_ms(lambda: torch.topk(x, k, dim=-1))})  # fmt: skip

    def run(one_pass: int, chunk: int, radix_bits: int, segment: int) -> None:
        ct.TOPK_ONE_PASS, ct.TOPK_CHUNK = one_pass, chunk
        ct.TUNING["topk_radix_bits"] = radix_bits
        ct.TUNING["topk_scan_segment"] = segment
        plan = ct._topk_plan(n, k)
        if plan is None:
            return
        idx, val = top_blocks(x, k, act, path="triton")
        same = torch.equal(idx[act].sort(-1).values, ref.indices[act].int().sort(-1).values)
        ms = kb.graph_ms(lambda: top_blocks(x, k, act, path="triton"))
        emit(out, {**base, "op": "top_blocks", "one_pass": one_pass, "chunk": chunk,
                   "radix_bits": radix_bits, "scan_segment": segment,
                   "plan": list(plan), "ms": ms,
                   "sets_equal": same,
                   "values_equal": torch.equal(val[act], ref.values[act])})  # fmt: skip

    # The shipped plan at each search width, then other one-pass limits and chunks.
    shipped = dict(ct.TUNING)
    for radix_bits, segment in itertools.product(bits, segments):
        run(saved[0], saved[1], radix_bits, segment)
    if n > 8192 and plans:
        for o, c in ((8192, 2048), (8192, 4096), (16384, 8192)):
            for radix_bits, segment in itertools.product(bits, segments):
                run(o, c, radix_bits, segment)
    ct.TOPK_ONE_PASS, ct.TOPK_CHUNK = saved
    ct.TUNING.update(shipped)


def compose(out: Any, fracs: list[float]) -> None:
    """``cis_compose`` at per-token CIS's widths (budget 1024, m 341, r 1, held window)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for frac in fracs:
        compose_case(out, frac, gen)


def compose_case(out: Any, frac: float, gen: torch.Generator) -> None:
    from prhs_kernels.cis import cis_compose, cis_local_width, top_blocks
    from prhs_kernels.cis import triton as ct
    from prhs_kernels.compose import window_widths

    b, h, g, d, mm, m, r, t = 16, 8, 4, 128, 1024, 341, 1, 16384
    n_sink, n_local = 4, 32
    ws, _ = window_widths(n_sink, n_local, 1)
    width = ws + mm + 2 * r * m + cis_local_width(n_local, 1, True)
    x, act = scores(t, frac, gen)
    x, act = x.view(b, h, t), act.view(b, h)
    new_idx, new_val = top_blocks(x, mm, act, path="triton")
    aq = torch.randn(b, h, g, d, device="cuda", generator=gen)
    alen = torch.full((b, h), t - 8, dtype=torch.int32, device="cuda")
    aidx = torch.stack([torch.randperm(t - 64, device="cuda", generator=gen)[:mm]
                        for _ in range(b * h)]).view(b, h, mm).int()  # fmt: skip
    acnt = torch.full((b, h), mm, dtype=torch.int32, device="cuda")
    alogd = torch.zeros(b, h, dtype=torch.float64, device="cuda")
    slots = torch.arange(b, device="cuda")
    lens = torch.full((b,), t, dtype=torch.int32, device="cuda")
    q = torch.randn(b, h * g, d, device="cuda", generator=gen).bfloat16()
    oi = torch.empty(b, h, width, dtype=torch.int32, device="cuda")
    oc = torch.empty(b, h, dtype=torch.int32, device="cuda")
    bad = torch.zeros_like(act)

    def run() -> None:
        cis_compose(
            q, act, bad, new_idx, new_val, aq, alen, aidx, acnt, alogd, slots, lens,
            n_sink=n_sink, n_local=n_local, block_size=1, m=m, r=r, out_indices=oi,
            out_counts=oc, hold_local=True, path="triton",
        )  # fmt: skip

    saved = dict(ct.TUNING)
    for warps in (4, 8, 16, 32):
        ct.TUNING["compose_warps_wide"] = warps
        emit(out, {"op": "cis_compose", "B": b, "Hkv": h, "width": width, "active": frac,
                   "warps": warps, "ms": kb.graph_ms(run)})  # fmt: skip
    ct.TUNING.clear()
    ct.TUNING.update(saved)


def steps(
    out: Any, shapes: list[tuple[int, int, int]], bits: list[int], segments: list[int], rho: float
) -> None:
    """The whole per-token CIS step (kernels.py's step rows: budget 1024, block_size 1, ``rho``
    of the query groups jumping each step) at each search width and scan segment of the
    top-k."""
    from prhs_kernels.cis import triton as ct

    bw = kb.copy_bandwidth()
    shipped = dict(ct.TUNING)
    for (b, t, hkv), radix_bits, segment in itertools.product(shapes, bits, segments):
        ct.TUNING["topk_radix_bits"] = radix_bits
        ct.TUNING["topk_scan_segment"] = segment
        r = kb.step_bench("cis", b, t, hkv, 1024, rho, bw)
        emit(out, {"op": "cis step", "B": b, "T": t, "Hkv": hkv, "rho": rho,
                   "radix_bits": radix_bits, "scan_segment": segment, **r})  # fmt: skip
        torch.cuda.empty_cache()
    ct.TUNING.update(shipped)


def emit(out: Any, row: dict[str, Any]) -> None:
    line = json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()})
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    cases = "16384x1024,16396x1024,65536x1024,65548x1024,8192x128,2048x128"
    p.add_argument("--cases", default=cases, help="NxK, comma separated")
    p.add_argument("--active", default="0.1,0.03")
    p.add_argument("--bits", default="1,2,4", help="search bits a round (TUNING topk_radix_bits)")
    p.add_argument("--segments", default="0", help="TUNING topk_scan_segment values")
    p.add_argument("--no-compose", action="store_true")
    p.add_argument("--no-plans", action="store_true", help="only the shipped chunking")
    p.add_argument("--steps", default="", help="BxTkxHkv shapes of whole-step rows, e.g. 16x16x8")
    p.add_argument("--rho", type=float, default=0.10, help="the whole-step rows' jump ratio")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cases = [tuple(int(v) for v in c.split("x")) for c in a.cases.split(",")]
    fracs = [float(f) for f in a.active.split(",")]
    with open(a.out, "w", encoding="utf-8") if a.out else open(os.devnull, "w") as out:
        emit(out, {"part": "machine", **kb.machine()})
        if not a.no_compose:
            compose(out, fracs)
        bits = [int(b) for b in a.bits.split(",")]
        segments = [int(v) for v in a.segments.split(",")]
        topk(out, cases, fracs, bits, segments, not a.no_plans)  # type: ignore[arg-type]
        shapes = [tuple(int(v) for v in x.split("x")) for x in a.steps.split(",") if x]
        shapes = [(b, t * 1024, h) for b, t, h in shapes]
        steps(out, shapes, bits, segments, a.rho)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
