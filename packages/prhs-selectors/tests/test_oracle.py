"""``oracle``: exact top-k by group-mean probability plus the windows, on every layout, GQA
ratio and batch of different lengths; aligned top blocks; the full budget is dense."""

from __future__ import annotations

import pytest
import torch

from prhs_core.config import SelectorConfig
from prhs_selectors import Oracle

# (lengths, Hq, Hkv, D): GQA ratios 1, 3 and 4; lengths not multiples of a block, T = 1.
GEOMETRIES = [
    ([37, 12, 1], 2, 2, 8),
    ([50, 29], 6, 2, 16),
    ([41, 64, 5], 8, 2, 8),
]
GEOMETRY_IDS = [f"T{'-'.join(map(str, ls))}-Hq{hq}-Hkv{hkv}-D{d}" for ls, hq, hkv, d in GEOMETRIES]


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_oracle_selects_windows_and_the_true_topk(
    make_sim, tools, layout, lengths, hq, hkv, d
) -> None:
    budget, n_sink, n_local = 6, 3, 5
    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout, max_new_tokens=3
    )
    oracle = Oracle(SelectorConfig(budget=budget, n_sink=n_sink, n_local=n_local))
    sim.attach(oracle)
    assert oracle.selection_width() == n_sink + budget + n_local + 1
    for _ in range(3):
        sel = sim.select(0)
        assert sel is not None and sel.block_size == 1
        probs = sim.group_probs(0)  # float64 brute force
        for b, n in enumerate(sim.lengths.tolist()):
            win = tools.window(n, n_sink, n_local)
            for h in range(hkv):
                got = tools.chosen(sel, b, h)
                assert win <= got, "a sink or local position was dropped"
                cand = [i for i in range(n) if i not in win]
                scores = probs[b, h].tolist()
                want = tools.brute_topk(cand, budget, scores)
                tools.assert_same_topk(got - win, want, scores, atol=1e-6)
        st = sel.stats
        assert bool(st.retrieved.all())
        expect_bytes = sim.lengths.double() * d * 4  # every float32 key
        assert torch.equal(st.proxy_bytes, expect_bytes.view(-1, 1).expand(-1, hkv))
        mask = sim.mask(sel)
        assert torch.equal(st.num_selected, mask.sum(-1).int())
        out, _ = sim.attend(0, sel)
        torch.testing.assert_close(out.double(), sim.reference_output(0, mask), rtol=0, atol=1e-5)
        sim.advance()


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_oracle_with_budget_covering_the_sequence_is_dense(
    make_sim, layout, lengths, hq, hkv, d
) -> None:
    sim = make_sim(lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout)
    oracle = Oracle(SelectorConfig(budget=max(lengths), n_sink=2, n_local=3))
    sim.attach(oracle)
    sel = sim.select(0)
    assert torch.equal(sim.mask(sel), sim.mask(None))
    out, lse = sim.attend(0, sel)
    dense, dense_lse = sim.attend(0, None)
    torch.testing.assert_close(out, dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, dense_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("s", [4, 5], ids=lambda s: f"s{s}")
def test_oracle_block_mode_selects_aligned_top_blocks(make_sim, tools, layout, s: int) -> None:
    budget, n_sink, n_local = 9, 2, 6
    cfg = SelectorConfig(budget=budget, n_sink=n_sink, n_local=n_local, block_size=s)
    sim = make_sim([53, 30, 7], num_q_heads=4, num_kv_heads=2, head_dim=8, layout=layout)
    oracle = Oracle(cfg)
    sim.attach(oracle)
    sel = sim.select(0)
    assert sel is not None and sel.block_size == s
    probs = sim.group_probs(0)
    k = max(1, budget // s)
    for b, n in enumerate(sim.lengths.tolist()):
        nb = -(-n // s)
        win_b = tools.blocks_of(tools.window(n, n_sink, n_local), s)
        for h in range(2):
            got = tools.chosen(sel, b, h)
            assert win_b <= got and got <= set(range(nb))
            bmax = tools.block_max(probs[b, h, :n].tolist(), s)
            cand = [j for j in range(nb) if j not in win_b]
            want = tools.brute_topk(cand, k, bmax)
            tools.assert_same_topk(got - win_b, want, bmax, atol=1e-6)
    # Reading in blocks means whole aligned blocks, clipped at each sequence's end.
    mask = sim.mask(sel)
    for b, n in enumerate(sim.lengths.tolist()):
        for h in range(2):
            want = {p for j in tools.chosen(sel, b, h) for p in range(j * s, min(n, j * s + s))}
            assert set(mask[b, h].nonzero().flatten().tolist()) == want
    assert torch.equal(sel.stats.num_selected, mask.sum(-1).int())
