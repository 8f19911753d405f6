"""The CIS decision that also writes the non-retrieving rows' selections (``cis_decide_compose``)
on a GPU, the retrieving rows then composed by ``cis_compose(..., retrieving_only=True)``
(``split``) or in the top-k's last launch (``top_blocks_compose``, ``fused``): the Triton
launches against the torch decision, top-k and composition (retrieve / bad, selection, counts,
anchors, unions, the non-finite count, the retrieval flag) on random states, then a reuse step's
launches (decision, top-k, composition) timed back to back in a CUDA graph, ``old`` (the three
separate) against ``split`` and ``fused``, at the Table V CIS-8 shapes.

    python benchmarks/scripts/decide_compose_check.py
"""

from __future__ import annotations

import torch

from prhs_kernels.cis import (
    anchor_union_reference,
    cis_compose,
    cis_decide,
    cis_decide_compose,
    cis_local_width,
    top_blocks,
    top_blocks_compose,
)
from prhs_kernels.compose import window_widths
from prhs_kernels.timing import graph_ms

BURST = 16  # reuse steps a graph replays (each over its own layer's state)


def case(b, h, g, d, mm, m, r, s, n_local, hold, max_len, p_fresh, p_bad, seed):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    n = b + 3
    aq = torch.randn(n, h, g, d, generator=gen)
    lens = torch.randint(1, max_len, (b,), generator=gen, dtype=torch.int32)
    slots = torch.randperm(n, generator=gen)[:b]
    alen = torch.zeros(n, h, dtype=torch.int32)
    age = torch.randint(0, n_local + 1, (b, h), generator=gen)
    fresh = torch.rand(b, h, generator=gen) < p_fresh
    ta = torch.where(fresh, lens.view(-1, 1) - age, lens.view(-1, 1) - n_local - 1 - age)
    alen[slots] = ta.clamp(min=0).to(torch.int32)
    nb = -(-max_len // s)
    cnt = torch.randint(0, mm + 1, (n, h), generator=gen, dtype=torch.int32)
    idx = torch.stack([torch.randperm(nb, generator=gen)[:mm] for _ in range(n * h)]).view(n, h, mm)
    idx = torch.where(torch.arange(mm) < cnt.unsqueeze(-1), idx, -1).to(torch.int32)
    union, ucnt = anchor_union_reference(idx, cnt, m, r)
    scores = torch.rand(b, h, nb, generator=gen)
    own = -(-lens // s)
    scores[(scores < 0.2) | (torch.arange(nb) >= own.view(-1, 1, 1))] = float("-inf")
    query = torch.randn(b, h * g, d, generator=gen).bfloat16()
    bad = torch.rand(b, h, generator=gen) < p_bad
    query.view(b, h, g * d)[bad] = float("nan")
    ws = window_widths(4, n_local, s)[0]
    width = ws + mm + 2 * r * m + cis_local_width(n_local, s, hold)
    t = lambda x: x.to(dev)  # noqa: E731
    return dict(
        query=t(query), scores=t(scores), mm=mm,
        state=tuple(map(t, (aq, alen, idx, cnt, torch.zeros(n, h, dtype=torch.float64),
                            union, ucnt))),
        slots=t(slots), lens=t(lens), width=width,
        kw=dict(n_sink=4, n_local=n_local, block_size=s, m=m, r=r, hold_local=hold),
    )  # fmt: skip


def step(c, mode, path):
    """One layer's decision, top-k and composition (``mode``: ``old``, ``split`` or ``fused``,
    as the module says); ``(fn, outputs)`` (``fn`` runs it again)."""
    st = tuple(x.clone() for x in c["state"])
    b, h = c["lens"].shape[0], st[1].shape[1]
    dev = c["query"].device
    out = torch.full((b, h, c["width"]), 777, dtype=torch.int32, device=dev)
    cnt = torch.full((b, h), 777, dtype=torch.int32, device=dev)
    nonfinite = torch.zeros(1, dtype=torch.int64, device=dev)
    flag = torch.zeros(1, dtype=torch.bool, device=dev)
    kw, n_local = c["kw"], c["kw"]["n_local"]
    sel = dict(out_indices=out, out_counts=cnt)
    union = dict(anchor_union=st[5], anchor_union_cnt=st[6])
    got = {}

    def fn():
        if mode == "old":
            rb = cis_decide(
                c["query"], st[0], st[1], c["slots"], c["lens"], tau=-1.0, n_local=n_local,
                nonfinite=nonfinite, any_retrieve=flag, path=path,
            )  # fmt: skip
        else:
            rb = cis_decide_compose(
                c["query"], *st[:4], st[5], st[6], c["slots"], c["lens"], tau=-1.0, **kw, **sel,
                nonfinite=nonfinite, any_retrieve=flag, path=path,
            )  # fmt: skip
        got["rb"] = rb
        common = (*st[:5], c["slots"], c["lens"])
        if mode == "fused":
            got["top"] = top_blocks_compose(
                c["scores"], c["mm"], c["query"], *rb, *common, **kw, **sel, **union,
                any_retrieve=flag, path=path,
            )  # fmt: skip
            return
        got["top"] = top_blocks(c["scores"], c["mm"], rb[0], path=path)
        cis_compose(c["query"], *rb, *got["top"], *common, **kw, **sel, any_retrieve=flag,
                    **union, retrieving_only=mode == "split", path=path)  # fmt: skip

    fn()
    retrieve = got["rb"][0]
    top = tuple(torch.where(retrieve.unsqueeze(-1), x, 0) for x in got["top"])
    return fn, (*got["rb"], *top, out, cnt, nonfinite, flag, *st)


def graph_us(fns):
    """Median µs of one call of ``fns`` (a burst replayed from one CUDA graph), per call."""
    return graph_ms(fns) * 1e3 / len(fns)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    bad_cases = 0
    cases = [(True, 8, 42, 1, 0.5, 0.05), (False, 8, 42, 1, 1.0, 0.0), (True, 4, 10, 2, 0.0, 0.1),
             (True, 1, 7, 3, 0.7, 0.2), (False, 16, 64, 2, 0.6, 0.1)]  # fmt: skip
    for seed, (hold, s, m, r, p_fresh, p_bad) in enumerate(cases):
        mm = 128 if s == 8 else 64
        c = case(16, 8, 4, 128, mm, m, r, s, 32, hold, 5000, p_fresh, p_bad, seed)
        _, want = step(c, "old", "torch")
        for mode in ("split", "fused"):
            _, got = step(c, mode, "triton")
            ok = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            rows = got[0]
            print(f"case {seed} {mode} (hold={hold}, s={s}, m={m}, r={r}; {int(rows.sum())} "
                  f"of {rows.numel()} rows retrieve, {int(got[1].sum())} bad): "
                  f"{'equal' if ok else 'DIFFERENT'}")  # fmt: skip
            bad_cases += not ok
    # Reuse steps (every row reuses) at the Table V CIS-8 shapes: M 128, m 42, r 1, s 8.
    for name, b, h, g in (("llama2-7b B1", 1, 32, 1), ("llama3-8b B8", 8, 8, 4),
                          ("llama3-8b B16", 16, 8, 4), ("llama2-7b B8", 8, 32, 1)):  # fmt: skip
        times = {}
        for mode in ("old", "split", "fused"):
            layers = [case(b, h, g, 128, 128, 42, 1, 8, 32, True, 16384, 1.0, 0.0, 7 + i)
                      for i in range(BURST)]  # fmt: skip
            times[mode] = graph_us([step(c, mode, "triton")[0] for c in layers])
        print(f"{name}: a reuse step's decision, top-k and composition, µs a layer back to "
              f"back: old {times['old']:.2f}, split {times['split']:.2f}, "
              f"fused {times['fused']:.2f}")  # fmt: skip
    if bad_cases:
        raise SystemExit(f"{bad_cases} case(s) differ from the reference")


if __name__ == "__main__":
    main()
