"""The CPU selection steps: torch references against the Numba kernels, at a CIS step's shapes.
A benchmark, not a test: nothing here asserts a speed (every Numba output is checked equal to
its reference, though).

For B in {1, 8} x Hkv in {3, 8} x T in {2048, 8192} x budget in {64, 2048} positions x block
size s in {1, 8} (every row of length T, CIS defaults n_sink 4, n_local 32, n_den 3, r 1), on
random softmax-like retrieval probabilities ``[B, Hkv, T]``:

- ``topk``: :func:`~prhs_kernels.topk.topk_indices` of the block scores (block max), ``k = M =
  budget/s``, eligibility ``[B, 1, NB]`` expanded over the heads (base selectors' top-k);
- ``top_p``: :func:`~prhs_kernels.topk.top_p_indices` of the float64 block masses, target 0.05,
  cap ``4·budget/s`` (certified CIS's retrieval), ``kept`` the sink's mass;
- ``dilate``: :func:`~prhs_kernels.compose.dilate_indices` of the anchor list ``[B, Hkv, M]``,
  ``m = M/3``, ``r = 1``;
- ``union``: :func:`~prhs_kernels.compose.union_indices`'s work, ``sink [B, ws] ∪ (anchor list +
  dilation) [B, Hkv, M + 2m] ∪ local [B, wl]`` into the selection width ``ws + M + 2m + wl``;
- ``bmax`` / ``bsum`` (s = 8 only; s = 1 is the identity): :func:`~prhs_kernels.blocks.block_reduce`
  of the float32 probabilities (max) and float64 probabilities (sum) against a Numba candidate
  defined here (it is not in the library: torch was as fast or faster).

Each time is the median of repeats (``time.perf_counter``, one untimed call first, torch at its
default thread count, torch and Numba calls alternating; the minimum goes to the JSON too). The
Numba kernels' compile time (their ``warm_up()``, once per process) is measured first and
reported separately.

Usage, from the repository root::

    .venv/bin/python benchmarks/scripts/cpu_selection_ops.py \\
        --out benchmarks/results/2026-11-30-cpu-selection-ops
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from prhs_kernels.blocks.reference import block_reduce_reference
from prhs_kernels.compose.reference import (
    dilate_indices_reference,
    union_indices_reference,
    window_indices_reference,
)
from prhs_kernels.topk.reference import top_p_indices_reference, topk_indices_reference

N_SINK, N_LOCAL, N_DEN, R = 4, 32, 3, 1
OPS = ("topk", "top_p", "dilate", "union", "bmax", "bsum")


def machine() -> dict[str, Any]:
    import numba

    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True)
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numba": numba.__version__,
        "commit": commit.strip(),
        "load_avg_start": os.getloadavg(),
    }


def timed_pair(f_torch, f_numba, budget_s: float = 0.3, max_reps: int = 25):
    """Median and minimum milliseconds of ``f_torch()`` and ``f_numba()`` over repeats (after one
    untimed call each), the two alternating so that a busy spell of the shared machine lands on
    both."""
    t0 = time.perf_counter()
    f_torch()
    f_numba()
    first = time.perf_counter() - t0
    reps = max(5, min(max_reps, int(budget_s / max(first, 1e-6))))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, ts in zip((f_torch, f_numba), times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return [(statistics.median(ts), min(ts)) for ts in times]


def same(a, b) -> bool:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def block_candidates():
    """Numba block max / sum over aligned blocks of ``s`` (T a multiple of ``s`` here)."""
    import numba
    import numpy as np

    @numba.njit(cache=False, nogil=True)
    def _bmax(x, s, out):
        rows, nb = out.shape
        for r in range(rows):
            for b in range(nb):
                m = x[r, b * s]
                for j in range(b * s + 1, b * s + s):
                    v = x[r, j]
                    if v > m or v != v:
                        m = v
                out[r, b] = m

    @numba.njit(cache=False, nogil=True)
    def _bsum(x, s, out):
        rows, nb = out.shape
        for r in range(rows):
            for b in range(nb):
                acc = x[r, b * s]
                for j in range(b * s + 1, b * s + s):
                    acc += x[r, j]
                out[r, b] = acc

    def run(kernel, x: torch.Tensor, s: int) -> torch.Tensor:
        t = x.shape[-1]
        a = x.reshape(-1, t).contiguous().numpy()
        out = np.empty((a.shape[0], t // s), a.dtype)
        kernel(a, s, out)
        return torch.from_numpy(out).view(*x.shape[:-1], t // s)

    return (lambda x, s: run(_bmax, x, s)), (lambda x, s: run(_bsum, x, s))


def inputs(b: int, h: int, t: int, budget: int, s: int, gen: torch.Generator) -> dict[str, Any]:
    nb = t // s
    m_width = budget // s
    m = m_width // N_DEN
    seq_lens = torch.full((b,), t, dtype=torch.int32)
    sink, local = window_indices_reference(seq_lens, N_SINK, N_LOCAL, s)
    probs = torch.softmax(torch.randn(b, h, t, generator=gen) * 2.5, -1)
    block_scores = block_reduce_reference(probs, s, "max") if s > 1 else probs
    mass = block_reduce_reference(probs.double(), s, "sum") if s > 1 else probs.double()
    j = torch.arange(nb)
    in_window = torch.zeros(b, nb, dtype=torch.bool)
    for w in (sink, local):
        in_window |= (j.view(1, 1, -1) == w.long().unsqueeze(-1)).any(1)
    eligible = (~in_window).unsqueeze(1).expand(b, h, nb)
    a_idx, a_cnt = topk_indices_reference(block_scores, m_width, eligible)
    dil = dilate_indices_reference(a_idx, a_cnt, m, R)
    part = torch.cat([a_idx, dil], -1)
    width = sink.shape[1] + part.shape[-1] + local.shape[1]
    kept = (mass * (j < sink.shape[1]).view(1, 1, -1)).sum(-1)
    return {
        "probs": probs,
        "block_scores": block_scores,
        "mass": mass,
        "eligible": eligible,
        "k": m_width,
        "cap": max(1, 4 * budget // s),
        "kept": kept,
        "a_idx": a_idx,
        "a_cnt": a_cnt,
        "m": m,
        "parts": [sink, part, local],
        "n_blocks": (seq_lens + s - 1) // s,
        "width": width,
    }


def cases(x: dict[str, Any], s: int, cn, tn, bmax, bsum):
    """``(op, torch fn, numba fn, size note)`` of one shape."""
    yield (
        "topk",
        lambda: topk_indices_reference(x["block_scores"], x["k"], x["eligible"]),
        lambda: tn.topk_indices_numba(x["block_scores"], x["k"], x["eligible"]),
        f"k={x['k']}",
    )
    args_p = (x["mass"], 0.05, x["cap"], x["eligible"], x["kept"])
    yield (
        "top_p",
        lambda: top_p_indices_reference(*args_p),
        lambda: tn.top_p_indices_numba(*args_p),
        f"cap={x['cap']}",
    )
    args_d = (x["a_idx"], x["a_cnt"], x["m"], R)
    yield (
        "dilate",
        lambda: dilate_indices_reference(*args_d),
        lambda: cn.dilate_indices_numba(*args_d),
        f"m={x['m']}",
    )
    args_u = (x["parts"], x["n_blocks"], x["width"])
    yield (
        "union",
        lambda: union_indices_reference(*args_u),
        lambda: cn.union_indices_numba(*args_u),
        f"W={x['width']}",
    )
    if s > 1:
        p, p64 = x["probs"], x["probs"].double()
        yield (
            "bmax",
            lambda: block_reduce_reference(p, s, "max"),
            lambda: bmax(p, s),
            "fp32",
        )
        yield (
            "bsum",
            lambda: block_reduce_reference(p64, s, "sum"),
            lambda: bsum(p64, s),
            "fp64",
        )


def fmt(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "–"
    return f"{rec['torch_ms']:.3f} / {rec['numba_ms']:.3f} ({rec['speedup']:.1f}×)"


def table(records: list[dict[str, Any]]) -> str:
    keyed = {(r["B"], r["Hkv"], r["T"], r["budget"], r["s"], r["op"]): r for r in records}
    shapes = sorted({k[:5] for k in keyed})
    head = "| B | Hkv | T | budget | s | W | " + " | ".join(OPS) + " |"
    rule = "|" + "---|" * (6 + len(OPS))
    lines = [head, rule]
    for shp in shapes:
        width = keyed[(*shp, "union")]["size"]
        cells = [fmt(keyed.get((*shp, op))) for op in OPS]
        lines.append(
            "| " + " | ".join(map(str, shp)) + f" | {width[2:]} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def summary(records: list[dict[str, Any]]) -> str:
    lines = [
        "| op | shapes | speedup min | median | max | Numba slower at |",
        "|---|---|---|---|---|---|",
    ]
    for op in OPS:
        rs = [r for r in records if r["op"] == op]
        if not rs:
            continue
        sp = sorted(r["speedup"] for r in rs)
        slow = sum(r["speedup"] < 1.0 for r in rs)
        lines.append(
            f"| {op} | {len(rs)} | {sp[0]:.2f}× | {statistics.median(sp):.2f}× | {sp[-1]:.2f}× "
            f"| {slow} |"
        )
    return "\n".join(lines)


def readme(info: dict[str, Any], tab: str, summ: str) -> str:
    la0 = ", ".join(f"{v:.2f}" for v in info["load_avg_start"])
    la1 = ", ".join(f"{v:.2f}" for v in info["load_avg_end"])
    comp = ", ".join(f"{k} {v:.1f} s" for k, v in info["compile_s"].items())
    return f"""# CPU selection steps: torch references vs Numba kernels

`.venv/bin/python benchmarks/scripts/cpu_selection_ops.py --out
benchmarks/results/2026-11-30-cpu-selection-ops` on a {info["cpu_count"]}-core CPU
({info["cpu"]}; torch at its default {info["torch_threads"]} threads), Python {info["python"]},
torch {info["torch"]}, Numba {info["numba"]}, commit {info["commit"]} plus the Numba paths.
The machine was shared (load average {la0} at the start, {la1} at the end), so single times
are noisy; every number is a median of repeats. The run took {info["bench_s"]:.0f} s after
compiling the Numba kernels once ({comp}).

Shapes: every row of length T, CIS defaults (sink 4, local 32, n_den 3, r 1); `W` the CIS
selection width `ws + M + 2·r·m + wl` with `M = budget/s`, `m = M/3`. See the script's
docstring for each op's inputs. Each cell: **torch ms / Numba ms (torch ÷ Numba)**.
`bmax`/`bsum` compare `block_reduce` with a Numba candidate kept in the script only.
Every Numba output of `topk`, `top_p`, `dilate` and `union` was checked equal to the torch
reference (bit for bit, dtypes included) before it was timed; `results.jsonl` has one record
per (shape, op), `exact` included.

{tab}

Speedups (torch ÷ Numba) over the shapes:

{summ}

The library takes the Numba path on the CPU for `topk_indices`, `top_p_indices`,
`dilate_indices` and `union_indices` (`prhs_kernels.paths.numba_path`; `PRHS_KERNELS=torch`
keeps the references). `block_reduce` stays torch: see docs/kernels.rst, "Numba (CPU)".
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for results.jsonl + README.md")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    info = machine()
    print(json.dumps(info))

    t0 = time.perf_counter()
    from prhs_kernels.compose import numba as cn

    cn.warm_up()
    t1 = time.perf_counter()
    from prhs_kernels.topk import numba as tn

    tn.warm_up()
    t2 = time.perf_counter()
    bmax, bsum = block_candidates()
    warm = torch.rand(1, 16)
    bmax(warm, 8), bsum(warm.double(), 8)
    info["compile_s"] = {"compose (numba import included)": t1 - t0, "topk": t2 - t1}
    print(f"compile: compose {t1 - t0:.1f} s (Numba import included), topk {t2 - t1:.1f} s")

    gen = torch.Generator().manual_seed(args.seed)
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    for b, h, t, budget, s in itertools.product((1, 8), (3, 8), (2048, 8192), (64, 2048), (1, 8)):
        x = inputs(b, h, t, budget, s, gen)
        for op, f_torch, f_numba, size in cases(x, s, cn, tn, bmax, bsum):
            exact = same(f_numba(), f_torch())
            if op in ("topk", "top_p", "dilate", "union") and not exact:
                raise AssertionError(f"{op} B{b} H{h} T{t} budget {budget} s {s}: not exact")
            (t_torch, min_torch), (t_numba, min_numba) = timed_pair(f_torch, f_numba)
            rec = {
                "op": op,
                "B": b,
                "Hkv": h,
                "T": t,
                "budget": budget,
                "s": s,
                "size": size,
                "torch_ms": t_torch,
                "numba_ms": t_numba,
                "torch_min_ms": min_torch,
                "numba_min_ms": min_numba,
                "speedup": t_torch / t_numba,
                "exact": exact,
            }
            records.append(rec)
            print(
                f"B={b} Hkv={h} T={t:5d} budget={budget:4d} s={s} {op:6s} {size:10s} "
                f"torch {t_torch:8.3f} ms  numba {t_numba:8.3f} ms  x{rec['speedup']:5.2f}"
                + ("" if exact else "  (not bit-exact)")
            )
    info["bench_s"] = time.perf_counter() - start
    info["load_avg_end"] = os.getloadavg()
    tab, summ = table(records), summary(records)
    print(tab)
    print(summ)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results.jsonl", "w") as f:
            f.write(json.dumps({"machine": info}) + "\n")
            for r in records:
                f.write(json.dumps(r) + "\n")
        (args.out / "README.md").write_text(readme(info, tab, summ))


if __name__ == "__main__":
    main()
