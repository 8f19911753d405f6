"""``hshare``: sharing off = Double Sparsity's top-k; query, head and layer sharing copy what the
pattern says; the pattern pairs the most overlapping critical sets; bytes count the searches."""

from __future__ import annotations

import pytest
import torch

from prhs_core.layout import ContiguousKV
from prhs_selectors import DoubleSparsity, DoubleSparsityConfig, HShare, HShareConfig
from prhs_selectors.hshare import greedy_pairs

BASE = {"budget": 6, "n_sink": 2, "n_local": 3, "label_channels": 3}


def observe(sim, selector, w: int = 3, seed: int = 0, copy_heads=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spec = sim.spec
    queries = torch.randn(sim.batch_size, w, spec.num_q_heads, spec.head_dim, generator=g)
    if copy_heads is not None:  # (dst, src) query heads
        dst, src = copy_heads
        queries[:, :, dst] = queries[:, :, src]
    for layer in spec.selectable_layers:
        kv = ContiguousKV(sim.keys[layer], sim.values[layer], sim.seq_lens())
        selector.observe_prompt(
            sim.state(selector), layer, sim.live_slots, queries, kv, sim.scaling
        )
    return queries


def chosen_topk(tools, sel, b, h, n, n_sink=2, n_local=3) -> set[int]:
    return tools.chosen(sel, b, h) - tools.window(n, n_sink, n_local)


@pytest.mark.parametrize("block_size", [1, 2])
def test_with_sharing_off_it_selects_exactly_its_proxys_top_k(
    make_sim, tools, layout, block_size
) -> None:
    sim = make_sim(
        [41, 23, 30], num_q_heads=6, num_kv_heads=3, head_dim=16, num_layers=3, layout=layout,
        max_new_tokens=3,
    )  # fmt: skip
    fields = BASE | {"block_size": block_size}
    hs = HShare(HShareConfig(query_share=1, head_share=0.0, layer_share=0.0, **fields))
    ds = DoubleSparsity(DoubleSparsityConfig(**fields))
    sim.attach(hs)
    sim.attach(ds)
    observe(sim, hs)
    observe(sim, ds)
    assert torch.equal(sim.state(hs).pool["ds_labels"], sim.state(ds).pool["ds_labels"])
    for _ in range(3):
        for layer in range(3):
            a, b_ = sim.select(layer, hs), sim.select(layer, ds)
            n = int(a.counts.max())
            assert torch.equal(a.counts, b_.counts)
            assert torch.equal(a.indices[..., :n], b_.indices[..., :n])
            assert torch.equal(a.stats.proxy_bytes, b_.stats.proxy_bytes)
        sim.advance()


def test_query_sharing_reuses_the_search_for_n_q_steps(make_sim, tools) -> None:
    sim = make_sim([40, 33], num_q_heads=4, num_kv_heads=2, head_dim=16, max_new_tokens=6)
    hs = HShare(HShareConfig(query_share=3, head_share=0.0, layer_share=0.0, **BASE))
    ds = DoubleSparsity(DoubleSparsityConfig(**BASE))
    sim.attach(hs)
    sim.attach(ds)
    last = None
    for step in range(6):
        a, fresh = sim.select(0, hs), sim.select(0, ds)
        for b, n in enumerate(sim.lengths.tolist()):
            for h in range(2):
                got = chosen_topk(tools, a, b, h, n)
                if step % 3 == 0:
                    assert got == chosen_topk(tools, fresh, b, h, n)
                    assert a.stats.proxy_bytes[b, h] == n * 3 * 4
                else:
                    # the searched set, less what the grown local window now holds
                    assert got == last[(b, h)] - tools.window(n, 2, 3)
                    assert a.stats.proxy_bytes[b, h] == 0
        if step % 3 == 0:
            last = {
                (b, h): chosen_topk(tools, a, b, h, n)
                for b, n in enumerate(sim.lengths.tolist())
                for h in range(2)
            }
        sim.advance()


def test_the_pattern_pairs_heads_and_layers_and_followers_copy_their_leader(
    make_sim, tools, layout
) -> None:
    sim = make_sim(
        [60, 45], num_q_heads=8, num_kv_heads=4, head_dim=16, num_layers=4, layout=layout,
        max_new_tokens=2,
    )  # fmt: skip
    # Make head 3 of every layer a near copy of head 1, and layer 2 a near copy of layer 0, so
    # that their critical sets overlap most.
    for layer in range(4):
        sim.keys[layer][:, 3] = sim.keys[layer][:, 1] + 1e-3 * sim.keys[layer][:, 3]
    sim.keys[2] = sim.keys[0] + 1e-3 * sim.keys[2]
    hs = HShare(HShareConfig(query_share=1, head_share=0.25, layer_share=0.25, **BASE))
    sim.attach(hs)
    queries = observe(sim, hs, w=3, copy_heads=([6, 7], [2, 3]))  # KV head 3's group = 1's
    pool = sim.state(hs).pool
    for b in range(2):
        for layer in range(4):
            src = pool["hs_head_src"][b, layer].tolist()
            assert src == [-1, -1, -1, 1], src  # floor(0.25 * 4) followers: head 3 copies 1
        assert pool["hs_layer_src"][b].tolist() == [-1, -1, 0, -1]
    del queries
    for _ in range(2):
        sels = {}
        for layer in range(4):
            sel = sim.select(layer, hs)
            sels[layer] = (sel.indices.clone(), sel.counts.clone())
            for b, n in enumerate(sim.lengths.tolist()):
                src = pool["hs_head_src"][b, layer].tolist()
                for h, leader in enumerate(src):
                    if leader >= 0:
                        assert chosen_topk(tools, sel, b, h, n) == chosen_topk(
                            tools, sel, b, leader, n
                        )
                        assert sel.stats.proxy_bytes[b, h] == 0
                    elif layer != 2:
                        assert sel.stats.proxy_bytes[b, h] == n * 3 * 4
                    else:
                        assert sel.stats.proxy_bytes[b, h] == 0
        assert torch.equal(sels[2][0], sels[0][0]) and torch.equal(sels[2][1], sels[0][1])
        sim.advance()


def test_head_followers_are_the_ones_of_most_overlap() -> None:
    overlap = torch.tensor(
        [
            [9.0, 1.0, 5.0, 0.0],
            [1.0, 9.0, 2.0, 7.0],
            [5.0, 2.0, 9.0, 3.0],
            [0.0, 7.0, 3.0, 9.0],
        ]
    )
    assert greedy_pairs(overlap, 1) == [0, 1, 2, 1]
    assert greedy_pairs(overlap, 2) == [0, 1, 0, 1]
    assert greedy_pairs(overlap, 5) == [0, 1, 0, 1]  # at most N // 2
    assert greedy_pairs(overlap, 0) == [0, 1, 2, 3]


def test_a_row_with_a_non_finite_query_keeps_its_last_selection(make_sim, tools) -> None:
    sim = make_sim([40], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=3)
    hs = HShare(HShareConfig(query_share=1, head_share=0.0, layer_share=0.0, **BASE))
    sim.attach(hs, checked=False)
    sim.select(0)
    before = sim.state(hs).pool["hs_idx"].clone()
    sim.advance()
    sim.queries[0][0, 0, 0] = float("nan")
    sel = sim.select(0)
    assert chosen_topk(tools, sel, 0, 0, 41) == set()
    assert torch.equal(sim.state(hs).pool["hs_idx"], before)
    assert sim.state(hs).nonfinite_count() == 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("query_share", 0, "query_share"),
        ("head_share", 0.6, "at most half"),
        ("layer_share", -0.1, "at most half"),
        ("head_share", "half", "must be a float"),
    ],
)
def test_bad_sharing_levels_are_refused(field, value, match) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        HShareConfig(**{field: value})
