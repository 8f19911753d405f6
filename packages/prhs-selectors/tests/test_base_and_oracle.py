"""The shared machinery of ``base.py`` against Python brute force, and the ``oracle`` and
``dense`` selectors on both cache layouts, GQA groups and batches of different lengths."""

from __future__ import annotations

import pytest
import torch

from prhs_core.config import SelectorConfig
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_selectors import Dense, Oracle
from prhs_selectors.base import block_any, block_max, block_sum, topk_mask, window_mask

# (lengths, Hq, Hkv, D): GQA ratios 1, 3 and 4; lengths not multiples of a block, T = 1.
GEOMETRIES = [
    ([37, 12, 1], 2, 2, 8),
    ([50, 29], 6, 2, 16),
    ([41, 64, 5], 8, 2, 8),
]
GEOMETRY_IDS = [f"T{'-'.join(map(str, ls))}-Hq{hq}-Hkv{hkv}-D{d}" for ls, hq, hkv, d in GEOMETRIES]


# -- window_mask, topk_mask, block_max, block_any --------------------------------------------
@pytest.mark.parametrize(
    ("n_sink", "n_local"), [(0, 0), (4, 0), (0, 5), (4, 32), (3, 7)], ids=lambda v: str(v)
)
def test_window_mask_matches_brute_force(n_sink: int, n_local: int) -> None:
    lens = torch.tensor([0, 1, 3, 8, 20, 40])
    t = 40
    got = window_mask(lens, t, n_sink, n_local)
    assert got.shape == (6, t) and got.dtype == torch.bool
    for b, n in enumerate(lens.tolist()):
        want = [i < n and (i < n_sink or i >= n - n_local) for i in range(t)]
        assert got[b].tolist() == want, (n, n_sink, n_local)


def _brute_topk(scores: list[float], k: int, eligible: list[bool]) -> list[bool]:
    order = sorted((i for i in range(len(scores)) if eligible[i]), key=lambda i: (-scores[i], i))
    chosen = set(order[:k])
    return [i in chosen for i in range(len(scores))]


@pytest.mark.parametrize("k", [0, 1, 3, 17, 40], ids=lambda k: f"k{k}")
def test_topk_mask_matches_brute_force_with_ties_and_eligibility(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    # Scores from a handful of integers: many ties, which must go to the lower position.
    scores = torch.randint(0, 4, (3, 2, 17), generator=g).float()
    eligible = torch.rand(3, 2, 17, generator=g) < 0.6
    eligible[0, 0] = False  # nothing eligible
    eligible[0, 1] = True  # everything eligible
    got = topk_mask(scores, k, eligible)
    for b in range(3):
        for h in range(2):
            want = _brute_topk(scores[b, h].tolist(), k, eligible[b, h].tolist())
            assert got[b, h].tolist() == want
    n_eligible = eligible.sum(-1)
    assert torch.equal(got.sum(-1), n_eligible.clamp(max=k))


def test_topk_mask_ignores_a_huge_ineligible_score() -> None:
    scores = torch.tensor([[1.0, 1e30, 2.0, 3.0]])
    eligible = torch.tensor([[True, False, True, True]])
    assert topk_mask(scores, 2, eligible).tolist() == [[False, False, True, True]]


@pytest.mark.parametrize("s", [1, 3, 4, 11], ids=lambda s: f"s{s}")
def test_block_max_and_block_any_match_brute_force(s: int) -> None:
    g = torch.Generator().manual_seed(s)
    t = 10
    scores = torch.randn(2, 3, t, generator=g)
    mask = torch.rand(2, 3, t, generator=g) < 0.2
    bm, ba = block_max(scores, s), block_any(mask, s)
    nb = -(-t // s)
    assert bm.shape == ba.shape == (2, 3, nb)
    for b in range(2):
        for h in range(3):
            for j in range(nb):
                lo, hi = j * s, min((j + 1) * s, t)
                assert bm[b, h, j].item() == max(scores[b, h, lo:hi].tolist())
                assert ba[b, h, j].item() == any(mask[b, h, lo:hi].tolist())


@pytest.mark.parametrize("s", [1, 3, 4, 10])
def test_block_sum_matches_brute_force(s: int) -> None:
    values = torch.rand(2, 3, 10, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
    bs = block_sum(values, s)
    for j in range(-(-10 // s)):
        torch.testing.assert_close(bs[..., j], values[..., j * s : (j + 1) * s].sum(-1))


# -- oracle ----------------------------------------------------------------------------------
@pytest.fixture
def new_sim(make_sim):
    """``new_sim(lengths, hq, hkv, d, layout="contiguous", **kw)``: a decode simulator."""

    def build(lengths, hq, hkv, d, layout="contiguous", **kw):
        return make_sim(lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout, **kw)

    return build


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_oracle_selects_windows_and_the_true_topk(new_sim, layout, lengths, hq, hkv, d) -> None:
    cfg = SelectorConfig(budget=6, n_sink=3, n_local=5)
    sim = new_sim(lengths, hq, hkv, d, layout)
    oracle = Oracle(cfg)
    pool = sim.attach(oracle)
    for _ in range(3):
        sel = oracle.select(sim.step(0), pool)
        assert sel.block_size == 1
        t = int(sim.lengths.max())
        mask = sel.to_mask(sim.lengths, t, hkv)
        probs = sim.group_probs(0)  # float64 brute force
        win = window_mask(sim.lengths, t, 3, 5)[:, None].expand_as(mask)
        assert bool((mask | ~win).all()), "a sink or local position was dropped"
        extra = mask & ~win
        available = (~win & sim.cache(0).valid_mask()[:, None]).sum(-1)
        assert torch.equal(extra.sum(-1), available.clamp(max=6))
        # The extra positions are the top by group-mean probability: none left out beats them.
        chosen_min = probs.masked_fill(~extra, float("inf")).amin(-1)
        rest = ~extra & ~win & sim.cache(0).valid_mask()[:, None]
        rest_max = probs.masked_fill(~rest, float("-inf")).amax(-1)
        assert bool((chosen_min >= rest_max - 1e-7).all())
        assert bool(sel.stats.retrieved.all())
        expect_bytes = sim.lengths.double() * d * 4
        assert torch.equal(sel.stats.proxy_bytes, expect_bytes.view(-1, 1).expand(-1, hkv))
        assert torch.equal(sel.stats.num_selected, mask.sum(-1))
        sim.advance()


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_oracle_with_budget_covering_the_sequence_is_dense(new_sim, lengths, hq, hkv, d) -> None:
    sim = new_sim(lengths, hq, hkv, d)
    oracle = Oracle(SelectorConfig(budget=max(lengths), n_sink=2, n_local=3))
    pool = sim.attach(oracle)
    sel = oracle.select(sim.step(0), pool)
    t = int(sim.lengths.max())
    valid = sim.cache(0).valid_mask()[:, None].expand(-1, hkv, -1)
    assert torch.equal(sel.to_mask(sim.lengths, t, hkv), valid)
    out, _ = sim.attend(0, sel)
    dense, _ = sim.attend(0, Selection(None))
    torch.testing.assert_close(out, dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("s", [4, 5], ids=lambda s: f"s{s}")
def test_oracle_block_mode_selects_aligned_top_blocks(new_sim, s: int) -> None:
    cfg = SelectorConfig(budget=9, n_sink=2, n_local=6, block_size=s)
    sim = new_sim([53, 30, 7], 4, 2, 8)
    oracle = Oracle(cfg)
    sel = oracle.select(sim.step(0), sim.attach(oracle))
    assert sel.block_size == s
    probs = sim.group_probs(0).float()
    t = int(sim.lengths.max())
    nb = -(-t // s)
    win_b = block_any(window_mask(sim.lengths, t, 2, 6)[:, None].expand(-1, 2, -1), s)
    valid_b = block_any(sim.cache(0).valid_mask()[:, None].expand(-1, 2, -1), s)
    chosen = torch.zeros(3, 2, nb, dtype=torch.bool)
    for b in range(3):
        for h in range(2):
            ids = [int(i) for i in sel.indices[b, h] if i >= 0]
            assert len(ids) == len(set(ids))
            chosen[b, h, ids] = True
    assert bool((chosen | ~win_b).all()) and not bool((chosen & ~valid_b).any())
    extra = chosen & ~win_b
    assert torch.equal(extra.sum(-1), (valid_b & ~win_b).sum(-1).clamp(max=max(1, 9 // s)))
    bmax = block_max(probs, s)
    lo = bmax.masked_fill(~extra, float("inf")).amin(-1)
    hi = bmax.masked_fill(~(valid_b & ~win_b & ~extra), float("-inf")).amax(-1)
    assert bool((lo >= hi - 1e-7).all())
    # Reading in blocks means whole aligned blocks, clipped at each sequence's end.
    pos = sel.positions(sim.lengths)
    mask = sel.to_mask(sim.lengths, t, 2)
    expect = chosen.repeat_interleave(s, -1)[..., :t] & sim.cache(0).valid_mask()[:, None]
    assert torch.equal(mask, expect)
    assert torch.equal(sel.stats.num_selected, (pos >= 0).sum(-1))


@pytest.mark.parametrize("name", ["oracle", "dense"])
@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_contiguous_and_paged_layouts_give_identical_results(
    new_sim, name, lengths, hq, hkv, d
) -> None:
    runs = []
    for layout in ("contiguous", "paged"):
        sim = new_sim(lengths, hq, hkv, d, layout, num_layers=2, max_new_tokens=3)
        sel = selectors.create(name, budget=5, n_sink=2, n_local=4)
        pool = sim.attach(sel)
        got = []
        for _ in range(3):
            for layer in range(2):
                s = sel.select(sim.step(layer), pool)
                out, lse = sim.attend(layer, s)
                assert bool(torch.isfinite(out).all())
                got.append((s.indices, s.stats.num_selected, out, lse))
            sim.advance()
        runs.append(got)
    for (ia, na, oa, la), (ib, nb, ob, lb) in zip(*runs, strict=True):
        assert (ia is None and ib is None) or torch.equal(ia, ib)
        assert torch.equal(na, nb) and torch.equal(oa, ob) and torch.equal(la, lb)


# -- dense -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_dense_reads_every_position(new_sim, layout, lengths, hq, hkv, d) -> None:
    sim = new_sim(lengths, hq, hkv, d, layout)
    dense = Dense(SelectorConfig(budget=3))
    sel = dense.select(sim.step(0), sim.attach(dense))
    assert sel.is_dense and sel.indices is None
    assert torch.equal(sel.stats.num_selected, sim.lengths.view(-1, 1).expand(-1, hkv))
    assert not bool(sel.stats.retrieved.any())
    out, _ = sim.attend(0, sel)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)
