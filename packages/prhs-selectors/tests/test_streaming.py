"""``streaming`` (StreamingLLM): sinks plus a recent window of ``n_local + budget`` positions."""

from __future__ import annotations

import pytest
import torch

from prhs_core.config import SelectorConfig
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_selectors import Streaming

LENGTHS = [61, 30, 9, 1]


def _brute_blocks(n: int, s: int, n_sink: int, n_local: int, budget: int) -> set[int]:
    """Blocks of a length-``n`` sequence: those touching the windows, plus the most recent
    ``max(1, budget // s)`` others (``s = 1``: the last ``n_local + budget`` positions)."""
    blocks = range(-(-n // s))
    window = {i for i in range(n) if i < n_sink or i >= n - n_local}
    win_b = {j for j in blocks if any(j * s <= i < (j + 1) * s for i in window)}
    others = sorted((j for j in blocks if j not in win_b), reverse=True)
    return win_b | set(others[: max(1, budget // s)])


def _chosen(sel: Selection, b: int, h: int) -> set[int]:
    ids = [int(i) for i in sel.indices[b, h, : int(sel.counts[b, h])]]
    assert len(ids) == len(set(ids)), "an index is listed twice"
    return set(ids)


CASES = [(1, 4, 8, 6), (1, 0, 0, 5), (1, 2, 3, 100), (4, 4, 8, 8), (5, 3, 7, 12), (8, 0, 0, 3)]
CASE_IDS = [f"s{s}-sink{a}-local{b}-k{k}" for s, a, b, k in CASES]


@pytest.mark.parametrize(("s", "n_sink", "n_local", "budget"), CASES, ids=CASE_IDS)
def test_selection_is_sinks_plus_the_recent_window(make_sim, layout, s, n_sink, n_local, budget):
    cfg = SelectorConfig(budget=budget, n_sink=n_sink, n_local=n_local, block_size=s)
    sim = make_sim(
        LENGTHS, num_q_heads=6, num_kv_heads=3, head_dim=8, layout=layout, max_new_tokens=3
    )
    streaming = Streaming(cfg)
    state = sim.attach(streaming)
    assert state.side is None
    for _ in range(3):
        sel = sim.select(0)
        assert sel is not None and sel.block_size == s
        for b, n in enumerate(sim.lengths.tolist()):
            want = _brute_blocks(n, s, n_sink, n_local, budget)
            for h in range(3):
                assert _chosen(sel, b, h) == want, (n, h)
        if s == 1:
            # Token mode: exactly the sinks and the last n_local + budget positions.
            expect = (sim.lengths.clamp(max=n_sink) + n_local + budget).clamp(max=sim.lengths)
            assert torch.equal(sel.stats.num_selected, expect.view(-1, 1).expand(-1, 3).int())
        assert not bool(sel.stats.retrieved.any())
        assert not bool(sel.stats.proxy_bytes.any())
        sim.advance()


def test_selection_ignores_queries_and_keys(make_sim) -> None:
    sim = make_sim([40, 17], num_q_heads=4, num_kv_heads=2, head_dim=8)
    sim.attach(Streaming(SelectorConfig(budget=5, n_sink=2, n_local=3)))
    first = sim.select(0).indices.clone()
    sim.queries[0].mul_(-50.0)
    sim.keys[0][:, :, 10] = sim.queries[0][:, ::2] * 100  # a key every head would attend to
    again = sim.select(0).indices
    assert torch.equal(first, again)
    assert 10 not in first[0, 0].tolist()


@pytest.mark.parametrize("s", [1, 4], ids=lambda s: f"s{s}")
def test_budget_covering_the_sequence_gives_the_dense_output(make_sim, layout, s) -> None:
    sim = make_sim(LENGTHS, num_q_heads=4, num_kv_heads=1, head_dim=16, layout=layout)
    streaming = selectors.create(
        "streaming", budget=max(LENGTHS), n_sink=1, n_local=1, block_size=s
    )
    sim.attach(streaming)
    sel = sim.select(0)
    assert torch.equal(sel.stats.num_selected, sim.seq_lens().view(-1, 1))
    out, _ = sim.attend(0, sel)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"budget": 0}, "budget"),
        ({"budget": -3}, "budget"),
        ({"n_sink": -1}, "n_sink"),
        ({"n_local": -1}, "n_local"),
        ({"block_size": 0}, "block_size"),
    ],
    ids=["budget0", "budget-neg", "sink-neg", "local-neg", "block0"],
)
def test_bad_config_raises(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        selectors.create("streaming", **options)
