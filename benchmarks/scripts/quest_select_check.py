"""Quest's selection in one launch (``prhs_kernels.quest.quest_select``) on a GPU: against the
torch path (top-k, then the union with the windows) on random page scores, then the ``quest``
selector's Triton step against its torch step over a decode trace, then a layer's Quest
selection (page scores + selection) timed back to back in a CUDA graph, the selection by the
Triton launch and by the torch path, at Table V shapes.

    python benchmarks/scripts/quest_select_check.py
"""

from __future__ import annotations

import os
import sys

import torch

from prhs_kernels.compose import window_widths
from prhs_kernels.quest import quest_page_scores, quest_select
from prhs_kernels.timing import graph_ms

P, N_SINK, N_LOCAL, BUDGET = 16, 4, 64, 1024  # Table V's Quest row: pages of 16, budget 1024
K = BUDGET // P
BURST = 16  # layers a graph replays


def scores_case(b, h, t, seed):
    """Page scores as the scoring writes them: random bounds, -inf where no page may be picked."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(t // 2, 1), t + 1, (b,), generator=gen, dtype=torch.int32)
    lens[0] = t
    n_pages = -(-t // P)
    scores = torch.randn(b, h, n_pages, generator=gen)
    bad = torch.rand(b, h, generator=gen) < 0.1
    lens, scores, bad = lens.to(dev), scores.to(dev), bad.to(dev)
    from prhs_kernels.cis.reference import block_eligible_reference

    ok = block_eligible_reference(lens, n_pages, P, N_SINK, N_LOCAL).unsqueeze(1)
    return scores.masked_fill(~(ok & ~bad.unsqueeze(-1)), float("-inf")), lens, bad


def buffers(b, h):
    ws, wl = window_widths(N_SINK, N_LOCAL, P)
    width = ws + K + wl
    dev = torch.device("cuda")
    return (torch.full((b, h, width), -7, dtype=torch.int32, device=dev),
            torch.full((b, h), -7, dtype=torch.int32, device=dev))  # fmt: skip


def check_select() -> None:
    for b, h, t in [(4, 8, 5000), (16, 8, 16384), (1, 32, 4096), (8, 32, 32768), (3, 2, 300)]:
        scores, lens, bad = scores_case(b, h, t, seed=b * t)
        kw = dict(page_size=P, n_sink=N_SINK, n_local=N_LOCAL)
        out, cnt = buffers(b, h)
        ref, ref_cnt = buffers(b, h)
        quest_select(scores, lens, bad, K, **kw, out_indices=out, out_counts=cnt, path="triton")
        quest_select(scores, lens, bad, K, **kw, out_indices=ref, out_counts=ref_cnt)
        torch.cuda.synchronize()
        same = bool(torch.equal(out, ref)) and bool(torch.equal(cnt, ref_cnt))
        print(f"select B{b} Hkv{h} T{t}: Triton == torch: {same} "
              f"(mean count {cnt.float().mean().item():.1f})", flush=True)  # fmt: skip


def check_selector() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernels as bench

    bench.check_selector_paths(None, "quest", {"budget": 256, "dense_layers": 0})
    bench.check_selector_paths(None, "quest", {"budget": 1024, "dense_layers": 0})


def quest_layer(scoring: tuple, buf: tuple | None, path: str):
    """One layer's Quest work: the page scores of ``scoring`` (the arguments of
    ``quest_page_scores`` but the keywords), then, given buffers, the selection by ``path``."""
    kw = dict(page_size=P, n_sink=N_SINK, n_local=N_LOCAL)
    lens, bad = scoring[4], scoring[5]

    def run():
        s = quest_page_scores(*scoring, **kw, path="triton")
        if buf is not None:
            quest_select(s, lens, bad, K, **kw, out_indices=buf[0], out_counts=buf[1], path=path)

    return run


def time_layer() -> None:
    dev = torch.device("cuda")
    for b, hq, h, t in [(1, 32, 32, 4096), (8, 32, 32, 16384), (16, 32, 8, 16384),
                        (16, 32, 8, 32768)]:  # fmt: skip
        d = 128
        gen = torch.Generator().manual_seed(t + b)
        n_pages = -(-t // P)
        rows = b * n_pages + 1
        kmin = (torch.randn(rows, h, d, generator=gen) - 1).to(dev, torch.bfloat16)
        kmax = (kmin.float() + 2).to(torch.bfloat16)
        pages = torch.arange(b * n_pages, device=dev).view(b, n_pages)
        lens = torch.full((b,), t, dtype=torch.int32, device=dev)
        bad = torch.zeros(b, h, dtype=torch.bool, device=dev)
        query = torch.randn(b, hq, d, generator=gen).to(dev, torch.bfloat16)
        scoring = (query, kmin, kmax, pages, lens, bad, d**-0.5)
        bufs = [buffers(b, h) for _ in range(BURST)]
        ms = {}
        for name, path, with_buf in [("scores", "triton", False), ("triton", "triton", True),
                                     ("torch", "torch", True)]:  # fmt: skip
            fns = [quest_layer(scoring, bufs[i] if with_buf else None, path) for i in range(BURST)]
            ms[name] = graph_ms(fns) * 1000 / BURST
        read = b * h * (n_pages * 2 * d * 2) / 1e6
        print(f"layer B{b} Hq{hq} Hkv{h} T{t}: page scores {ms['scores']:.2f} us "
              f"({read:.1f} MB of bounds), + selection by Triton {ms['triton']:.2f} us, "
              f"+ by torch {ms['torch']:.2f} us", flush=True)  # fmt: skip


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    check_select()
    check_selector()
    time_layer()
