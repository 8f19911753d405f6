"""``quest`` (Quest): the page bound is an upper bound, pages are maintained incrementally, the
top pages by bound are selected, and the first layers are dense."""

from __future__ import annotations

import pytest
import torch

from prhs_core.config import AttentionSpec
from prhs_core.registry import selectors
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


@pytest.fixture(params=["contiguous", "paged16"])
def quest_layout(request: pytest.FixtureRequest) -> str:
    """Layouts Quest pages of 4 run on (a paged pool needs a page size multiple of 4)."""
    return request.param


def _state_pages(state, sim, layer_row: int, b: int, n: int, p: int):
    """``[Hkv, ceil(n/p), D]`` float32 page min and max of row ``b``, read from the side cache
    through the KV location of each page's first position."""
    loc = sim.locations(state.row_stride)[b, :n:p]
    pages = state.side.pages_of(loc)
    kmin = state.side["quest_kmin"][pages, layer_row].transpose(0, 1).float()
    kmax = state.side["quest_kmax"][pages, layer_row].transpose(0, 1).float()
    return kmin, kmax


@pytest.mark.parametrize(("lengths", "hq", "hkv"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_state_bounds_hold_for_every_page_and_head(make_sim, quest_layout, lengths, hq, hkv):
    sim = make_sim(
        lengths,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=8,
        layout=quest_layout,
        max_new_tokens=3,
    )
    sim.keys[0][:, :, 5::7] *= 3e3  # some huge keys
    quest = Quest(QuestConfig(budget=8, page_size=4, dense_layers=0, n_sink=1, n_local=2))
    state = sim.attach(quest)
    g = hq // hkv
    for _ in range(3):
        sim.select(0)
        for b, n in enumerate(sim.lengths.tolist()):
            kmin, kmax = _state_pages(state, sim, 0, b, n, 4)
            q = sim.queries[0][b].view(hkv, g, -1).float()
            bound = page_bounds(q[None], kmin[None], kmax[None], sim.scaling)[0]
            true_max = _page_max_logits(q, sim.keys[0][b], n, 4, sim.scaling)
            slack = _slack(q[None], kmin[None], kmax[None], sim.scaling)[0]
            assert bool((bound.double() >= true_max - slack).all())
        sim.advance()


@pytest.mark.parametrize(
    ("layout", "p"),
    [
        ("contiguous", 1),
        ("contiguous", 4),
        ("contiguous", 5),
        ("paged", 1),
        ("paged16", 4),
        ("paged16", 16),
    ],
)
def test_incremental_min_max_equals_recomputation(make_sim, layout, p: int) -> None:
    kw = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "num_layers": 3, "layout": layout}
    sim = make_sim([22, 9, 16, 1], max_new_tokens=9, **kw)
    quest = Quest(QuestConfig(budget=8, page_size=p, dense_layers=1, n_sink=1, n_local=2))
    state = sim.attach(quest)
    assert state.side["quest_kmin"].shape[1:] == (2, 2, 8)  # only the 2 sparse layers

    def check(sim) -> None:
        for layer in (1, 2):
            for b, n in enumerate(sim.lengths.tolist()):
                kmin, kmax = _brute_pages(sim.keys[layer][b], n, p)
                got_min, got_max = _state_pages(state, sim, layer - 1, b, n, p)
                assert torch.equal(got_min, kmin), (layer, b)
                assert torch.equal(got_max, kmax), (layer, b)

    check(sim)
    for _ in range(9):
        for layer in range(3):
            sim.select(layer)
        sim.advance()
        check(sim)
    # A new sequence in the same slots and KV locations: each page restarts at its first key,
    # nothing of the old sequence's keys is left in its bounds.
    sim.release()
    again = make_sim([22, 9, 16, 1], max_new_tokens=9, seed=3, **kw)
    again.attach(quest, state)
    for _ in range(3):
        again.select(2)
        again.advance()
    sim = again
    check(again)


def test_first_layers_are_dense(make_sim) -> None:
    sim = make_sim([40, 13], num_q_heads=4, num_kv_heads=2, head_dim=8, num_layers=4)
    quest = selectors.create("quest", budget=16, page_size=8, n_sink=1, n_local=1)
    assert quest.config.dense_layers == 2
    state = sim.attach(quest)
    # Only the two sparse layers keep pages: [pages + 1, L - 2, Hkv, D].
    side = state.side
    assert side["quest_kmin"].shape == (side.num_pages + 1, 2, 2, 8)
    assert side.num_pages == -(-2 * state.row_stride // 8)
    for layer in range(4):
        sel = sim.select(layer)
        st = sim.plan().stats
        assert (sel is None) == (layer < 2)
        if layer < 2:
            assert torch.equal(st.num_selected, sim.seq_lens().view(-1, 1).expand(-1, 2))
        else:
            assert sel.block_size == 8
            assert bool((st.num_selected < sim.seq_lens().view(-1, 1)).any())
        assert not bool(st.retrieved.any())
    none_dense = Quest(QuestConfig(dense_layers=0, page_size=8, budget=8))
    sim.attach(none_dense)
    assert sim.select(0, none_dense) is not None


@pytest.mark.parametrize(("lengths", "hq", "hkv"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_selection_is_window_pages_plus_top_pages_by_bound(
    make_sim, tools, quest_layout, lengths, hq, hkv
) -> None:
    p, budget, n_sink, n_local = 4, 13, 2, 3
    sim = make_sim(
        lengths,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=8,
        layout=quest_layout,
        max_new_tokens=3,
    )
    quest = Quest(
        QuestConfig(budget=budget, page_size=p, dense_layers=0, n_sink=n_sink, n_local=n_local)
    )
    sim.attach(quest)
    g = hq // hkv
    for _ in range(3):
        sel = sim.select(0)
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
            win_pages = tools.blocks_of(tools.window(n, n_sink, n_local), p)
            others = [j for j in range(n_pages) if j not in win_pages]
            for h in range(hkv):
                chosen = tools.chosen(sel, b, h)
                assert win_pages <= chosen
                scores = bound[h].tolist()
                want = tools.brute_topk(others, budget // p, scores)
                tools.assert_same_topk(chosen - win_pages, want, scores, atol=1e-5)
            expect_bytes = n_pages * 2 * 8 * 4
            assert sel.stats.proxy_bytes[b].tolist() == [expect_bytes] * hkv
        mask = sim.mask(sel)
        assert torch.equal(sel.stats.num_selected, mask.sum(-1).int())
        out, _ = sim.attend(0, sel)
        torch.testing.assert_close(out.double(), sim.reference_output(0, mask), rtol=0, atol=1e-5)
        sim.advance()


@pytest.mark.parametrize("p", [4, 16], ids=lambda p: f"page{p}")
def test_budget_covering_the_sequence_gives_the_dense_output(
    make_sim, quest_layout, p: int
) -> None:
    lengths = [50, 33, 1]
    sim = make_sim(lengths, num_q_heads=6, num_kv_heads=2, head_dim=16, layout=quest_layout)
    quest = Quest(QuestConfig(budget=max(lengths), page_size=p, dense_layers=0))
    sim.attach(quest)
    sel = sim.select(0)
    assert torch.equal(sel.stats.num_selected, sim.seq_lens().view(-1, 1).expand(-1, 2))
    out, _ = sim.attend(0, sel)
    dense, _ = sim.attend(0, None)
    torch.testing.assert_close(out, dense, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)


def test_bounds_are_kept_in_the_cache_dtype_and_bytes_use_its_size(make_sim) -> None:
    sim = make_sim([40, 7], num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
    quest = Quest(QuestConfig(budget=8, page_size=8, dense_layers=0))
    state = sim.attach(quest)
    assert state.side["quest_kmin"].dtype == torch.bfloat16
    stats = sim.select(0).stats
    assert stats.proxy_bytes.flatten().tolist() == [5 * 2 * 16 * 2, 1 * 2 * 16 * 2]
    # A min or max of bf16 keys is a bf16 key: exact.
    kmin, kmax = _brute_pages(sim.keys[0][0], 40, 8)
    got_min, got_max = _state_pages(state, sim, 0, 0, 40, 8)
    assert torch.equal(got_min, kmin) and torch.equal(got_max, kmax)


def test_paged_pool_must_use_whole_quest_pages() -> None:
    quest = Quest(QuestConfig(page_size=16))
    spec = AttentionSpec(2, 2, 1, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        quest.init_state(spec, capacity=2, max_seq_len=64, num_kv_locations=256, kv_page_size=8)
    quest.init_state(spec, capacity=2, max_seq_len=64, num_kv_locations=256, kv_page_size=32)


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


@pytest.mark.parametrize("quest_layout_name", ["contiguous", "paged"])
def test_a_sparse_layer_on_a_triton_path_is_two_launches(
    make_sim, monkeypatch, op_log, triton_launches, quest_layout_name
) -> None:
    """The page scores and the selection, each one launch; no top-k, sort or union in torch,
    and no separate check of the query (the launches find the rows it would). On a contiguous
    cache, nothing else at all: the page rows are kept from the first step; a paged pool's are
    a gather from its table and a division."""
    layout = "contiguous" if quest_layout_name == "contiguous" else "paged16"
    sim = make_sim(
        [300, 129], num_q_heads=8, num_kv_heads=2, head_dim=16, layout=layout,
        dtype=torch.bfloat16,
    )  # fmt: skip
    quest = Quest(QuestConfig(budget=64, page_size=16, dense_layers=0))
    state = sim.attach(quest, stats=False, checked=False)
    monkeypatch.setattr(quest, "kernel_path", lambda device, dtype: "triton")
    launches = triton_launches
    plan, kv = sim.update(quest), sim.kv(0)
    quest.select(plan, 0, sim.queries[0], kv, state)  # the first step keeps the rows
    launches.clear()
    with op_log() as log:
        sel = quest.select(plan, 0, sim.queries[0], kv, state)
    ops = log.ops
    assert launches == ["_page_scores_kernel", "_select_kernel"]
    assert sel.indices.data_ptr() == plan.selection.indices.data_ptr()
    assert not {"topk", "sort", "cat", "scatter"} & set(ops), ops
    assert not {"abs", "isfinite", "isnan", "all", "any"} & set(ops), ops
    views = {"select", "slice", "alias", "view", "detach", "as_strided", "empty"}
    if layout == "contiguous":  # views of the side fields and the scores' buffer only
        assert set(ops) <= views, ops
    else:
        assert set(ops) <= views | {"_to_copy", "index", "floor_divide"}, ops


def _write_step(sim, quest, state, layer):
    """Write each row's newest position of ``layer`` from the cache in place (the columns a
    transformers static cache writes at), as the integration's decode step does."""
    kv = sim.kv(layer)
    last = (kv.seq_lens - 1).long()
    loc = sim.locations(state.row_stride)[torch.arange(sim.batch_size), last]
    cols = last + kv.start
    quest.write_kv(state, layer, loc, kv.k, kv.v, columns=cols)
    rows = torch.arange(sim.batch_size)
    return loc, kv.k[rows, :, cols], kv.v[rows, :, cols]


def test_a_decode_write_from_the_cache_equals_the_write_of_its_rows(make_sim) -> None:
    """Keys read in place at the rows' columns fold as the same keys given as rows; a
    non-finite one is counted once either way."""
    sim = make_sim(
        [37, 29, 16], num_q_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, max_new_tokens=2
    )
    n1 = int(sim.lengths[1])
    sim.keys[1][1, 0, n1, 3] = float("nan")
    states = []
    for _ in ("columns", "rows"):
        quest = Quest(QuestConfig(budget=8, page_size=4, dense_layers=0, n_local=2))
        states.append((quest, sim.attach(quest, checked=False)))
    sim.lengths = sim.lengths + 1  # the new token is in the logical data: write it both ways
    (q_cols, s_cols), (q_rows, s_rows) = states
    for layer in range(sim.spec.num_layers):
        loc, key, value = _write_step(sim, q_cols, s_cols, layer)
        q_rows.write_kv(s_rows, layer, loc, key, value)
    assert s_cols.nonfinite_count() == s_rows.nonfinite_count() == 1
    for name in ("quest_kmin", "quest_kmax"):
        assert torch.equal(s_cols.side[name][:-1], s_rows.side[name][:-1]), name


def test_a_decode_write_on_a_triton_path_is_one_launch(
    make_sim, monkeypatch, op_log, triton_launches
) -> None:
    """The new tokens' keys are read in place, checked, counted and folded by one launch: no
    gather, no finiteness check, no scatter in torch."""
    sim = make_sim(
        [300, 129], num_q_heads=8, num_kv_heads=2, head_dim=16, num_layers=2, dtype=torch.bfloat16
    )
    quest = Quest(QuestConfig(budget=64, page_size=16, dense_layers=1))
    state = sim.attach(quest, stats=False, checked=False)
    monkeypatch.setattr(quest, "kernel_path", lambda device, dtype: "triton")
    kv = sim.kv(1)
    loc = sim.locations(state.row_stride)[:, 0].contiguous()
    cols = torch.zeros(sim.batch_size, dtype=torch.int32)
    with op_log() as log:
        quest.write_kv(state, 1, loc, kv.k, kv.v, columns=cols)
        quest.write_kv(state, 0, loc, kv.k, kv.v, columns=cols)  # a dense layer: nothing
    assert triton_launches == ["_fold_kernel"]
    ops = log.ops
    assert set(ops) <= {"select", "slice", "alias", "view", "detach", "as_strided"}, ops
