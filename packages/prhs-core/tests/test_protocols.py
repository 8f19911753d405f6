"""DecodeStep and PrefillLayerPlan validation, the prefill mask, and a selector on the protocol.

``ExactTopK`` below is a tiny reference selector written against the protocol only: it scores
every cached key with the GQA group mean of the softmax probabilities (SPEC.md §1) and keeps
the sink and local windows. It checks that the protocol is implementable with what a
KVCacheView exposes, and that a selector sees the same thing through either cache layout.
"""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core import (
    AttentionSpec,
    ContiguousKVCache,
    DecodeSelector,
    DecodeStep,
    PagedKVCache,
    PrefillLayerPlan,
    PrefillPlanner,
    Selection,
    SelectorConfig,
    SequenceStatePool,
    StepStats,
)


def contiguous(b: int = 2, hkv: int = 2, t: int = 6, d: int = 4) -> ContiguousKVCache:
    return ContiguousKVCache(torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d))


# -- DecodeStep -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hq", "hkv", "g"), [(2, 2, 1), (8, 2, 4), (8, 1, 8)], ids=["Hq2-Hkv2", "Hq8-Hkv2", "Hq8-Hkv1"]
)
def test_decode_step_group_size(hq: int, hkv: int, g: int) -> None:
    cache = contiguous(hkv=hkv)
    step = DecodeStep(3, torch.randn(2, hq, 4), cache, torch.tensor([0, 1]), 0.5)
    assert step.group_size == g
    assert step.cache is cache


@pytest.mark.parametrize(
    ("changes", "error", "fragment"),
    [
        (
            {"query": torch.randn(3, 4, 4)},
            ValueError,
            r"query \[B, Hq, D\] = \[3, 4, 4\] does not match the cache \(B=2, D=4\)",
        ),
        ({"query": torch.randn(2, 4, 8)}, ValueError, r"does not match the cache \(B=2, D=4\)"),
        (
            {"query": torch.randn(2, 3, 4)},
            ValueError,
            r"query heads \(3\) must be a multiple of the cache's KV heads \(2\)",
        ),
        ({"query": torch.randn(2, 4)}, ValueError, "query must have 3 dimensions"),
        (
            {"query": torch.ones(2, 4, 4, dtype=torch.long)},
            TypeError,
            "query must be a floating-point tensor",
        ),
        ({"cache": object()}, TypeError, "cache must be a KVCacheView, got object"),
        ({"slots": torch.tensor([[0, 1]])}, ValueError, "slots must have 1 dimensions"),
        (
            {"slots": torch.tensor([0, 1, 2])},
            ValueError,
            r"slots must have shape \[B=2\], got \[3\]",
        ),
        ({"slots": torch.tensor([0.0, 1.0])}, TypeError, "slots must be an integer tensor"),
        ({"scaling": 0.0}, ValueError, "scaling must be a positive finite float, got 0.0"),
        ({"scaling": -0.5}, ValueError, "scaling must be a positive finite float, got -0.5"),
        ({"scaling": math.nan}, ValueError, "scaling must be a positive finite float, got nan"),
        ({"scaling": math.inf}, ValueError, "scaling must be a positive finite float, got inf"),
        ({"scaling": True}, TypeError, "scaling must be a float, got bool"),
        ({"scaling": torch.tensor(0.5)}, TypeError, "scaling must be a float, got Tensor"),
        ({"layer": -1}, ValueError, "layer must be >= 0, got -1"),
    ],
    ids=[
        "batch-mismatch",
        "head-dim-mismatch",
        "Hq-not-multiple",
        "query-2d",
        "query-int",
        "cache-not-view",
        "slots-2d",
        "slots-wrong-B",
        "slots-float",
        "scaling-zero",
        "scaling-neg",
        "scaling-nan",
        "scaling-inf",
        "scaling-bool",
        "scaling-tensor",
        "layer-neg",
    ],
)
def test_decode_step_rejects_bad_input(changes: dict, error: type, fragment: str) -> None:
    fields = {
        "layer": 0,
        "query": torch.randn(2, 4, 4),
        "cache": contiguous(b=2, hkv=2, d=4),
        "slots": torch.tensor([0, 1]),
        "scaling": 0.5,
        **changes,
    }
    with pytest.raises(error, match=fragment):
        DecodeStep(**fields)


def test_decode_step_accepts_an_int_scaling() -> None:
    step = DecodeStep(0, torch.randn(2, 4, 4), contiguous(), torch.tensor([0, 1]), 1)
    assert step.scaling == 1


# -- PrefillLayerPlan -----------------------------------------------------------------------


def ref_prefill_mask(n: int, n_sink: int, window_start: list[int] | None) -> torch.Tensor:
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            causal = j <= i
            in_window = window_start is None or j >= window_start[i] or j < n_sink
            mask[i, j] = causal and in_window
    return mask


PLAN_CASES = [(1, 0), (1, 4), (7, 0), (7, 2), (33, 4), (64, 1)]


@pytest.mark.parametrize(("n", "n_sink"), PLAN_CASES, ids=[f"L{n}-sink{s}" for n, s in PLAN_CASES])
@pytest.mark.parametrize("windowed", [False, True], ids=["causal", "window"])
def test_prefill_attention_mask_matches_brute_force(n: int, n_sink: int, windowed: bool) -> None:
    g = torch.Generator().manual_seed(n * 10 + n_sink)
    ws = None
    if windowed:
        ws = torch.tensor([int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(n)])
    plan = PrefillLayerPlan(layer=1, prompt_len=n, n_sink=n_sink, window_start=ws)
    mask = plan.attention_mask()
    assert mask.dtype == torch.bool and mask.shape == (n, n)
    assert torch.equal(mask, ref_prefill_mask(n, n_sink, None if ws is None else ws.tolist()))
    assert bool(mask.diagonal().all())  # every row sees itself


def test_prefill_mask_sliding_window_by_hand() -> None:
    # Row i sees [max(0, i - 1), i] plus sink 0.
    plan = PrefillLayerPlan(0, 5, n_sink=1, window_start=torch.tensor([0, 0, 1, 2, 3]))
    assert plan.attention_mask().int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 1, 1, 0],
        [1, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (
            {"window_start": torch.tensor([0, 2, 1, 1, 1])},
            ValueError,
            r"window_start\[i\] must lie in \[0, i\] for every row i",
        ),
        (
            {"window_start": torch.tensor([0, 0, -1, 0, 0])},
            ValueError,
            r"window_start\[i\] must lie in \[0, i\]",
        ),
        (
            {"window_start": torch.tensor([0, 0, 1, 2])},
            ValueError,
            r"window_start must have shape \[L=5\], got \[4\]",
        ),
        (
            {"window_start": torch.zeros(1, 5, dtype=torch.long)},
            ValueError,
            "window_start must have 1 dimensions",
        ),
        ({"window_start": torch.zeros(5)}, TypeError, "window_start must be an integer tensor"),
        ({"frozen_prefix": 6}, ValueError, r"frozen_prefix \(6\) must be <= prompt_len \(5\)"),
        ({"frozen_prefix": -1}, ValueError, "frozen_prefix must be >= 0"),
        ({"n_sink": -1}, ValueError, "n_sink must be >= 0"),
        ({"prompt_len": -1}, ValueError, "prompt_len must be >= 0"),
        ({"layer": True}, TypeError, "layer must be an int, got bool"),
    ],
    ids=[
        "ws>i",
        "ws-neg",
        "ws-short",
        "ws-2d",
        "ws-float",
        "frozen>L",
        "frozen-neg",
        "sink-neg",
        "L-neg",
        "layer-bool",
    ],
)
def test_prefill_plan_rejects_bad_input(kwargs: dict, error: type, fragment: str) -> None:
    fields = {"layer": 0, "prompt_len": 5, **kwargs}
    with pytest.raises(error, match=fragment):
        PrefillLayerPlan(**fields)


@pytest.mark.parametrize(
    ("kwargs", "dense"),
    [
        ({}, True),
        ({"n_sink": 4}, True),  # sinks mean nothing without a window
        ({"frozen_prefix": 5}, False),
        ({"frozen_prefix": 1}, False),
        ({"window_start": torch.zeros(5, dtype=torch.long)}, False),
    ],
    ids=["plain", "sinks-only", "all-frozen", "one-frozen", "window"],
)
def test_prefill_plan_is_dense(kwargs: dict, dense: bool) -> None:
    plan = PrefillLayerPlan(layer=0, prompt_len=5, **kwargs)
    assert plan.is_dense is dense
    if plan.window_start is None:
        assert torch.equal(plan.attention_mask(), torch.ones(5, 5, dtype=torch.bool).tril())


def test_prefill_planner_protocol() -> None:
    class Planner:
        def plan_prefill(self, layer: int, num_layers: int, prompt_len: int) -> PrefillLayerPlan:
            return PrefillLayerPlan(layer, prompt_len, frozen_prefix=prompt_len // 2)

    assert isinstance(Planner(), PrefillPlanner)
    assert not isinstance(object(), PrefillPlanner)
    assert Planner().plan_prefill(2, 4, 9).frozen_prefix == 4


# -- a reference selector on the protocol ---------------------------------------------------


class ExactTopK:
    """Exact top-``budget`` by the GQA group mean of softmax probabilities, plus sink/local."""

    def __init__(self, config: SelectorConfig) -> None:
        self.config = config

    def init_state(
        self,
        spec: AttentionSpec,
        capacity: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
    ) -> SequenceStatePool:
        pool = SequenceStatePool(capacity, device)
        pool.add_field("retrievals", (len(spec.selectable_layers),), torch.int64)
        return pool

    def select(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        cache = step.cache
        b, _, d = step.query.shape
        hkv, g, t = cache.num_kv_heads, step.group_size, cache.max_seq_len
        keys = cache.keys().float()  # [B, Hkv, T, D]
        # Query head h reads KV head h // g.
        logits = torch.einsum("bhd,bhtd->bht", step.query.float(), keys.repeat_interleave(g, dim=1))
        valid = cache.valid_mask()  # [B, T]
        logits = (logits * step.scaling).masked_fill(~valid.unsqueeze(1), -math.inf)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an empty row has no mass
        score = probs.view(b, hkv, g, t).mean(dim=2)  # [B, Hkv, T]
        pos = torch.arange(t).view(1, 1, -1)
        lens = cache.seq_lens.view(-1, 1, 1)
        valid3 = valid.unsqueeze(1).expand(-1, hkv, -1)
        forced = ((pos < self.config.n_sink) | (pos >= lens - self.config.n_local)) & valid3
        ranked = score.masked_fill(forced | ~valid3, -1.0)
        top = ranked.topk(min(self.config.budget, t), dim=-1)
        mask = forced.clone()
        mask.scatter_(-1, top.indices, top.values >= 0)
        mask |= forced
        num = mask.sum(-1)
        stats = StepStats(
            retrieved=torch.ones(b, hkv, dtype=torch.bool),
            num_selected=num,
            proxy_bytes=(cache.seq_lens * d * keys.element_size())
            .view(-1, 1)
            .expand(b, hkv)
            .clone(),
        )
        state["retrievals"][step.slots, 0] += 1
        return Selection.from_mask(mask, stats=stats)


def layouts(b: int, hkv: int, t: int, d: int, seed: int) -> tuple[ContiguousKVCache, PagedKVCache]:
    """The same data, left-padded contiguously and scattered through a shuffled token pool."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    lens[0] = t
    key = torch.randn(b, hkv, t, d, generator=g)
    value = torch.randn(b, hkv, t, d, generator=g)
    start = t - lens  # left padding, as batched generate() does
    cont = ContiguousKVCache(key, value, seq_lens=lens, start=start)
    n = int(lens.sum())
    perm = torch.randperm(n + 3, generator=g)
    kp, vp = torch.zeros(n + 3, hkv, d), torch.zeros(n + 3, hkv, d)
    table = torch.full((b, t), -1, dtype=torch.long)
    used = 0
    for r in range(b):
        for p in range(int(lens[r])):
            s = int(perm[used])
            used += 1
            table[r, p] = s
            kp[s], vp[s] = key[r, :, int(start[r]) + p], value[r, :, int(start[r]) + p]
    return cont, PagedKVCache(kp, vp, table, lens)


TOPK_CASES = [
    # (B, Hq, Hkv, T, D, budget, n_sink, n_local)
    (1, 1, 1, 1, 4, 1, 0, 0),
    (2, 4, 2, 37, 16, 5, 2, 3),
    (3, 8, 1, 20, 8, 4, 1, 1),
    (2, 8, 8, 64, 8, 16, 4, 8),
]
TOPK_IDS = [f"B{b}-Hq{hq}-Hkv{hkv}-T{t}-D{d}-k{k}" for b, hq, hkv, t, d, k, _, _ in TOPK_CASES]


def test_exact_topk_satisfies_the_protocol() -> None:
    sel = ExactTopK(SelectorConfig(budget=4))
    assert isinstance(sel, DecodeSelector)
    assert not isinstance(object(), DecodeSelector)
    spec = AttentionSpec(3, 4, 2, 8, layer_types=("full", "sliding", "full"))
    pool = sel.init_state(spec, capacity=5, max_seq_len=100)
    assert isinstance(pool, SequenceStatePool)
    assert pool.capacity == 5 and pool["retrievals"].shape == (5, 2)


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "t", "d", "k", "sink", "local"), TOPK_CASES, ids=TOPK_IDS
)
def test_exact_topk_selects_the_same_on_both_layouts(
    b: int, hq: int, hkv: int, t: int, d: int, k: int, sink: int, local: int
) -> None:
    cont, paged = layouts(b, hkv, t, d, seed=t + hq)
    selector = ExactTopK(SelectorConfig(budget=k, n_sink=sink, n_local=local))
    pool = selector.init_state(AttentionSpec(1, hq, hkv, d), capacity=b + 2, max_seq_len=t)
    slots = torch.arange(b) + 1
    pool.create(slots, cont.seq_lens)
    query = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(1))
    a = selector.select(DecodeStep(0, query, cont, slots, d**-0.5), pool)
    p = selector.select(DecodeStep(0, query, paged, slots, d**-0.5), pool)
    assert torch.equal(a.indices, p.indices)
    assert torch.equal(a.stats.num_selected, p.stats.num_selected)
    assert torch.equal(a.stats.proxy_bytes, p.stats.proxy_bytes)
    assert bool(a.stats.retrieved.all())
    assert pool["retrievals"][:, 0].tolist() == [0] + [2] * b + [0]  # only the step's slots
    mask = a.to_mask(cont.seq_lens, t, hkv)
    lens = cont.seq_lens.tolist()
    for bi in range(b):
        n = lens[bi]
        forced = set(range(min(sink, n))) | set(range(max(0, n - local), n))
        for h in range(hkv):
            chosen = set(torch.nonzero(mask[bi, h]).flatten().tolist())
            assert forced <= chosen
            assert len(chosen) == min(n, len(forced) + k)
            assert int(a.stats.num_selected[bi, h]) == len(chosen)
    # What is read: every selected K and V row (fp32: 4 bytes) plus every cached key scored.
    expected = [
        hkv * (lens[bi] * d * 4) + int(a.stats.num_selected[bi].sum()) * 2 * d * 4
        for bi in range(b)
    ]
    assert a.stats.bytes_read(head_dim=d, element_size=4).tolist() == expected


def test_exact_topk_uses_the_group_mean_of_probabilities() -> None:
    # One KV head, g = 2: head 0 puts almost all its mass on key 1, head 1 spreads evenly over
    # keys 2 and 3. Group mean ~ [0, .5, .25, .25]: key 1 wins, though head 1 alone would pick
    # 2 or 3 and the group mean of logits ([0, 25, 25, 25]) would tie keys 1, 2 and 3.
    key = torch.zeros(1, 1, 4, 4)
    key[0, 0, 1, 0] = 1.0
    key[0, 0, 2, 1] = 1.0
    key[0, 0, 3, 1] = 1.0
    cache = ContiguousKVCache(key, key.clone())
    query = torch.zeros(1, 2, 4)
    query[0, 0, 0] = 50.0
    query[0, 1, 1] = 50.0
    sel = ExactTopK(SelectorConfig(budget=1, n_sink=0, n_local=0))
    pool = sel.init_state(AttentionSpec(1, 2, 1, 4), 1, 4)
    pool.create([0], [4])
    out = sel.select(DecodeStep(0, query, cache, torch.tensor([0]), 1.0), pool)
    assert out.indices.tolist() == [[[1]]]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "t", "d", "k", "sink", "local"), TOPK_CASES, ids=TOPK_IDS
)
def test_exact_topk_with_budget_at_least_t_covers_every_valid_position(
    b: int, hq: int, hkv: int, t: int, d: int, k: int, sink: int, local: int
) -> None:
    cont, paged = layouts(b, hkv, t, d, seed=2 * t + hq)
    for budget in (t, t + 7):
        selector = ExactTopK(SelectorConfig(budget=budget, n_sink=sink, n_local=local))
        pool = selector.init_state(AttentionSpec(1, hq, hkv, d), capacity=b, max_seq_len=t)
        pool.create(list(range(b)), cont.seq_lens)
        query = torch.randn(b, hq, d)
        for cache in (cont, paged):
            out = selector.select(DecodeStep(0, query, cache, torch.arange(b), 1.0), pool)
            mask = out.to_mask(cache.seq_lens, t, hkv)
            assert torch.equal(mask, cache.valid_mask().unsqueeze(1).expand(-1, hkv, -1))
            assert out.stats.num_selected.tolist() == [[n] * hkv for n in cache.seq_lens.tolist()]
