"""``h2o`` (Heavy-Hitter Oracle): against a per-head Python reference, permanent eviction, the
budget split, the seeding retrieval and the state's lifecycle."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core.registry import selectors
from prhs_selectors import H2O, H2OConfig


class ReferenceH2O:
    """H2O for one (sequence, layer, KV head), one Python step at a time, in float64."""

    def __init__(self, cfg: H2OConfig) -> None:
        self.cfg = cfg
        self.mass: list[float] = []
        self.evicted: set[int] = set()
        self.initialised = False

    def step(self, q, keys, scaling: float, softmax, chosen: set[int], tools) -> set[int]:
        """``q [g, D]``, ``keys [n, D]`` (every cached key), a float64 ``softmax``; returns the
        selected positions. ``chosen`` is the selector's selection: its heavy hitters must be a
        top set by mass (any order among ties), and the reference goes on with them."""
        c, n = self.cfg, keys.shape[0]
        q, keys = q.double(), keys.double()
        self.mass += [0.0] * (n - len(self.mass))
        seeded = not self.initialised
        if seeded:
            probs = softmax(q @ keys.T * scaling).mean(0)
            self.mass = probs.tolist()
            self.initialised = True
        win = {i for i in range(n) if i < c.n_sink or i >= n - c.n_local}
        recent = {i for i in range(n - c.n_local - c.n_recent, n - c.n_local) if i >= 0} - win
        rest = [i for i in range(n) if i not in win | recent | self.evicted]
        heavy = tools.brute_topk(rest, c.n_heavy, self.mass)
        got = chosen - win - recent
        tools.assert_same_topk(got, heavy, self.mass, atol=1e-5)
        sel = win | recent | got
        self.evicted |= set(range(n)) - sel
        if not seeded:
            ids = sorted(sel)
            p = softmax(q @ keys[ids].T * scaling).mean(0)
            for i, pi in zip(ids, p.tolist(), strict=True):
                self.mass[i] += pi
        return sel


GEOMETRIES = [([40, 23, 3], 2, 2), ([50, 31], 6, 2), ([44, 27], 8, 2)]
GEOMETRY_IDS = [f"T{'-'.join(map(str, ls))}-Hq{hq}-Hkv{hkv}" for ls, hq, hkv in GEOMETRIES]


def _mass(state, loc, layer: int, h: int, n: int, b: int = 0) -> torch.Tensor:
    """Accumulated mass of positions ``0..n-1`` of row ``b`` (read through their locations)."""
    return state.side["h2o_mass"][loc[b, :n], layer, h]


def _evicted(state, loc, layer: int, h: int, n: int, b: int = 0) -> set[int]:
    return set(state.side["h2o_evicted"][loc[b, :n], layer, h].nonzero().flatten().tolist())


@pytest.mark.parametrize(("lengths", "hq", "hkv"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_matches_the_python_reference_over_steps(make_sim, tools, layout, lengths, hq, hkv):
    cfg = H2OConfig(budget=8, n_sink=2, n_local=3, heavy_ratio=0.2, recent_ratio=0.1)
    sim = make_sim(
        lengths,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=8,
        num_layers=2,
        layout=layout,
        max_new_tokens=6,
    )
    h2o = H2O(cfg)
    state = sim.attach(h2o)
    assert state.side is not None
    g = hq // hkv
    refs = {
        (b, layer_, h): ReferenceH2O(cfg)
        for b in range(len(lengths))
        for layer_ in range(2)
        for h in range(hkv)
    }
    for _ in range(6):
        loc = sim.locations(state.row_stride)
        for layer in range(2):
            sel = sim.select(layer)
            for b, n in enumerate(sim.lengths.tolist()):
                for h in range(hkv):
                    q = sim.queries[layer][b, h * g : (h + 1) * g]
                    ref = refs[b, layer, h]
                    got = tools.chosen(sel, b, h)
                    keys = sim.keys[layer][b, h, :n]
                    want = ref.step(q, keys, sim.scaling, sim.softmax64, got, tools)
                    assert got == want, (b, layer, h)
                    want_mass = torch.tensor(ref.mass, dtype=torch.float64)
                    got_mass = _mass(state, loc, layer, h, n, b).double()
                    torch.testing.assert_close(got_mass, want_mass, rtol=1e-5, atol=1e-6)
                    assert _evicted(state, loc, layer, h, n, b) == ref.evicted
            out, _ = sim.attend(layer, sel)
            mask = sim.mask(sel)
            torch.testing.assert_close(
                out.double(), sim.reference_output(layer, mask), rtol=0, atol=1e-5
            )
        sim.advance()


def test_an_evicted_position_is_never_selected_again(make_sim, tools, layout) -> None:
    cfg = H2OConfig(budget=6, n_sink=1, n_local=2)
    sim = make_sim([30], num_q_heads=2, num_kv_heads=1, head_dim=8, layout=layout)
    h2o = H2O(cfg)
    state = sim.attach(h2o)
    loc = sim.locations(state.row_stride)
    first = tools.chosen(sim.select(0), 0, 0)
    evicted = set(range(30)) - first
    assert evicted and _evicted(state, loc, 0, 0, 30) == evicted
    e = min(evicted)
    sim.advance()

    # (a) The evicted position now has by far the largest accumulated mass.
    state.side["h2o_mass"][loc[0, e], 0, 0] = 1e6
    chosen = tools.chosen(sim.select(0), 0, 0)
    assert e not in chosen
    assert len(chosen) == 1 + 2 + cfg.n_recent + cfg.n_heavy  # the budget went elsewhere
    assert state.side["h2o_mass"][loc[0, e], 0, 0].item() == 1e6  # and it gained nothing
    sim.advance()

    # (b) ... and the largest logit of every head: the oracle's first choice.
    sim.queries[0][0] = 40 * sim.keys[0][0, 0, e] / sim.keys[0][0, 0, e].norm()
    assert int(sim.group_probs(0)[0, 0].argmax()) == e
    assert e not in tools.chosen(sim.select(0, h2o), 0, 0)
    oracle = selectors.create("oracle", budget=6, n_sink=1, n_local=2)
    sim.attach(oracle)
    assert e in tools.chosen(sim.select(0, oracle), 0, 0)


@pytest.mark.parametrize(
    ("budget", "heavy", "recent", "n_heavy", "n_recent"),
    [
        (64, 0.1, 0.1, 32, 32),
        (12, 0.3, 0.1, 9, 3),
        (7, 0.1, 0.1, 4, 3),
        (5, 0.1, 0.4, 1, 4),
        (1, 1.0, 0.1, 1, 0),
        (1, 0.1, 1.0, 0, 1),
    ],
    ids=["default", "k12-3to1", "k7-even", "k5-1to4", "k1-heavy", "k1-recent"],
)
def test_budget_split(make_sim, tools, budget, heavy, recent, n_heavy, n_recent) -> None:
    cfg = H2OConfig(budget=budget, n_sink=3, n_local=4, heavy_ratio=heavy, recent_ratio=recent)
    assert (cfg.n_heavy, cfg.n_recent) == (n_heavy, n_recent)
    assert cfg.n_heavy == round(budget * heavy / (heavy + recent))
    n = 3 + 4 + budget + 20
    sim = make_sim([n], num_q_heads=4, num_kv_heads=2, head_dim=8, max_new_tokens=2)
    h2o = H2O(cfg)
    sim.attach(h2o)
    assert h2o.selection_width() == 3 + 4 + 1 + budget
    for _ in range(2):
        sel = sim.select(0)
        n = int(sim.lengths[0])
        for h in range(2):
            chosen = tools.chosen(sel, 0, h)
            sinks, local = set(range(3)), set(range(n - 4, n))
            recent_w = set(range(n - 4 - n_recent, n - 4))
            assert sinks | local | recent_w <= chosen  # windows and recent always in
            assert len(chosen - sinks - local - recent_w) == n_heavy
        sim.advance()


def test_seeding_is_the_only_retrieval_and_bytes_are_the_score_row(make_sim, layout) -> None:
    sim = make_sim(
        [25, 12],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_layers=2,
        layout=layout,
        max_new_tokens=3,
    )
    h2o = H2O(H2OConfig(budget=4, n_sink=1, n_local=2))
    state = sim.attach(h2o)
    for step in range(3):
        for layer in range(2):
            stats = sim.select(layer).stats
            assert bool(stats.retrieved.all()) == (step == 0)
            assert bool(stats.retrieved.any()) == (step == 0)
            row = sim.lengths.double() * 4  # float32 accumulated mass per position
            keys = sim.lengths.double() * 16 * 4 if step == 0 else 0.0  # every key, once
            assert torch.equal(stats.proxy_bytes, (row + keys).view(-1, 1).expand(-1, 2))
        assert bool(state.pool["h2o_seeded"][:2].all())
        sim.advance()


def test_budget_covering_the_sequence_never_evicts_and_is_dense(make_sim, layout) -> None:
    sim = make_sim(
        [20, 9], num_q_heads=3, num_kv_heads=1, head_dim=8, layout=layout, max_new_tokens=3
    )
    h2o = selectors.create("h2o", budget=60, n_sink=1, n_local=1)
    state = sim.attach(h2o)
    for _ in range(3):
        sel = sim.select(0)
        assert torch.equal(sel.stats.num_selected, sim.seq_lens().view(-1, 1))
        out, _ = sim.attend(0, sel)
        torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)
        sim.advance()
    assert not bool(state.side["h2o_evicted"].any())


def _run(sim, h2o, steps: int) -> list[tuple[torch.Tensor, ...]]:
    got = []
    for _ in range(steps):
        sel = sim.select(0, h2o)
        got.append((sel.indices.clone(), sel.counts.clone(), sel.stats.retrieved.clone()))
        sim.advance()
    return got


@pytest.mark.parametrize("layout", ["paged", "paged16"])
def test_state_is_reset_when_a_slot_is_reused(make_sim, layout) -> None:
    """Two batches share one state (disjoint KV locations); the first ends and new sequences
    reuse its slots and KV locations: they run exactly as on a fresh state, and the live
    sequence of the other batch is untouched."""
    kw = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "layout": layout}
    h2o = H2O(H2OConfig(budget=4, n_sink=1, n_local=2))
    first = make_sim([30, 26], slots=[2, 0], capacity=4, seed=1, **kw)
    other = make_sim([18], slots=[3], capacity=4, seed=5, kv_offset=1024, **kw)
    state = h2o.init_state(
        first.spec,
        capacity=4,
        max_seq_len=64,
        num_kv_locations=2048,
        kv_page_size=first.kv_page_size,
        kv_dtype=torch.float32,
    )
    first.attach(h2o, state)
    other.attach(h2o, state)
    ref_other = make_sim([18], slots=[3], capacity=4, seed=5, **kw)
    ref_other.attach(H2O(h2o.config))
    for _ in range(3):
        first.select(0, h2o)
        first.advance()
    got_other = _run(other, h2o, 3)
    want_other = _run(ref_other, ref_other.attachments[0].selector, 3)
    for a, b in zip(got_other, want_other, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert bool(state.side["h2o_evicted"].any())
    first.release(h2o)

    # New sequences in the released slots (and the same KV locations).
    second = make_sim([21, 33], slots=[0, 2], capacity=4, seed=9, **kw)
    second.attach(h2o, state)
    for name in state.pool.field_names:
        assert not bool(state.pool[name][[0, 2]].any()), f"{name} survived the slot's reuse"
    loc = second.locations(state.row_stride)
    for b, n in enumerate(second.lengths.tolist()):
        assert not bool(state.side["h2o_mass"][loc[b, :n]].any())
        assert not bool(state.side["h2o_evicted"][loc[b, :n]].any())
    kept = {n: state.side[n][1024:].clone() for n in state.side.field_names}
    fresh_sim = make_sim([21, 33], slots=[0, 2], capacity=4, seed=9, **kw)
    fresh_h2o = H2O(h2o.config)
    fresh_sim.attach(fresh_h2o)
    for a, b in zip(_run(second, h2o, 3), _run(fresh_sim, fresh_h2o, 3), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for n, t in kept.items():  # the other batch's locations were not touched
        assert torch.equal(state.side[n][1024:-1], t[:-1]), n


def test_a_sequence_created_before_another_plans_step_is_seeded(make_sim) -> None:
    """Slots given on the CPU tell each plan exactly which of its rows are new: a step of
    another batch does not use up a new sequence's seeding."""
    kw = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "layout": "paged"}
    h2o = H2O(H2OConfig(budget=4, n_sink=1, n_local=2))
    a = make_sim([30], slots=[0], capacity=2, seed=1, **kw)
    b = make_sim([20], slots=[1], capacity=2, seed=2, kv_offset=1024, **kw)
    state = h2o.init_state(a.spec, capacity=2, max_seq_len=64, num_kv_locations=2048)
    a.attach(h2o, state)
    b.attach(h2o, state)
    a.select(0, h2o)
    assert bool(b.select(0, h2o).stats.retrieved.all()), "b's first step did not seed"


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"budget": 0}, ValueError, "budget"),
        ({"heavy_ratio": 0.0}, ValueError, "heavy_ratio"),
        ({"heavy_ratio": 1.5}, ValueError, "heavy_ratio"),
        ({"recent_ratio": -0.1}, ValueError, "recent_ratio"),
        ({"recent_ratio": math.nan}, ValueError, "recent_ratio"),
        ({"heavy_ratio": True}, TypeError, "heavy_ratio"),
        ({"heavy_ratio": "0.1"}, TypeError, "heavy_ratio"),
        ({"block_size": 8}, ValueError, "evicts single tokens"),
    ],
    ids=[
        "budget0",
        "heavy0",
        "heavy1.5",
        "recent-neg",
        "recent-nan",
        "heavy-bool",
        "heavy-str",
        "block8",
    ],
)
def test_bad_config_raises(options, error, match) -> None:
    with pytest.raises(error, match=match):
        selectors.create("h2o", **options)
