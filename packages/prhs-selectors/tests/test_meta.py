"""Every selector runs a decode step on the ``meta`` device: no device value is ever read on the
host (a ``meta`` tensor has no value: ``.item()``, ``bool()``, ``.tolist()`` raise), and every
shape and dtype is what the contracts say. This is what a CUDA graph capture of a step needs.

Geometry: Llama-3-8B's heads (Hq 32, Hkv 8, D 128, bf16 cache) over a few layers."""

from __future__ import annotations

import pytest
import torch

from prhs_core.config import AttentionSpec
from prhs_core.layout import ContiguousKV, PagedKV
from prhs_core.protocols import DecodeSelector
from prhs_core.selection import Selection
from prhs_kernels import sparse_decode_attention, token_locations

META = torch.device("meta")
BF16 = torch.bfloat16
SPEC = AttentionSpec(4, 32, 8, 128, ("full", "full", "sliding", "full"))
B, CAPACITY, MAX_LEN, POOL, PAGE = 3, 4, 512, 4096, 16


def _meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def _kv(paged: bool, seq_lens: torch.Tensor):
    hkv, d = SPEC.num_kv_heads, SPEC.head_dim
    if paged:
        table = _meta(CAPACITY + 1, MAX_LEN, dtype=torch.int32)
        req = _meta(B, dtype=torch.int32)
        return PagedKV(_meta(POOL, hkv, d), _meta(POOL, hkv, d), table, req, seq_lens, PAGE)
    return ContiguousKV(
        _meta(B, hkv, MAX_LEN, d), _meta(B, hkv, MAX_LEN, d), seq_lens, _meta(B, dtype=torch.int32)
    )


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_decode_step_reads_no_device_value(tools, case, paged) -> None:
    sel = tools.make_selector(case)
    assert isinstance(sel, DecodeSelector)
    kw = {"num_kv_locations": POOL, "kv_page_size": PAGE} if paged else {}
    state = sel.init_state(
        SPEC, capacity=CAPACITY, max_seq_len=MAX_LEN, kv_dtype=BF16, device=META, **kw
    )
    assert state.device.type == "meta"
    state.pool.create([0, 2])
    plan = sel.make_plan(state, batch_size=B, scaling=128**-0.5, stats=True, checked=False)
    width = sel.selection_width()
    indices = plan.selection.indices
    assert indices.shape == (B, SPEC.num_kv_heads, width) and indices.dtype == torch.int32
    hq, hkv, d = SPEC.num_q_heads, SPEC.num_kv_heads, SPEC.head_dim
    for _ in range(3):
        # Row 1 is padded (slot -1); lengths and slots are device tensors the host never reads.
        plan.update(_meta(B, dtype=torch.int32), _meta(B, dtype=torch.int64))
        for layer in range(SPEC.num_layers):
            kv = _kv(paged, plan.seq_lens)
            # The host wrote this step's token (and, once, a prompt) through write_kv.
            loc = token_locations(kv, _meta(B, 5, dtype=torch.int64), state.row_stride)
            sel.write_kv(state, layer, loc.flatten(), _meta(B * 5, hkv, d), _meta(B * 5, hkv, d))
            if layer not in SPEC.selectable_layers:
                continue
            q = _meta(B, hq, d)
            s = sel.select(plan, layer, q, kv, state)
            if s is not None:
                assert isinstance(s, Selection) and s is plan.selection
                assert s.indices is indices  # the plan's buffer, written in place
                assert s.counts.shape == (B, hkv) and s.counts.dtype == torch.int32
            st = plan.stats
            assert st.retrieved.shape == (B, hkv) and st.retrieved.dtype == torch.bool
            assert st.num_selected.shape == (B, hkv)
            assert (st.delta_hat is not None) == sel.certifies
            out, lse = sparse_decode_attention(q, kv, s, plan.scaling)
            assert out.shape == (B, hq, d) and out.dtype == BF16
            assert lse.shape == (B, hq) and lse.dtype == torch.float32
    assert plan.totals.shape == (SPEC.num_layers, 4)
    assert state.nonfinite.shape == (1,)
