"""PSAW and ETF: prefill plans against the published formulas, dense decode, config errors.

``P_ℓ(t) = ⌊(1 − φ^{α(ℓ−ℓ_s)/(N−ℓ_s)})·t⌋`` (PSAW's window start of row ``t``) and
``E_ℓ = ⌊(1 − ψ^{γ(ℓ−ℓ_s)/(N−ℓ_s)})·L⌋`` (ETF's frozen prefix), ``ℓ_s = N // 2`` by default;
layers below ``ℓ_s`` are untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core.protocols import PrefillLayerPlan, PrefillPlanner
from prhs_core.registry import selectors
from prhs_selectors import ETF, PSAW, ETFConfig, PSAWConfig
from prhs_selectors.prefill import DecoderDims, prefill_flops


def _fraction(base: float, power: float, layer: int, n: int, ls: int) -> float:
    return 0.0 if layer < ls else 1 - base ** (power * (layer - ls) / (n - ls))


@pytest.mark.parametrize(
    ("n", "start", "phi", "alpha", "n_sink"),
    [(30, None, 0.5, 1.0, 3), (8, 2, 0.3, 1.5, 0), (5, 0, 0.9, 0.5, 4), (1, None, 0.5, 1.0, 4)],
    ids=["N30-default", "N8-ls2", "N5-ls0", "N1"],
)
def test_psaw_window_matches_the_formula(n, start, phi, alpha, n_sink):
    sel = PSAW(PSAWConfig(phi=phi, alpha=alpha, start_layer=start, n_sink=n_sink))
    assert isinstance(sel, PrefillPlanner)
    ls = n // 2 if start is None else start
    length = 50
    starts = []
    for layer in range(n):
        plan = sel.plan_prefill(layer, n)
        assert isinstance(plan, PrefillLayerPlan) and plan.layer == layer
        assert plan.frozen_fraction == 0.0
        frac = _fraction(phi, alpha, layer, n, ls)
        assert plan.window_fraction == frac
        if layer <= ls:
            assert plan.is_dense and plan.n_sink == 0  # ℓ_s itself: φ^0 = 1, a zero window
            assert not bool(plan.window_start(length).any())
            continue
        assert plan.n_sink == n_sink
        want = [math.floor(frac * t) for t in range(length)]
        got = plan.window_start(length)
        assert got.dtype == torch.long and got.tolist() == want
        mask = plan.attention_mask(length)
        for i in range(length):
            allowed = {j for j in range(i + 1) if j < n_sink or j >= want[i]}
            assert set(mask[i].nonzero().flatten().tolist()) == allowed
        starts.append(want[-1])
    assert starts == sorted(starts)  # the window narrows with depth


@pytest.mark.parametrize(
    ("n", "start", "psi", "gamma", "n_sink"),
    [(12, None, 0.7, 1.0, 4), (32, None, 0.7, 2.0, 0), (8, 3, 0.2, 0.5, 2)],
    ids=["N12-default", "N32-gamma2-published", "N8-ls3-sink2"],
)
def test_etf_frozen_prefix_matches_the_formula(n, start, psi, gamma, n_sink):
    sel = ETF(ETFConfig(psi=psi, gamma=gamma, start_layer=start, n_sink=n_sink))
    assert isinstance(sel, PrefillPlanner)
    ls = n // 2 if start is None else start
    prefixes = []
    for layer in range(n):
        plan = sel.plan_prefill(layer, n)
        assert plan.window_fraction == 0.0 and plan.n_sink == n_sink
        frac = _fraction(psi, gamma, layer, n, ls)
        assert plan.frozen_fraction == frac
        for length in (0, 1, 7, 101, 4096):
            e = math.floor(frac * length)
            assert plan.frozen_prefix(length) == e
            assert plan.frozen_rows(length) == (min(n_sink, e), e)  # the sinks stay live
        assert plan.is_dense == (layer <= ls)
        prefixes.append(plan.frozen_prefix(101))
    assert prefixes == sorted(prefixes) and prefixes[-1] < 101


@pytest.mark.parametrize("name", ["psaw", "etf"])
def test_decode_is_dense(make_sim, layout, name):
    sim = make_sim([30, 9], num_q_heads=4, num_kv_heads=2, head_dim=8, layout=layout)
    sel = selectors.create(name)
    state = sim.attach(sel)
    assert state.side is None and sel.selection_width() == 0
    assert sim.select(0) is None
    out, _ = sim.attend(0, None)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)


def test_prefill_plan_errors():
    with pytest.raises(ValueError, match="phi"):
        PSAWConfig(phi=1.0)
    with pytest.raises(ValueError, match="alpha"):
        PSAWConfig(alpha=0.0)
    with pytest.raises(ValueError, match="n_sink"):
        PSAWConfig(n_sink=-1)
    with pytest.raises(ValueError, match="psi"):
        ETFConfig(psi=0.0)
    with pytest.raises(ValueError, match="gamma"):
        ETFConfig(gamma=-1.0)
    with pytest.raises(TypeError, match="gamma"):
        ETFConfig(gamma="1")
    with pytest.raises(ValueError, match="start_layer"):
        PSAW(PSAWConfig(start_layer=9)).plan_prefill(0, 8)
    with pytest.raises(ValueError, match="out of range"):
        ETF().plan_prefill(8, 8)
    with pytest.raises(ValueError, match="layer"):
        PSAW().plan_prefill(-1, 8)
    with pytest.raises(ValueError, match="prompt_len"):
        PSAW().plan_prefill(7, 8).window_start(-1)


def _brute_prefill_flops(planner, dims, n):
    """Row by row, from each layer plan's attention mask and frozen rows."""
    hq, hkv, d, hid = dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.hidden
    total = 0.0
    plans = getattr(planner, "plan_prefill", lambda layer, _: PrefillLayerPlan(layer))
    for layer in range(dims.num_layers):
        plan = plans(layer, dims.num_layers)
        mask = plan.attention_mask(n)
        a, e = plan.frozen_rows(n)
        for t in range(n):
            total += 2 * hid * 2 * hkv * d  # K and V: every row
            if a <= t < e:
                continue
            total += 2 * (2 * hid * hq * d + 3 * hid * dims.intermediate)
            total += 2 * 2 * hq * d * int(mask[t].sum())
    return total


@pytest.mark.parametrize(
    ("name", "options"),
    [("dense", {}), ("psaw", {"phi": 0.3, "n_sink": 2}), ("etf", {"psi": 0.4, "n_sink": 3}),
     ("prhs", {"phi": 0.4, "start_layer": 1, "use_psaw": True}),
     ("prhs", {"phi": 0.4, "psi": 0.5, "start_layer": 1, "use_psaw": True, "use_etf": True})],
)  # fmt: skip
def test_prefill_flops_count_what_the_plans_skip(name, options):
    dims = DecoderDims(num_layers=6, hidden=16, intermediate=40, num_q_heads=4, num_kv_heads=2,
                       head_dim=4)  # fmt: skip
    sel = selectors.create(name, **options)
    planned, dense = prefill_flops(sel, dims, 37)
    assert planned == pytest.approx(_brute_prefill_flops(sel, dims, 37), rel=1e-12)
    assert dense == pytest.approx(_brute_prefill_flops(selectors.create("dense"), dims, 37))
    assert (planned < dense) == (name != "dense")


def test_decoder_dims_from_a_transformers_config():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                          num_attention_heads=9, num_key_value_heads=3)  # fmt: skip
    assert DecoderDims.from_config(cfg) == DecoderDims(30, 576, 1536, 9, 3, 64)
    with pytest.raises(ValueError, match="hidden"):
        DecoderDims(30, 0, 1536, 9, 3, 64)
