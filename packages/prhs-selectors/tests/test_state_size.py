"""State sizes for a serving geometry, measured on the ``meta`` device (no memory is allocated).

Llama-3-8B: 32 layers, Hq 32, Hkv 8, D 128, a bf16 cache; 256 request slots and an SGLang pool
of 131072 token slots in pages of 16. Per-request state must not depend on the context length,
and side caches must be small beside the KV pool they describe.
"""

from __future__ import annotations

import pytest
import torch

from prhs_core.config import AttentionSpec
from prhs_core.registry import selectors
from prhs_kernels.keycodes import code_bytes

SPEC = AttentionSpec(32, 32, 8, 128)
CAPACITY, LOCATIONS, PAGE = 256, 131072, 16
K_POOL_BYTES = LOCATIONS * SPEC.num_layers * SPEC.num_kv_heads * SPEC.head_dim * 2  # bf16 keys
MiB = 1 << 20


def _sizes(sel, max_seq_len: int = 32768, paged: bool = True) -> dict[str, int]:
    kw = {"num_kv_locations": LOCATIONS, "kv_page_size": PAGE} if paged else {}
    state = sel.init_state(
        SPEC,
        capacity=CAPACITY,
        max_seq_len=max_seq_len,
        kv_dtype=torch.bfloat16,
        device="meta",
        **kw,
    )
    return state.nbytes()


def test_quest_page_bounds_are_at_most_an_eighth_of_the_k_pool() -> None:
    side = _sizes(selectors.create("quest"))["side_cache"]  # default: pages of 16
    assert 0 < side <= K_POOL_BYTES / 8, (side / MiB, K_POOL_BYTES / MiB)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("cis", {}),
        ("cis", {"scorer": "int4"}),
        ("cis", {"delta_max": 0.1}),
        ("cis", {"delta_max": 0.1, "certificate": "global"}),
        ("prhs", {}),
        ("prhs", {"delta_max": 0.1}),
    ],
    ids=["cis", "cis-int4", "cis-certified", "cis-certified-global", "prhs", "prhs-certified"],
)
def test_cis_state_is_at_most_one_mib_per_request(name, fields) -> None:
    sel = selectors.create(name, **fields)
    sizes = _sizes(sel)
    assert 0 < sizes["per_request"] <= MiB, sizes["per_request"] / MiB
    if not sel.uses_side_cache():
        assert sizes["side_cache"] == 0
        return
    if sel.config.key_codes:
        # Paper mode scores code rows: D/2 + 8 bytes rounded up to 16 (80 at D 128) per
        # location, layer and KV head, 31 % of the K pool (16 % of the KV pool).
        assert code_bytes(SPEC.head_dim) == 80
        per_loc = SPEC.num_layers * SPEC.num_kv_heads * code_bytes(SPEC.head_dim)
        centers = SPEC.num_layers * SPEC.num_kv_heads * SPEC.head_dim * 4  # float32, once
        assert sizes["side_cache"] == (LOCATIONS + 1) * per_loc + centers
        assert sizes["side_cache"] <= K_POOL_BYTES * 0.313
        return
    # The per-page certificate: per page of 16 locations, layer and KV head, the key box (2·D
    # bf16) and the anchor's two float32 masses per query head: 13.3 % of the K pool.
    g = SPEC.num_q_heads // SPEC.num_kv_heads
    per_page = SPEC.num_layers * SPEC.num_kv_heads * (2 * SPEC.head_dim * 2 + 2 * g * 4)
    assert sizes["side_cache"] == (LOCATIONS // PAGE + 1) * per_page
    assert sizes["side_cache"] <= K_POOL_BYTES * 0.134


def test_h2o_side_cache_is_reported() -> None:
    sizes = _sizes(selectors.create("h2o"))
    # float32 mass and a bool flag per (location, layer, KV head), plus the scratch location.
    assert sizes["side_cache"] == (LOCATIONS + 1) * SPEC.num_layers * SPEC.num_kv_heads * 5
    assert sizes["per_request"] == SPEC.num_layers  # one "seeded" flag per layer


def test_no_state_grows_with_max_seq_len(tools, case) -> None:
    sel = tools.make_selector(case)
    short, long = _sizes(sel, 1024), _sizes(sel, 131072)
    assert short == long, (short, long)
    # Contiguous layouts size side caches by capacity × max_seq_len (their KV is that big too);
    # per-request state still does not grow.
    c_short, c_long = _sizes(sel, 1024, paged=False), _sizes(sel, 131072, paged=False)
    assert c_short["per_request"] == c_long["per_request"] == short["per_request"]
    if c_short["side_cache"]:
        assert c_long["side_cache"] > c_short["side_cache"]
