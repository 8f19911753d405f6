"""The Theory page's statements: every equality checked exactly, every inequality on random and
adversarial input."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from prhs_core import theory as th

F64 = torch.float64
settings.register_profile("prhs", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("prhs")


# ---------------------------------------------------------------------------------------------
# strategies: logits (peaked, flat, huge), selections (random, all, sink only, empty)
# ---------------------------------------------------------------------------------------------
@st.composite
def logits_and_selection(draw: st.DrawFn, allow_empty: bool = False):
    rows = draw(st.integers(1, 4))
    t = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    style = draw(st.sampled_from(["normal", "peaked", "flat", "huge", "tiny"]))
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, t, generator=g, dtype=F64)
    logits = {
        "normal": base,
        "peaked": base * 30.0,
        "flat": torch.zeros(rows, t, dtype=F64),
        "huge": base * 1e3,  # keys of huge norm
        "tiny": base * 1e-6,
    }[style]
    kind = draw(st.sampled_from(["random", "all", "sink", "top", "bottom", "empty"]))
    if kind == "empty" and not allow_empty:
        kind = "sink"
    if kind == "random":
        sel = torch.rand(rows, t, generator=g) < draw(st.floats(0.05, 0.95))
        sel[:, 0] |= not allow_empty
    elif kind == "all":
        sel = torch.ones(rows, t, dtype=torch.bool)
    elif kind == "sink":  # nothing but the first position (an attention sink)
        sel = torch.zeros(rows, t, dtype=torch.bool)
        sel[:, 0] = True
    elif kind in ("top", "bottom"):
        k = draw(st.integers(1, t))
        order = torch.argsort(logits, dim=-1, descending=(kind == "top"))
        sel = torch.zeros(rows, t, dtype=torch.bool).scatter_(-1, order[:, :k], True)
    else:
        sel = torch.zeros(rows, t, dtype=torch.bool)
    return logits, sel


def values_like(
    logits: torch.Tensor, dv: int = 5, scale: float = 1.0, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*logits.shape, dv, generator=g, dtype=F64) * scale


def brute_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, -1)


# ---------------------------------------------------------------------------------------------
# masses
# ---------------------------------------------------------------------------------------------
@given(logits_and_selection(allow_empty=True))
def test_dropped_plus_retained_is_one_and_matches_probabilities(case):
    logits, sel = case
    p = brute_probs(logits)
    delta = th.dropped_mass(logits, sel)
    tau = th.retained_mass(logits, sel)
    torch.testing.assert_close(delta, (p * ~sel).sum(-1), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(delta + tau, torch.ones_like(delta), rtol=0, atol=1e-12)
    assert bool(((delta >= 0) & (delta <= 1)).all())


def test_dropped_mass_is_computed_directly_not_as_one_minus_tau():
    # The dropped position's mass is e^-700 / (1 + e^-700): 1 − τ rounds it to exactly 0.
    logits = torch.tensor([[0.0, -700.0]], dtype=F64)
    sel = torch.tensor([[True, False]])
    delta = th.dropped_mass(logits, sel)
    assert 1 - th.retained_mass(logits, sel).item() == 0.0
    assert delta.item() > 0
    assert th.log_dropped_mass(logits, sel).item() == pytest.approx(-700.0, abs=1e-9)


def test_nothing_dropped_gives_exactly_zero_and_log_minus_inf():
    logits = torch.randn(3, 7, dtype=F64)
    sel = torch.ones(3, 7, dtype=torch.bool)
    assert bool((th.dropped_mass(logits, sel) == 0).all())
    assert bool(torch.isneginf(th.log_dropped_mass(logits, sel)).all())


def test_valid_mask_ignores_padding_and_selected_padding():
    logits = torch.tensor([[1.0, 2.0, 99.0], [0.5, 0.1, -3.0]], dtype=F64)
    valid = torch.tensor([[True, True, False], [True, True, True]])
    sel = torch.tensor([[True, False, True], [True, False, False]])
    p0 = torch.softmax(logits[0, :2], -1)
    p1 = torch.softmax(logits[1], -1)
    expected = torch.stack([p0[1], p1[1] + p1[2]])
    torch.testing.assert_close(th.dropped_mass(logits, sel, valid), expected)


# ---------------------------------------------------------------------------------------------
# §2.1 TV(p, p_S) = δ, §2.2 the o − o_S identity and its bound
# ---------------------------------------------------------------------------------------------
@given(logits_and_selection())
def test_tv_between_p_and_p_s_equals_delta(case):
    logits, sel = case
    p = th.attention_probs(logits)
    ps = th.restricted_probs(logits, sel)
    torch.testing.assert_close(
        th.total_variation(p, ps), th.dropped_mass(logits, sel), rtol=1e-9, atol=1e-12
    )
    assert bool((ps[~sel] == 0).all())
    torch.testing.assert_close(ps.sum(-1), torch.ones(ps.shape[0], dtype=F64))


@given(logits_and_selection(), st.sampled_from([1e-3, 1.0, 1e3]))
def test_output_difference_identity_and_bound(case, vscale):
    logits, sel = case
    v = values_like(logits, scale=vscale)
    o = th.dense_output(logits, v)
    o_s = th.sparse_output(logits, v, sel)
    delta = th.dropped_mass(logits, sel)
    mu = th.tail_mean(logits, v, sel)
    lhs = o - o_s
    rhs = delta.unsqueeze(-1) * (mu - o_s)
    torch.testing.assert_close(lhs, rhs, rtol=1e-8, atol=1e-10 * vscale)
    err = th.output_error(logits, v, sel)
    bound = th.output_error_bound(delta, v)
    assert bool((err <= bound * (1 + 1e-9) + 1e-12 * vscale).all())


def test_sparse_output_matches_brute_force():
    torch.manual_seed(0)
    logits = torch.randn(2, 9, dtype=F64)
    v = torch.randn(2, 9, 4, dtype=F64)
    sel = torch.rand(2, 9) < 0.5
    sel[:, 3] = True
    for r in range(2):
        idx = sel[r].nonzero().flatten()
        w = torch.softmax(logits[r, idx], -1)
        torch.testing.assert_close(th.sparse_output(logits, v, sel)[r], w @ v[r, idx])
        tail = (~sel[r]).nonzero().flatten()
        wt = torch.softmax(logits[r, tail], -1)
        torch.testing.assert_close(th.tail_mean(logits, v, sel)[r], wt @ v[r, tail])


def test_output_bound_is_attained_by_opposite_values():
    # Two positions, v_0 = +u, v_1 = −u: o − o_S = δ(v_1 − v_0) has norm exactly 2δ‖u‖.
    logits = torch.tensor([[0.3, -0.2]], dtype=F64)
    v = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]], dtype=F64)
    sel = torch.tensor([[True, False]])
    delta = th.dropped_mass(logits, sel)
    torch.testing.assert_close(th.output_error(logits, v, sel), th.output_error_bound(delta, v))


# ---------------------------------------------------------------------------------------------
# §2.3 entropy continuity
# ---------------------------------------------------------------------------------------------
def test_binary_entropy_of_tiny_arguments_keeps_its_second_term():
    # h(x) = x ln(1/x) + x + O(x²): ln(1 − x) rounds to 0 below 1e-16, log1p does not.
    for x in (1e-20, 1e-12, 1e-300):
        want = x * math.log(1 / x) + x
        got = th.binary_entropy(torch.tensor(x, dtype=F64)).item()
        assert got == pytest.approx(want, rel=1e-12, abs=0)
    tiny = torch.tensor(1e-30, dtype=torch.float32)
    want = 1e-30 * math.log(1e30) + 1e-30
    assert th.binary_entropy(tiny).item() == pytest.approx(want, rel=1e-5, abs=0)
    edge = th.binary_entropy(torch.tensor([0.0, 1.0, 1 - 1e-16], dtype=F64))
    assert edge[0] == 0.0 and edge[1] == 0.0 and torch.isfinite(edge).all()
    # The entropy bound inherits it: f(δ) for a tiny δ is about δ ln(t/δ), not δ ln t alone.
    d = torch.tensor(1e-20, dtype=F64)
    bound = th.entropy_continuity_bound(d, 1000).item()
    assert bound == pytest.approx(1e-20 * (math.log(999) + math.log(1e20) + 1), rel=1e-9, abs=0)


def test_masses_do_not_move_when_every_logit_shifts_by_a_constant():
    # Logits on a grid of 1/8 stay exact when shifted by 4096 in float32, so any difference is
    # the computation's: the masses are differences of log-sum-exps, taken relative to the max.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-160, 160, (4, 300), generator=gen).float() / 8
    sel = torch.rand(4, 300, generator=gen) < 0.3
    valid = torch.rand(4, 300, generator=gen) < 0.9
    for shift in (4096.0, -4096.0, 1e6 / 8):
        moved = logits + shift
        assert torch.equal(moved - shift, logits)  # exactly representable
        for f in (th.dropped_mass, th.retained_mass, th.retained_mass_gap, th.log_dropped_mass):
            assert torch.equal(f(moved, sel, valid), f(logits, sel, valid)), (f.__name__, shift)
        a = th.top_p_budget(moved, 0.05, valid)
        b = th.top_p_budget(logits, 0.05, valid)
        assert torch.equal(a.size, b.size) and torch.equal(a.dropped, b.dropped)
        assert torch.equal(a.mask, b.mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_tensors_on_two_devices_get_our_error():
    logits = torch.randn(2, 5)
    sel = torch.ones(2, 5, dtype=torch.bool, device="cuda")
    with pytest.raises(ValueError, match="selected is on cuda"):
        th.dropped_mass(logits, sel)
    with pytest.raises(ValueError, match="values is on cuda"):
        th.dense_output(logits, torch.randn(2, 5, 3, device="cuda"))
    with pytest.raises(ValueError, match="anchor is on cuda"):
        th.logit_shift_bound(torch.randn(4), torch.randn(4, device="cuda"), 1.0, 1.0)
    with pytest.raises(ValueError, match="eps is on cuda"):
        th.log_reuse_certificate(torch.tensor([-1.0]), torch.tensor([0.1], device="cuda"))


def test_binary_entropy_values():
    x = torch.tensor([0.0, 0.5, 1.0, 0.1], dtype=F64)
    expected = torch.tensor(
        [0.0, math.log(2), 0.0, -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))], dtype=F64
    )
    torch.testing.assert_close(th.binary_entropy(x), expected)


@pytest.mark.parametrize("t", [2, 3, 10, 1000])
@pytest.mark.parametrize("eps", [0.0, 0.01, 0.3])
def test_entropy_bound_is_tight(t, eps):
    # p a point mass, q moves ε of it uniformly onto the other t − 1 points: equality holds.
    if eps > 1 - 1 / t:
        pytest.skip("outside the bound's regime")
    p = torch.zeros(t, dtype=F64)
    p[0] = 1
    q = torch.full((t,), eps / (t - 1), dtype=F64)
    q[0] = 1 - eps
    gap = (th.entropy(p) - th.entropy(q)).abs()
    torch.testing.assert_close(th.total_variation(p, q), torch.tensor(eps, dtype=F64))
    torch.testing.assert_close(th.entropy_continuity_bound(eps, t), gap, rtol=1e-12, atol=1e-14)


def test_entropy_bound_continues_as_log_t_and_is_monotone():
    t = 5
    tv = torch.linspace(0, 1, 201, dtype=F64)
    b = th.entropy_continuity_bound(tv, t)
    assert bool((b[1:] >= b[:-1] - 1e-12).all())
    assert b[-1].item() == pytest.approx(math.log(t))
    assert th.entropy_continuity_bound(1 - 1 / t, t).item() == pytest.approx(math.log(t))
    # t = 1: one position, nothing can move.
    assert th.entropy_continuity_bound(0.0, 1).item() == 0.0


@given(logits_and_selection())
def test_entropy_of_restriction_within_bound(case):
    logits, sel = case
    p = th.attention_probs(logits)
    ps = th.restricted_probs(logits, sel)
    delta = th.dropped_mass(logits, sel)
    gap = (th.entropy(p) - th.entropy(ps)).abs()
    bound = th.entropy_continuity_bound(delta.clamp(0, 1), logits.shape[-1])
    assert bool((gap <= bound + 1e-9).all()), (gap, bound)


# ---------------------------------------------------------------------------------------------
# §2.4 routing mutual information
# ---------------------------------------------------------------------------------------------
def test_routing_mi_known_values():
    same = torch.softmax(torch.randn(1, 7, dtype=F64), -1).expand(4, 7)
    assert th.routing_mutual_information(same).item() == pytest.approx(0.0, abs=1e-12)
    onehot = torch.eye(4, 6, dtype=F64)  # 4 queries routed to 4 distinct positions
    assert th.routing_mutual_information(onehot).item() == pytest.approx(math.log(4))


@given(
    st.integers(0, 10_000),
    st.integers(1, 6),
    st.integers(1, 30),
    st.sampled_from([0.3, 3.0, 40.0]),
    st.sampled_from(["random", "top", "sink"]),
)
def test_mi_loss_within_b_mi(seed, q, t, scale, kind):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, q, t, generator=g, dtype=F64) * scale
    if kind == "random":
        sel = torch.rand(2, q, t, generator=g) < 0.5
        sel[..., 0] = True
    elif kind == "top":
        sel = th.oracle_topk_mask(logits, max(1, t // 3))
    else:
        sel = torch.zeros(2, q, t, dtype=torch.bool)
        sel[..., 0] = True
    p = th.attention_probs(logits)
    ps = th.restricted_probs(logits, sel)
    deltas = th.dropped_mass(logits, sel)
    d_mi = (th.routing_mutual_information(p) - th.routing_mutual_information(ps)).abs()
    b_mi = th.mi_loss_bound(deltas, t)
    weak = 2 * th.entropy_continuity_bound(deltas.mean(-1), t)
    assert bool((d_mi <= b_mi + 1e-9).all()), (d_mi, b_mi)
    assert bool((b_mi <= weak + 1e-12).all())


def test_mi_loss_bound_formula():
    deltas = torch.tensor([0.1, 0.3], dtype=F64)
    t = 9

    def f(d: float) -> float:
        return d * math.log(t - 1) - d * math.log(d) - (1 - d) * math.log(1 - d)

    expected = f(0.2) + (f(0.1) + f(0.3)) / 2
    assert th.mi_loss_bound(deltas, t).item() == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# §2.5 the pre-hoc reuse certificate
# ---------------------------------------------------------------------------------------------
def test_certificate_formula_is_attained():
    # Shift every dropped logit by +ε and every kept one by −ε: δ' equals δ̂ exactly.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 20, generator=g, dtype=F64) * 3
    sel = th.oracle_topk_mask(logits, 6)
    eps = torch.tensor([0.0, 0.05, 0.7, 4.0], dtype=F64)
    shifted = logits + torch.where(sel, -eps.unsqueeze(-1), eps.unsqueeze(-1))
    d_a = th.dropped_mass(logits, sel)
    attained, bound = th.dropped_mass(shifted, sel), th.reuse_certificate(d_a, eps)
    # Equal up to the 1e-9 (relative) margin the bound adds for its own rounding.
    torch.testing.assert_close(attained, bound, rtol=2e-9, atol=1e-14)
    assert bool((bound >= attained).all())


def test_certificate_edge_values():
    assert th.reuse_certificate(0.0, 5.0).item() == 0.0
    assert th.reuse_certificate(1.0, 0.3).item() == 1.0
    assert th.reuse_certificate(0.25, 0.0).item() == pytest.approx(0.25)
    assert th.reuse_certificate(0.25, float("inf")).item() == 1.0
    # Log form keeps a mass far below float64's smallest normal number.
    out = th.log_reuse_certificate(torch.tensor(-900.0, dtype=F64), 1.5)
    assert out.item() == pytest.approx(-897.0, abs=1e-9)


@given(
    st.integers(0, 100_000),
    st.integers(1, 4),
    st.integers(8, 64),
    st.integers(0, 6),
    st.sampled_from([1e-3, 0.1, 1.0]),
    st.sampled_from([1.0, 30.0]),
)
def test_certificate_bounds_true_drop_for_gqa_groups(seed, g, t_anchor, n_new, noise, key_scale):
    """δ(S; q) ≤ δ̂ for real keys: S = top-k of the anchor plus every position added since."""
    gen = torch.Generator().manual_seed(seed)
    d = 16
    scaling = 1 / math.sqrt(d)
    t = t_anchor + n_new
    keys = torch.randn(t, d, generator=gen, dtype=F64) * key_scale
    keys[torch.randint(t, (1,), generator=gen)] *= 20  # one key of huge norm
    q_a = torch.randn(g, d, generator=gen, dtype=F64)  # the group's g query heads
    q = q_a + noise * torch.randn(g, d, generator=gen, dtype=F64)
    anchor_logits = (q_a @ keys[:t_anchor].T) * scaling  # [g, t_anchor]
    # GQA: the group scores positions by mean probability; S = its top-k plus the new positions.
    group_p = th.attention_probs(anchor_logits).mean(0)
    k = max(1, t_anchor // 4)
    sel = torch.zeros(t, dtype=torch.bool)
    sel[:t_anchor] = th.oracle_topk_mask(group_p.unsqueeze(0), k)[0]
    sel[t_anchor:] = True
    d_a = th.dropped_mass(anchor_logits, sel[:t_anchor].expand(g, -1)).mean()
    kmax = keys.norm(dim=-1).max()
    eps = th.logit_shift_bound(q, q_a, kmax, scaling).max()
    new_logits = (q @ keys.T) * scaling
    d_true = th.dropped_mass(new_logits, sel.expand(g, -1)).mean()
    assert d_true.item() <= th.reuse_certificate(d_a, eps).item() * (1 + 1e-12) + 1e-300


def test_logit_shift_bound_bounds_every_logit_change():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(50, 8, generator=g, dtype=F64) * 5
    q_a, q = torch.randn(2, 8, generator=g, dtype=F64)
    eps = th.logit_shift_bound(q, q_a, keys.norm(dim=-1).max(), 0.125)
    shift = ((q - q_a) @ keys.T * 0.125).abs().max()
    assert shift.item() <= eps.item()
    # Unit queries: ‖q − q_a‖ = sqrt(2 − 2 cos).
    u, w = torch.nn.functional.normalize(torch.randn(2, 8, generator=g, dtype=F64), dim=-1)
    cos = (u @ w).item()
    assert th.logit_shift_bound(u, w, 1.0, 1.0).item() == pytest.approx(math.sqrt(2 - 2 * cos))


# ---------------------------------------------------------------------------------------------
# §2.5 the per-page certificate, rounding
# ---------------------------------------------------------------------------------------------
def _pages(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, ...]:
    """Box (min, max) and ball (mean, radius) of every aligned page of ``keys [T, D]``."""
    t, d = keys.shape
    pad = -t % page
    k = keys.double()
    lo = torch.nn.functional.pad(k, (0, 0, 0, pad), value=math.inf).view(-1, page, d).amin(1)
    hi = torch.nn.functional.pad(k, (0, 0, 0, pad), value=-math.inf).view(-1, page, d).amax(1)
    n = torch.nn.functional.pad(torch.ones(t, dtype=F64), (0, pad)).view(-1, page)
    centre = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(-1, page, d).sum(1) / n.sum(1, True)
    dist = (torch.nn.functional.pad(k, (0, 0, 0, pad)).view(-1, page, d) - centre[:, None]).norm(
        dim=-1
    )
    radius = torch.where(n > 0, dist, -math.inf).amax(1)
    return lo, hi, centre, radius


@st.composite
def reuse_case(draw: st.DrawFn):
    """An anchor's group of queries, keys in pages, a chosen set, a later group of queries."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    g = draw(st.integers(1, 4))
    d = draw(st.sampled_from([4, 16]))
    page = draw(st.sampled_from([1, 3, 16]))
    t_anchor = draw(st.integers(1, 70))
    n_new = draw(st.integers(0, 5))
    dtype = draw(st.sampled_from([torch.float32, F64]))
    scaling = draw(st.sampled_from([1 / math.sqrt(d), 1.0, 7.3]))
    kind = draw(st.sampled_from(["normal", "channels", "outlier", "tiny"]))
    t = t_anchor + n_new
    keys = torch.randn(t, d, generator=gen, dtype=F64)
    if kind == "channels":  # a few huge channels, as real keys have
        keys = keys * torch.logspace(-2, 2, d, dtype=F64)[torch.randperm(d, generator=gen)]
    elif kind == "outlier":
        keys[torch.randint(t, (1,), generator=gen)] *= 50
    elif kind == "tiny":
        keys = keys * 1e-4
    q_a = torch.randn(g, d, generator=gen, dtype=F64) * draw(st.sampled_from([0.3, 1.0, 4.0]))
    sel = torch.rand(t, generator=gen) < draw(st.floats(0.0, 1.0))
    sel[t_anchor:] = True  # every position added since the anchor is read
    noise = draw(st.sampled_from([0.0, 0.01, 0.3, 2.0]))
    direction = draw(st.sampled_from(["random", "adversarial"]))
    if direction == "adversarial" and (~sel).any() and sel[:t_anchor].any():
        # Move every head toward the dropped keys and away from the selected ones.
        toward = keys[~sel].mean(0) - keys[:t_anchor][sel[:t_anchor]].mean(0)
        dq = toward / toward.norm().clamp_min(1e-30) * noise * math.sqrt(d)
        q = q_a + dq
    else:
        q = q_a + noise * torch.randn(g, d, generator=gen, dtype=F64)
    return keys.to(dtype), q_a.to(dtype), q.to(dtype), sel, t_anchor, page, scaling


@given(reuse_case())
def test_page_certificates_bound_the_dropped_mass_of_every_query_head(case):
    keys, q_a, q, sel, t_anchor, page, scaling = case
    k64 = keys.double()
    anchor_logits = (q_a.double() @ k64[:t_anchor].T) * scaling  # [g, t_a]
    new_logits = (q.double() @ k64.T) * scaling  # [g, t]
    true = th.dropped_mass(new_logits, sel.expand_as(new_logits))  # per head
    m_drop, m_sel = th.page_log_masses(anchor_logits, sel[:t_anchor].expand_as(anchor_logits), page)
    lo, hi, centre, radius = _pages(keys[:t_anchor], page)
    box = th.page_box_shift_bounds(q, q_a, lo.to(keys.dtype), hi.to(keys.dtype), scaling)
    ball = th.page_ball_shift_bounds(q, q_a, centre, radius, scaling)
    for lower, upper in (box, ball):
        bound = th.log_page_reuse_certificate(m_drop, m_sel, lower, upper).exp()
        assert bool((true <= bound).all()), (true, bound)
    # The global certificate, per head: each head's own δ_a and ε.
    d_a = th.dropped_mass(anchor_logits, sel[:t_anchor].expand_as(anchor_logits))
    eps = th.logit_shift_bound(q, q_a, k64[:t_anchor].norm(dim=-1).max(), scaling)
    assert bool((true <= th.reuse_certificate(d_a, eps).double()).all())


@given(reuse_case())
def test_page_bounds_hold_every_key_and_the_box_is_attained_at_its_corners(case):
    keys, q_a, q, _, _, page, scaling = case
    lo, hi, centre, radius = _pages(keys, page)
    dq = q.double() - q_a.double()
    change = (dq @ keys.double().T) * scaling  # [g, t]
    p = lo.shape[0]
    pad = p * page - keys.shape[0]
    per_page = torch.nn.functional.pad(change, (0, pad), value=math.nan).view(-1, p, page)
    for lower, upper in (
        th.page_box_shift_bounds(q, q_a, lo, hi, scaling),
        th.page_ball_shift_bounds(q, q_a, centre, radius, scaling),
    ):
        assert bool((per_page.nan_to_num(math.inf).amin(-1) >= lower).all())
        assert bool((per_page.nan_to_num(-math.inf).amax(-1) <= upper).all())
    # A key at the corner the linear function prefers reaches the box's upper bound.
    corner = torch.where(dq > 0, hi[0], lo[0])  # [g, D]
    reach = (dq * corner).sum(-1) * scaling
    upper = th.page_box_shift_bounds(q, q_a, lo, hi, scaling)[1][:, 0]
    assert torch.allclose(reach, upper, rtol=1e-12, atol=1e-12 * (1 + upper.abs().max().item()))


def test_page_certificate_with_one_key_a_page_is_exact():
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(40, 8, generator=g, dtype=F64) * 2
    q_a, q = torch.randn(2, 3, 8, generator=g, dtype=F64)
    sel = torch.rand(40, generator=g) < 0.3
    anchor = q_a @ keys.T * 0.35
    m_drop, m_sel = th.page_log_masses(anchor, sel.expand(3, -1), 1)
    lower, upper = th.page_box_shift_bounds(q, q_a, keys, keys, 0.35)
    bound = th.log_page_reuse_certificate(m_drop, m_sel, lower, upper).exp()
    true = th.dropped_mass(q @ keys.T * 0.35, sel.expand(3, -1))
    assert bool((bound >= true).all())
    torch.testing.assert_close(bound, true, rtol=1e-8, atol=0)


def test_page_certificate_with_one_shift_bound_is_the_global_certificate():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 50, generator=g, dtype=F64) * 3
    sel = th.oracle_topk_mask(logits, 10)
    m_drop, m_sel = th.page_log_masses(logits, sel, 16)
    eps = torch.tensor([0.0, 0.1, 1.0, 6.0], dtype=F64).unsqueeze(-1)
    page = th.log_page_reuse_certificate(
        m_drop, m_sel, (-eps).expand_as(m_drop), eps.expand_as(m_drop)
    )
    glob = th.log_reuse_certificate(th.log_dropped_mass(logits, sel), eps.squeeze(-1))
    torch.testing.assert_close(page, glob, rtol=0, atol=1e-12)
    # A common shift of every page's bounds changes nothing.
    moved = th.log_page_reuse_certificate(
        m_drop, m_sel, 40 - eps.expand_as(m_drop), 40 + eps.expand_as(m_drop)
    )
    torch.testing.assert_close(moved, glob, rtol=0, atol=1e-11)


def test_page_log_masses_and_certificate_edges():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]], dtype=F64)
    sel = torch.tensor([[True, False, True, True, False]])
    m_drop, m_sel = th.page_log_masses(logits, sel, 2)
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(m_drop.exp()[0], torch.stack([p[1], p[1] * 0, p[4]]))
    torch.testing.assert_close(m_sel.exp()[0], torch.stack([p[0], p[2] + p[3], p[4] * 0]))
    zero = torch.zeros(1, 3, dtype=F64)
    none = torch.full((1, 3), -math.inf, dtype=F64)
    # Nothing dropped: δ̂ = 0 exactly; nothing selected: δ̂ = 1.
    assert th.log_page_reuse_certificate(none, m_sel, zero, zero).item() == -math.inf
    assert th.log_page_reuse_certificate(m_drop, none, zero, zero).item() == 0.0
    # An empty page (its box min > max) bounds nothing and is skipped.
    lo = torch.tensor([[0.0, 1.0], [math.inf, math.inf]], dtype=F64)
    hi = torch.tensor([[1.0, 2.0], [-math.inf, -math.inf]], dtype=F64)
    one = torch.tensor([1.0, -1.0], dtype=F64)
    lower, upper = th.page_box_shift_bounds(one, 0 * one, lo, hi, 1.0)
    assert lower[1].item() == math.inf and upper[1].item() == -math.inf
    assert lower[0].item() == pytest.approx(-2.0) and upper[0].item() == pytest.approx(0.0)


def test_round_to_float32_never_lands_on_the_wrong_side():
    g = torch.Generator().manual_seed(7)
    x = torch.cat(
        [
            torch.randn(1000, generator=g, dtype=F64)
            * 10.0 ** torch.randint(-40, 30, (1000,), generator=g),
            torch.tensor([0.0, 1e-300, -1e-300, 1.0, -math.inf, math.inf], dtype=F64),
        ]
    )
    up, down = th.round_to_float32(x, up=True), th.round_to_float32(x, up=False)
    assert up.dtype == torch.float32
    assert bool((up.double() >= x).all()) and bool((down.double() <= x).all())
    # The nearest float32 on each side: equal, or one step apart.
    fin = torch.isfinite(x)
    step = torch.nextafter(down, torch.full_like(down, math.inf))
    assert bool(((up == down) | (up == step))[fin].all())
    assert up[-5].item() > 0.0 and down[-4].item() < 0.0  # no underflow to 0
    assert up[-6].item() == 0.0 and down[-6].item() == 0.0
    assert (
        th.round_to_float32(torch.tensor([0.1], dtype=torch.float16), up=True).dtype
        == torch.float32
    )


def test_float32_certificates_are_never_below_their_float64_value():
    g = torch.Generator().manual_seed(8)
    q, q_a = torch.randn(2, 500, 64, generator=g)
    eps32 = th.logit_shift_bound(q, q_a, 13.7, 0.125)
    eps64 = (q.double() - q_a.double()).norm(dim=-1) * 13.7 * 0.125
    assert eps32.dtype == torch.float32 and bool((eps32.double() >= eps64).all())
    log_d = -torch.rand(500, generator=g) * 30
    hat32 = th.log_reuse_certificate(log_d, eps32)
    hat64 = th.log_reuse_certificate(log_d.double(), eps32.double())
    assert hat32.dtype == torch.float32 and bool((hat32.double() >= hat64).all())
    # A positive δ̂ far below float32's range stays positive.
    tiny = th.reuse_certificate(torch.tensor([1e-44]), 0.0)  # a float32 subnormal
    assert tiny.dtype == torch.float32 and tiny.double().item() >= torch.tensor(1e-44).double()


# ---------------------------------------------------------------------------------------------
# §1 oracle comparisons, §2.6 the top-p budget
# ---------------------------------------------------------------------------------------------
def test_oracle_topk_mask_with_ties_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 9.0]], dtype=F64)
    valid = torch.tensor([[True, True, True, True, False]])
    assert th.oracle_topk_mask(scores, 2, valid).tolist() == [[False, True, True, False, False]]
    assert th.oracle_topk_mask(scores, 10, valid).tolist() == [valid[0].tolist()]
    per_row = th.oracle_topk_mask(scores.expand(2, -1), torch.tensor([1, 3]), valid.expand(2, -1))
    assert per_row.sum(-1).tolist() == [1, 3]


@given(logits_and_selection(allow_empty=True))
def test_retained_mass_gap_against_brute_force(case):
    logits, sel = case
    p = brute_probs(logits)
    beta = th.retained_mass_gap(logits, sel)
    for r in range(logits.shape[0]):
        k = int(sel[r].sum())
        best = torch.sort(p[r], descending=True).values[:k].sum()
        assert beta[r].item() == pytest.approx((best - p[r][sel[r]].sum()).item(), abs=1e-12)
        assert beta[r].item() >= 0
    top = th.oracle_topk_mask(logits, max(1, int(sel.sum(-1).min())))
    assert bool((th.retained_mass_gap(logits, top) <= 1e-15).all())


def test_oracle_overlap_and_top_mass_recall_brute_force():
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        t = int(torch.randint(1, 30, (1,), generator=g))
        logits = torch.randn(1, t, generator=g, dtype=F64) * 4
        sel = torch.rand(1, t, generator=g) < 0.4
        k = int(torch.randint(1, t + 1, (1,), generator=g))
        p = torch.softmax(logits[0], -1)
        order = torch.argsort(p, descending=True, stable=True)
        star = set(order[:k].tolist())
        chosen = set(sel[0].nonzero().flatten().tolist())
        assert th.oracle_overlap(logits, sel, k).item() == pytest.approx(len(star & chosen) / k)
        total = p[order[:k]].sum().item()
        acc, top = 0.0, []
        for i in order[:k].tolist():
            top.append(i)
            acc += p[i].item()
            if acc >= 0.5 * total:
                break
        expected = len(set(top) & chosen) / len(top)
        assert th.top_mass_recall(logits, sel, k).item() == pytest.approx(expected)


@given(
    st.integers(0, 10_000),
    st.integers(1, 25),
    st.sampled_from([0.0, 1e-9, 0.05, 0.5, 1.0]),
    st.sampled_from([0.1, 2.0, 50.0]),
)
def test_top_p_budget_is_the_smallest_sufficient_top_set(seed, t, target, scale):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, t, generator=g, dtype=F64) * scale
    out = th.top_p_budget(logits, target)
    log_target = math.log(target) if target > 0 else -math.inf
    for r in range(3):
        order = torch.argsort(logits[r], descending=True, stable=True)
        lse = torch.logsumexp(logits[r], -1).item()

        def log_drop(j: int, r: int = r, order: torch.Tensor = order, lse: float = lse) -> float:
            tail = logits[r][order[j:]]
            return torch.logsumexp(tail, -1).item() - lse if len(tail) else -math.inf

        # brute force, in log space: smallest j >= 1 whose top-j drops at most the target
        j = next(j for j in range(1, t + 1) if log_drop(j) <= log_target)
        assert out.size[r].item() == j
        assert set(out.mask[r].nonzero().flatten().tolist()) == set(order[:j].tolist())
    assert bool((out.dropped <= target + 1e-12).all())


def test_top_p_budget_caps_and_padding():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=F64)
    valid = torch.tensor([[True, True, True, False]])
    out = th.top_p_budget(logits, 0.0, valid)
    assert out.size.tolist() == [3] and out.mask.tolist() == [[True, True, True, False]]
    capped = th.top_p_budget(logits, 0.0, valid, max_size=2)
    assert capped.size.tolist() == [2]
    assert capped.dropped.item() == pytest.approx(1 / 3)
    assert th.top_p_budget(logits, 1.0, min_size=0).size.tolist() == [0]


def test_group_query_heads_follows_repeat_kv_order():
    x = torch.arange(2 * 6 * 3, dtype=F64).view(2, 6, 3)  # Hq = 6, Hkv = 2, g = 3
    mean = th.group_query_heads(x, 2)
    torch.testing.assert_close(mean[:, 0], x[:, 0:3].mean(1))
    torch.testing.assert_close(mean[:, 1], x[:, 3:6].mean(1))
    torch.testing.assert_close(th.group_query_heads(x, 2, "max")[:, 1], x[:, 5])


def test_half_precision_inputs_computed_in_float32():
    logits = (torch.randn(2, 33) * 5).to(torch.bfloat16)
    sel = th.oracle_topk_mask(logits, 4)
    delta = th.dropped_mass(logits, sel)
    assert delta.dtype == torch.float32
    ref = th.dropped_mass(logits.to(F64), sel)
    torch.testing.assert_close(delta.to(F64), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
BAD_CALLS = {
    "mismatched-selection": (
        lambda: th.dropped_mass(torch.randn(2, 5), torch.ones(2, 4, dtype=torch.bool)),
        ValueError,
        "shape",
    ),
    "selection-not-bool": (
        lambda: th.dropped_mass(torch.randn(2, 5), torch.ones(2, 5)),
        TypeError,
        "bool",
    ),
    "integer-logits": (
        lambda: th.dropped_mass(
            torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)
        ),
        TypeError,
        "floating",
    ),
    "no-valid-position": (
        lambda: th.attention_probs(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)),
        ValueError,
        "t >= 1",
    ),
    "zero-length": (lambda: th.attention_probs(torch.randn(2, 0)), ValueError, "t >= 1"),
    "nan-logits": (
        lambda: th.attention_probs(torch.tensor([[0.0, float("nan")]])),
        ValueError,
        "finite",
    ),
    "empty-selection-p_S": (
        lambda: th.restricted_probs(torch.randn(2, 4), torch.zeros(2, 4, dtype=torch.bool)),
        ValueError,
        "empty selection",
    ),
    "empty-selection-o_S": (
        lambda: th.sparse_output(
            torch.randn(1, 4), torch.randn(1, 4, 2), torch.zeros(1, 4, dtype=torch.bool)
        ),
        ValueError,
        "empty selection",
    ),
    "values-shape": (
        lambda: th.dense_output(torch.randn(1, 4), torch.randn(1, 5, 2)),
        ValueError,
        "values",
    ),
    "tv-shapes": (
        lambda: th.total_variation(torch.rand(3), torch.rand(4)),
        ValueError,
        "same shape",
    ),
    "delta-above-one": (lambda: th.reuse_certificate(1.5, 0.1), ValueError, r"\[0, 1\]"),
    "delta-negative": (lambda: th.entropy_continuity_bound(-0.1, 4), ValueError, r"\[0, 1\]"),
    "delta-nan": (lambda: th.binary_entropy(float("nan")), ValueError, r"\[0, 1\]"),
    "deltas-above-one": (
        lambda: th.mi_loss_bound(torch.tensor([0.2, 1.2]), 5),
        ValueError,
        r"\[0, 1\]",
    ),
    "bound-deltas": (
        lambda: th.output_error_bound(torch.tensor([2.0]), torch.randn(1, 3, 2)),
        ValueError,
        r"\[0, 1\]",
    ),
    "target-above-one": (lambda: th.top_p_budget(torch.randn(1, 4), 1.01), ValueError, r"\[0, 1\]"),
    "t-zero": (lambda: th.entropy_continuity_bound(0.1, 0), ValueError, ">= 1"),
    "negative-eps": (lambda: th.reuse_certificate(0.1, -1.0), ValueError, "eps"),
    "positive-log-delta": (
        lambda: th.log_reuse_certificate(torch.tensor(0.5), 0.1),
        ValueError,
        "<= 0",
    ),
    "k-zero": (lambda: th.oracle_topk_mask(torch.randn(1, 4), 0), ValueError, ">= 1"),
    "k-bool": (lambda: th.oracle_topk_mask(torch.randn(1, 4), True), TypeError, "int"),
    "scaling-negative": (
        lambda: th.logit_shift_bound(torch.randn(4), torch.randn(4), 1.0, -1.0),
        ValueError,
        "scaling",
    ),
    "kmax-negative": (
        lambda: th.logit_shift_bound(torch.randn(4), torch.randn(4), -1.0, 1.0),
        ValueError,
        "key_norm_max",
    ),
    "query-anchor-shape": (
        lambda: th.logit_shift_bound(torch.randn(4), torch.randn(5), 1.0, 1.0),
        ValueError,
        "same shape",
    ),
    "query-nan": (
        lambda: th.logit_shift_bound(torch.tensor([1.0, math.nan]), torch.zeros(2), 1.0, 1.0),
        ValueError,
        "query holds a non-finite",
    ),
    "anchor-inf": (
        lambda: th.logit_shift_bound(torch.zeros(2), torch.tensor([math.inf, 0.0]), 1.0, 1.0),
        ValueError,
        "anchor holds a non-finite",
    ),
    "key-norm-nan": (
        lambda: th.logit_shift_bound(torch.zeros(2), torch.ones(2), math.nan, 1.0),
        ValueError,
        "key_norm_max holds a non-finite",
    ),
    "key-norm-inf": (
        lambda: th.logit_shift_bound(torch.zeros(2), torch.ones(2), math.inf, 1.0),
        ValueError,
        "key_norm_max holds a non-finite",
    ),
    "scaling-nan": (
        lambda: th.logit_shift_bound(torch.zeros(2), torch.ones(2), 1.0, math.nan),
        ValueError,
        "scaling",
    ),
    "log-delta-nan": (
        lambda: th.log_reuse_certificate(torch.tensor([-1.0, math.nan]), 0.1),
        ValueError,
        "log_delta_anchor",
    ),
    "delta-anchor-nan": (
        lambda: th.reuse_certificate(torch.tensor([math.nan]), 0.1),
        ValueError,
        "delta_anchor",
    ),
    "box-dim": (
        lambda: th.page_box_shift_bounds(
            torch.randn(4), torch.randn(4), torch.randn(3, 5), torch.randn(3, 5), 1.0
        ),
        ValueError,
        "D = 4",
    ),
    "box-nan-query": (
        lambda: th.page_box_shift_bounds(
            torch.tensor([math.nan, 0.0]), torch.zeros(2), torch.zeros(1, 2), torch.ones(1, 2), 1.0
        ),
        ValueError,
        "query holds a non-finite",
    ),
    "box-min-max-shape": (
        lambda: th.page_box_shift_bounds(
            torch.randn(2), torch.randn(2), torch.zeros(1, 2), torch.ones(3, 2), 1.0
        ),
        ValueError,
        "same shape",
    ),
    "box-scaling": (
        lambda: th.page_box_shift_bounds(
            torch.randn(2), torch.randn(2), torch.zeros(1, 2), torch.ones(1, 2), 0.0
        ),
        ValueError,
        "scaling",
    ),
    "ball-negative-radius": (
        lambda: th.page_ball_shift_bounds(
            torch.randn(2), torch.randn(2), torch.zeros(1, 2), torch.tensor([-1.0]), 1.0
        ),
        ValueError,
        "radius",
    ),
    "ball-radius-shape": (
        lambda: th.page_ball_shift_bounds(
            torch.randn(2), torch.randn(2), torch.zeros(3, 2), torch.ones(2), 1.0
        ),
        ValueError,
        "radius must have shape",
    ),
    "page-cert-positive-mass": (
        lambda: th.log_page_reuse_certificate(
            torch.tensor([0.5]), torch.tensor([-1.0]), torch.zeros(1), torch.zeros(1)
        ),
        ValueError,
        "log masses",
    ),
    "page-cert-nan-bound": (
        lambda: th.log_page_reuse_certificate(
            torch.tensor([-1.0]), torch.tensor([-1.0]), torch.zeros(1), torch.tensor([math.nan])
        ),
        ValueError,
        "NaN",
    ),
    "page-cert-shape": (
        lambda: th.log_page_reuse_certificate(
            torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2)
        ),
        ValueError,
        "same shape",
    ),
    "page-masses-size": (
        lambda: th.page_log_masses(torch.randn(1, 4), torch.ones(1, 4, dtype=torch.bool), 0),
        ValueError,
        "page_size",
    ),
    "round-int": (
        lambda: th.round_to_float32(torch.ones(2, dtype=torch.int64), up=True),
        TypeError,
        "x",
    ),
    "gqa-not-multiple": (
        lambda: th.group_query_heads(torch.randn(1, 6, 3), 4),
        ValueError,
        "multiple",
    ),
    "gqa-reduce": (
        lambda: th.group_query_heads(torch.randn(1, 4, 3), 2, "sum"),
        ValueError,
        "reduce",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises_clear_error(name):
    call, exc, match = BAD_CALLS[name]
    with pytest.raises(exc, match=match):
        call()


def test_all_exported_functions_exist():
    assert set(th.__all__) <= set(dir(th))
    # Every public theory function is exercised above by name.
    src = open(__file__).read()
    missing = [n for n in th.__all__ if f"th.{n}" not in src and n != "TopPSelection"]
    assert not missing, missing


def test_all_selected_and_t_equal_one():
    logits = torch.tensor([[4.2]], dtype=F64)
    sel = torch.tensor([[True]])
    assert th.dropped_mass(logits, sel).item() == 0.0
    assert th.entropy_continuity_bound(th.dropped_mass(logits, sel), 1).item() == 0.0
    assert th.mi_loss_bound(torch.zeros(1, 3, dtype=F64), 1).tolist() == [0.0]
    assert th.oracle_overlap(logits, sel, 1).item() == 1.0
    assert th.top_mass_recall(logits, sel, 1).item() == 1.0


def test_ranks_from_order_inverts_a_descending_sort():
    scores = torch.tensor([[0.3, 2.0, -1.0, 2.0]], dtype=F64)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    assert th.ranks_from_order(order).tolist() == [[2, 0, 3, 1]]
