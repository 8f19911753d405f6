"""``rabitq``: centroids and codes written at prefill, groups quantised as they fill, the top-p
of the estimated attention, storage per key, and bad configurations."""

from __future__ import annotations

import pytest
import torch

from prhs_core.layout import ContiguousKV
from prhs_kernels.rabitq import quantize_keys
from prhs_selectors import RaBitQ, RaBitQConfig
from prhs_selectors.rabitq import estimate_logits

FIELDS = {"n_sink": 2, "n_local": 4, "group": 4, "dense_layers": 0}


def observe(sim, selector, w: int = 3) -> torch.Tensor:
    """Show ``selector`` the prompts: ``w`` random queries and the logical K/V, with the
    simulator's KV locations."""
    g = torch.Generator().manual_seed(9)
    spec = sim.spec
    queries = torch.randn(sim.batch_size, w, spec.num_q_heads, spec.head_dim, generator=g)
    state = sim.state(selector)
    locs = sim.locations(state.row_stride)
    for layer in spec.selectable_layers:
        kv = ContiguousKV(sim.keys[layer], sim.values[layer], sim.seq_lens())
        selector.observe_prompt(
            state, layer, sim.live_slots, queries, kv, sim.scaling, locations=locs
        )
    return queries


def test_prefill_writes_centroids_and_the_codes_of_every_full_group(make_sim, layout) -> None:
    sim = make_sim([23, 9], num_q_heads=4, num_kv_heads=2, head_dim=16, layout=layout)
    rq = RaBitQ(RaBitQConfig(budget=6, **FIELDS))
    sim.attach(rq)
    queries = observe(sim, rq)
    state = sim.state(rq)
    pool, side = state.pool, state.side
    locs = sim.locations(state.row_stride)
    p, _ = rq.rotation(0)
    for b, n in enumerate(sim.lengths.tolist()):
        keys = sim.keys[0][b, :, :n].float()
        ck = keys.mean(1)
        cq = queries[b].view(3, 2, 2, 16).mean(dim=(0, 2))
        torch.testing.assert_close(pool["rq_ck"][b, 0], ck)
        torch.testing.assert_close(pool["rq_cq"][b, 0], cq)
        full = (n // 4) * 4
        assert int(pool["rq_qlen"][b, 0]) == full
        codes, factor = quantize_keys(keys[:, :full].transpose(0, 1), ck, p)
        at = locs[b, :full].long()
        assert torch.equal(side["rq_codes"][at, 0], codes)
        torch.testing.assert_close(side["rq_factor"][at, 0], factor)
        cqk = (keys[:, :full].transpose(0, 1) * cq).sum(-1)  # [full, Hkv]
        torch.testing.assert_close(side["rq_cqk"][at, 0], cqk)


def test_decode_quantises_each_group_as_it_fills(make_sim) -> None:
    sim = make_sim([10], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=3)
    rq = RaBitQ(RaBitQConfig(budget=6, **FIELDS))
    sim.attach(rq)
    observe(sim, rq)
    state = sim.state(rq)
    qlens = []
    for _ in range(4):
        sim.select(0)
        qlens.append(int(state.pool["rq_qlen"][0, 0]))
        if sim.steps_taken < 3:
            sim.advance()
    assert qlens == [8, 8, 12, 12]  # lengths 10, 11, 12 (the group 8..11 fills), 13
    p, _ = rq.rotation(0)
    ck = state.pool["rq_ck"][0, 0]
    codes, _ = quantize_keys(sim.keys[0][0, :, 8:12].float().transpose(0, 1), ck, p)
    at = sim.locations(state.row_stride)[0, 8:12].long()
    assert torch.equal(state.side["rq_codes"][at, 0], codes)


def test_the_selection_is_the_top_p_of_the_estimated_attention(make_sim, tools) -> None:
    sim = make_sim([60, 41], num_q_heads=4, num_kv_heads=2, head_dim=16)
    top_p, budget = 0.7, 10
    rq = RaBitQ(RaBitQConfig(budget=budget, top_p=top_p, **FIELDS))
    sim.attach(rq)
    observe(sim, rq)
    sel = sim.select(0)
    state = sim.state(rq)
    loc = sim.locations(state.row_stride)
    p, dither = rq.rotation(0)
    for b, n in enumerate(sim.lengths.tolist()):
        at = loc[b : b + 1, :n].long()
        est = estimate_logits(
            sim.queries[0][b : b + 1],
            state.side["rq_codes"][at, 0],
            state.side["rq_factor"][at, 0],
            state.side["rq_cqk"][at, 0],
            state.pool["rq_ck"][b : b + 1, 0],
            state.pool["rq_cq"][b : b + 1, 0],
            p,
            dither,
            sim.scaling,
        )[0].double()  # fmt: skip  [Hkv, g, n]
        exact = sim.logits(0)[b].view(2, 2, -1)[..., :n]
        win = tools.window(n, 2, 4)
        full = (n // 4) * 4
        for h in range(2):
            logits = torch.full((2, n), float("-inf"), dtype=torch.float64)
            for t in range(n):
                if t in win:
                    logits[:, t] = exact[h, :, t]
                elif t < full:
                    logits[:, t] = est[h, :, t]
            mass = torch.softmax(logits, -1).mean(0).tolist()
            kept = sum(mass[t] for t in win)
            order = sorted((t for t in range(full) if t not in win), key=lambda t: -mass[t])
            want = []
            for t in order:
                if 1 - kept - sum(mass[x] for x in want) <= 1 - top_p or len(want) == budget:
                    break
                want.append(t)
            got = tools.chosen(sel, b, h) - win
            tools.assert_same_topk(got, set(want), mass, atol=1e-5)


def test_estimated_logits_track_the_true_ones(make_sim) -> None:
    """On keys with a common offset (what the centroids remove) the 1-bit estimates correlate
    with the true logits (measured 0.80 for both query heads at D = 64)."""
    sim = make_sim([200], num_q_heads=2, num_kv_heads=1, head_dim=64)
    sim.keys[0] = sim.keys[0] + 3.0
    rq = RaBitQ(RaBitQConfig(budget=8, n_sink=2, n_local=8, group=8, dense_layers=0))
    sim.attach(rq)
    observe(sim, rq)
    state = sim.state(rq)
    at = sim.locations(state.row_stride)[:, :200].long()
    p, u = rq.rotation(0)
    args = (state.side["rq_codes"][at, 0], state.side["rq_factor"][at, 0])
    est = estimate_logits(
        sim.queries[0], *args, state.side["rq_cqk"][at, 0], state.pool["rq_ck"][:1, 0],
        state.pool["rq_cq"][:1, 0], p, u, sim.scaling,
    )[0, 0]  # fmt: skip
    true = sim.logits(0)[0]
    for h in range(2):
        r = torch.corrcoef(torch.stack([est[h].double(), true[h]]))[0, 1]
        assert r > 0.6, r


def test_code_storage_is_a_sixteenth_of_bf16_keys_plus_eight_bytes(make_sim) -> None:
    sim = make_sim([10], num_q_heads=2, num_kv_heads=2, head_dim=128)
    rq = RaBitQ(RaBitQConfig(budget=4, **FIELDS))
    state = sim.attach(rq)
    side = state.side
    per_key = sum(side[n][0, 0, 0].numel() * side[n].element_size() for n in side.field_names)
    assert per_key == 128 // 8 + 4 + 4  # codes + factor + c_q·k per KV head and layer
    assert side["rq_codes"][0, 0, 0].numel() <= (128 * 2) / 8  # <= 1/8 of a bf16 key


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"n_local": 16, "group": 32}, "n_local"),
        ({"block_size": 2}, "block_size must be 1"),
        ({"prompt_queries": 1}, "prompt_queries"),
    ],
)
def test_bad_configs_are_refused(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        RaBitQConfig(**fields)


def test_a_head_dim_not_a_multiple_of_8_is_refused(make_sim) -> None:
    sim = make_sim([10], num_q_heads=2, num_kv_heads=1, head_dim=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        sim.attach(RaBitQ(RaBitQConfig(budget=4, **FIELDS)))
