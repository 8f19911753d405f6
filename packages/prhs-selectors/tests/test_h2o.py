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

    def step(self, q, keys, scaling: float, softmax) -> set[int]:
        """``q [g, D]``, ``keys [n, D]`` (every cached key), a float64 ``softmax``; returns the
        selected positions."""
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
        heavy = sorted(rest, key=lambda i: (-self.mass[i], i))[: c.n_heavy]
        sel = win | recent | set(heavy)
        self.evicted |= set(range(n)) - sel
        if not seeded:
            ids = sorted(sel)
            p = softmax(q @ keys[ids].T * scaling).mean(0)
            for i, pi in zip(ids, p.tolist(), strict=True):
                self.mass[i] += pi
        return sel


def _chosen(sel, b: int, h: int) -> set[int]:
    ids = [int(i) for i in sel.indices[b, h] if i >= 0]
    assert len(ids) == len(set(ids))
    return set(ids)


GEOMETRIES = [([40, 23, 3], 2, 2), ([50, 31], 6, 2), ([44, 27], 8, 2)]
GEOMETRY_IDS = [f"T{'-'.join(map(str, ls))}-Hq{hq}-Hkv{hkv}" for ls, hq, hkv in GEOMETRIES]


@pytest.mark.parametrize(("lengths", "hq", "hkv"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_matches_the_python_reference_over_steps(make_sim, layout, lengths, hq, hkv) -> None:
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
    pool = sim.attach(h2o)
    g = hq // hkv
    refs = {
        (b, layer_, h): ReferenceH2O(cfg)
        for b in range(len(lengths))
        for layer_ in range(2)
        for h in range(hkv)
    }
    for _ in range(6):
        for layer in range(2):
            sel = h2o.select(sim.step(layer), pool)
            for b, n in enumerate(sim.lengths.tolist()):
                for h in range(hkv):
                    q = sim.queries[layer][b, h * g : (h + 1) * g]
                    want = refs[b, layer, h].step(
                        q, sim.keys[layer][b, h, :n], sim.scaling, sim.softmax64
                    )
                    assert _chosen(sel, b, h) == want, (b, layer, h)
                    ref = refs[b, layer, h]
                    mass = pool["h2o_mass"][b, layer, h, :n]
                    want_mass = torch.tensor(ref.mass, dtype=torch.float64)
                    torch.testing.assert_close(mass.double(), want_mass, rtol=1e-5, atol=1e-6)
                    evicted = pool["h2o_evicted"][b, layer, h, :n].nonzero().flatten().tolist()
                    assert set(evicted) == ref.evicted
            out, _ = sim.attend(layer, sel)
            mask = sel.to_mask(sim.lengths, sim.max_len, hkv)
            torch.testing.assert_close(
                out.double(), sim.reference_output(layer, mask), rtol=0, atol=1e-5
            )
        sim.advance()


def test_an_evicted_position_is_never_selected_again(make_sim) -> None:
    cfg = H2OConfig(budget=6, n_sink=1, n_local=2)
    sim = make_sim([30], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=4)
    h2o = H2O(cfg)
    pool = sim.attach(h2o)
    first = _chosen(h2o.select(sim.step(0), pool), 0, 0)
    evicted = set(range(30)) - first
    assert evicted and pool["h2o_evicted"][0, 0, 0, :30].nonzero().flatten().tolist() == sorted(
        evicted
    )
    e = min(evicted)
    sim.advance()

    # (a) The evicted position now has by far the largest accumulated mass.
    pool["h2o_mass"][0, 0, 0, e] = 1e6
    chosen = _chosen(h2o.select(sim.step(0), pool), 0, 0)
    assert e not in chosen
    assert len(chosen) == 1 + 2 + cfg.n_recent + cfg.n_heavy  # the budget went elsewhere
    assert pool["h2o_mass"][0, 0, 0, e].item() == 1e6  # and it gained nothing
    sim.advance()

    # (b) ... and the largest logit of every head: the oracle's first choice.
    sim.queries[0][0] = 40 * sim.keys[0][0, 0, e] / sim.keys[0][0, 0, e].norm()
    assert int(sim.group_probs(0)[0, 0].argmax()) == e
    chosen = _chosen(h2o.select(sim.step(0), pool), 0, 0)
    assert e not in chosen
    oracle = selectors.create("oracle", budget=6, n_sink=1, n_local=2)
    assert e in _chosen(oracle.select(sim.step(0), sim.attach(oracle)), 0, 0)


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
def test_budget_split(make_sim, budget, heavy, recent, n_heavy, n_recent) -> None:
    cfg = H2OConfig(budget=budget, n_sink=3, n_local=4, heavy_ratio=heavy, recent_ratio=recent)
    assert (cfg.n_heavy, cfg.n_recent) == (n_heavy, n_recent)
    assert cfg.n_heavy == round(budget * heavy / (heavy + recent))
    n = 3 + 4 + budget + 20
    sim = make_sim([n], num_q_heads=4, num_kv_heads=2, head_dim=8, max_new_tokens=2)
    h2o = H2O(cfg)
    pool = sim.attach(h2o)
    for _ in range(2):
        sel = h2o.select(sim.step(0), pool)
        n = int(sim.lengths[0])
        for h in range(2):
            chosen = _chosen(sel, 0, h)
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
    pool = sim.attach(h2o)
    for step in range(3):
        for layer in range(2):
            stats = h2o.select(sim.step(layer), pool).stats
            assert bool(stats.retrieved.all()) == (step == 0)
            assert bool(stats.retrieved.any()) == (step == 0)
            row = sim.lengths.double() * 4  # float32 accumulated mass per position
            keys = sim.lengths.double() * 16 * 4 if step == 0 else 0.0  # every key, once
            assert torch.equal(stats.proxy_bytes, (row + keys).view(-1, 1).expand(-1, 2))
        assert bool(pool["h2o_initialised"][:2].all())
        sim.advance()


def test_budget_covering_the_sequence_never_evicts_and_is_dense(make_sim) -> None:
    sim = make_sim([20, 9], num_q_heads=3, num_kv_heads=1, head_dim=8, max_new_tokens=3)
    h2o = selectors.create("h2o", budget=60, n_sink=1, n_local=1)
    pool = sim.attach(h2o)
    for _ in range(3):
        sel = h2o.select(sim.step(0), pool)
        assert torch.equal(sel.stats.num_selected, sim.lengths.view(-1, 1))
        out, _ = sim.attend(0, sel)
        torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)
        sim.advance()
    assert not bool(pool["h2o_evicted"].any())


def test_state_is_reset_when_a_slot_is_reused(make_sim, layout) -> None:
    kw = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "layout": layout}
    h2o = H2O(H2OConfig(budget=4, n_sink=1, n_local=2))
    first = make_sim([30, 26], slots=[2, 0], capacity=4, seed=1, **kw)
    pool = first.attach(h2o)
    other = make_sim([18], slots=[3], capacity=4, seed=5, **kw)
    other.attach(h2o, pool)
    for _ in range(3):
        h2o.select(first.step(0), pool)
        h2o.select(other.step(0), pool)
        first.advance()
        other.advance()
    assert bool(pool["h2o_evicted"][[0, 2, 3]].any(-1).any(-1).all())
    kept = {f: pool[f][3].clone() for f in pool.field_names}
    first.release()

    # New sequences in the released slots behave exactly as in a fresh pool.
    second = make_sim([21, 33], slots=[0, 2], capacity=4, seed=9, **kw)
    second.attach(h2o, pool)
    for f in pool.field_names:
        assert not bool(pool[f][[0, 2]].any()), f"{f} survived the slot's reuse"
        assert torch.equal(pool[f][3], kept[f]), f"{f} of a live slot changed"
    fresh_sim = make_sim([21, 33], slots=[0, 2], capacity=4, seed=9, **kw)
    fresh_h2o = H2O(h2o.config)
    fresh = fresh_sim.attach(fresh_h2o)
    for _ in range(3):
        a = h2o.select(second.step(0), pool)
        b = fresh_h2o.select(fresh_sim.step(0), fresh)
        assert torch.equal(a.indices, b.indices)
        assert torch.equal(a.stats.retrieved, b.stats.retrieved)
        second.advance()
        fresh_sim.advance()


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
