"""DecodeStep, PrefillLayerPlan / PrefillPlanner, and a tiny selector on the DecodeSelector
protocol.

``LastWindow`` below is written against the protocol only: it keeps the last ``window``
positions of every row, writes them into the plan's buffers with device ops (no host read),
counts steps per request slot through ``plan.slots`` and keeps a per-location side cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from prhs_core import (
    AttentionSpec,
    ContiguousKV,
    DecodePlan,
    DecodeSelector,
    DecodeStep,
    KVLayout,
    PagedKV,
    PrefillLayerPlan,
    PrefillPlanner,
    Selection,
    SelectorConfig,
    SelectorState,
    SequenceStatePool,
    SideCache,
)

I32 = torch.int32


def i32(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def contiguous(b: int = 2, hkv: int = 2, t: int = 6, d: int = 4) -> ContiguousKV:
    return ContiguousKV(
        torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d), torch.full((b,), t, dtype=I32)
    )


def paged(b: int = 2, hkv: int = 2, t: int = 6, d: int = 4) -> PagedKV:
    table = torch.arange(b * t, dtype=I32).view(b, t)
    return PagedKV(
        torch.randn(b * t, hkv, d),
        torch.randn(b * t, hkv, d),
        table,
        torch.arange(b, dtype=I32),
        torch.full((b,), t, dtype=I32),
    )


def tiny_plan(b: int = 2) -> DecodePlan:
    state = SelectorState(SequenceStatePool(4), None, row_stride=8)
    return DecodePlan(
        state, batch_size=b, num_kv_heads=2, num_layers=1, width=2, block_size=1, scaling=0.25
    )


# -- DecodeStep -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [contiguous, paged], ids=["contiguous", "paged"])
@pytest.mark.parametrize(
    ("hq", "hkv", "g"), [(2, 2, 1), (8, 2, 4), (8, 1, 8)], ids=["Hq2-Hkv2", "Hq8-Hkv2", "Hq8-Hkv1"]
)
def test_decode_step_reports_what_select_saw(layout, hq: int, hkv: int, g: int) -> None:
    kv = layout(hkv=hkv)
    plan = tiny_plan()
    step = DecodeStep(3, torch.randn(2, hq, 4), kv, plan)
    assert step.group_size == g
    assert step.seq_lens is kv.seq_lens  # the cache's own lengths, not a copy
    assert step.scaling == 0.25 and step.plan is plan and step.layer == 3
    with pytest.raises(AttributeError):
        step.layer = 4  # type: ignore[misc]


# -- PrefillLayerPlan -----------------------------------------------------------------------


FRACTIONS = [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.7, 0.9, 0.999]


@pytest.mark.parametrize("f", FRACTIONS, ids=lambda f: f"f{f:.3g}")
@pytest.mark.parametrize("n", [0, 1, 17, 1000], ids=lambda n: f"L{n}")
def test_window_start_is_floor_of_f_times_t(f: float, n: int) -> None:
    ws = PrefillLayerPlan(0, window_fraction=f).window_start(n)
    assert ws.dtype == torch.int64 and ws.shape == (n,)
    assert ws.tolist() == [math.floor(f * t) for t in range(n)]
    assert all(0 <= s <= t for t, s in enumerate(ws.tolist()))  # every row sees itself


@pytest.mark.parametrize("e", [0.0, 0.1, 0.3, 0.5, 0.75, 0.99], ids=lambda e: f"e{e}")
def test_frozen_prefix_is_floor_of_e_times_l(e: float) -> None:
    plan = PrefillLayerPlan(1, frozen_fraction=e)
    for n in (0, 1, 3, 10, 97, 4096):
        got = plan.frozen_prefix(n)
        assert got == math.floor(e * n) and isinstance(got, int)
        assert 0 <= got < max(n, 1)  # a fraction below 1 never freezes every row
        assert plan.frozen_rows(n) == (0, got)
        sinks = PrefillLayerPlan(1, n_sink=4, frozen_fraction=e)
        assert sinks.frozen_rows(n) == (min(4, got), got)  # sink rows are never frozen


def ref_prefill_mask(n: int, f: float, n_sink: int) -> list[list[bool]]:
    out = []
    for i in range(n):
        row = []
        for j in range(n):
            causal = j <= i
            in_window = f == 0.0 or j >= math.floor(f * i) or j < n_sink
            row.append(causal and in_window)
        out.append(row)
    return out


MASK_CASES = [
    # (L, f, n_sink)
    (0, 0.5, 0),
    (1, 0.5, 4),
    (7, 0.0, 3),  # sinks mean nothing without a window
    (7, 0.5, 0),
    (7, 0.5, 2),
    (33, 1 / 3, 4),
    (64, 0.9, 1),
    (64, 0.999, 0),
    (20, 0.25, 30),  # more sinks than rows
]


@pytest.mark.parametrize(
    ("n", "f", "n_sink"), MASK_CASES, ids=[f"L{n}-f{f:.3g}-sink{s}" for n, f, s in MASK_CASES]
)
def test_attention_mask_matches_a_python_double_loop(n: int, f: float, n_sink: int) -> None:
    plan = PrefillLayerPlan(2, window_fraction=f, n_sink=n_sink)
    mask = plan.attention_mask(n)
    assert mask.dtype == torch.bool and mask.shape == (n, n)
    assert mask.tolist() == ref_prefill_mask(n, f, n_sink)
    assert bool(mask.diagonal().all())  # every row sees itself


@pytest.mark.parametrize(
    ("n", "f", "n_sink"), MASK_CASES, ids=[f"L{n}-f{f:.3g}-sink{s}" for n, f, s in MASK_CASES]
)
def test_attention_mask_of_a_chunk_is_the_full_masks_tail(n: int, f: float, n_sink: int) -> None:
    plan = PrefillLayerPlan(2, window_fraction=f, n_sink=n_sink)
    full = plan.attention_mask(n)
    for first in {0, n // 3, n}:
        assert torch.equal(plan.attention_mask(n, first_row=first), full[first:])
    with pytest.raises(ValueError, match="first_row"):
        plan.attention_mask(n, first_row=n + 1)


def test_attention_mask_by_hand() -> None:
    # f = 0.5, one sink: row i sees [floor(i/2), i] and position 0.
    plan = PrefillLayerPlan(0, window_fraction=0.5, n_sink=1)
    assert plan.attention_mask(6).int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 0, 1, 1, 1, 0],
        [1, 0, 1, 1, 1, 1],
    ]
    assert plan.window_start(6).tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("kwargs", "dense"),
    [
        ({}, True),
        ({"n_sink": 4}, True),
        ({"frozen_fraction": 0.5}, False),
        ({"window_fraction": 0.1}, False),
        ({"window_fraction": 0.3, "frozen_fraction": 0.2}, False),
    ],
    ids=["plain", "sinks-only", "frozen", "window", "both"],
)
def test_is_dense(kwargs: dict, dense: bool) -> None:
    plan = PrefillLayerPlan(layer=0, **kwargs)
    assert plan.is_dense is dense
    if plan.window_fraction == 0.0:
        assert torch.equal(plan.attention_mask(5), torch.ones(5, 5, dtype=torch.bool).tril())


def test_fractions_are_stored_as_floats() -> None:
    plan = PrefillLayerPlan(0, window_fraction=0, frozen_fraction=0)
    assert isinstance(plan.window_fraction, float) and isinstance(plan.frozen_fraction, float)
    with pytest.raises(AttributeError):
        plan.n_sink = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"layer": -1}, ValueError, "layer must be >= 0, got -1"),
        ({"layer": True}, TypeError, "layer must be an int, got bool"),
        ({"n_sink": -1}, ValueError, "n_sink must be >= 0, got -1"),
        ({"n_sink": 2.0}, TypeError, "n_sink must be an int, got float"),
        ({"window_fraction": 1.0}, ValueError, r"window_fraction must lie in \[0, 1\), got 1.0"),
        ({"window_fraction": -0.1}, ValueError, r"window_fraction must lie in \[0, 1\), got -0.1"),
        (
            {"window_fraction": math.nan},
            ValueError,
            r"window_fraction must lie in \[0, 1\), got nan",
        ),
        ({"window_fraction": math.inf}, ValueError, r"window_fraction must lie in \[0, 1\)"),
        ({"window_fraction": True}, TypeError, "window_fraction must be a float, got bool"),
        ({"window_fraction": "0.5"}, TypeError, "window_fraction must be a float, got str"),
        ({"frozen_fraction": 1}, ValueError, r"frozen_fraction must lie in \[0, 1\), got 1"),
        ({"frozen_fraction": -1e-9}, ValueError, r"frozen_fraction must lie in \[0, 1\)"),
        ({"frozen_fraction": None}, TypeError, "frozen_fraction must be a float, got NoneType"),
    ],
    ids=[
        "layer-neg",
        "layer-bool",
        "sink-neg",
        "sink-float",
        "f=1",
        "f-neg",
        "f-nan",
        "f-inf",
        "f-bool",
        "f-str",
        "e=1",
        "e-neg",
        "e-none",
    ],
)
def test_prefill_plan_rejects_bad_parameters(kwargs: dict, error: type, fragment: str) -> None:
    fields = {"layer": 0, **kwargs}
    with pytest.raises(error, match=fragment):
        PrefillLayerPlan(**fields)


@pytest.mark.parametrize("method", ["window_start", "frozen_prefix", "attention_mask"])
@pytest.mark.parametrize(
    ("n", "error", "fragment"),
    [
        (-1, ValueError, "prompt_len must be >= 0, got -1"),
        (3.0, TypeError, "prompt_len must be an int"),
    ],
    ids=["neg", "float"],
)
def test_prompt_len_is_checked(method: str, n: object, error: type, fragment: str) -> None:
    plan = PrefillLayerPlan(0, window_fraction=0.5, frozen_fraction=0.5)
    with pytest.raises(error, match=fragment):
        getattr(plan, method)(n)


def test_prefill_planner_protocol() -> None:
    class Planner:
        def plan_prefill(self, layer: int, num_layers: int) -> PrefillLayerPlan:
            return PrefillLayerPlan(layer, window_fraction=0.5 * layer / num_layers)

    assert isinstance(Planner(), PrefillPlanner)
    assert not isinstance(object(), PrefillPlanner)
    assert Planner().plan_prefill(2, 4).window_fraction == 0.25


# -- a selector on the protocol -------------------------------------------------------------


class LastWindow:
    """Keeps the last ``config.n_local`` positions of every row (all KV heads alike)."""

    name = "last_window"

    def __init__(self, config: SelectorConfig) -> None:
        self.config = config

    def init_state(
        self,
        spec: AttentionSpec,
        *,
        capacity: int,
        max_seq_len: int,
        num_kv_locations: int | None = None,
        kv_page_size: int = 1,
        kv_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> SelectorState:
        pool = SequenceStatePool(capacity, device)
        pool.add_field("steps", (spec.num_layers,), torch.int64)
        n = num_kv_locations if num_kv_locations is not None else capacity * max_seq_len
        side = SideCache(n, kv_page_size, device)
        side.add_field("key_norm", (spec.num_kv_heads,), torch.float32, fill=-1.0)
        return SelectorState(pool, side, row_stride=max_seq_len, kv_page_size=kv_page_size)

    def selection_width(self) -> int:
        return self.config.n_local

    def make_plan(
        self,
        state: SelectorState,
        *,
        batch_size: int,
        scaling: float,
        stats: bool = False,
        checked: bool = False,
    ) -> DecodePlan:
        return DecodePlan(
            state,
            batch_size=batch_size,
            num_kv_heads=state.side["key_norm"].shape[1],
            num_layers=state.pool["steps"].shape[1],
            width=self.selection_width(),
            block_size=1,
            scaling=scaling,
            stats=stats,
            checked=checked,
        )

    def select(
        self, plan: DecodePlan, layer: int, query: torch.Tensor, kv: KVLayout, state: SelectorState
    ) -> Selection | None:
        w = self.selection_width()
        lens = plan.seq_lens.view(-1, 1, 1)
        counts = lens.clamp(max=w)
        first = lens - counts
        k = torch.arange(w, dtype=I32, device=lens.device).view(1, 1, -1)
        sel = plan.selection
        sel.indices.copy_((first + k).expand_as(sel.indices))  # entries >= count: >= seq_len
        sel.counts.copy_(counts.view(-1, 1).expand_as(sel.counts))
        state.pool["steps"][plan.slots, layer] += 1  # padded rows count into the scratch slot
        return sel

    def write_kv(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        side = state.side
        side["key_norm"][side.rows_of(locations)] = key.float().norm(dim=-1)


def test_a_selector_satisfies_the_protocol_and_a_partial_one_does_not() -> None:
    selector = LastWindow(SelectorConfig(n_local=3))
    assert isinstance(selector, DecodeSelector)
    assert not isinstance(object(), DecodeSelector)

    class NoWriteKV:
        name = "x"
        config = None
        init_state = selection_width = make_plan = select = LastWindow.select

    class NoName:
        config = None
        init_state = selection_width = make_plan = select = write_kv = LastWindow.select

    assert not isinstance(NoWriteKV(), DecodeSelector)
    assert not isinstance(NoName(), DecodeSelector)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_protocol_selector_runs_a_step_through_the_plan(layout: str) -> None:
    b, hkv, d, t, w = 3, 2, 4, 9, 4
    selector = LastWindow(SelectorConfig(n_local=w))
    spec = AttentionSpec(2, 4, hkv, d)
    state = selector.init_state(spec, capacity=4, max_seq_len=t)
    plan = selector.make_plan(state, batch_size=b, scaling=d**-0.5, checked=True)
    state.pool.create([1, 3])
    lens, slots = i32([9, 2, 5]), torch.tensor([3, -1, 1])  # row 1 is padding
    plan.update(lens, slots)
    g = torch.Generator().manual_seed(0)
    if layout == "contiguous":
        kv: KVLayout = ContiguousKV(
            torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g), lens
        )
    else:
        table = torch.randperm(b * t, generator=g).to(I32).view(b, t)
        kv = PagedKV(
            torch.randn(b * t, hkv, d, generator=g),
            torch.randn(b * t, hkv, d, generator=g),
            table,
            torch.arange(b, dtype=I32),
            lens,
        )
    kv.check_values()
    query = torch.randn(b, 4, d, generator=g)
    sel = selector.select(plan, 1, query, kv, state)
    assert sel is plan.selection  # written in place
    expected = [
        [[p >= n - w for p in range(t) if p < n] + [False] * (t - n)] * hkv for n in (9, 2, 5)
    ]
    assert sel.to_mask(lens, t).tolist() == expected
    assert sel.num_tokens(lens).tolist() == [[4, 4], [2, 2], [4, 4]]
    # Slots 3 and 1 advanced at layer 1 only; the padded row went to the scratch slot.
    steps = state.pool["steps"]
    assert steps[:, 1].tolist() == [0, 1, 0, 1, 1] and not steps[:, 0].any()
    # The side cache follows KV locations; location -1 lands in the scratch row.
    locs = torch.tensor([0, 7, -1])
    key = torch.full((3, hkv, d), 0.5)
    selector.write_kv(state, 1, locs, key, key)
    norm = state.side["key_norm"]
    assert norm[[0, 7, state.side.scratch_location]].tolist() == [[1.0] * hkv] * 3
    assert int((norm == -1.0).all(dim=1).sum()) == norm.shape[0] - 3
    step = DecodeStep(1, query, kv, plan)
    assert step.group_size == 2 and step.seq_lens is lens
