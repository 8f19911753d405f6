"""Quest's page-score launch over its tile sizes and warps (``prhs_kernels.quest.triton.TUNING``
``scores_tile`` / ``scores_warps``), at Table V shapes, on a GPU: µs a layer (16 layers back to
back in one CUDA graph) and the bounds' bytes over that time. The side fields are laid out as
the selector keeps them (``[pages + 1, layers, Hkv, D]``, one layer's strided view read).

    python benchmarks/scripts/quest_scores_sweep.py
"""

from __future__ import annotations

from functools import partial

import torch

import prhs_kernels.quest.triton as qt
from prhs_kernels.quest import quest_page_scores
from prhs_kernels.timing import graph_ms

P, N_SINK, N_LOCAL, LAYERS, BURST = 16, 4, 64, 30, 16
SHAPES = [(1, 32, 32, 4096), (8, 32, 32, 16384), (16, 32, 8, 16384), (16, 32, 8, 32768)]
TILES, WARPS = (1024, 2048, 4096, 8192), (2, 4, 8)


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for b, hq, h, t in SHAPES:
        d = 128
        n_pages = -(-t // P)
        rows = b * n_pages + 1
        field = torch.randn(rows, LAYERS, h, d, device=dev).to(torch.bfloat16)
        kmin, kmax = field[:, 7], field[:, 8]  # one layer's rows, strided as in the side cache
        pages = torch.arange(b * n_pages, device=dev).view(b, n_pages)
        lens = torch.full((b,), t, dtype=torch.int32, device=dev)
        query = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        args = (query, kmin, kmax, pages, lens, None, d**-0.5)
        kw = dict(page_size=P, n_sink=N_SINK, n_local=N_LOCAL, path="triton")
        mb = b * h * n_pages * 2 * d * 2 / 1e6
        cells = []
        for tile in TILES:
            for warps in WARPS:
                qt.TUNING.update(scores_tile=tile, scores_warps=warps)
                us = graph_ms([partial(quest_page_scores, *args, **kw)] * BURST) * 1000 / BURST
                cells.append((us, tile, warps))
        best = min(cells)
        row = "  ".join(f"{tile}/{warps}:{us:.1f}" for us, tile, warps in cells)
        print(f"B{b} Hkv{h} T{t} ({mb:.1f} MB): {row}  best {best[1]}/{best[2]} {best[0]:.1f} us "
              f"({mb / best[0]:.2f} TB/s)", flush=True)  # fmt: skip
    qt.TUNING.update(scores_tile=4096, scores_warps=4)


if __name__ == "__main__":
    main()
