"""CIS's ``tau="auto"``: the prompt replay against a step-by-step reference and against the
selector's own decisions, the threshold choice, and the selector's prompt hook."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core.config import AttentionSpec
from prhs_core.layout import ContiguousKV
from prhs_core.registry import selectors
from prhs_selectors.cis import FALLBACK_TAU, CISConfig
from prhs_selectors.cis_calibration import TAU_GRID, ReplayConfig, choose_tau, replay_curves


def _prompt(seed: int, w: int, n: int, hq: int = 4, h: int = 2, d: int = 16):
    """Queries that drift slowly around a per-head direction (so reuse decisions vary), and
    keys with a few strong positions."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(hq, d, generator=g)
    walk = torch.cumsum(0.35 * torch.randn(w, hq, d, generator=g), 0)
    queries = base + walk
    keys = torch.randn(h, n, d, generator=g)
    keys[:, torch.randint(0, n, (n // 10,), generator=g)] *= 3.0
    return queries, keys


def _reference(queries, keys, scaling, c: ReplayConfig, tau: float):
    """Step by step, sets as Python sets (block_size 1): per KV head, mean β and the retrieval
    ratio over queries 1..W-1."""
    w, hq, _ = queries.shape
    h, n, _ = keys.shape
    g = hq // h
    beta = torch.zeros(h, dtype=torch.float64)
    ret = torch.zeros(h, dtype=torch.float64)
    for head in range(h):
        anchor = None  # (step, query, set)
        for j in range(w):
            ln = n - w + j + 1
            q = queries[j, head * g : (head + 1) * g].double()
            z = (q @ keys[head, :ln].double().T) * scaling
            gm = torch.softmax(z, -1).mean(0)
            sink = set(range(min(c.n_sink, ln)))
            local = set(range(max(0, ln - c.n_local), ln))
            elig = [t for t in range(ln) if t not in sink and t not in local]
            order = sorted(elig, key=lambda t: (-float(gm[t]), t))[: c.budget]
            top_m = order[: c.budget // c.n_den]
            dil = {p + s for p in top_m for k in range(1, c.r + 1) for s in (k, -k)}
            dil = {x for x in dil if 0 <= x < ln}
            ranked = gm.sort(descending=True).values.cumsum(0)

            def beta_of(read: set[int], gm=gm, ranked=ranked) -> float:
                kept = float(gm[sorted(read)].sum())
                return max(0.0, float(ranked[len(read) - 1]) - kept)

            reuse = False
            if anchor is not None and j - anchor[0] <= c.n_local:
                qa = anchor[1]
                cos = float(torch.dot(q.flatten(), qa.flatten()) / (q.norm() * qa.norm()))
                reuse = cos >= tau
            if reuse:
                a_ln = n - w + anchor[0] + 1
                lo = a_ln - c.n_local if c.hold_local else ln - c.n_local
                read = anchor[2] | set(range(max(0, lo), ln))
            else:
                read = set(order) | sink | local
                anchor = (j, q, set(order) | dil | sink)
            if j > 0:
                beta[head] += beta_of(read)
                ret[head] += 0.0 if reuse else 1.0
    return beta / (w - 1), ret / (w - 1)


def _config(hold: bool = True, s: int = 1) -> ReplayConfig:
    return ReplayConfig(
        budget=24, n_sink=3, n_local=6, block_size=s, block_score="mass", n_den=3, r=1,
        hold_local=hold,
    )  # fmt: skip


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_replay_matches_a_step_by_step_reference(hold, seed):
    queries, keys = _prompt(seed, w=14, n=120)
    c = _config(hold)
    scaling = 16**-0.5
    beta, rho, last, _ = replay_curves(queries, keys, scaling, c, torch.tensor(TAU_GRID))
    assert beta.shape == rho.shape == (2, len(TAU_GRID)) and last.shape == (2, c.budget)
    seen = set()
    for k, tau in enumerate(TAU_GRID):
        ref_beta, ref_rho = _reference(queries, keys, scaling, c, tau)
        torch.testing.assert_close(beta[:, k].double(), ref_beta, atol=2e-5, rtol=0)
        torch.testing.assert_close(rho[:, k].double(), ref_rho, atol=1e-6, rtol=0)
        seen.add(tuple(ref_rho.tolist()))
    assert len(seen) > 2, "the prompt should give different decisions at different thresholds"
    assert float(rho[:, -1].min()) == 1.0  # 1.01: always retrieve


@pytest.mark.parametrize("block_size", [1, 4])
def test_replay_decisions_are_the_selectors(block_size):
    """The retrieval ratio a replay gives at a threshold is the one the selector shows when the
    same queries decode, step by step, over the same keys."""
    w, n, hq, h, d = 12, 150, 4, 2, 16
    queries, keys = _prompt(3, w=w, n=n, hq=hq, h=h, d=d)
    scaling = d**-0.5
    c = _config(True, block_size)
    tau = 0.85
    rho = replay_curves(queries, keys, scaling, c, torch.tensor([tau])).rho
    sel = selectors.create("cis", budget=24, n_sink=3, n_local=6, block_size=block_size, tau=tau)
    spec = AttentionSpec(num_layers=1, num_q_heads=hq, num_kv_heads=h, head_dim=d)
    state = sel.init_state(spec, capacity=1, max_seq_len=n, kv_dtype=torch.float32)
    state.pool.create([0])
    plan = sel.make_plan(state, batch_size=1, scaling=scaling, checked=True)
    k = keys.unsqueeze(0)
    retrieved = torch.zeros(h)
    for j in range(w):
        ln = n - w + j + 1
        lens = torch.tensor([ln], dtype=torch.int32)
        plan.update(lens, torch.tensor([0]))
        sel.select(plan, 0, queries[j : j + 1], ContiguousKV(k, k, lens), state)
        if j > 0:
            retrieved += (state.pool["anchor_len"][0, 0] == ln).float()
    torch.testing.assert_close(rho[:, 0], retrieved / (w - 1))


def test_choose_tau_meets_the_target_and_keeps_the_fallback():
    taus = torch.tensor([0.5, 0.7, 0.9, 1.01])
    # Two prompts, three rows: row 2 of prompt 0 was not calibrated (-1).
    rho = torch.tensor([[0.1, 0.3, 0.6, 1.0]]).expand(2, 3, 4).clone()
    beta = torch.tensor([[0.20, 0.08, 0.03, 0.0]]).expand(2, 3, 4).clone()
    beta[1, 0] = torch.tensor([0.01, 0.009, 0.008, 0.0])  # row 0 of prompt 1 reuses cheaply
    beta[0, 2] = -1.0
    rho[0, 2] = -1.0
    out = choose_tau(beta, rho, taus, target_rho=0.35, fallback=0.72)
    assert out.shape == (2, 3)
    assert out[0, 2] == pytest.approx(0.72)
    for b in range(2):
        valid = (rho[b, :, 0] >= 0).nonzero().flatten().tolist()
        picked = [int((taus == out[b, r]).nonzero()) for r in valid]
        mean = sum(float(rho[b, r, k]) for r, k in zip(valid, picked, strict=True)) / len(valid)
        assert mean <= 0.35 + 1e-6
    # Prompt 1 spends its retrievals where reuse costs most: its cheap row reuses most.
    assert out[1, 0] < out[1, 1]
    # A target every row can afford: each row takes its smallest β.
    free = choose_tau(beta, rho, taus, target_rho=1.0, fallback=0.72)
    assert torch.all(free[:, 1] == 1.01)


def _auto_cis(**options):
    sel = selectors.create("cis", budget=16, n_sink=2, n_local=4, **options)
    spec = AttentionSpec(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=16)
    state = sel.init_state(spec, capacity=3, max_seq_len=200, kv_dtype=torch.float32)
    state.pool.create([0, 1, 2])
    return sel, state


def test_observe_prompt_calibrates_each_slot_after_the_last_layer():
    sel, state = _auto_cis(prompt_queries=12)
    assert sel.config.tau == "auto" and sel.prompt_queries() == 12
    n_long, n_short = 160, 20  # the short one drops nothing a replay could measure
    q0, k0 = _prompt(5, w=12, n=n_long)
    q1, k1 = _prompt(6, w=12, n=n_long)
    keys = torch.zeros(2, 2, n_long, 16)
    keys[0] = k0
    keys[1, :, n_long - n_short :] = k1[:, :n_short]  # left-padded short prompt
    lens = torch.tensor([n_long, n_short], dtype=torch.int32)
    start = torch.tensor([0, n_long - n_short], dtype=torch.int32)
    kv = ContiguousKV(keys, keys, lens, start)
    queries = torch.stack([q0, q1])
    tau = state.pool["tau"]
    for layer in range(3):
        before = tau.clone()
        sel.observe_prompt(state, layer, [2, 0], queries, kv, 0.25)
        if layer < 2:
            assert torch.equal(tau, before)  # chosen only once every layer is seen
    grid = torch.tensor(TAU_GRID)
    assert torch.isin(tau[2], grid).all()
    assert not torch.equal(tau[2], torch.full_like(tau[2], FALLBACK_TAU))
    assert torch.all(tau[0] == FALLBACK_TAU)  # too short: the fallback
    assert torch.all(tau[1] == FALLBACK_TAU)  # not observed
    assert torch.all(state.pool["tau_rho"][2] >= 0)
    assert torch.all(state.pool["tau_rho"][0] == -1)
    # The host's (start, length) give what reading them from kv gives.
    sel2, state2 = _auto_cis(prompt_queries=12)
    bounds = [(0, n_long), (n_long - n_short, n_short)]
    for layer in range(3):
        sel2.observe_prompt(state2, layer, [2, 0], queries, kv, 0.25, bounds)
    assert torch.equal(state2.pool["tau"], tau)


def test_observe_prompt_rejects_bad_input_and_changes_nothing():
    sel, state = _auto_cis()
    q, k = _prompt(0, w=8, n=100)
    kv = ContiguousKV(k[None], k[None], torch.tensor([100], dtype=torch.int32))
    snapshot = {f: state.pool[f].clone() for f in state.pool.field_names}
    bad = [
        (dict(layer=3), "selectable layer"),
        (dict(queries=q[None, :1]), "2 to 32"),
        (dict(queries=q[None, :, :2]), "Hq=4"),
        (dict(slots=[0, 1]), "one slot per row"),
        (dict(slots=[5]), "slots must lie"),
        (dict(scaling=0.0), "positive"),
        (dict(kv=k), "ContiguousKV"),
        (dict(bounds=[(0, 101)]), "bounds must give"),
        (dict(bounds=[(0, 50), (0, 50)]), "bounds must give"),
    ]
    for change, message in bad:
        args = dict(layer=0, slots=[0], queries=q[None], kv=kv, scaling=0.25) | change
        with pytest.raises((ValueError, TypeError), match=message):
            sel.observe_prompt(state, **args)
    state.pool.release([1])
    with pytest.raises(ValueError, match="hold no sequence"):
        sel.observe_prompt(state, 0, [1], q[None], kv, 0.25)
    for f, t in snapshot.items():
        assert torch.equal(state.pool[f], t), f


def test_the_decide_reads_each_slots_threshold():
    sel, state = _auto_cis()
    state.pool["tau"][0] = 1.01  # slot 0 always retrieves
    state.pool["tau"][1] = -1.0  # slot 1 always reuses a live anchor
    scaling = 0.25
    q, k = _prompt(2, w=4, n=100)
    plan = sel.make_plan(state, batch_size=2, scaling=scaling, checked=True)
    kv_k = torch.stack([k, k])
    for j in range(4):
        lens = torch.tensor([97 + j, 97 + j], dtype=torch.int32)
        plan.update(lens, torch.tensor([0, 1]))
        query = torch.stack([q[j], q[j]])
        sel.select(plan, 1, query, ContiguousKV(kv_k, kv_k, lens), state)
    a_len = state.pool["anchor_len"][:, 1]
    assert torch.all(a_len[0] == 100)  # retrieved at the last step
    assert torch.all(a_len[1] == 97)  # the first step's anchor, reused since


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(tau="automatic"), "tau must be a float, a table or 'auto'"),
        (dict(tau=0.8, target_rho=0.3), "apply to tau='auto'"),
        (dict(tau=0.8, prompt_queries=8), "apply to tau='auto'"),
        (dict(target_rho=0.0), "target_rho"),
        (dict(target_rho=1.5), "target_rho"),
        (dict(prompt_queries=1), "prompt_queries"),
    ],
)
def test_auto_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        CISConfig(**options)


def test_fixed_tau_needs_no_prompt():
    sel = selectors.create("cis", tau=0.8)
    assert sel.prompt_queries() == 0
    certified = selectors.create("cis", delta_max=0.1, require_cosine=False)
    assert certified.prompt_queries() == 0  # no cosine gate to calibrate
    assert math.isclose(selectors.create("cis").config.auto_target_rho, 0.2)  # re-ranking reuses
    assert math.isclose(selectors.create("cis", rescore=0).config.auto_target_rho, 0.28)


@pytest.mark.parametrize("rescore", [None, 0])
@pytest.mark.parametrize("block_size", [1, 4])
def test_the_prompts_last_query_becomes_the_anchor(block_size, rescore):
    """After the calibration a row's anchor is what an exact retrieval by the prompt's last
    query stores (the replay scores the prompt's keys), so the first decode step can reuse it
    (without ``rescore``, its union too: what the Triton composition of a reuse copies)."""
    n, w = 150, 12
    queries, keys = _prompt(7, w=w, n=n)
    kv = ContiguousKV(keys[None], keys[None], torch.tensor([n], dtype=torch.int32))
    seeded, state = _auto_cis(prompt_queries=w, block_size=block_size, rescore=rescore)
    for layer in range(3):
        seeded.observe_prompt(state, layer, [1], queries[None], kv, 0.25)
    fresh, ref = _auto_cis(
        tau=0.8, block_size=block_size, rescore=rescore, scorer="exact"
    )  # it retrieves
    plan = fresh.make_plan(ref, batch_size=1, scaling=0.25, checked=True)
    plan.update(torch.tensor([n], dtype=torch.int32), torch.tensor([1]))
    fresh.select(plan, 2, queries[-1:], kv, ref)
    fields = ["anchor_q", "anchor_len", "anchor_idx", "anchor_cnt"]
    if rescore == 0:
        fields += ["anchor_union", "anchor_ucnt"]
        assert int(ref.pool["anchor_ucnt"][1, 2].min()) > 0
    assert ("anchor_union" in state.pool) is (rescore == 0)
    for field in fields:
        assert torch.equal(state.pool[field][1, 2], ref.pool[field][1, 2]), field
    assert torch.all(state.pool["anchor_len"][0] == 0)  # other slots untouched
    # The next decode step, one token on, reuses wherever its query stays close.
    state.pool["tau"][1] = -1.0
    plan = seeded.make_plan(state, batch_size=1, scaling=0.25, checked=True)
    longer = torch.cat([keys, keys[:, -1:]], 1)[None]
    lens = torch.tensor([n + 1], dtype=torch.int32)
    plan.update(lens, torch.tensor([1]))
    seeded.select(plan, 2, queries[-1:], ContiguousKV(longer, longer, lens), state)
    assert torch.all(state.pool["anchor_len"][1, 2] == n)  # reused, not retrieved
