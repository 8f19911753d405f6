"""CIS's retrieval by block mass in two launches (``retrieval_compose``: the logits pass writing
block log-sum-exps, the top-k scoring its rows from them) against the three launches it replaces
(``retrieval_block_scores`` then ``top_blocks_compose``) and the torch path, on a GPU: winners,
selections, counts, anchors, unions and the cleared flag on random caches and states; then a
layer's decision and retrieval timed back to back in a CUDA graph (16 layers a replay) when no
row retrieves (a reuse step), when about 10 % do, and when all do, at Table V shapes.

    python benchmarks/scripts/retrieval_compose_check.py
"""

from __future__ import annotations

import torch

from prhs_core.layout import ContiguousKV
from prhs_kernels.cis import (
    anchor_union_reference,
    cis_decide_compose,
    cis_local_width,
    retrieval_block_scores,
    retrieval_compose,
    top_blocks_compose,
)
from prhs_kernels.compose import window_widths
from prhs_kernels.timing import graph_ms

BURST = 16  # layers a graph replays (each over its own state, one cache)
S, M_TOP, M, R, N_SINK, N_LOCAL = 8, 128, 42, 1, 4, 32  # Table V's CIS-8 row


def case(b, h, g, d, t, p_fresh, seed, keys=None):
    """A cache of ``t`` positions (``keys`` reused when given), anchors fresh with probability
    ``p_fresh`` (else too old: the row retrieves), a query."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    n = b + 2
    lens = torch.randint(max(t // 2, 1), t + 1, (b,), generator=gen, dtype=torch.int32)
    lens[0] = t
    slots = torch.randperm(n, generator=gen)[:b]
    age = torch.randint(0, N_LOCAL + 1, (b, h), generator=gen)
    fresh = torch.rand(b, h, generator=gen) < p_fresh
    ta = torch.where(fresh, lens.view(-1, 1) - age, lens.view(-1, 1) - N_LOCAL - 1 - age)
    alen = torch.zeros(n, h, dtype=torch.int32)
    alen[slots] = ta.clamp(min=0).to(torch.int32)
    nb = -(-t // S)
    cnt = torch.randint(0, M_TOP + 1, (n, h), generator=gen, dtype=torch.int32)
    idx = torch.stack([torch.randperm(nb, generator=gen)[:M_TOP] for _ in range(n * h)])
    idx = torch.where(torch.arange(M_TOP) < cnt.unsqueeze(-1), idx.view(n, h, M_TOP), -1)
    idx = idx.to(torch.int32)
    union, ucnt = anchor_union_reference(idx, cnt, M, R)
    if keys is None:
        keys = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16)
    kv = ContiguousKV(k=keys, v=keys, seq_lens=lens.to(dev))
    query = torch.randn(b, h * g, d, generator=gen).bfloat16().to(dev)
    aq = torch.randn(n, h, g, d, generator=gen)
    state = (aq, alen, idx, cnt, torch.zeros(n, h, dtype=torch.float64), union, ucnt)
    width = window_widths(N_SINK, N_LOCAL, S)[0] + M_TOP + 2 * R * M
    width += cis_local_width(N_LOCAL, S, True)
    return dict(query=query, kv=kv, slots=slots.to(dev), width=width,
                state=tuple(x.to(dev) for x in state))  # fmt: skip


def step(c, mode, path):
    """One layer's decision and retrieval (``mode``: ``three`` launches for the retrieval or
    ``two``); ``(fn, outputs)``."""
    st = tuple(x.clone() for x in c["state"])
    q, kv, slots = c["query"], c["kv"], c["slots"]
    b, h = q.shape[0], kv.num_kv_heads
    out = torch.full((b, h, c["width"]), 777, dtype=torch.int32, device=q.device)
    cnt = torch.full((b, h), 777, dtype=torch.int32, device=q.device)
    flag = torch.zeros(1, dtype=torch.bool, device=q.device)
    kw = dict(n_sink=N_SINK, n_local=N_LOCAL, block_size=S, m=M, r=R, hold_local=True)
    sel = dict(out_indices=out, out_counts=cnt)
    union = dict(anchor_union=st[5], anchor_union_cnt=st[6])
    got = {}

    def fn():
        rb = cis_decide_compose(q, *st[:4], st[5], st[6], slots, kv.seq_lens, tau=-1.0, **kw,
                                **sel, any_retrieve=flag, path=path)  # fmt: skip
        got["rb"] = rb
        if mode == "two":
            got["top"] = retrieval_compose(
                q, kv, 0.088, M_TOP, *rb, *st[:5], slots, **kw, **sel, **union,
                any_retrieve=flag, path=path,
            )  # fmt: skip
            return
        scores = retrieval_block_scores(q, kv, 0.088, rb[0], block_size=S, n_sink=N_SINK,
                                        n_local=N_LOCAL, score="mass", fill_idle=False,
                                        path=path)  # fmt: skip
        got["top"] = top_blocks_compose(scores, M_TOP, q, *rb, *st[:5], slots, kv.seq_lens,
                                        **kw, **sel, **union, any_retrieve=flag,
                                        path=path)  # fmt: skip

    fn()
    retrieve = got["rb"][0]
    idx, val = (torch.where(retrieve.unsqueeze(-1), x, 0) for x in got["top"])
    return fn, dict(rb=got["rb"], idx=idx, val=val, out=out, cnt=cnt, flag=flag, st=st)


def compare(got, want):
    """``(rows whose winners differ, max relative difference of the winners' values, whether
    everything else is equal)``."""
    retrieve = want["rb"][0]
    same_ids = (got["idx"] == want["idx"]).all(-1)
    differ = int((retrieve & ~same_ids).sum())
    v, w = got["val"][retrieve], want["val"][retrieve]
    fin = torch.isfinite(w)
    rel = ((v - w).abs() / w.abs().clamp_min(1e-30))[fin].max().item() if fin.any() else 0.0
    rest = all(torch.equal(a, b) for a, b in zip(got["rb"], want["rb"], strict=True))
    rest &= torch.equal(torch.isfinite(v), fin)
    if differ == 0:
        rest &= torch.equal(got["out"], want["out"]) and torch.equal(got["cnt"], want["cnt"])
        rest &= all(torch.equal(a, b) for a, b in zip(got["st"], want["st"], strict=True))
    return differ, rel, rest and torch.equal(got["flag"], want["flag"])


def graph_us(fns):
    """Median µs of one call of ``fns`` (a burst replayed from one CUDA graph), per call."""
    return graph_ms(fns) * 1e3 / len(fns)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    failures = 0
    cases = [(4, 8, 4, 128, 5000, 0.5), (2, 32, 1, 128, 4096, 0.3), (3, 4, 8, 64, 3000, 0.0),
             (16, 8, 4, 128, 16384, 0.9)]  # fmt: skip
    for seed, (b, h, g, d, t, p) in enumerate(cases):
        c = case(b, h, g, d, t, p, seed)
        _, want = step(c, "three", "torch")
        for mode in ("three", "two"):
            _, got = step(c, mode, "triton")
            differ, rel, rest = compare(got, want)
            n_ret = int(got["rb"][0].sum())
            print(f"case {seed} B{b} Hkv{h} g{g} T{t}, {mode} launches: {n_ret} of "
                  f"{b * h} rows retrieve; winners differ on {differ} rows, values within "
                  f"{rel:.1e} (rel.); the rest {'equal' if rest else 'DIFFERENT'}")  # fmt: skip
            failures += (not rest) or rel > 1e-4 or differ > max(1, n_ret // 20)
    for name, b, h, g, t in (("llama2-7b B1 T4k", 1, 32, 1, 4096),
                             ("llama3-8b B8 T4k", 8, 8, 4, 4096),
                             ("llama2-7b B8 T16k", 8, 32, 1, 16384),
                             ("llama3-8b B16 T16k", 16, 8, 4, 16384)):  # fmt: skip
        keys = torch.randn(b, h, t, 128, device="cuda", dtype=torch.bfloat16)
        line = []
        for label, p in (("none retrieve", 1.0), ("~10 % retrieve", 0.9), ("all retrieve", 0.0)):
            times = {}
            for mode in ("three", "two"):
                layers = [case(b, h, g, 128, t, p, 7 + i, keys) for i in range(BURST)]
                times[mode] = graph_us([step(c, mode, "triton")[0] for c in layers])
            line.append(f"{label}: three {times['three']:.2f} / two {times['two']:.2f}")
        print(f"{name}, decision + retrieval, µs a layer: " + "; ".join(line))
        del keys
    if failures:
        raise SystemExit(f"{failures} case(s) differ from the reference")


if __name__ == "__main__":
    main()
