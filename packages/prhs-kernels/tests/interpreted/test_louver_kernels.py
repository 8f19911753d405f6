"""Louver's cluster scan (:func:`prhs_kernels.louver.cluster_scores`) on its Triton path against
the torch reference, under Triton's interpreter (run by ``../test_triton.py``): strided index
fields read at page rows, GQA 1 / 4 / 8, D not a power of two, S 1 to 8, infinite thresholds,
bf16 and fp16 centres."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.louver import cluster_scores, cluster_scores_reference, louver_path

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


# (B, Hq, Hkv, D, clusters per page, S, pages)
CASES = [
    (1, 4, 4, 16, 4, 1, 1),  # GQA 1, one subspace, one page
    (3, 8, 2, 16, 8, 4, 5),  # GQA 4, clusters over several tiles
    (2, 8, 1, 64, 64, 8, 3),  # GQA 8, a real page of 256 keys
    (2, 6, 2, 24, 4, 3, 2),  # D not a power of two
]
IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-C{c[4]}-S{c[5]}-NP{c[6]}" for c in CASES]


def test_path_rules():
    assert louver_path("cpu", torch.bfloat16) == "triton-interpreter"
    assert louver_path("cpu", torch.float32) == "torch"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("b", "hq", "hkv", "d", "c", "s", "n_pages"), CASES, ids=IDS)
def test_cluster_scores_match_the_reference(dtype, b, hq, hkv, d, c, s, n_pages):
    gen = torch.Generator().manual_seed(b + d + c)
    r = b * n_pages + 2
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    centres = torch.randn(r, 3, hkv, c, d, generator=gen).to(dtype)[:, 2]
    radii = torch.rand(r, 3, hkv, c, s, generator=gen)[:, 1]
    rows = torch.randperm(r, generator=gen)[: b * n_pages].view(b, n_pages)
    thr = torch.randn(b, hkv, hq // hkv, generator=gen)
    thr[0, 0, 0] = float("-inf")  # no sample: every cluster passes
    args = (q, centres, radii, rows, thr, d**-0.5)
    got = cluster_scores(*args)
    want = cluster_scores_reference(*args)
    assert got.shape == want.shape == (b, hkv, n_pages * c)
    assert torch.equal(torch.isposinf(got), torch.isposinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)
