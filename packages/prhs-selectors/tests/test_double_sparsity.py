"""``double_sparsity``: the label-channel proxy against brute force, labels from a table or from
the prompt, every channel a label = oracle, bytes, and bad tables."""

from __future__ import annotations

import pytest
import torch

from prhs_core.layout import ContiguousKV
from prhs_selectors import DoubleSparsity, DoubleSparsityConfig, Oracle
from prhs_selectors.double_sparsity import channel_scores

GEOMETRIES = [([37, 12, 1], 2, 2, 8), ([50, 29], 6, 2, 16), ([41, 64, 5], 8, 2, 8)]
IDS = [f"T{'-'.join(map(str, ls))}-Hq{hq}-Hkv{hkv}-D{d}" for ls, hq, hkv, d in GEOMETRIES]


def prompt_kv(sim, layer: int) -> ContiguousKV:
    """The prompts' logical K/V as one contiguous cache (what a host passes at prefill)."""
    return ContiguousKV(sim.keys[layer], sim.values[layer], sim.seq_lens())


def observe(sim, selector, w: int = 4, seed: int = 0) -> torch.Tensor:
    """Show ``selector`` each layer's prompt with ``w`` random queries; returns them."""
    g = torch.Generator().manual_seed(seed)
    spec = sim.spec
    queries = torch.randn(sim.batch_size, w, spec.num_q_heads, spec.head_dim, generator=g)
    for layer in spec.selectable_layers:
        selector.observe_prompt(
            sim.state(selector), layer, sim.live_slots, queries, prompt_kv(sim, layer),
            sim.scaling,
        )  # fmt: skip
    return queries


def brute_label_probs(sim, tools, layer: int, labels: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, T]`` float64 group-mean softmax of logits over ``labels [B, Hkv, r]`` only."""
    spec = sim.spec
    g = spec.group_size
    mask = torch.zeros(sim.batch_size, spec.num_kv_heads, spec.head_dim, dtype=torch.float64)
    mask.scatter_(-1, labels, 1.0)
    q = sim.queries[layer].double() * mask.repeat_interleave(g, 1)
    logits = tools.brute_logits(q, sim.keys[layer], sim.lengths, sim.scaling)
    return tools.brute_group_probs(logits, spec.num_kv_heads)


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=IDS)
def test_table_labels_select_the_top_k_of_the_label_logits(
    make_sim, tools, layout, lengths, hq, hkv, d
) -> None:
    budget, n_sink, n_local, r = 6, 2, 4, 3
    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout, num_layers=2,
        max_new_tokens=2,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    table = [[torch.randperm(d, generator=gen)[:r].tolist() for _ in range(hkv)] for _ in range(2)]
    ds = DoubleSparsity(
        DoubleSparsityConfig(budget=budget, n_sink=n_sink, n_local=n_local, channels=table)
    )
    sim.attach(ds)
    assert ds.prompt_queries() == 0 and "ds_labels" not in sim.state(ds).pool
    for _ in range(2):
        for layer in range(2):
            sel = ds.select(sim.update(), layer, sim.queries[layer], sim.kv(layer), sim.state())
            labels = torch.tensor(table[layer]).unsqueeze(0).expand(len(lengths), -1, -1)
            probs = brute_label_probs(sim, tools, layer, labels)
            for b, n in enumerate(sim.lengths.tolist()):
                win = tools.window(n, n_sink, n_local)
                for h in range(hkv):
                    got = tools.chosen(sel, b, h)
                    assert win <= got
                    cand = [i for i in range(n) if i not in win]
                    scores = probs[b, h].tolist()
                    want = tools.brute_topk(cand, budget, scores)
                    tools.assert_same_topk(got - win, want, scores, atol=1e-6)
            st = sel.stats
            assert not bool(st.retrieved.any())
            want_bytes = sim.lengths.double() * r * 4  # float32 cache
            assert torch.equal(st.proxy_bytes, want_bytes.view(-1, 1).expand(-1, hkv))
        sim.advance()


@pytest.mark.parametrize("mode", ["prompt", "table"])
@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=IDS)
def test_every_channel_a_label_selects_what_oracle_selects(
    make_sim, tools, layout, mode, lengths, hq, hkv, d
) -> None:
    fields = {"budget": 6, "n_sink": 2, "n_local": 4, "block_size": 2}
    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout, max_new_tokens=2
    )
    if mode == "table":
        ds = DoubleSparsity(DoubleSparsityConfig(channels=[[list(range(d))] * hkv], **fields))
    else:
        ds = DoubleSparsity(DoubleSparsityConfig(label_channels=d, **fields))
    oracle = Oracle(Oracle.config_type(**fields))
    sim.attach(ds)
    sim.attach(oracle)
    if mode == "prompt":
        observe(sim, ds)
        assert sorted(sim.state(ds).pool["ds_labels"][0, 0, 0].tolist()) == list(range(d))
    for _ in range(2):
        a = sim.select(0, ds)
        b_ = sim.select(0, oracle)
        probs = sim.group_probs(0)
        for b, n in enumerate(sim.lengths.tolist()):
            for h in range(hkv):
                got, want = tools.chosen(a, b, h), tools.chosen(b_, b, h)
                blocks = tools.block_max([*probs[b, h, :n].tolist(), 0.0], 2)
                tools.assert_same_topk(got, want, blocks, atol=1e-6)
        sim.advance()


def test_prompt_labels_are_the_channels_of_largest_mean_q_times_k(make_sim) -> None:
    sim = make_sim([40, 23], num_q_heads=4, num_kv_heads=2, head_dim=16, num_layers=2)
    ds = DoubleSparsity(DoubleSparsityConfig(budget=4, label_channels=3, prompt_queries=5))
    sim.attach(ds)
    pool = sim.state(ds).pool
    assert bool((pool["ds_labels"] == -1).all()), "labels before any prompt: not chosen"
    queries = observe(sim, ds, w=5, seed=3)
    for layer in range(2):
        for b, n in enumerate(sim.lengths.tolist()):
            q = queries[b].double().view(5, 2, 2, 16)  # [W, Hkv, g, D]
            k = sim.keys[layer][b, :, :n].double()  # [Hkv, n, D]
            # mean over every (query head of the group, query, key) triple of |q_j k_j|
            pairs = q.abs().permute(1, 0, 2, 3).reshape(2, 10, 1, 16) * k.abs().unsqueeze(1)
            brute = pairs.mean(dim=(1, 2))  # [Hkv, D]
            torch.testing.assert_close(
                channel_scores(queries[b], sim.keys[layer][b, :, :n]).double(), brute,
                rtol=1e-5, atol=1e-6,
            )  # fmt: skip
            want = brute.topk(3, -1).indices.sort(-1).values
            assert torch.equal(pool["ds_labels"][b, layer], want)


def test_a_slot_whose_prompt_was_not_seen_uses_the_first_r_channels(make_sim, tools) -> None:
    sim = make_sim([30], num_q_heads=2, num_kv_heads=1, head_dim=8)
    ds = DoubleSparsity(DoubleSparsityConfig(budget=5, n_sink=1, n_local=2, label_channels=2))
    sim.attach(ds)
    sel = sim.select(0)
    probs = brute_label_probs(sim, tools, 0, torch.tensor([[[0, 1]]]))
    win = tools.window(30, 1, 2)
    cand = [i for i in range(30) if i not in win]
    scores = probs[0, 0].tolist()
    tools.assert_same_topk(tools.chosen(sel, 0, 0) - win, tools.brute_topk(cand, 5, scores), scores)


def test_default_r_is_an_eighth_of_the_head_dim(make_sim) -> None:
    sim = make_sim([20], num_q_heads=2, num_kv_heads=1, head_dim=16)
    ds = DoubleSparsity()
    sim.attach(ds)
    assert ds.num_labels() == 2 and sim.state(ds).pool["ds_labels"].shape[-1] == 2


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ([], "non-empty table"),
        ([[[0, 1]], [[0, 1, 2]]], "one r"),
        ([[[0, 0]]], "repeats"),
        ([[[-1, 2]]], ">= 0"),
        ([[[0.5, 2]]], "int"),
        ([None], "no layer with labels"),
        ([[[]]], "non-empty list of channel ids"),
    ],
)
def test_bad_tables_are_refused_with_what_was_wrong(table, match) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        DoubleSparsityConfig(channels=table)


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ([[[0, 1]]], "1 rows; the model 2 layers"),
        ([[[0, 1]], [[0, 1], [2, 3]]], "2 heads; the model 1 KV heads"),
        ([[[0, 1]], [[0, 8]]], "channels \\[8\\] >= head_dim 8"),
        ([[[0, 1]], None], "null but layer 1 is a full-attention layer"),
    ],
)
def test_a_table_that_does_not_fit_the_model_is_refused_at_init(make_sim, table, match) -> None:
    sim = make_sim([10], num_q_heads=2, num_kv_heads=1, head_dim=8, num_layers=2)
    ds = DoubleSparsity(DoubleSparsityConfig(channels=table))
    with pytest.raises(ValueError, match=match):
        sim.attach(ds)


def test_null_rows_are_allowed_for_sliding_layers(make_sim) -> None:
    sim = make_sim(
        [10], num_q_heads=2, num_kv_heads=1, head_dim=8, num_layers=2,
        layer_types=("sliding", "full"),
    )  # fmt: skip
    ds = DoubleSparsity(DoubleSparsityConfig(budget=2, n_local=2, channels=[None, [[1, 5]]]))
    sim.attach(ds)
    assert sim.select(1) is not None


def test_label_channels_must_agree_with_the_table_and_fit_the_head() -> None:
    with pytest.raises(ValueError, match="label_channels=3 but the channels table holds 2"):
        DoubleSparsityConfig(label_channels=3, channels=[[[0, 1]]])
    with pytest.raises(ValueError, match="prompt_queries"):
        DoubleSparsityConfig(prompt_queries=1)


def test_label_channels_above_the_head_dim_is_refused(make_sim) -> None:
    sim = make_sim([10], num_q_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="label_channels=9 exceeds head_dim=8"):
        sim.attach(DoubleSparsity(DoubleSparsityConfig(label_channels=9)))


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES[:2], ids=IDS[:2])
def test_a_table_keeps_a_label_cache_and_the_proxy_reads_it(
    make_sim, layout, lengths, hq, hkv, d
) -> None:
    from prhs_kernels.kv import token_locations

    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout, num_layers=2,
        max_new_tokens=1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    table = [[torch.randperm(d, generator=gen)[:3].tolist() for _ in range(hkv)] for _ in range(2)]
    ds = DoubleSparsity(DoubleSparsityConfig(budget=4, n_sink=1, n_local=2, channels=table))
    sim.attach(ds)
    state = sim.state(ds)
    assert ds.uses_side_cache() and state.side is not None
    plan = sim.update()
    b, t = len(lengths), sim.keys[0].shape[2]
    pos = torch.arange(t).view(1, -1).expand(b, -1)
    for layer in range(2):
        kv = sim.kv(layer)
        loc = token_locations(kv, pos, state.row_stride)  # [B, T]
        cache = state.side["ds_keys"][:, layer]
        lab = torch.tensor(table[layer])  # [Hkv, r]
        for bi, n in enumerate(sim.lengths.tolist()):
            want = sim.keys[layer][bi, :, :n].gather(-1, lab.unsqueeze(1).expand(-1, n, -1))
            torch.testing.assert_close(cache[loc[bi, :n]].transpose(0, 1), want)
        # With the label cache zeroed every proxy logit is 0: the probabilities are uniform,
        # whatever the key rows hold. So the proxy reads the cache.
        cache.zero_()
        probs = ds.proxy_probs(plan, layer, sim.queries[layer], kv, state)
        for bi, n in enumerate(sim.lengths.tolist()):
            torch.testing.assert_close(probs[bi, :, :n], torch.full((hkv, n), 1.0 / n))


def test_prompt_labels_keep_no_label_cache(make_sim) -> None:
    sim = make_sim([9], num_q_heads=2, num_kv_heads=1, head_dim=8)
    ds = DoubleSparsity(DoubleSparsityConfig(budget=2, label_channels=2))
    sim.attach(ds)
    assert not ds.uses_side_cache() and sim.state(ds).side is None
