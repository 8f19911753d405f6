"""PSAW prefill attention's torch reference against PrefillLayerPlan's mask and SDPA, and its
launcher's input checks."""

from __future__ import annotations

import pytest
import torch

from prhs_core.protocols import PrefillLayerPlan
from prhs_kernels.prefill import psaw_allowed, psaw_prefill_attention


@pytest.mark.parametrize(
    ("f", "n_sink", "tq", "tk"),
    [(0.5, 4, 40, 40), (0.0, 0, 30, 30), (0.7, 3, 12, 45), (0.95, 64, 50, 50)],
)
def test_reference_is_the_plans_mask_with_sdpa(f, n_sink, tq, tk):
    gen = torch.Generator().manual_seed(tk)
    q = torch.randn(1, 4, tq, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, tk, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, tk, 16, generator=gen, dtype=torch.float64)
    plan = PrefillLayerPlan(0, window_fraction=f, n_sink=n_sink)
    mask = plan.attention_mask(tk, first_row=tk - tq)
    pos = torch.arange(tk).view(1, -1)
    assert torch.equal(psaw_allowed(pos[:, tk - tq :], pos, f, n_sink)[0], mask)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    )
    got, lse = psaw_prefill_attention(q, k, v, window_fraction=f, n_sink=n_sink, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 accumulation
    assert lse.dtype == torch.float32 and torch.isfinite(lse).all()


def test_left_padding_shifts_positions():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 20, 8, generator=gen)
    k = torch.randn(2, 2, 20, 8, generator=gen)
    v = torch.randn(2, 2, 20, 8, generator=gen)
    start = torch.tensor([0, 6])
    got, lse = psaw_prefill_attention(q, k, v, window_fraction=0.5, n_sink=2, scaling=0.3,
                                      start=start)  # fmt: skip
    # Row 1 is row 0's computation on its last 14 positions.
    alone, _ = psaw_prefill_attention(q[1:, :, 6:], k[1:, :, 6:], v[1:, :, 6:],
                                      window_fraction=0.5, n_sink=2, scaling=0.3)  # fmt: skip
    torch.testing.assert_close(got[1:, :, 6:], alone)
    assert (got[1, :, :6] == 0).all() and torch.isneginf(lse[1, :, :6]).all()


def test_bad_input_is_rejected():
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    kw = dict(window_fraction=0.5, n_sink=1, scaling=0.3)
    with pytest.raises(ValueError, match="must not exceed the key rows"):
        psaw_prefill_attention(torch.randn(1, 4, 6, 8), k, k, **kw)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        psaw_prefill_attention(torch.randn(1, 3, 5, 8), k, k, **kw)
    with pytest.raises(ValueError, match=r"window_fraction must lie in \[0, 1\)"):
        psaw_prefill_attention(q, k, k, window_fraction=1.0, n_sink=1, scaling=0.3)
    with pytest.raises(TypeError, match="share a dtype"):
        psaw_prefill_attention(q.double(), k, k, **kw)
    with pytest.raises(ValueError, match="start must be"):
        psaw_prefill_attention(q, k, k, start=torch.zeros(2, dtype=torch.int32), **kw)


@pytest.mark.parametrize("chunk", [1, 7, 256])
@pytest.mark.parametrize(
    ("f", "n_sink", "tq", "tk", "padded"),
    [
        (0.5, 4, 40, 40, True),
        (0.0, 0, 33, 33, True),
        (0.8, 3, 12, 45, False),
        (0.9, 70, 50, 50, True),
    ],
)
def test_chunked_path_equals_the_reference(chunk, f, n_sink, tq, tk, padded):
    from prhs_kernels.prefill import (
        psaw_prefill_attention_chunked,
        psaw_prefill_attention_reference,
    )

    gen = torch.Generator().manual_seed(tq + chunk)
    q = torch.randn(3, 4, tq, 8, generator=gen)
    k = torch.randn(3, 2, tk, 8, generator=gen)
    v = torch.randn(3, 2, tk, 8, generator=gen)
    start = torch.tensor([0, 9, tk]) if padded else None  # row 2: padding only
    got = psaw_prefill_attention_chunked(q, k, v, start, f, n_sink, 0.3, chunk=chunk)
    want = psaw_prefill_attention_reference(q, k, v, start, f, n_sink, 0.3)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    # Through SDPA per chunk (no lse): the same output on every row that is not padding.
    out, lse = psaw_prefill_attention_chunked(
        q, k, v, start, f, n_sink, 0.3, chunk=chunk, with_lse=False
    )
    assert lse is None
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
