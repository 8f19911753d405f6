"""``quest`` (Quest): the page bound is an upper bound, pages are maintained incrementally, the
top pages by bound are selected, and the first layers are dense."""

from __future__ import annotations

import pytest
import torch

from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_selectors import Quest, QuestConfig
from prhs_selectors.quest import page_bounds


def _brute_pages(keys: torch.Tensor, n: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Hkv, ceil(n/p), D]`` element-wise min and max of each page of ``keys[:, :n]``."""
    pages = [keys[:, j : min(j + p, n)].float() for j in range(0, n, p)]
    return torch.stack([x.amin(1) for x in pages], 1), torch.stack([x.amax(1) for x in pages], 1)


def _page_max_logits(q: torch.Tensor, keys: torch.Tensor, n: int, p: int, scaling: float):
    """``[Hkv, g, ceil(n/p)]`` float64: the largest true logit of each page, per query head."""
    logits = torch.einsum("hgd,htd->hgt", q.double(), keys[:, :n].double()) * scaling
    return torch.stack([logits[..., j : j + p].amax(-1) for j in range(0, n, p)], -1)


def _slack(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scaling: float):
    """Float32 rounding allowance of a bound: a few ulps of ``Σ_j |q_j|·max(|min_j|, |max_j|)``."""
    mag = torch.maximum(kmin.abs(), kmax.abs())
    return 1e-5 * scaling * torch.einsum("bhgd,bhpd->bhgp", q.abs().double(), mag.double())


KEY_KINDS = ["random", "huge-norms", "constant-pages", "sign-flips", "sparse-query"]


@pytest.mark.parametrize("kind", KEY_KINDS)
def test_page_bound_is_at_least_every_logit_in_the_page(kind: str) -> None:
    g = torch.Generator().manual_seed(len(kind))
    b, hkv, grp, t, d, p = 2, 3, 4, 45, 16, 8
    keys = torch.randn(b, hkv, t, d, generator=g)
    q = torch.randn(b, hkv, grp, d, generator=g)
    if kind == "huge-norms":
        keys[:, :, ::3] *= 1e4
        q[:, :, 0] *= 1e3
    elif kind == "constant-pages":  # one key repeated: the bound is that key's logit
        keys = keys[:, :, ::p].repeat_interleave(p, 2)[:, :, :t]
    elif kind == "sign-flips":  # opposite keys in a page: the bound is far above both logits
        keys[:, :, 1::2] = -keys[:, :, ::2][:, :, : keys[:, :, 1::2].shape[2]]
    elif kind == "sparse-query":
        q[..., ::2] = 0.0
    n_pages = -(-t // p)
    kmin = torch.stack([keys[:, :, j * p : (j + 1) * p].amin(2) for j in range(n_pages)], 2)
    kmax = torch.stack([keys[:, :, j * p : (j + 1) * p].amax(2) for j in range(n_pages)], 2)
    scaling = d**-0.5
    bound = page_bounds(q, kmin, kmax, scaling)
    assert bound.shape == (b, hkv, grp, n_pages)
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double()) * scaling
    true_max = torch.stack([logits[..., j * p : (j + 1) * p].amax(-1) for j in range(n_pages)], -1)
    slack = _slack(q, kmin, kmax, scaling)
    assert bool(torch.isfinite(bound).all())
    assert bool((bound.double() >= true_max - slack).all())
    if kind == "constant-pages":
        torch.testing.assert_close(bound.double(), true_max, rtol=0, atol=float(slack.max()))
    if kind == "sign-flips":
        assert bool((bound.double() > true_max + 1e-3).all())


GEOMETRIES = [([37, 20, 1], 2, 2), ([45, 30], 6, 2), ([50, 9], 8, 2)]
GEOMETRY_IDS = [f"T{'-'.join(map(str, ls))}-Hq{hq}-Hkv{hkv}" for ls, hq, hkv in GEOMETRIES]


@pytest.mark.parametrize(("lengths", "hq", "hkv"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_state_bounds_hold_for_every_page_and_head(make_sim, layout, lengths, hq, hkv) -> None:
    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=8, layout=layout, max_new_tokens=3
    )
    sim.keys[0][:, :, 5::7] *= 3e3  # some huge keys
    quest = Quest(QuestConfig(budget=8, page_size=4, dense_layers=0, n_sink=1, n_local=2))
    pool = sim.attach(quest)
    g = hq // hkv
    for _ in range(3):
        quest.select(sim.step(0), pool)
        for b, n in enumerate(sim.lengths.tolist()):
            np_ = -(-n // 4)
            kmin, kmax = pool["quest_kmin"][b, 0, :, :np_], pool["quest_kmax"][b, 0, :, :np_]
            q = sim.queries[0][b].view(hkv, g, -1).float()
            bound = page_bounds(q[None], kmin[None], kmax[None], sim.scaling)[0]
            true_max = _page_max_logits(q, sim.keys[0][b], n, 4, sim.scaling)
            slack = _slack(q[None], kmin[None], kmax[None], sim.scaling)[0]
            assert bool((bound.double() >= true_max - slack).all())
        sim.advance()


@pytest.mark.parametrize("p", [1, 4, 5], ids=lambda p: f"page{p}")
def test_incremental_min_max_equals_recomputation(make_sim, layout, p: int) -> None:
    sim = make_sim(
        [22, 9, 16, 1],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_layers=3,
        layout=layout,
        max_new_tokens=9,
    )
    quest = Quest(QuestConfig(budget=8, page_size=p, dense_layers=1, n_sink=1, n_local=2))
    pool = sim.attach(quest)

    def check() -> None:
        for layer in (1, 2):
            for b, n in enumerate(sim.lengths.tolist()):
                kmin, kmax = _brute_pages(sim.keys[layer][b], n, p)
                np_ = kmin.shape[1]
                assert torch.equal(pool["quest_kmin"][b, layer - 1, :, :np_], kmin)
                assert torch.equal(pool["quest_kmax"][b, layer - 1, :, :np_], kmax)
                # Pages not reached yet hold nothing.
                assert bool((pool["quest_kmin"][b, layer - 1, :, np_:] == float("inf")).all())
                assert int(pool["quest_pages_built"][b, layer - 1]) == n

    for step in range(9):
        if step == 5:
            # Forget sequence 1's pages on layer 2: this step folds 14 positions for it and
            # one for the others, in one call.
            pool["quest_pages_built"][1, 1] = 0
            pool["quest_kmin"][1, 1] = float("inf")
            pool["quest_kmax"][1, 1] = float("-inf")
        for layer in range(3):
            quest.select(sim.step(layer), pool)
        check()
        sim.advance()


def test_first_layers_are_dense(make_sim) -> None:
    sim = make_sim([40, 13], num_q_heads=4, num_kv_heads=2, head_dim=8, num_layers=4)
    quest = selectors.create("quest", budget=16, page_size=8, n_sink=1, n_local=1)
    assert quest.config.dense_layers == 2
    pool = sim.attach(quest)
    # Only the two sparse layers keep pages: [capacity, L - 2, Hkv, ceil(max_seq_len / 8), D].
    assert pool["quest_kmin"].shape == (2, 2, 2, -(-sim.capacity_len // 8), 8)
    for layer in range(4):
        sel = quest.select(sim.step(layer), pool)
        assert sel.is_dense == (layer < 2)
        if layer < 2:
            assert torch.equal(sel.stats.num_selected, sim.lengths.view(-1, 1).expand(-1, 2))
        else:
            assert sel.block_size == 8
            assert bool((sel.stats.num_selected < sim.lengths.view(-1, 1)).any())
        assert not bool(sel.stats.retrieved.any())
    none_dense = Quest(QuestConfig(dense_layers=0, page_size=8, budget=8))
    assert not none_dense.select(sim.step(0), sim.attach(none_dense)).is_dense


@pytest.mark.parametrize(("lengths", "hq", "hkv"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_selection_is_window_pages_plus_top_pages_by_bound(
    make_sim, layout, lengths, hq, hkv
) -> None:
    p, budget, n_sink, n_local = 4, 13, 2, 3
    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=8, layout=layout, max_new_tokens=3
    )
    quest = Quest(
        QuestConfig(budget=budget, page_size=p, dense_layers=0, n_sink=n_sink, n_local=n_local)
    )
    pool = sim.attach(quest)
    g = hq // hkv
    for _ in range(3):
        sel = quest.select(sim.step(0), pool)
        assert sel.block_size == p
        for b, n in enumerate(sim.lengths.tolist()):
            kmin, kmax = _brute_pages(sim.keys[0][b], n, p)
            q = sim.queries[0][b].view(hkv, g, -1).double()
            # Σ_j max(q_j·max_j, q_j·min_j), then the max over the group's heads.
            terms = torch.maximum(
                q[:, :, None] * kmax[:, None].double(), q[:, :, None] * kmin[:, None].double()
            )
            bound = (terms.sum(-1) * sim.scaling).amax(1)  # [Hkv, pages]
            n_pages = bound.shape[-1]
            window = {i for i in range(n) if i < n_sink or i >= n - n_local}
            win_pages = {i // p for i in window}
            for h in range(hkv):
                chosen = {int(i) for i in sel.indices[b, h] if i >= 0}
                assert win_pages <= chosen
                extra = chosen - win_pages
                others = [j for j in range(n_pages) if j not in win_pages]
                assert len(extra) == min(budget // p, len(others))
                left = [bound[h, j].item() for j in others if j not in extra]
                if extra and left:
                    assert min(bound[h, j].item() for j in extra) >= max(left) - 1e-5
            expect_bytes = n_pages * 2 * 8 * 4
            assert sel.stats.proxy_bytes[b].tolist() == [expect_bytes] * hkv
        mask = sel.to_mask(sim.lengths, sim.max_len, hkv)
        assert torch.equal(sel.stats.num_selected, mask.sum(-1))
        out, _ = sim.attend(0, sel)
        torch.testing.assert_close(out.double(), sim.reference_output(0, mask), rtol=0, atol=1e-5)
        sim.advance()


def test_layouts_agree(make_sim) -> None:
    got = []
    for layout in ("contiguous", "paged"):
        sim = make_sim(
            [45, 30, 2],
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=8,
            layout=layout,
            num_layers=3,
            max_new_tokens=2,
        )
        quest = Quest(QuestConfig(budget=8, page_size=4, n_sink=1, n_local=2))
        pool = sim.attach(quest)
        run = []
        for _ in range(2):
            for layer in range(3):
                sel = quest.select(sim.step(layer), pool)
                run.append((sel.indices, sim.attend(layer, sel)[0]))
            sim.advance()
        got.append(run)
    for (ia, oa), (ib, ob) in zip(*got, strict=True):
        assert (ia is None and ib is None) or torch.equal(ia, ib)
        assert torch.equal(oa, ob)


@pytest.mark.parametrize("p", [4, 16], ids=lambda p: f"page{p}")
def test_budget_covering_the_sequence_gives_the_dense_output(make_sim, layout, p: int) -> None:
    lengths = [50, 33, 1]
    sim = make_sim(lengths, num_q_heads=6, num_kv_heads=2, head_dim=16, layout=layout)
    quest = Quest(QuestConfig(budget=max(lengths), page_size=p, dense_layers=0))
    sel = quest.select(sim.step(0), sim.attach(quest))
    assert torch.equal(sel.stats.num_selected, sim.lengths.view(-1, 1).expand(-1, 2))
    out, _ = sim.attend(0, sel)
    dense, _ = sim.attend(0, Selection(None))
    torch.testing.assert_close(out, dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)


def test_proxy_bytes_use_the_cache_element_size(make_sim) -> None:
    sim = make_sim([40, 7], num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
    quest = Quest(QuestConfig(budget=8, page_size=8, dense_layers=0))
    pool = sim.attach(quest)
    stats = quest.select(sim.step(0), pool).stats
    assert stats.proxy_bytes.flatten().tolist() == [5 * 2 * 16 * 2, 1 * 2 * 16 * 2]
    # The float32 pages hold the bf16 keys' extremes exactly.
    kmin, kmax = _brute_pages(sim.keys[0][0], 40, 8)
    assert torch.equal(pool["quest_kmin"][0, 0, :, :5], kmin)
    assert torch.equal(pool["quest_kmax"][0, 0, :, :5], kmax)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"budget": 0}, ValueError, "budget"),
        ({"page_size": 0}, ValueError, "page_size"),
        ({"page_size": -16}, ValueError, "page_size"),
        ({"page_size": 2.0}, TypeError, "page_size"),
        ({"dense_layers": -1}, ValueError, "dense_layers"),
        ({"block_size": 8}, ValueError, "block_size must be 1 or page_size"),
        ({"block_size": 8, "page_size": 16}, ValueError, "block_size must be 1 or page_size"),
    ],
    ids=["budget0", "page0", "page-neg", "page-float", "dense-neg", "block8", "block8-page16"],
)
def test_bad_config_raises(options, error, match) -> None:
    with pytest.raises(error, match=match):
        selectors.create("quest", **options)


def test_block_size_equal_to_page_size_is_accepted() -> None:
    assert QuestConfig(page_size=8, block_size=8).block_size == 8
