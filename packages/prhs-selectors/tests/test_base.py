"""The shared machinery of ``base.py`` against Python brute force: windows as blocks, the blocks
top-k may pick, the GQA group mean, the non-finite rows and the contiguous row stride."""

from __future__ import annotations

import pytest
import torch

from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import ContiguousKV
from prhs_selectors import Oracle
from prhs_selectors.base import ROW_STRIDE_ALIGN, group_probs, nonfinite_rows

LENS = [1, 2, 3, 8, 20, 40, 41]


def _kv(lens: list[int], t: int = 48) -> ContiguousKV:
    k = torch.zeros(()).expand(len(lens), 1, t, 2)
    return ContiguousKV(k, k, torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize(
    ("n_sink", "n_local", "s"),
    [(0, 0, 1), (4, 0, 1), (0, 5, 1), (4, 32, 1), (3, 7, 1), (3, 7, 4), (0, 1, 5), (9, 2, 8)],
    ids=lambda v: str(v),
)
def test_window_and_eligible_blocks_match_brute_force(n_sink: int, n_local: int, s: int) -> None:
    sel = Oracle(SelectorConfig(budget=4, n_sink=n_sink, n_local=n_local, block_size=s))
    kv = _kv(LENS)
    nb = -(-48 // s)
    win = sel.window_block_mask(kv, nb)
    eligible = sel.block_eligible(kv, nb)
    sink, local = sel.windows(kv)
    assert win.shape == eligible.shape == (len(LENS), nb)
    for b, n in enumerate(LENS):
        window = {i for i in range(n) if i < n_sink or i >= n - n_local}
        want_win = {p // s for p in window}
        exists = set(range(-(-n // s)))
        assert set(win[b].nonzero().flatten().tolist()) == want_win, (n, n_sink, n_local, s)
        assert set(eligible[b].nonzero().flatten().tolist()) == exists - want_win
        listed = {int(j) for j in torch.cat([sink[b], local[b]]) if j >= 0}
        assert listed == want_win
    assert torch.equal(sel.num_blocks(kv), torch.tensor([-(-n // s) for n in LENS]).int())


def test_group_probs_is_the_mean_of_each_groups_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 9, generator=g)
    logits[1, 2, :, 5:] = float("-inf")
    got = group_probs(logits)
    want = torch.softmax(logits.double(), -1).mean(2)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-7)


def test_nonfinite_rows_marks_the_kv_head_of_any_bad_query_head() -> None:
    q = torch.randn(3, 8, 4)  # Hkv = 2, g = 4
    q[0, 5, 1] = float("nan")  # KV head 1 of row 0
    q[2, 0, 3] = float("-inf")  # KV head 0 of row 2
    bad = nonfinite_rows(q, 2)
    assert bad.tolist() == [[False, True], [False, False], [True, False]]


@pytest.mark.parametrize("max_seq_len", [1, 255, 256, 257, 1000])
def test_contiguous_row_stride_is_aligned(max_seq_len: int) -> None:
    sel = Oracle(SelectorConfig(budget=4))
    state = sel.init_state(AttentionSpec(1, 2, 1, 4), capacity=3, max_seq_len=max_seq_len)
    assert state.row_stride >= max_seq_len
    assert state.row_stride % ROW_STRIDE_ALIGN == 0
    assert state.row_stride < max_seq_len + ROW_STRIDE_ALIGN
