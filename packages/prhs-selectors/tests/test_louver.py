"""``louver``: zero false negatives against the selector's own thresholds (sampled and oracle),
on random, clustered and adversarial keys, after incremental folds of the recent buffer; the
index written at prefill and at each fold; the budget cap; bad configurations."""

from __future__ import annotations

import pytest
import torch

from prhs_core.layout import ContiguousKV
from prhs_selectors import Louver, LouverConfig
from prhs_selectors.louver import sample_positions

SMALL = {"n_sink": 1, "n_local": 8, "buffer": 8, "page": 8, "subspaces": 2}


def observe(sim, selector) -> None:
    spec = sim.spec
    queries = torch.zeros(sim.batch_size, 2, spec.num_q_heads, spec.head_dim)
    state = sim.state(selector)
    locs = sim.locations(state.row_stride)
    for layer in spec.selectable_layers:
        kv = ContiguousKV(sim.keys[layer], sim.values[layer], sim.seq_lens())
        selector.observe_prompt(
            state, layer, sim.live_slots, queries, kv, sim.scaling, locations=locs
        )


def thresholds(sim, selector, logits: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """``[B, Hq]`` the selector's thresholds, recomputed (float64 logits ``[B, Hq, T]``)."""
    c = selector.config
    t = logits.shape[-1]
    masked = logits.masked_fill(torch.arange(t).view(1, 1, -1) >= length.view(-1, 1, 1), -torch.inf)
    if c.threshold == "oracle":
        return masked.topk(min(c.oracle_k, t), -1).values[..., -1]
    pos = sample_positions(length, c.sample_size, c.seed)
    taken = torch.gather(masked, 2, pos.clamp_min(0).unsqueeze(1).expand(-1, logits.shape[1], -1))
    return taken.masked_fill((pos < 0).unsqueeze(1), -torch.inf).amax(-1)


def shape_keys(sim, kind: str) -> None:
    g = torch.Generator().manual_seed(11)
    k = sim.keys[0]
    if kind == "clustered":
        centres = torch.randn(k.shape[0], k.shape[1], 3, k.shape[-1], generator=g) * 3
        pick = torch.randint(0, 3, k.shape[:3], generator=g)
        near = torch.gather(centres, 2, pick.unsqueeze(-1).expand(*k.shape))
        sim.keys[0] = near + 0.1 * k
    elif kind == "adversarial":
        k = k.clone()
        k[:, :, ::5] *= 30.0
        k[:, :, 1::5] *= 1e-3
        k[:, :, 10:20] = k[:, :, 0:10]
        sim.keys[0] = k


@pytest.mark.parametrize("threshold", ["sample", "oracle"])
@pytest.mark.parametrize("kind", ["random", "clustered", "adversarial"])
def test_every_key_above_its_heads_threshold_is_selected(make_sim, layout, kind, threshold) -> None:
    """Zero false negatives, through prefill and three folds of the recent buffer."""
    if layout == "paged":
        pytest.skip("louver keeps its index per page: a paged pool needs whole pages")
    sim = make_sim(
        [37, 58], num_q_heads=4, num_kv_heads=2, head_dim=8, layout=layout, max_new_tokens=24
    )
    shape_keys(sim, kind)
    # A budget above the whole index: the guarantee holds for every cluster that passes.
    cfg = LouverConfig(budget=128, threshold=threshold, sample_size=5, oracle_k=6, **SMALL)
    lv = Louver(cfg)
    sim.attach(lv)
    observe(sim, lv)
    state = sim.state(lv)
    folds = 0
    for step in range(25):
        before = state.pool["lv_len"][:2, 0].clone()
        sel = sim.select(0)
        length = state.pool["lv_len"][:2, 0].clone()
        folds += int((length > before).sum())
        assert bool((length + 8 > sim.lengths).all()) and bool((length % 8 == 0).all())
        logits = sim.logits(0)
        thr = thresholds(sim, lv, logits, length)
        for b in range(2):
            for h in range(2):
                chosen = tools_chosen(sel, b, h)
                for qh in (2 * h, 2 * h + 1):
                    above = [
                        i for i in range(int(length[b]))
                        if logits[b, qh, i] >= thr[b, qh] + 1e-9
                    ]  # fmt: skip
                    missed = set(above) - chosen
                    assert not missed, (step, b, qh, sorted(missed))
        if step < 24:
            sim.advance()
    assert folds >= 4  # the buffer was folded into the index during decode


def tools_chosen(sel, b: int, h: int) -> set[int]:
    n = int(sel.counts[b, h])
    return set(sel.indices[b, h, :n].tolist())


def test_prefill_and_folds_write_the_index_of_each_page(make_sim) -> None:
    from prhs_kernels.louver import balanced_clusters, cluster_bounds

    sim = make_sim([20], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=5)
    lv = Louver(LouverConfig(budget=16, **SMALL))
    sim.attach(lv)
    observe(sim, lv)
    state = sim.state(lv)
    assert int(state.pool["lv_len"][0, 0]) == 16
    for _ in range(5):
        sim.select(0)
        sim.advance()
    sim.select(0)
    assert int(state.pool["lv_len"][0, 0]) == 24  # lengths 20..25: the buffer 16..23 folded
    side = state.side
    loc = sim.locations(state.row_stride)[0]
    for first in (0, 8, 16):
        row = int(loc[first]) // 8
        keys = sim.keys[0][0, :, first : first + 8]  # [1, 8, D]
        perm = balanced_clusters(keys)
        centres, radii = cluster_bounds(keys, perm, 2)
        assert torch.equal(side["lv_perm"][row, 0].long(), perm)
        torch.testing.assert_close(side["lv_center"][row, 0], centres)
        torch.testing.assert_close(side["lv_radius"][row, 0], radii)


def test_the_budget_caps_the_clusters_read_keeping_those_furthest_above(make_sim) -> None:
    sim = make_sim([200], num_q_heads=2, num_kv_heads=1, head_dim=8)
    cfg = LouverConfig(budget=8, threshold="oracle", oracle_k=60, **SMALL)
    lv = Louver(cfg)
    sim.attach(lv)
    observe(sim, lv)
    sel = sim.select(0)
    assert lv.selection_width() == sum(lv.window_widths()) + 8
    win = {0} | set(range(192, 200))
    assert len(tools_chosen(sel, 0, 0) - win) <= 8


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"page": 12, "buffer": 12, "n_local": 12}, "power of two"),
        ({"page": 16, "buffer": 24, "n_local": 24}, "must divide buffer"),
        ({"n_local": 64}, "n_local"),
        ({"threshold": "max"}, "threshold must be one of"),
        ({"budget": 3}, "one cluster"),
        ({"block_size": 4}, "block_size must be 1"),
    ],
)
def test_bad_configs_are_refused(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        LouverConfig(**fields)


def test_subspaces_must_divide_the_head_dim(make_sim) -> None:
    sim = make_sim([10], num_q_heads=2, num_kv_heads=1, head_dim=6)
    with pytest.raises(ValueError, match="subspaces"):
        sim.attach(Louver(LouverConfig(budget=8, **{**SMALL, "subspaces": 4})))
