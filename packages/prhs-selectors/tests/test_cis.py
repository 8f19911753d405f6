"""CIS (paper and certified modes) against brute-force Python references: dilation, the reuse
rule, what a reuse reads, the certificate, the certified retrieval and the slot lifecycle."""

from __future__ import annotations

import itertools

import pytest
import torch

from prhs_core import theory
from prhs_core.registry import selectors
from prhs_kernels.compose import dilate_indices
from prhs_selectors.cis import CIS, MIN_CENTER_KEYS, CISConfig


def _window_blocks(t: int, s: int, n_sink: int, n_local: int) -> set[int]:
    pos = set(range(min(n_sink, t))) | set(range(max(0, t - n_local), t))
    return {p // s for p in pos}


def _dilate(top: list[int], r: int, nb: int) -> set[int]:
    out: set[int] = set()
    for p in top:
        for j in range(1, r + 1):
            out |= {x for x in (p - j, p + j) if 0 <= x < nb}
    return out


def _anchor(state, slot: int, layer: int, h: int) -> list[int]:
    """The anchor's list, in its stored order (by anchor score, largest first)."""
    n = int(state.pool["anchor_cnt"][slot, layer, h])
    return [int(x) for x in state.pool["anchor_idx"][slot, layer, h, :n]]


# ---------------------------------------------------------------------------------------------
# dilation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("m", "r"), [(0, 1), (1, 1), (2, 2), (5, 3), (3, 0), (9, 1)])
def test_dilation_adds_exactly_p_plus_minus_j(seed, m, r):
    g = torch.Generator().manual_seed(seed)
    n, width = 23, 6
    idx = torch.stack([torch.randperm(n, generator=g)[:width] for _ in range(4)]).int()
    counts = torch.randint(0, width + 1, (4,), generator=g).int()
    idx = torch.where(torch.arange(width) < counts.view(-1, 1), idx, -1)
    out = dilate_indices(idx, counts, m, r)
    assert out.shape == (4, 2 * r * m) and out.dtype == torch.int32
    for row in range(4):
        top = [int(p) for p in idx[row, : min(m, int(counts[row]))]]
        expected = {p + j for p in top for j in range(1, r + 1)}
        expected |= {p - j for p in top for j in range(1, r + 1) if p - j >= 0}
        assert {int(x) for x in out[row] if x >= 0} == expected


# ---------------------------------------------------------------------------------------------
# paper mode: the reuse rule and what a reuse reads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("block_size", "block_score", "hold"),
    [(1, "max", True), (4, "max", False), (4, "mass", True), (1, "mass", False)],
)
@pytest.mark.parametrize("scorer", ["int4", "exact"])
def test_paper_mode_reuses_exactly_when_the_rule_says(
    make_sim, tools, layout, block_size, block_score, hold, scorer
):
    """The reuse rule, what a reuse and a retrieval read, against brute force over exact
    logits; with ``scorer="int4"`` the keys lie on their 4-bit grid, so that the codes score
    them exactly and the same references hold."""
    cfg = CISConfig(budget=8, n_sink=2, n_local=6, block_size=block_size, tau=0.8, n_den=2, r=1,
                    block_score=block_score, hold_local=hold, scorer=scorer)  # fmt: skip
    sel = CIS(cfg)
    steps = 14
    sim = make_sim(
        [57, 40, 33],
        key_grid=scorer == "int4",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        layout=layout,
        max_new_tokens=steps,
        seed=3,
    )
    state = sim.attach(sel)
    assert not sel.certifies and sim.plan().stats.delta_hat is None
    b, h, g, s = 3, 2, 2, block_size
    k_blocks, m = max(1, cfg.budget // s), max(1, cfg.budget // s) // cfg.n_den
    anchor_q = torch.zeros(b, h, g * 16)
    anchor_t = torch.zeros(b, h, dtype=torch.long)
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
        out = sim.select(0)
        assert torch.equal(out.stats.retrieved, ~expected_reuse)
        probs = sim.group_probs(0)
        for i in range(b):
            tt = int(sim.lengths[i])
            nb = -(-tt // s)
            win = _window_blocks(tt, s, cfg.n_sink, cfg.n_local)
            for j in range(h):
                got = tools.chosen(out, i, j)
                assert win <= got, "sink and local are always selected"
                anchor = _anchor(state, i, 0, j)
                if expected_reuse[i, j]:
                    seen["reuse"] += 1
                    want = (set(anchor) | _dilate(anchor[:m], cfg.r, nb) | win) & set(range(nb))
                    if hold:  # the local window from where the anchor's started
                        ta = int(anchor_t[i, j])
                        want |= {p // s for p in range(max(0, ta - cfg.n_local), tt)}
                        assert ta < tt  # the held window is wider than the current one
                    assert got == want
                else:
                    seen["stale" if has[i, j] and not fresh[i, j] else "retrieve"] += 1
                    row = probs[i, j, :tt].tolist()
                    if block_score == "max":
                        bmax = tools.block_max(row, s)
                    else:  # the block's attention mass
                        bmax = [sum(row[x * s : (x + 1) * s]) for x in range(nb)]
                    cand = [x for x in range(nb) if x not in win]
                    top = tools.brute_topk(cand, k_blocks, bmax)
                    tools.assert_same_topk(set(anchor), top, bmax, atol=1e-6)
                    assert got == set(anchor) | win
                    # Stored by anchor score, so that dilation takes the first m entries.
                    scores = [bmax[x] for x in anchor]
                    assert all(a >= c - 1e-6 for a, c in itertools.pairwise(scores))
                    assert int(state.pool["anchor_len"][i, 0, j]) == tt
        anchor_q = torch.where(expected_reuse.unsqueeze(-1), anchor_q, q)
        anchor_t = torch.where(expected_reuse, anchor_t, t.expand(b, h))
        sim.advance()
    assert min(seen.values()) > 0, seen  # every branch was exercised


def test_paper_mode_retrieves_inside_a_conditional_on_the_states_flag(make_sim, monkeypatch):
    """The retrieval's kernels run under ``run_if(state.retrieving)``: the flag is true there
    exactly when some row retrieves (so a captured step may skip them otherwise), and the
    composition leaves it clear for the next layer."""
    import contextlib

    import prhs_selectors.cis as cis_module

    seen = []
    real_run_if = cis_module.run_if

    @contextlib.contextmanager
    def recording(flag):
        seen.append(("enter", bool(flag.item())))
        with real_run_if(flag) as conditional:
            yield conditional

    monkeypatch.setattr(cis_module, "run_if", recording)
    real_scores = cis_module.retrieval_block_scores
    monkeypatch.setattr(
        cis_module,
        "retrieval_block_scores",
        lambda *a, **k: seen.append(("scores",)) or real_scores(*a, **k),
    )
    cfg = CISConfig(budget=8, n_sink=2, n_local=3, block_size=2, tau=-1.0, n_den=2, r=1)
    sel = CIS(cfg)
    sim = make_sim([30, 22], num_q_heads=4, num_kv_heads=2, head_dim=16, max_new_tokens=9)
    state = sim.attach(sel)
    flags = []
    for _ in range(9):
        seen.clear()
        out = sim.select(0)
        assert seen[:2] == [("enter", seen[0][1]), ("scores",)]
        flags.append((seen[0][1], bool(out.stats.retrieved.any())))
        assert not state.retrieving.item()
        sim.advance()
    assert all(flag == some for flag, some in flags)
    assert {flag for flag, _ in flags} == {True, False}  # tau -1: retrieval every n_local steps


@pytest.mark.parametrize("block_size", [1, 4])
def test_random_expansion_replaces_the_dilation_by_as_many_random_blocks(
    make_sim, tools, block_size
):
    """RandomExpansion decides and retrieves as CIS does; a reuse reads the anchor's list, the
    windows and ``2·r·m`` blocks drawn from the whole context instead of the neighbours."""
    base = dict(budget=12, n_sink=2, n_local=6, block_size=block_size, tau=0.8, n_den=2, r=2,
                rescore=0, hold_local=False)  # fmt: skip
    runs = {}
    for expansion in ("dilate", "random"):
        sel = CIS(CISConfig(**base, expansion=expansion))
        sim = make_sim([150, 97, 120], num_q_heads=4, num_kv_heads=2, head_dim=16,
                       max_new_tokens=12, seed=5)  # fmt: skip
        runs[expansion] = (sel, sim, sim.attach(sel))
    assert runs["random"][0].selection_width() == runs["dilate"][0].selection_width()
    gen = torch.Generator().manual_seed(2)
    s, m, r = block_size, max(1, 12 // block_size) // 2, 2
    n_reuse = n_outside = 0
    draws: list[set[int]] = []
    for step in range(12):
        if step % 4 == 0:  # a new direction: every row retrieves
            q0 = torch.randn(3, 4, 16, generator=gen)
        noise = torch.randn(3, 4, 16, generator=gen) * 0.02
        outs = {}
        for name, (_, sim, _) in runs.items():
            sim.queries[0] = q0 + noise
            outs[name] = sim.select(0)
        got_d, got_r = outs["dilate"], outs["random"]
        assert torch.equal(got_d.stats.retrieved, got_r.stats.retrieved)
        sim, state = runs["random"][1], runs["random"][2]
        for i in range(3):
            tt = int(sim.lengths[i])
            nb = -(-tt // s)
            win = _window_blocks(tt, s, 2, 6)
            for j in range(2):
                a, b = tools.chosen(got_d, i, j), tools.chosen(got_r, i, j)
                if bool(got_r.stats.retrieved[i, j]):
                    assert a == b
                    continue
                n_reuse += 1
                anchor = set(_anchor(state, i, 0, j))
                extra = b - anchor
                assert anchor | win <= b and extra <= set(range(nb))
                assert len(b) <= len(anchor | win) + 2 * r * m
                outside = extra - win - _dilate(_anchor(state, i, 0, j)[:m], r, nb)
                n_outside += len(outside)
                draws.append(extra)
        for _, sim, _ in runs.values():
            sim.advance()
    assert n_reuse > 10
    assert n_outside > 2 * n_reuse  # most draws are not the dilation's neighbours
    assert len({frozenset(d) for d in draws}) > len(draws) // 2  # a fresh draw each time


def test_random_expansion_is_paper_mode_only():
    with pytest.raises(ValueError, match="expansion must be one of"):
        CISConfig(expansion="shuffle")
    with pytest.raises(ValueError, match="applies to paper mode"):
        CISConfig(delta_max=0.1, expansion="random")
    assert CISConfig(expansion="random", r=0).expansion == "random"


def _pool(state, slot: int, layer: int, h: int) -> list[int]:
    """The anchor's pool (its list, then its next-best blocks), in stored order."""
    nxt = [int(x) for x in state.pool["anchor_next"][slot, layer, h] if x >= 0]
    return _anchor(state, slot, layer, h) + nxt


@pytest.mark.parametrize(
    ("block_size", "block_score", "hold"), [(1, "mass", True), (4, "mass", False), (2, "max", True)]
)
@pytest.mark.parametrize("scorer", ["int4", "exact"])
def test_rescore_reads_the_best_of_the_anchors_pool_at_each_query(
    make_sim, tools, layout, block_size, block_score, hold, scorer
):
    """A retrieval keeps the next ``rescore`` positions of its ranking with its list; a reuse
    re-ranks that pool by the group's probabilities normalised over what it reads (pool, sink,
    local window) and reads the best ``k`` (with the dilation of their top ``m``); the pool
    itself lasts until the next retrieval. ``scorer="int4"``: on keys on their 4-bit grid,
    which the codes score exactly."""
    cfg = CISConfig(budget=8, n_sink=2, n_local=6, block_size=block_size, tau=0.8, n_den=2, r=1,
                    block_score=block_score, hold_local=hold, rescore=8,
                    scorer=scorer)  # fmt: skip
    sel = CIS(cfg)
    steps, b, h, g, d, s = 14, 3, 2, 2, 16, block_size
    sim = make_sim([57, 40, 33], num_q_heads=h * g, num_kv_heads=h, head_dim=d, layout=layout,
                   max_new_tokens=steps, seed=5, key_grid=scorer == "int4")  # fmt: skip
    state = sim.attach(sel)
    k_blocks, n_next = max(1, cfg.budget // s), -(-cfg.rescore // s)
    m = k_blocks // cfg.n_den
    gen = torch.Generator().manual_seed(12)
    anchor_q = torch.zeros(b, h, g * d)
    pools: dict[tuple[int, int], set[int]] = {}
    seen = {"reuse": 0, "retrieve": 0, "reordered": 0}
    for step in range(steps):
        if step > 0:  # small moves reuse and re-rank; large ones retrieve
            near = torch.rand(b, h, generator=gen) < 0.75
            scale = torch.where(near, 0.3, 5.0).repeat_interleave(g, 1).unsqueeze(-1)
            base = anchor_q.view(b, h, g, d).reshape(b, h * g, d)
            sim.queries[0] = base + scale * torch.randn(b, h * g, d, generator=gen)
        before = {(i, j): _pool(state, i, 0, j) for i in range(b) for j in range(h)}
        ta_before = state.pool["anchor_len"][:b, 0].clone()
        out = sim.select(0)
        logits = sim.logits(0)  # [B, Hq, T] float64
        probs = sim.group_probs(0)
        for i in range(b):
            tt = int(sim.lengths[i])
            nb = -(-tt // s)
            win = _window_blocks(tt, s, cfg.n_sink, cfg.n_local)
            for j in range(h):
                got = tools.chosen(out, i, j)
                listed = _anchor(state, i, 0, j)
                if not bool(out.stats.retrieved[i, j]):
                    seen["reuse"] += 1
                    pool = before[(i, j)]
                    assert set(_pool(state, i, 0, j)) == set(pool) == pools[(i, j)]
                    ta = int(ta_before[i, j])
                    lo = max(0, min(ta, tt) - cfg.n_local) if hold else max(0, tt - cfg.n_local)
                    read = {p for x in pool for p in range(x * s, min((x + 1) * s, tt))}
                    read |= set(range(min(cfg.n_sink, tt))) | set(range(lo, tt))
                    ids = torch.tensor(sorted(read))
                    z = logits[i, j * g : (j + 1) * g][:, ids]
                    p = torch.softmax(z, -1).mean(0)
                    at = {int(x): float(v) for x, v in zip(ids, p, strict=True)}
                    per = [[at[q] for q in range(x * s, min((x + 1) * s, tt))] for x in pool]
                    score = [max(v) if block_score == "max" else sum(v) for v in per]
                    best = sorted(range(len(pool)), key=lambda e: (-score[e], e))[:k_blocks]
                    want_list = [pool[e] for e in best]
                    tools.assert_same_topk(
                        set(listed), set(want_list), dict(zip(pool, score, strict=True)), atol=1e-6
                    )
                    seen["reordered"] += listed != pool[: len(listed)]
                    want = set(listed) | _dilate(listed[:m], cfg.r, nb) | win
                    want |= {q // s for q in range(lo, tt)}
                    assert got == want & set(range(nb))
                else:
                    seen["retrieve"] += 1
                    row = probs[i, j, :tt].tolist()
                    if block_score == "max":
                        bsc = tools.block_max(row, s)
                    else:
                        bsc = [sum(row[x * s : (x + 1) * s]) for x in range(nb)]
                    cand = [x for x in range(nb) if x not in win]
                    top = tools.brute_topk(cand, k_blocks + n_next, bsc)
                    pool = _pool(state, i, 0, j)
                    tools.assert_same_topk(set(pool), top, bsc, atol=1e-6)
                    assert got == set(listed) | win  # the retrieval reads its top k only
                    assert len(listed) == min(k_blocks, len(cand))
                    pools[(i, j)] = set(pool)
        q = sim.queries[0].reshape(b, h, g * d)
        anchor_q = torch.where(out.stats.retrieved.unsqueeze(-1), q, anchor_q)
        sim.advance()
    assert min(seen.values()) > 0, seen  # reuses happened, and some re-ranked their pool


def test_rescore_is_paper_mode_only_and_sized_by_blocks():
    from prhs_core.config import AttentionSpec

    with pytest.raises(ValueError, match="rescore applies to paper mode"):
        CISConfig(delta_max=0.1, rescore=64)
    with pytest.raises(ValueError, match="rescore"):
        CISConfig(rescore=-1)
    sel = CIS(CISConfig(budget=16, block_size=4, rescore=10, tau=0.8))
    st = sel.init_state(AttentionSpec(2, 4, 2, 8), capacity=2, max_seq_len=64)
    assert tuple(st.pool["anchor_next"].shape[1:]) == (2, 2, 3)  # ceil(10 / 4) blocks
    spec = AttentionSpec(2, 4, 2, 8)
    for plain in (CISConfig(tau=0.8, rescore=0), CISConfig(tau=0.8, delta_max=0.1)):
        assert plain.rescore_positions == 0
        st = CIS(plain).init_state(spec, capacity=1, max_seq_len=64)
        assert "anchor_next" not in st.pool.field_names
    # The default: a pool of 2·k in paper mode, and the lower target ratio that goes with it.
    default = CISConfig(budget=24, block_size=8)
    assert default.rescore_positions == 48 and default.auto_target_rho == 0.2
    assert CISConfig(rescore=0).auto_target_rho == 0.28
    assert CISConfig(delta_max=0.1).auto_target_rho == 0.28
    st = CIS(default).init_state(spec, capacity=1, max_seq_len=64)
    assert tuple(st.pool["anchor_next"].shape[1:]) == (2, 2, 6)


def test_budget_covering_everything_gives_dense_output(make_sim, layout):
    sel = selectors.create("cis", budget=4096, block_size=1, n_sink=0, n_local=1)
    sim = make_sim(
        [50, 31], num_q_heads=6, num_kv_heads=2, head_dim=8, layout=layout, max_new_tokens=4
    )
    sim.attach(sel)
    for _ in range(4):
        out = sim.select(0)
        attn, _ = sim.attend(0, out)
        torch.testing.assert_close(attn.double(), sim.reference_output(0), rtol=1e-5, atol=1e-5)
        sim.advance()


def test_released_slot_starts_without_anchor(make_sim):
    sel = selectors.create("cis", budget=8, block_size=1, n_local=8)
    sim = make_sim([30], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=3)
    state = sim.attach(sel)
    sim.select(0)
    sim.advance()
    sim.queries[0] = sim.queries[0] * 0 + 1.0
    sim.select(0)  # becomes the anchor
    assert bool(state.pool["anchor_len"][0, 0].gt(0).all())
    sim.release()
    assert state.pool.num_active == 0
    sim.attach(sel, state)  # the same slot, a new sequence
    for name in state.pool.field_names:
        fills = {"anchor_idx": -1, "anchor_next": -1, "tau": 0.72, "tau_beta": -1, "tau_rho": -1}
        fill = fills.get(name, 0)
        assert bool((state.pool[name][0] == fill).all()), name
    # The same (constant) query would reuse a stale anchor: a fresh slot must retrieve.
    assert bool(sim.select(0).stats.retrieved.all())


# ---------------------------------------------------------------------------------------------
# certified mode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("certificate", ["page", "global"])
@pytest.mark.parametrize("require_cosine", [True, False])
@pytest.mark.parametrize(("block_size", "hq", "hkv"), [(1, 2, 2), (4, 4, 1), (2, 6, 2)])
def test_certificate_bounds_the_true_dropped_mass_every_step(
    make_sim, layout, certificate, require_cosine, block_size, hq, hkv
):
    page = {"page": {"certificate_page": 1 if layout == "paged" else 4}, "global": {}}
    cfg = CISConfig(
        budget=8,
        n_sink=2,
        n_local=8,
        block_size=block_size,
        tau=0.6,
        delta_max=0.3,
        require_cosine=require_cosine,
        k_max=32,
        certificate=certificate,
        **page[certificate],
    )
    sel = CIS(cfg)
    steps = 10
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
    sim.attach(sel)
    assert sel.certifies
    reused = 0
    g = hq // hkv
    for _ in range(steps):
        sim.queries[0] = direction + 0.01 * torch.randn(sim.queries[0].shape, generator=gen)
        out = sim.select(0)
        mask = sim.mask(out)
        logits = sim.logits(0)
        valid = torch.isfinite(logits)
        delta = theory.dropped_mass(
            logits.masked_fill(~valid, 0.0), mask.repeat_interleave(g, 1) & valid, valid
        )
        # Every query head of the group, not only their mean: δ̂ bounds each.
        worst = delta.view(2, hkv, g).amax(-1)
        dhat = out.stats.delta_hat
        assert dhat is not None
        assert bool((worst <= dhat.double()).all()), (worst, dhat)
        reuse = ~out.stats.retrieved
        assert bool((dhat[reuse] <= cfg.delta_max).all())
        reused += int(reuse.sum())
        sim.advance()
    assert reused > 0  # the certificate did allow reuse


def test_unchecked_certificate_matches_the_checked_one():
    """The decode path's certificate (``check=False``: no host read) is the same formula, and a
    skipped (non-finite) query's NaN shift certifies nothing instead of raising."""
    inf = float("inf")
    la = torch.tensor([0.0, -1e-9, -0.1, -2.0, -800.0, -inf], dtype=torch.float64)
    eps = torch.tensor([0.0, 0.3, 5.0, 1e3, inf], dtype=torch.float64)
    la, eps = torch.broadcast_tensors(la.view(-1, 1), eps.view(1, -1))
    want = theory.log_reuse_certificate(la, eps)
    got = theory.log_reuse_certificate(la, eps, check=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    nan = torch.full_like(la[:, :1], float("nan"))
    assert bool(theory.log_reuse_certificate(la[:, :1], nan, check=False).isnan().any())
    with pytest.raises(ValueError, match="eps must be >= 0"):
        theory.log_reuse_certificate(la[:, :1], nan)


def test_certified_retrieval_is_the_smallest_top_p_set(make_sim, tools):
    cfg = CISConfig(
        budget=4, n_sink=1, n_local=1, block_size=1, delta_max=0.2, delta_target=0.1, k_max=64
    )
    sel = CIS(cfg)
    sim = make_sim([60], num_q_heads=1, num_kv_heads=1, head_dim=8, max_new_tokens=1, seed=4)
    sim.keys[0] *= 3
    sim.attach(sel)
    out = sim.select(0)
    probs = sim.group_probs(0)[0, 0, :60].tolist()
    # The certified set is sink ∪ S_a: the local window is read but not counted, because a
    # later reuse may no longer cover the anchor's local positions.
    kept = probs[0]
    rest = sorted(range(1, 60), key=lambda i: -probs[i])
    need = 0
    while 1 - kept > cfg.retrieval_target + 1e-12:
        kept += probs[rest[need]]
        need += 1
    assert need > 1
    got = tools.chosen(out, 0, 0)
    assert got == {0, 59, *rest[:need]}
    assert tools.dropped_mass(probs, {0, *rest[:need]}) <= cfg.retrieval_target
    assert tools.dropped_mass(probs, {0, *rest[: need - 1]}) > cfg.retrieval_target


def test_certified_retrieval_meets_its_target_for_every_query_head(make_sim):
    """One head of the group puts its mass on one key, the other spreads it evenly: the group
    mean would meet the target with a set that drops twice the target for the second head."""
    cfg = CISConfig(
        budget=4, n_sink=1, n_local=1, block_size=1, delta_max=0.2, delta_target=0.1, k_max=64
    )
    sim = make_sim([60], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=1, seed=4)
    sim.keys[0].zero_()
    sim.keys[0][..., 0] = torch.where(torch.arange(sim.keys[0].shape[2]) == 10, 25.0, 0.0)
    sim.queries[0].zero_()
    sim.queries[0][:, 0, 0] = 1.0  # head 0: key 10 only; head 1 (zero query): uniform
    sim.attach(CIS(cfg))
    out = sim.select(0)
    logits = sim.logits(0)
    valid = torch.isfinite(logits)
    keep = sim.mask(out).repeat_interleave(2, 1) & valid
    per_head = theory.dropped_mass(logits.masked_fill(~valid, 0.0), keep, valid)[0]
    assert bool((per_head <= cfg.retrieval_target).all()), per_head
    assert per_head[1] > cfg.retrieval_target / 2  # the mean alone would stop at 2x this
    assert not bool(out.stats.missed.any())
    assert out.stats.delta_hat[0, 0].item() >= per_head.max().item()


def test_certified_state_layouts():
    """Page mode keeps the anchor's per-page masses per query head and the key boxes in a side
    cache; global mode one log δ_a per query head and K_max."""
    from prhs_core.config import AttentionSpec

    spec = AttentionSpec(2, 4, 2, 8)
    page = CIS(CISConfig(budget=8, delta_max=0.1, certificate_page=16))
    st = page.init_state(spec, capacity=3, max_seq_len=100)
    assert page.side_page_size() == 16 and st.side is not None
    # Per side-cache page: (layers, KV heads, D) box, (layers, KV heads, g, drop/sel) masses.
    assert tuple(st.side["cis_page_logm"].shape[1:]) == (2, 2, 2, 2)
    assert tuple(st.side["cis_kmin"].shape[1:]) == (2, 2, 8)
    assert page.state_per_location  # the masses are the request's: no prefix sharing
    glob = CIS(CISConfig(budget=8, delta_max=0.1, certificate="global"))
    st = glob.init_state(spec, capacity=3, max_seq_len=100)
    assert st.side is None and glob.side_page_size() == 1
    assert tuple(st.pool["anchor_log_delta"].shape[1:]) == (2, 2, 2)
    assert not glob.state_per_location
    paper = CIS(CISConfig(budget=8, tau=0.8, scorer="exact"))
    assert paper.init_state(spec, capacity=1, max_seq_len=100).side is None
    # Paper mode's default scorer keeps a code row per key: a side cache, one row a location.
    codes = CIS(CISConfig(budget=8, tau=0.8))
    st = codes.init_state(spec, capacity=1, max_seq_len=100)
    assert st.side is not None and codes.side_page_size() == 1


@pytest.mark.parametrize("d", [16, 64])
def test_paper_mode_keeps_a_code_row_per_key_and_counts_its_bytes(make_sim, d):
    """``scorer="int4"``: a side cache of one code row (``D/2 + 8`` bytes rounded up to 16: 16
    at D 16, 48 at D 64) per (location, layer, KV head), a function of the key and the layer's
    centre (prefix sharing is safe), and a retrieval or re-ranking counted at those bytes, not
    the keys'."""
    from prhs_core.config import AttentionSpec
    from prhs_kernels.keycodes import code_bytes, dequantize_keys_reference

    width = {16: 16, 64: 48}[d]
    assert code_bytes(d) == width
    assert CISConfig().key_codes and CISConfig(scorer="int4").key_codes  # paper mode's default
    assert not CISConfig(scorer="exact").key_codes
    assert not CISConfig(delta_max=0.1).key_codes  # certified mode scores the keys
    spec = AttentionSpec(2, 4, 2, d)
    sel = CIS(CISConfig(budget=8, tau=0.8, scorer="int4"))
    st = sel.init_state(spec, capacity=2, max_seq_len=100)
    assert st.side is not None and sel.side_page_size() == 1 and not sel.state_per_location
    assert st.side["cis_codes"].dtype == torch.uint8
    assert tuple(st.side["cis_codes"].shape[1:]) == (2, 2, width)
    assert tuple(st.side["cis_center"].shape) == (2, 2, d)  # one centre per layer, KV head
    # The codes follow the keys written, at their locations, around the first keys' mean.
    sim = make_sim([40, 25], num_q_heads=4, num_kv_heads=2, head_dim=d, num_layers=2, seed=3)
    st = sim.attach(sel)
    codes = sel.key_codes(st, 1)
    prompt = torch.cat([sim.keys[1][0, :, :40], sim.keys[1][1, :, :25]], 1).float()  # [Hkv, n, D]
    torch.testing.assert_close(codes.center, prompt.mean(1))
    center_before = codes.center.clone()
    sim.advance()  # a later write leaves the centre as it was
    assert torch.equal(sel.key_codes(st, 1).center, center_before)
    kv = sim.kv(1)
    loc = 0 * st.row_stride + 30  # row 0, position 30
    back = dequantize_keys_reference(codes.rows[loc], d, codes.center)
    key = sim.keys[1][0, :, 30].float()
    step = codes.rows[loc, :, d // 2 + 4 : d // 2 + 8].contiguous().view(torch.float32)
    assert bool(((back - key).abs() <= step / 2 + 1e-6).all())
    # Bytes: a retrieval reads one code row per position.
    exact = CIS(CISConfig(budget=8, tau=0.8, scorer="exact"))
    exact.init_state(spec, capacity=2, max_seq_len=100)
    assert sel.key_row_bytes(kv) == width and exact.key_row_bytes(kv) == d * 4
    assert torch.equal(sel.retrieval_bytes(kv), kv.seq_lens.view(-1, 1).double() * width)


def test_a_pinned_key_center_codes_every_write_around_it(make_sim):
    """``set_key_center`` before the first write: the codes are taken around the pinned centre
    whatever the first prompt holds (two batches that share a sequence code it alike), and a
    late, misshapen, non-finite or exact-scorer pin is refused before anything changes.
    Unpinned, a write shorter than ``MIN_CENTER_KEYS`` leaves the centre at 0."""
    from prhs_kernels.keycodes import key_center

    kw = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2, "seed": 4}
    center = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(2))
    rows, free_centers = [], []
    for lengths, ids in (([40, 25], [0, 1]), ([40, 33, 18], [0, 5, 6])):
        sel = CIS(CISConfig(budget=8, tau=0.8))
        sim = make_sim(lengths, row_ids=ids, **kw)
        st = sim.init_state(sel)
        sel.set_key_center(st, center)
        sim.attach(sel, st)
        assert torch.equal(st.side["cis_center"], center)
        rows.append(st.side["cis_codes"][:40].clone())  # row 0's prompt, contiguous
        # Unpinned, the first write's mean is the centre: the two batches' differ.
        free = CIS(CISConfig(budget=8, tau=0.8))
        free_centers.append(sim.attach(free).side["cis_center"].clone())
    assert torch.equal(rows[0], rows[1])
    assert not torch.allclose(free_centers[0], free_centers[1])
    sel = CIS(CISConfig(budget=8, tau=0.8))
    sim = make_sim([30], **kw)
    st = sim.init_state(sel)
    before = st.side["cis_center"].clone()
    with pytest.raises(ValueError, match=r"center must be \[num_layers=2, Hkv=2, D=16\]"):
        sel.set_key_center(st, center[:1])
    bad = center.clone()
    bad[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="center"):
        sel.set_key_center(st, bad)
    with pytest.raises(TypeError, match="center"):
        sel.set_key_center(st, center.long())
    assert torch.equal(st.side["cis_center"], before) and not st.side.initialized
    # A first write shorter than MIN_CENTER_KEYS codes around 0 and fixes nothing, but a pin
    # after it is too late (its codes are written).
    sim.attach(sel, st)
    assert not bool(st.side["cis_center"].any())
    with pytest.raises(ValueError, match=r"before the first key is written: layer\(s\) \[0, 1\]"):
        sel.set_key_center(st, center)
    assert not bool(st.side["cis_center"].any())
    # Unpinned, the first write of MIN_CENTER_KEYS keys or more fixes it: their mean.
    sel = CIS(CISConfig(budget=8, tau=0.8))
    sim = make_sim([MIN_CENTER_KEYS], **kw)
    st = sim.attach(sel)
    loc = torch.arange(MIN_CENTER_KEYS)
    prompt = sim.keys[1][0, :, :MIN_CENTER_KEYS].transpose(0, 1)  # [n, Hkv, D]
    torch.testing.assert_close(st.side["cis_center"][1], key_center(loc, prompt))
    exact = CIS(CISConfig(budget=8, tau=0.8, scorer="exact"))
    with pytest.raises(ValueError, match="applies to paper mode with key codes"):
        exact.set_key_center(make_sim([30], **kw).init_state(exact), center)


def test_cis_config_errors():
    with pytest.raises(ValueError, match="scorer must be one of"):
        CISConfig(scorer="int8")
    with pytest.raises(ValueError, match="scorer='int4' applies to paper mode"):
        CISConfig(delta_max=0.1, scorer="int4")
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
    with pytest.raises(ValueError, match="certified mode"):
        CISConfig(certificate="page")
    with pytest.raises(ValueError, match="certificate must be one of"):
        CISConfig(delta_max=0.1, certificate="box")
    with pytest.raises(ValueError, match="certificate_page"):
        CISConfig(delta_max=0.1, certificate_page=0)
    with pytest.raises(ValueError, match="certificate_page applies"):
        CISConfig(delta_max=0.1, certificate="global", certificate_page=8)
    with pytest.raises(ValueError, match="delta_target"):
        CISConfig(delta_max=0.1, delta_target=0.2)
    with pytest.raises(ValueError, match="k_max"):
        CISConfig(delta_max=0.1, budget=64, k_max=32)
    with pytest.raises(ValueError, match="n_den"):
        CISConfig(n_den=0)
    with pytest.raises(ValueError, match=r"block score must be one of \('max', 'mass'\)"):
        CISConfig(block_score="sum")
    with pytest.raises(ValueError, match="non-empty"):
        CISConfig(tau=[])
    with pytest.raises(ValueError, match=r"tau\[1\]\[0\]"):
        CISConfig(tau=[[0.7], [1.2]])
    with pytest.raises(TypeError, match=r"tau\[0\]\[1\]"):
        CISConfig(tau=[[0.7, "x"]])


# ---------------------------------------------------------------------------------------------
# a threshold per (layer, KV head)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("certified", [False, True])
def test_tau_table_sets_each_rows_threshold(make_sim, certified):
    """Rows whose threshold is -1 reuse whenever their anchor lives; rows at 1.01 always
    retrieve; a row of one value applies it to every KV head."""
    extra = {"delta_max": 0.99, "require_cosine": True} if certified else {}
    table = [[-1.0, 1.01], [1.01], [-1.0]]
    sel = CIS(CISConfig(budget=8, n_local=16, tau=table, **extra))
    assert sel.config.tau == ((-1.0, 1.01), (1.01,), (-1.0,))
    sim = make_sim([60, 45], num_q_heads=4, num_kv_heads=2, head_dim=8, num_layers=3,
                   max_new_tokens=6, seed=4)  # fmt: skip
    sim.attach(sel)
    for step in range(6):
        got = [sim.select(layer).stats.retrieved.clone() for layer in range(3)]
        assert got[1].all()  # 1.01: always
        if certified:  # the certificate may also refuse a reuse; the cosine rule never forces one
            assert got[0][:, 1].all()
        else:
            assert got[0][:, 1].all() and (got[0][:, 0] == (step == 0)).all()
            assert (got[2] == (step == 0)).all()
        sim.advance()


def test_tau_table_must_fit_the_model(make_sim):
    sim = make_sim([20], num_q_heads=4, num_kv_heads=2, head_dim=8, num_layers=2)
    with pytest.raises(ValueError, match="needs 2 rows"):
        sim.attach(CIS(CISConfig(budget=8, tau=[[0.7, 0.7]])))
    with pytest.raises(ValueError, match="1 or 2"):
        sim.attach(CIS(CISConfig(budget=8, tau=[[0.7, 0.7, 0.7], [0.7]])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("certificate", ["page", "global"])
def test_certified_cis_on_cuda_with_a_bf16_cache(certificate):
    """The certified step on a GPU, in a bf16 cache (the H200 run): it runs on the device, keeps
    its state there, and every query head's dropped mass stays within the step's δ̂."""
    from prhs_core.config import AttentionSpec
    from prhs_core.layout import ContiguousKV
    from prhs_kernels import token_locations

    dev = torch.device("cuda")
    b, hq, h, d, t0, steps = 2, 8, 2, 64, 600, 6
    spec = AttentionSpec(1, hq, h, d)
    sel = CIS(CISConfig(budget=32, delta_max=0.3, require_cosine=False, certificate=certificate))
    gen = torch.Generator(device=dev).manual_seed(0)
    cap = t0 + steps
    k = torch.randn(b, h, cap, d, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, h, cap, d, device=dev, generator=gen).to(torch.bfloat16)
    direction = torch.randn(d, device=dev, generator=gen)
    k[:, :, ::9] += (2.0 * direction).to(torch.bfloat16)
    state = sel.init_state(spec, capacity=b, max_seq_len=cap, kv_dtype=torch.bfloat16, device=dev)
    state.pool.create(list(range(b)))
    plan = sel.make_plan(state, batch_size=b, scaling=d**-0.5, stats=True)
    zero = torch.zeros(b, dtype=torch.int32, device=dev)
    reused = 0
    for s in range(steps):
        n = t0 + s + 1
        lens = torch.full((b,), n, dtype=torch.int32, device=dev)
        plan.update(lens, torch.arange(b, device=dev))
        kv = ContiguousKV(k[:, :, :n], v[:, :, :n], lens, zero)
        pos = torch.arange(n, device=dev) if s == 0 else torch.tensor([n - 1], device=dev)
        pos = pos.view(1, -1).expand(b, -1)
        loc = token_locations(kv, pos, state.row_stride)
        rows = torch.arange(b, device=dev).view(-1, 1).expand_as(pos)
        sel.write_kv(state, 0, loc.flatten(), k[rows, :, pos].flatten(0, 1),
                     v[rows, :, pos].flatten(0, 1))  # fmt: skip
        kv = ContiguousKV(kv.k, kv.v, plan.seq_lens, zero)
        q = (direction + 0.005 * torch.randn(b, hq, d, device=dev, generator=gen)).bfloat16()
        out = sel.select(plan, 0, q, kv, state)
        assert out.indices.device.type == "cuda" and plan.stats.delta_hat.device.type == "cuda"
        logits = torch.einsum("bhgd,bhtd->bhgt", q.view(b, h, hq // h, d).double(),
                              kv.k.double()) * d**-0.5  # fmt: skip
        mask = out.to_mask(kv.seq_lens, n).unsqueeze(2).expand_as(logits)
        worst = theory.dropped_mass(logits, mask).amax(-1)
        assert bool((worst <= plan.stats.delta_hat.double()).all())
        reused += int((~plan.stats.retrieved).sum())
    assert reused > 0


@pytest.mark.parametrize("expansion", ["dilate", "random"])
def test_each_anchor_keeps_the_union_its_reuses_copy(make_sim, expansion):
    """Paper mode without ``rescore``: after every step, each anchor's ``anchor_union`` is
    ``S_a ∪ dilate(S_a)`` of its list (what the Triton composition of a reusing row copies);
    with ``rescore`` or a certificate the fields do not exist."""
    from prhs_kernels.cis import anchor_union_reference

    cfg = CISConfig(budget=12, n_sink=2, n_local=5, block_size=2, tau=0.8, n_den=2, r=2,
                    rescore=0, expansion=expansion)  # fmt: skip
    sel = CIS(cfg)
    sim = make_sim([90, 61, 75], num_q_heads=4, num_kv_heads=2, head_dim=16,
                   max_new_tokens=16, seed=8)  # fmt: skip
    state = sim.attach(sel)
    pool = state.pool
    m = 0 if expansion == "random" else sel.dilation_m()
    assert sel.union_m() == m and pool["anchor_union"].shape[-1] == sel.anchor_width() + 4 * m
    gen = torch.Generator().manual_seed(4)
    retrieved = reused = 0
    for step in range(16):
        if step % 6 == 0:
            q0 = torch.randn(3, 4, 16, generator=gen)
        sim.queries[0] = q0 + 0.02 * torch.randn(3, 4, 16, generator=gen)
        out = sim.select(0)
        retrieved += int(out.stats.retrieved.sum())
        reused += int((~out.stats.retrieved).sum())
        live = pool["anchor_len"][:, 0] > 0
        want, want_cnt = anchor_union_reference(
            pool["anchor_idx"][:, 0], pool["anchor_cnt"][:, 0], m, cfg.r
        )
        assert live.any()
        assert torch.equal(pool["anchor_union"][:, 0][live], want[live])
        assert torch.equal(pool["anchor_ucnt"][:, 0][live], want_cnt[live])
        sim.advance()
    assert retrieved > 0 and reused > 0
    for other in (CISConfig(budget=12, tau=0.8), CISConfig(budget=12, delta_max=0.1)):
        s2 = CIS(other)
        assert not s2.keeps_union()
        st = make_sim([40], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=1).attach(s2)
        assert "anchor_union" not in st.pool and "anchor_ucnt" not in st.pool
