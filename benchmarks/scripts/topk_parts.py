"""Where a pass of the CIS top-k spends its time: the shipped kernel timed beside copies of it
with one part cut out (a GPU probe; the cut copies give wrong results, only their time counts).

Each variant is ``prhs_kernels/cis/triton.py`` with a text substitution, written to a temporary
module and imported, so the kernel under test is the shipped one line for line:

- ``shipped``: unchanged (the copy mechanism's control);
- ``search-1``: one round of the search for the ``k``-th key instead of ``32 / bits``;
- ``no-compact``: no prefix sums (each lane writes at its own index, masked to ``k``);
- ``no-sort``: the last pass does not sort its winners;
- ``floor``: all three cut (load, one round, store, the scratch round trip, the launch);
- ``tie-fast``: a correct candidate that skips the ties' prefix sum when there is no tie to
  break.

Usage (packages' ``src`` on ``PYTHONPATH``)::

    python benchmarks/scripts/topk_parts.py --out parts.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as kb

SEARCH = "for _ in range(32 // RADIX_BITS):"
STORE = "tl.store(scratch + pos, comp, mask=take)"
TAKE = "take = greater | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))"
POS = "pos = tl.cumsum(take.to(tl.int32), 0) - 1"
SORT = "if SORT:  # largest first"
SAFE_STORE = "tl.store(scratch + pos, comp, mask=take & (pos < BLOCK_K) & (pos >= 0))"

CUTS: dict[str, list[tuple[str, str]]] = {
    "shipped": [],
    "search-1": [(SEARCH, "for _ in range(1):")],
    # Every one of the first k lanes writes, so no scratch entry is left unwritten.
    "no-compact": [
        (TAKE, "take = greater | tie"),
        (POS, "pos = offs"),
        (SAFE_STORE, "tl.store(scratch + pos, comp, mask=pos < BLOCK_K)"),
    ],
    "no-sort": [(SORT, "if False:  # cut")],
}
CUTS["floor"] = CUTS["search-1"] + CUTS["no-compact"] + CUTS["no-sort"]
# The winners' prefix sum and scattered store apart: positions by lane, the prefix sum of the
# ties kept (``pos-by-lane``); the prefix sum kept but the store by lane (``store-by-lane``).
CUTS["pos-by-lane"] = [
    (POS, "pos = offs"),
    (SAFE_STORE, "tl.store(scratch + pos, comp, mask=pos < BLOCK_K)"),
]
CUTS["store-by-lane"] = [
    (SAFE_STORE, "tl.store(scratch + offs, comp, mask=(offs < BLOCK_K) & (pos >= -1))"),
]
# A correct candidate: the ties' prefix sum only when the threshold key is shared by more
# entries than are still needed (distinct keys, the common case, skip it).
CUTS["tie-fast"] = [
    (
        TAKE,
        "n_tie = tl.sum(tie.to(tl.int32), 0)\n"
        "        if n_tie == need:\n"
        "            take = greater | tie\n"
        "        else:\n"
        "            " + TAKE,
    )
]


def variant(name: str, source: str, tmp: str) -> Any:
    text = source.replace(STORE, SAFE_STORE)  # a cut search may take more than k lanes
    for old, new in CUTS[name]:
        if old not in text:
            raise SystemExit(f"{name}: the kernel no longer has {old!r}; update this probe")
        text = text.replace(old, new)
    path = os.path.join(tmp, f"topk_variant_{name.replace('-', '_')}.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    spec = importlib.util.spec_from_file_location(f"topk_variant_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="128x16384x1024x13,128x65536x1024x13,8x16384x1024x1",
                   help="ROWSxNxKxACTIVE, comma separated")  # fmt: skip
    p.add_argument("--bits", default="2", help="TUNING topk_radix_bits values, comma separated")
    p.add_argument("--variants", default=",".join(CUTS))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from prhs_kernels.cis import triton as ct

    with open(ct.__file__, encoding="utf-8") as fh:
        source = fh.read()
    out = open(a.out, "w", encoding="utf-8") if a.out else None
    kb.emit(out, {"part": "machine", **kb.machine()})
    gen = torch.Generator(device="cuda").manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        mods = {name: variant(name, source, tmp) for name in a.variants.split(",")}
        for case in a.cases.split(","):
            rows, n, k, active = (int(v) for v in case.split("x"))
            x = torch.softmax(2.0 * torch.randn(rows, n, generator=gen, device="cuda"), -1)
            act = torch.zeros(rows, dtype=torch.bool, device="cuda")
            act[torch.randperm(rows, generator=gen, device="cuda")[:active]] = True
            want = torch.topk(x, k, dim=-1).indices[act].int().sort(-1).values
            for (name, mod), bits in itertools.product(mods.items(), a.bits.split(",")):
                mod.TUNING["topk_radix_bits"] = int(bits)
                idx, _ = mod.top_blocks_triton(x, k, act)
                same = torch.equal(idx[act].sort(-1).values, want)
                ms = kb.graph_ms(lambda m=mod, x=x, k=k, a=act: m.top_blocks_triton(x, k, a))
                kb.emit(out, {"rows": rows, "n": n, "k": k, "active": active, "variant": name,
                              "radix_bits": int(bits), "plan": ct._topk_plan(n, k), "us": 1e3 * ms,
                              "equal_to_torch": same})  # fmt: skip
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
