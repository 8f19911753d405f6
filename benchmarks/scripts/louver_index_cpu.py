"""Louver's index build on the CPU: the torch reference against the Numba kernel, as an op and
inside a SmolLM2 decode. A benchmark, not a test: nothing here asserts a speed (the Numba
permutations are checked equal to the reference's on the op's inputs, though).

1. The op, :func:`~prhs_kernels.louver.balanced_clusters` at a decode step's shapes: ``[B, Hkv,
   1, 256, D]`` keys (one 256-position buffer a sequence and KV head, Louver's defaults), B in
   {1, 8}, (Hkv, D) in {(3, 64), (8, 128)}: the reference (every group clustered, as its static
   shapes require), Numba with every group active (a step that indexes), Numba with none active
   (the other 255 steps in 256).
2. Decode: SmolLM2-135M (offline), one passkey prompt of ``--context-len`` tokens, Louver at
   ``--budget``, ``--tokens`` greedy tokens after the prefill: decode tokens/s with the Numba
   clustering, with the torch reference (``prhs_kernels.louver.numba_path`` patched off; every
   other op keeps its path), and dense.

Usage, from the repository root::

    .venv/bin/python benchmarks/scripts/louver_index_cpu.py \\
        --out benchmarks/results/2026-12-01-louver-index-cpu
"""

from __future__ import annotations

import argparse
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

import prhs_kernels.louver as louver
from prhs_kernels.louver.reference import balanced_clusters_reference


def machine() -> dict[str, Any]:
    import numba
    import transformers

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "commit": commit,
    }


def timed(fn, budget_s: float = 0.5, max_reps: int = 30) -> tuple[float, float]:
    """(median, min) seconds of ``fn()`` after one untimed call."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def op_rows() -> list[dict[str, Any]]:
    from prhs_kernels.louver.numba import balanced_clusters_numba

    rows = []
    gen = torch.Generator().manual_seed(0)
    for b in (1, 8):
        for h, d in ((3, 64), (8, 128)):
            keys = torch.randn(b, h, 1, 256, d, generator=gen)
            on = torch.ones(b, h, 1, dtype=torch.bool)
            off = torch.zeros_like(on)
            same = torch.equal(
                balanced_clusters_numba(keys, 4, on), balanced_clusters_reference(keys)
            )
            rec: dict[str, Any] = {"kind": "op", "B": b, "Hkv": h, "D": d, "equal": same}
            for name, fn in (
                ("torch", lambda k=keys: balanced_clusters_reference(k)),
                ("numba_all", lambda k=keys, a=on: balanced_clusters_numba(k, 4, a)),
                ("numba_none", lambda k=keys, a=off: balanced_clusters_numba(k, 4, a)),
            ):
                med, low = timed(fn)
                rec[f"{name}_ms"] = 1e3 * med
                rec[f"{name}_min_ms"] = 1e3 * low
            rows.append(rec)
            print(
                f"op B{b} Hkv{h} D{d}: torch {rec['torch_ms']:.2f} ms, numba (all active) "
                f"{rec['numba_all_ms']:.2f} ms, numba (none active) {rec['numba_none_ms']:.3f} ms, "
                f"equal={same}",
                flush=True,
            )
    return rows


def decode_rows(context_len: int, tokens: int, budget: int) -> list[dict[str, Any]]:
    import prhs_eval
    from prhs_eval.models import load_model
    from prhs_eval.tasks import make_samples

    loaded = load_model("smollm2-135m")
    model, tok = loaded.model, loaded.tokenizer
    prompt = make_samples("passkey", tok, context_len=context_len, num_samples=1, seed=0)[0].prompt
    batch = tok([prompt], return_tensors="pt")
    n_prompt = int(batch["input_ids"].shape[1])
    rows = []

    def run(label: str, selector: str | None) -> None:
        def generate(n: int) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return time.perf_counter() - t0

        def timed_decode() -> tuple[float, float]:
            one = generate(1)  # prefill + first token
            full = generate(tokens + 1)
            return one, full

        if selector is None:
            one, full = timed_decode()
        else:
            with prhs_eval.enable(model, selector, budget=budget):
                one, full = timed_decode()
        decode_s = max(full - one, 1e-9)
        rec = {
            "kind": "decode",
            "label": label,
            "prompt_tokens": n_prompt,
            "decode_tokens": tokens,
            "budget": budget,
            "decode_s": decode_s,
            "tokens_per_s": tokens / decode_s,
            "prefill_and_first_s": one,
        }
        rows.append(rec)
        print(
            f"decode {label}: {rec['tokens_per_s']:.2f} tokens/s ({decode_s:.1f} s for {tokens}), "
            f"prefill + first token {one:.1f} s",
            flush=True,
        )

    run("dense", None)
    run("louver, numba clustering", "louver")
    real = louver.numba_path
    louver.numba_path = lambda device: False  # the torch reference for the clustering only
    try:
        run("louver, torch clustering", "louver")
    finally:
        louver.numba_path = real
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="folder for results.jsonl")
    ap.add_argument("--context-len", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--no-decode", action="store_true", help="time the op only")
    args = ap.parse_args()
    info = machine()
    print(json.dumps(info), flush=True)
    rows = op_rows()
    if not args.no_decode:
        rows += decode_rows(args.context_len, args.tokens, args.budget)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.jsonl").open("w") as f:
            for r in [{"kind": "machine", **info, "argv": sys.argv[1:]}, *rows]:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
