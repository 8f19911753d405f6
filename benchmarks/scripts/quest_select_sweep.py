"""Quest's selection launch (``prhs_kernels.quest.quest_select``) over its search's radix bits
and warps a program (``prhs_kernels.quest.triton.TUNING``: ``radix_bits``, ``select_warps``),
at Table V shapes, on a GPU: µs a layer (16 layers back to back in one CUDA graph). At one
sequence a layer is only Hkv programs, each ranking every page of its row: latency, not bytes.

    python benchmarks/scripts/quest_select_sweep.py
"""

from __future__ import annotations

from functools import partial

import torch

import prhs_kernels.quest.triton as qt
from prhs_kernels.compose import window_widths
from prhs_kernels.quest import quest_select
from prhs_kernels.timing import graph_ms

P, N_SINK, N_LOCAL, K, BURST = 16, 4, 64, 64, 16
SHAPES = [(1, 32, 16384), (1, 32, 32768), (1, 8, 32768), (16, 8, 16384), (8, 32, 16384)]
BITS, WARPS = (1, 2, 4, 8), (4, 8, 16)


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    shipped = dict(qt.TUNING)
    rule = qt.search_warps
    qt.search_warps = lambda block: 1  # TUNING["select_warps"] alone sets the warps here
    for b, h, t in SHAPES:
        n_pages = -(-t // P)
        gen = torch.Generator().manual_seed(t + b)
        scores = torch.randn(b, h, n_pages, generator=gen).to(dev)
        lens = torch.full((b,), t, dtype=torch.int32, device=dev)
        ws, wl = window_widths(N_SINK, N_LOCAL, P)
        out = torch.empty(b, h, ws + K + wl, dtype=torch.int32, device=dev)
        cnt = torch.empty(b, h, dtype=torch.int32, device=dev)
        bad = torch.zeros(b, h, dtype=torch.bool, device=dev)
        kw = dict(page_size=P, n_sink=N_SINK, n_local=N_LOCAL, out_indices=out,
                  out_counts=cnt, path="triton")  # fmt: skip
        cells = []
        for bits in BITS:
            for warps in WARPS:
                qt.TUNING.update(radix_bits=bits, select_warps=warps)
                fn = partial(quest_select, scores, lens, bad, K, **kw)
                us = graph_ms([fn] * BURST) * 1000 / BURST
                cells.append((us, bits, warps))
        qt.TUNING.update(shipped)
        best = min(cells)
        row = "  ".join(f"{bits}b/{w}w:{us:.1f}" for us, bits, w in cells)
        print(f"B{b} Hkv{h} T{t} ({n_pages} pages): {row}  best {best[1]} bits, "
              f"{best[2]} warps: {best[0]:.1f} us", flush=True)  # fmt: skip
    qt.search_warps = rule


if __name__ == "__main__":
    main()
