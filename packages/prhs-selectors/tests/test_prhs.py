"""``prhs`` (CPE = CIS + PSAW + ETF): CIS at decode, PSAW's window and ETF's frozen prefix at
prefill when switched on, sharing one ``start_layer`` (``N // 2`` by default) and CIS's
``n_sink``."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core.protocols import PrefillPlanner
from prhs_core.registry import selectors
from prhs_selectors import CIS, ETF, PSAW, CISConfig, ETFConfig, PrHS, PrHSConfig, PSAWConfig


@pytest.mark.parametrize("n", [8, 32])
def test_prefill_plans_follow_both_formulas_with_the_default_start(n):
    sel = PrHS(PrHSConfig(phi=0.4, alpha=1.5, psi=0.6, gamma=0.8, use_psaw=True, use_etf=True))
    assert isinstance(sel, PrefillPlanner) and isinstance(sel, CIS)
    ls = n // 2
    for layer in range(n):
        plan = sel.plan_prefill(layer, n)
        if layer < ls:
            assert plan.is_dense
            continue
        f = 1 - 0.4 ** (1.5 * (layer - ls) / (n - ls))
        e = 1 - 0.6 ** (0.8 * (layer - ls) / (n - ls))
        assert plan.window_fraction == f and plan.frozen_fraction == e
        assert plan.window_start(40).tolist() == [math.floor(f * t) for t in range(40)]
        assert plan.frozen_prefix(40) == math.floor(e * 40)
        assert plan.n_sink == 4  # PSAW's visible sinks are the rows ETF keeps live


def test_default_cpe_is_cis_after_a_dense_prefill():
    assert not PrHSConfig().use_psaw and not PrHSConfig().use_etf
    assert PrHS(PrHSConfig(start_layer=2)).plan_prefill(5, 8).is_dense
    plan = PrHS(PrHSConfig(start_layer=2, use_psaw=True)).plan_prefill(5, 8)
    assert plan.frozen_fraction == 0.0 and plan.window_fraction > 0.0


def test_cpe_combines_psaw_and_etf():
    sel = PrHS(PrHSConfig(start_layer=2, use_psaw=True, use_etf=True))
    plan = sel.plan_prefill(5, 8)
    psaw = PSAW(PSAWConfig(start_layer=2)).plan_prefill(5, 8)
    etf = ETF(ETFConfig(start_layer=2)).plan_prefill(5, 8)
    assert torch.equal(plan.window_start(40), psaw.window_start(40))
    assert plan.window_fraction == psaw.window_fraction
    assert plan.frozen_prefix(40) == etf.frozen_prefix(40) > 0
    assert plan.frozen_rows(40) == etf.frozen_rows(40) == (4, plan.frozen_prefix(40))
    assert plan.n_sink == 4
    assert PrHS(PrHSConfig(start_layer=2, n_sink=7, use_psaw=True)).plan_prefill(5, 8).n_sink == 7
    no_psaw = PrHS(PrHSConfig(start_layer=2, use_psaw=False, use_etf=True)).plan_prefill(5, 8)
    assert no_psaw.window_fraction == 0.0 and no_psaw.frozen_fraction == etf.frozen_fraction
    assert no_psaw.frozen_rows(40) == etf.frozen_rows(40)  # sinks live without PSAW too
    no_etf = PrHS(PrHSConfig(start_layer=2, use_psaw=True)).plan_prefill(5, 8)
    assert no_etf.frozen_fraction == 0.0 and no_etf.window_fraction == psaw.window_fraction
    off = PrHS(PrHSConfig(start_layer=2, use_psaw=False, use_etf=False)).plan_prefill(5, 8)
    assert off.is_dense
    assert isinstance(selectors.create("prhs"), PrHS)


def test_decode_is_cis(make_sim, layout):
    """With the same CIS fields, PrHS selects exactly as CIS."""
    kw = {"budget": 8, "n_sink": 2, "n_local": 2, "block_size": 2, "tau": -1.0}  # reuse while fresh
    runs = []
    for sel in (CIS(CISConfig(**kw)), PrHS(PrHSConfig(**kw))):
        sim = make_sim(
            [40, 29], num_q_heads=4, num_kv_heads=2, head_dim=8, layout=layout, max_new_tokens=4
        )
        sim.attach(sel)
        got = []
        for _ in range(4):
            s = sim.select(0)
            got.append((s.indices.clone(), s.counts.clone(), s.stats.retrieved.clone()))
            sim.advance()
        runs.append(got)
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not bool(r.all()) for _, _, r in runs[0][1:])  # some step reused


def test_prhs_config_errors():
    with pytest.raises(ValueError, match="phi"):
        PrHSConfig(phi=0.0)
    with pytest.raises(ValueError, match="psi"):
        PrHSConfig(psi=1.0)
    with pytest.raises(ValueError, match="alpha"):
        PrHSConfig(alpha=-1.0)
    with pytest.raises(TypeError, match="use_psaw"):
        PrHSConfig(use_psaw=1)
    with pytest.raises(ValueError, match="tau"):
        PrHSConfig(tau=2.0)
    with pytest.raises(ValueError, match="start_layer"):
        PrHS(PrHSConfig(start_layer=8)).plan_prefill(0, 8)
