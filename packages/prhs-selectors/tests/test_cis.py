"""CIS (paper and certified modes), PSAW, ETF and CPE against brute-force Python references."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core import theory
from prhs_core.registry import selectors
from prhs_selectors.cis import CIS, CISConfig, dilate_blocks
from prhs_selectors.cpe import CPE, CPEConfig
from prhs_selectors.prefill import ETF, PSAW, ETFConfig, PSAWConfig


def _blocks_of(sel, b: int, h: int) -> set[int]:
    return {int(x) for x in sel.indices[b, h].tolist() if x >= 0}


def _window_blocks(t: int, s: int, n_sink: int, n_local: int) -> set[int]:
    pos = set(range(min(n_sink, t))) | set(range(max(0, t - n_local), t))
    return {p // s for p in pos}


def _anchor_blocks(probs: list[float], t: int, cfg: CISConfig) -> tuple[set[int], list[float]]:
    """Brute force S_a: the top k/s non-window blocks by their max group probability."""
    s = cfg.block_size
    nb = -(-t // s)
    bmax = [max(probs[j * s : min(t, (j + 1) * s)]) for j in range(nb)]
    win = _window_blocks(t, s, cfg.n_sink, cfg.n_local)
    cand = sorted((j for j in range(nb) if j not in win), key=lambda j: (-bmax[j], j))
    return set(cand[: max(1, cfg.budget // s)]), bmax


def _dilate(anchor: set[int], bmax: list[float], cfg: CISConfig, nb: int) -> set[int]:
    m = max(1, cfg.budget // cfg.block_size) // cfg.n_den
    top = sorted(anchor, key=lambda j: (-bmax[j], j))[:m]
    out = set(anchor)
    for p in top:
        for j in range(1, cfg.r + 1):
            out |= {x for x in (p - j, p + j) if 0 <= x < nb}
    return out


# ---------------------------------------------------------------------------------------------
# dilation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("m", "r"), [(0, 1), (1, 1), (2, 2), (5, 3), (3, 0)])
def test_dilation_adds_exactly_p_plus_minus_j(seed, m, r):
    g = torch.Generator().manual_seed(seed)
    n = 23
    anchor = torch.rand(3, n, generator=g) < 0.3
    score = torch.rand(3, n, generator=g)
    out = dilate_blocks(anchor, score, m, r)
    for row in range(3):
        members = [j for j in range(n) if anchor[row, j]]
        top = sorted(members, key=lambda j: (-float(score[row, j]), j))[:m]
        expected = set(members)
        for p in top:
            for j in range(1, r + 1):
                expected |= {x for x in (p - j, p + j) if 0 <= x < n}
        assert set(out[row].nonzero().flatten().tolist()) == expected


# ---------------------------------------------------------------------------------------------
# paper mode: the reuse rule and what a reuse reads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4])
def test_paper_mode_reuses_exactly_when_the_rule_says(make_sim, layout, block_size):
    cfg = CISConfig(budget=8, n_sink=2, n_local=6, block_size=block_size, tau=0.8, n_den=2, r=1)
    sel = CIS(cfg)
    steps = 14
    sim = make_sim(
        [57, 40, 33],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        layout=layout,
        max_new_tokens=steps,
        seed=3,
    )
    pool = sim.attach(sel)
    b, h, g = 3, 2, 2
    anchor_q = torch.zeros(b, h, g * 16)
    anchor_t = torch.zeros(b, h, dtype=torch.long)
    anchor_blocks: dict[tuple[int, int], tuple[set[int], list[float]]] = {}
    gen = torch.Generator().manual_seed(11)
    seen = {"reuse": 0, "retrieve": 0, "stale": 0}
    for step in range(steps):
        if step > 0:
            # Per (sequence, KV head): stay near the anchor or jump away.
            near = torch.rand(b, h, generator=gen) < 0.7
            scale = torch.where(near, 0.05, 5.0).repeat_interleave(g, 1).unsqueeze(-1)
            base = anchor_q.view(b, h, g, 16).reshape(b, h * g, 16)
            sim.queries[0] = base + scale * torch.randn(b, h * g, 16, generator=gen)
        q = sim.queries[0].reshape(b, h, g * 16)
        t = sim.lengths.view(-1, 1)
        cos = torch.nn.functional.cosine_similarity(q, anchor_q, dim=-1)
        has = anchor_t > 0
        fresh = (t - anchor_t) <= cfg.n_local
        expected_reuse = has & fresh & (cos >= cfg.tau)
        out = sel.select(sim.step(0), pool)
        assert torch.equal(out.stats.retrieved, ~expected_reuse)
        probs = sim.group_probs(0)
        for i in range(b):
            tt = int(sim.lengths[i])
            nb = -(-tt // cfg.block_size)
            win = _window_blocks(tt, cfg.block_size, cfg.n_sink, cfg.n_local)
            for j in range(h):
                got = _blocks_of(out, i, j)
                assert win <= got, "sink and local are always selected"
                if expected_reuse[i, j]:
                    seen["reuse"] += 1
                    a_set, a_max = anchor_blocks[(i, j)]
                    assert got == (_dilate(a_set, a_max, cfg, nb) | win) & set(range(nb))
                else:
                    seen["stale" if has[i, j] and not fresh[i, j] else "retrieve"] += 1
                    a_set, a_max = _anchor_blocks(probs[i, j, :tt].tolist(), tt, cfg)
                    assert got == a_set | win
                    anchor_blocks[(i, j)] = (a_set, a_max)
        anchor_q = torch.where(expected_reuse.unsqueeze(-1), anchor_q, q)
        anchor_t = torch.where(expected_reuse, anchor_t, t.expand(b, h))
        sim.advance()
    assert min(seen.values()) > 0, seen  # every branch was exercised


def test_budget_covering_everything_gives_dense_output(make_sim, layout):
    sel = selectors.create("cis", budget=4096, block_size=1, n_sink=0, n_local=1)
    sim = make_sim(
        [50, 31], num_q_heads=6, num_kv_heads=2, head_dim=8, layout=layout, max_new_tokens=4
    )
    pool = sim.attach(sel)
    for _ in range(4):
        out = sel.select(sim.step(0), pool)
        attn, _ = sim.attend(0, out)
        torch.testing.assert_close(attn.double(), sim.reference_output(0), rtol=1e-5, atol=1e-5)
        sim.advance()


def test_selection_is_identical_on_both_layouts(make_sim):
    picks = []
    for lay in ("contiguous", "paged"):
        sel = selectors.create("cis", budget=8, block_size=2, n_local=4, tau=0.5)
        sim = make_sim(
            [40, 29],
            num_q_heads=3,
            num_kv_heads=1,
            head_dim=8,
            layout=lay,
            max_new_tokens=5,
            seed=5,
        )
        pool = sim.attach(sel)
        run = []
        for _ in range(5):
            out = sel.select(sim.step(0), pool)
            run.append((out.indices.sort(-1).values, out.stats.retrieved))
            sim.advance()
        picks.append(run)
    for (a, ra), (b, rb) in zip(*picks, strict=True):
        assert torch.equal(a, b) and torch.equal(ra, rb)


def test_released_slot_starts_without_anchor(make_sim):
    sel = selectors.create("cis", budget=8, block_size=1, n_local=8)
    sim = make_sim([30], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=3)
    pool = sim.attach(sel)
    sel.select(sim.step(0), pool)
    sim.advance()
    sim.queries[0] = sim.queries[0] * 0 + 1.0
    sel.select(sim.step(0), pool)  # becomes the anchor
    assert bool(pool["anchor_len"][0, 0].gt(0).all())
    sim.release()
    sim.attach(sel, pool)  # the same slot, a new sequence
    assert bool(pool["anchor_len"][0, 0].eq(0).all())
    assert bool(sel.select(sim.step(0), pool).stats.retrieved.all())


# ---------------------------------------------------------------------------------------------
# certified mode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("require_cosine", [True, False])
@pytest.mark.parametrize(("block_size", "hq", "hkv"), [(1, 2, 2), (4, 4, 1), (2, 6, 2)])
def test_certificate_bounds_the_true_dropped_mass_every_step(
    make_sim, layout, require_cosine, block_size, hq, hkv
):
    cfg = CISConfig(
        budget=8,
        n_sink=2,
        n_local=8,
        block_size=block_size,
        tau=0.6,
        delta_max=0.3,
        require_cosine=require_cosine,
        k_max=32,
    )
    sel = CIS(cfg)
    steps = 12
    sim = make_sim(
        [48, 35],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=16,
        layout=layout,
        max_new_tokens=steps,
        seed=9,
    )
    # Peaked attention: a few keys aligned with a drifting query direction.
    gen = torch.Generator().manual_seed(2)
    direction = torch.randn(16, generator=gen)
    sim.keys[0][:, :, ::7] += 2.5 * direction
    pool = sim.attach(sel)
    reused = 0
    for _ in range(steps):
        sim.queries[0] = direction + 0.01 * torch.randn(sim.queries[0].shape, generator=gen)
        out = sel.select(sim.step(0), pool)
        mask = out.to_mask(sim.lengths, sim.max_len, hkv)
        logits = sim.logits(0)
        g = hq // hkv
        valid = torch.isfinite(logits)
        delta = theory.dropped_mass(
            logits.masked_fill(~valid, 0.0), mask.repeat_interleave(g, 1) & valid, valid
        )
        group_delta = delta.view(2, hkv, g).mean(-1)
        assert out.stats.delta_hat is not None
        assert bool((group_delta <= out.stats.delta_hat.double() * (1 + 1e-5) + 1e-7).all()), (
            group_delta,
            out.stats.delta_hat,
        )
        reuse = ~out.stats.retrieved
        assert bool((out.stats.delta_hat[reuse] <= cfg.delta_max).all())
        reused += int(reuse.sum())
        sim.advance()
    assert reused > 0  # the certificate did allow reuse


def test_certified_retrieval_is_the_smallest_top_p_set(make_sim):
    cfg = CISConfig(
        budget=4, n_sink=1, n_local=1, block_size=1, delta_max=0.2, delta_target=0.1, k_max=64
    )
    sel = CIS(cfg)
    sim = make_sim([60], num_q_heads=1, num_kv_heads=1, head_dim=8, max_new_tokens=1, seed=4)
    sim.keys[0] *= 3
    pool = sim.attach(sel)
    out = sel.select(sim.step(0), pool)
    probs = sim.group_probs(0)[0, 0, :60].tolist()
    # The certified set is sink ∪ S_a: the local window is read but not counted, because a
    # later reuse may no longer cover the anchor's local positions.
    kept = probs[0]
    rest = sorted(range(1, 60), key=lambda i: -probs[i])
    need = 0
    while 1 - kept > cfg.retrieval_target + 1e-12:
        kept += probs[rest[need]]
        need += 1
    expected = {0, 59, *rest[:need]}
    assert _blocks_of(out, 0, 0) == expected


def test_cis_config_errors():
    with pytest.raises(ValueError, match="tau"):
        CISConfig(tau=1.5)
    with pytest.raises(ValueError, match="budget"):
        CISConfig(budget=0)
    with pytest.raises(ValueError, match="delta_max"):
        CISConfig(delta_max=1.0)
    with pytest.raises(ValueError, match="no reuse rule"):
        CISConfig(require_cosine=False)
    with pytest.raises(ValueError, match="certified mode"):
        CISConfig(k_max=128)
    with pytest.raises(ValueError, match="delta_target"):
        CISConfig(delta_max=0.1, delta_target=0.2)
    with pytest.raises(ValueError, match="k_max"):
        CISConfig(delta_max=0.1, budget=64, k_max=32)
    with pytest.raises(ValueError, match="n_den"):
        CISConfig(n_den=0)


# ---------------------------------------------------------------------------------------------
# PSAW, ETF, CPE
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "start", "phi", "alpha"), [(30, None, 0.5, 1.0), (8, 2, 0.3, 1.5)])
def test_psaw_window_matches_the_formula(n, start, phi, alpha):
    sel = PSAW(PSAWConfig(phi=phi, alpha=alpha, start_layer=start, n_sink=3))
    ls = n // 2 if start is None else start
    length = 50
    for layer in range(n):
        plan = sel.plan_prefill(layer, n, length)
        if layer <= ls:
            assert plan.is_dense
            continue
        frac = 1 - phi ** (alpha * (layer - ls) / (n - ls))
        assert plan.window_start.tolist() == [math.floor(frac * t) for t in range(length)]
        mask = plan.attention_mask()
        for i in range(length):
            allowed = {j for j in range(i + 1) if j < 3 or j >= math.floor(frac * i)}
            assert set(mask[i].nonzero().flatten().tolist()) == allowed


def test_etf_frozen_prefix_matches_the_formula():
    sel = ETF(ETFConfig(psi=0.7, gamma=1.0))
    n, length = 12, 101
    prefixes = []
    for layer in range(n):
        plan = sel.plan_prefill(layer, n, length)
        expected = 0 if layer < 6 else math.floor((1 - 0.7 ** ((layer - 6) / 6)) * length)
        assert plan.frozen_prefix == expected
        assert plan.window_start is None
        prefixes.append(plan.frozen_prefix)
    assert prefixes == sorted(prefixes) and prefixes[-1] < length


def test_cpe_combines_cis_psaw_and_etf():
    sel = CPE(CPEConfig(start_layer=2))
    plan = sel.plan_prefill(5, 8, 40)
    psaw = PSAW(PSAWConfig(start_layer=2)).plan_prefill(5, 8, 40)
    etf = ETF(ETFConfig(start_layer=2)).plan_prefill(5, 8, 40)
    assert torch.equal(plan.window_start, psaw.window_start)
    assert plan.frozen_prefix == etf.frozen_prefix > 0
    assert sel.plan_prefill(5, 8, 40).n_sink == 4
    off = CPE(CPEConfig(start_layer=2, use_psaw=False, use_etf=False)).plan_prefill(5, 8, 40)
    assert off.is_dense
    assert isinstance(selectors.create("prhs"), CIS)


def test_prefill_plan_errors():
    with pytest.raises(ValueError, match="phi"):
        PSAWConfig(phi=1.0)
    with pytest.raises(ValueError, match="psi"):
        ETFConfig(psi=0.0)
    with pytest.raises(ValueError, match="gamma"):
        ETFConfig(gamma=-1.0)
    with pytest.raises(ValueError, match="start_layer"):
        PSAW(PSAWConfig(start_layer=9)).plan_prefill(0, 8, 10)
    with pytest.raises(ValueError, match="out of range"):
        ETF().plan_prefill(8, 8, 10)
