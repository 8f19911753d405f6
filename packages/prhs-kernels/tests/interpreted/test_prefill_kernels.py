"""PSAW prefill attention's Triton kernel against its torch reference, under Triton's
interpreter (run by ``../test_triton.py``)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.prefill import psaw_prefill_attention

# (B, Hq, Hkv, Tq, Tk, D, window_fraction, n_sink, left padding)
CASES = [
    (2, 4, 2, 37, 37, 16, 0.5, 4, True),  # GQA 2, left padding, windows and sinks
    (1, 2, 1, 20, 50, 16, 0.3, 2, False),  # a chunk after a cached prefix of 30
    (2, 8, 2, 70, 70, 32, 0.0, 0, True),  # f = 0: plain causal, padded
    (1, 4, 4, 1, 1, 16, 0.5, 4, False),  # one row
    (2, 2, 2, 33, 80, 16, 0.9, 8, False),  # narrow windows: the middle keys are skipped
    (1, 8, 1, 17, 17, 16, 0.6, 40, False),  # sinks wider than the prompt
]
IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-Tq{c[3]}-Tk{c[4]}-f{c[6]}-s{c[7]}" for c in CASES]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "f", "ns", "padded"), CASES, ids=IDS)
def test_matches_the_reference(monkeypatch, b, hq, hkv, tq, tk, d, f, ns, padded, dtype):
    gen = torch.Generator().manual_seed(tq + tk)
    q = torch.randn(b, hq, tq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, tk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, tk, d, generator=gen).to(dtype)
    start = torch.tensor([5 * i for i in range(b)], dtype=torch.int32) if padded else None
    kw = dict(window_fraction=f, n_sink=ns, scaling=d**-0.5, start=start)
    out = torch.full((b, hq, tq, d), float("nan"), dtype=dtype)
    got, lse = psaw_prefill_attention(q, k, v, out=out, **kw)
    assert got is out and not torch.isnan(out).any()
    with monkeypatch.context() as m:
        m.setenv("PRHS_KERNELS", "torch")
        want, want_lse = psaw_prefill_attention(q, k, v, **kw)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    if padded:  # padding rows read nothing
        assert torch.isneginf(lse[1, :, :5]).all() and (got[1, :, :5] == 0).all()
