"""RaBitQ's bit packing on the CPU: the torch reference against the Numba kernel
(:mod:`prhs_kernels.rabitq.numba`), and the whole key quantisation with each. A benchmark, not a
test: nothing here asserts a speed (the kernel's bytes are checked equal to the reference's).

Shapes: RaBitQ quantises keys when a group of 128 positions fills at decode (``[B, Hkv, 128,
D]``, B in {1, 8}) and every full group of the prompt at prefill (``[1, Hkv, 4096, D]``), for
(Hkv, D) in {(3, 64), (8, 128)}: SmolLM2-135M's heads and a Llama-3-8B-shaped layer. Each time
is the median of repeats after one untimed call (torch at its default thread count).

Usage, from the repository root::

    .venv/bin/python benchmarks/scripts/cpu_pack_bits.py \\
        --out benchmarks/results/2026-12-01-cpu-pack-bits
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numba
import torch

from prhs_kernels.rabitq.numba import pack_bits_numba
from prhs_kernels.rabitq.reference import pack_bits, quantize_keys_reference, random_rotation


def timed(fn: Any, budget_s: float = 0.4, max_reps: int = 50) -> float:
    """Median seconds of ``fn()`` after one untimed call."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="folder for results.jsonl")
    args = ap.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    info = {
        "kind": "machine",
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "threads": torch.get_num_threads(),
        "commit": commit,
    }
    print(json.dumps(info), flush=True)
    t0 = time.perf_counter()
    pack_bits_numba(torch.zeros(1, 8, dtype=torch.bool))
    info["numba_compile_s"] = time.perf_counter() - t0
    rows: list[dict[str, Any]] = [info]
    gen = torch.Generator().manual_seed(0)
    for h, d in ((3, 64), (8, 128)):
        rotation, _ = random_rotation(d, 0)
        for label, shape in (
            ("decode group, B1", (1, h, 128, d)),
            ("decode group, B8", (8, h, 128, d)),
            ("prefill 4096", (1, h, 4096, d)),
        ):
            keys = torch.randn(*shape, generator=gen)
            centroid = torch.randn(1, h, 1, d, generator=gen)
            bits = torch.randn(*shape, generator=gen) > 0
            equal = torch.equal(pack_bits(bits), pack_bits_numba(bits))
            rec = {
                "kind": "op",
                "case": label,
                "shape": list(shape),
                "equal": equal,
                "pack_torch_ms": 1e3 * timed(lambda b=bits: pack_bits(b)),
                "pack_numba_ms": 1e3 * timed(lambda b=bits: pack_bits_numba(b)),
                "quantize_torch_ms": 1e3
                * timed(lambda k=keys, c=centroid, p=rotation: quantize_keys_reference(k, c, p)),
                "quantize_numba_ms": 1e3
                * timed(
                    lambda k=keys, c=centroid, p=rotation: quantize_keys_reference(
                        k, c, p, pack=pack_bits_numba
                    )
                ),
            }
            rows.append(rec)
            print(
                f"{label} Hkv{h} D{d}: pack torch {rec['pack_torch_ms']:.3f} ms, numba "
                f"{rec['pack_numba_ms']:.3f} ms; whole quantisation {rec['quantize_torch_ms']:.3f} "
                f"-> {rec['quantize_numba_ms']:.3f} ms; equal={equal}",
                flush=True,
            )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.jsonl").open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
