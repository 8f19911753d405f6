"""The CIS composition with the anchors' union on a GPU: the Triton kernel against the torch
reference (selection, counts, anchors, unions) on random states, then the time of a reuse step's
composition with the union (a copy) against without it (a sort), at the Table V CIS-8 shapes.

    python benchmarks/scripts/compose_union_check.py
"""

from __future__ import annotations

import torch

from prhs_kernels.cis import anchor_union_reference, cis_compose, cis_local_width
from prhs_kernels.compose import window_widths
from prhs_kernels.timing import median_ms


def case(b, h, g, d, n, mm, m, r, s, n_sink, n_local, hold, max_len, p_retrieve, seed):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    aq = torch.randn(n, h, g, d, generator=gen)
    lens = torch.randint(1, max_len, (b,), generator=gen, dtype=torch.int32)
    slots = torch.randperm(n, generator=gen)[:b]
    alen = torch.zeros(n, h, dtype=torch.int32)
    alen[slots] = (
        (lens.view(-1, 1) - torch.randint(0, n_local + 1, (b, h), generator=gen))
        .clamp(min=1)
        .to(torch.int32)
    )
    nb = -(-max_len // s)
    cnt = torch.randint(0, mm + 1, (n, h), generator=gen, dtype=torch.int32)
    idx = torch.stack([torch.randperm(nb, generator=gen)[:mm] for _ in range(n * h)]).view(n, h, mm)
    idx = torch.where(torch.arange(mm) < cnt.unsqueeze(-1), idx, -1).to(torch.int32)
    logd = torch.zeros(n, h, dtype=torch.float64)
    union, ucnt = anchor_union_reference(idx, cnt, m, r)
    scores = torch.rand(b, h, nb, generator=gen)
    scores[scores < 0.2] = float("-inf")
    new_scores, new_idx = torch.topk(scores, mm, dim=-1)
    retrieve = torch.rand(b, h, generator=gen) < p_retrieve
    bad = (torch.rand(b, h, generator=gen) < 0.05) & ~retrieve
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    ws = window_widths(n_sink, n_local, s)[0]
    width = ws + mm + 2 * r * m + cis_local_width(n_local, s, hold)
    t = lambda x: x.to(dev)  # noqa: E731
    return dict(
        args=tuple(map(t, (query, retrieve, bad, new_idx.to(torch.int32), new_scores))),
        state=tuple(map(t, (aq, alen, idx, cnt, logd))),
        union=(t(union), t(ucnt)),
        slots=t(slots), lens=t(lens), width=width,
        kw=dict(n_sink=n_sink, n_local=n_local, block_size=s, m=m, r=r, hold_local=hold),
    )  # fmt: skip


def run(c, path, with_union):
    state = tuple(x.clone() for x in c["state"])
    union = tuple(x.clone() for x in c["union"])
    b, h = c["args"][1].shape
    out = torch.full((b, h, c["width"]), 777, dtype=torch.int32, device="cuda")
    cnt = torch.full((b, h), 777, dtype=torch.int32, device="cuda")
    extra = dict(anchor_union=union[0], anchor_union_cnt=union[1]) if with_union else {}
    fn = lambda: cis_compose(*c["args"], *state, c["slots"], c["lens"], **c["kw"],  # noqa: E731
                             out_indices=out, out_counts=cnt, **extra, path=path)  # fmt: skip
    fn()
    return out, cnt, state, union, fn


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    bad_cases = 0
    for seed, (hold, s, m, r, p) in enumerate(
        [(True, 8, 42, 1, 0.3), (False, 8, 42, 1, 0.0), (True, 4, 10, 2, 1.0), (True, 1, 7, 3, 0.5)]
    ):
        c = case(16, 8, 4, 128, 20, 128 if s == 8 else 64, m, r, s, 4, 32, hold, 5000, p, seed)
        go, gc, gs, gu, _ = run(c, "triton", True)
        wo, wc, ws, wu, _ = run(c, "torch", True)
        ok = torch.equal(go, wo) and torch.equal(gc, wc)
        ok &= all(torch.equal(a, b) for a, b in zip(gs, ws, strict=True))
        ok &= all(torch.equal(a, b) for a, b in zip(gu, wu, strict=True))
        print(f"case {seed} (hold={hold}, s={s}, m={m}, r={r}, retrieve {p:.0%}): "
              f"{'equal' if ok else 'DIFFERENT'}")  # fmt: skip
        bad_cases += not ok
    # Reuse steps (no row retrieves) at the Table V CIS-8 shapes: M 128, m 42, r 1, s 8.
    for name, b, h, g in (("llama2-7b B1", 1, 32, 1), ("llama3-8b B8", 8, 8, 4),
                          ("llama3-8b B16", 16, 8, 4), ("llama2-7b B8", 8, 32, 1)):  # fmt: skip
        c = case(b, h, g, 128, b + 1, 128, 42, 1, 8, 4, 32, True, 16384, 0.0, 7)
        times = {}
        for with_union in (False, True):
            *_, fn = run(c, "triton", with_union)
            times[with_union] = median_ms(fn, warmup_ms=10, rep_ms=50) * 1e3
        print(f"{name}: compose of a reuse step {times[False]:.2f} µs sorting, "
              f"{times[True]:.2f} µs copying the union (launch included)")  # fmt: skip
    if bad_cases:
        raise SystemExit(f"{bad_cases} case(s) differ from the reference")


if __name__ == "__main__":
    main()
