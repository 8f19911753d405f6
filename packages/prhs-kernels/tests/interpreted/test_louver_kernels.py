"""Louver's cluster scan (:func:`prhs_kernels.louver.cluster_scores`) on its Triton path against
the torch reference, under Triton's interpreter (run by ``../test_triton.py``): strided index
fields read at page rows, GQA 1 / 4 / 8, D not a power of two, S 1 to 8, infinite thresholds,
bf16 and fp16 centres."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.louver import (
    cluster_scores,
    cluster_scores_reference,
    cluster_upper_bounds,
    index_pages,
    index_pages_reference,
    louver_path,
)

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


# --- the index build ------------------------------------------------------------------------

# (B, Hkv, pages, P, D, S)
INDEX_CASES = [
    (1, 1, 1, 4, 16, 1),  # one cluster: no split at all
    (2, 3, 2, 16, 24, 3),  # D not a power of two, several pages and heads
    (2, 2, 1, 256, 64, 4),  # Louver's page of 256 keys
]
INDEX_IDS = [f"B{c[0]}-Hkv{c[1]}-NP{c[2]}-P{c[3]}-D{c[4]}-S{c[5]}" for c in INDEX_CASES]


def _fields(r, h, p, d, s, dtype):
    # Strided views, as a side cache's layer slice is, filled with values a build never writes.
    perm = torch.full((r, 2, h, p), -7, dtype=torch.int16)[:, 1]
    centres = torch.full((r, h, 2, p // 4, d), 9.0).to(dtype)[:, :, 0]
    radii = torch.full((r, h, p // 4, s), 5.0)
    return perm, centres, radii


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("b", "h", "n_pages", "p", "d", "s"), INDEX_CASES, ids=INDEX_IDS)
def test_index_pages_matches_the_reference(dtype, b, h, n_pages, p, d, s):
    gen = torch.Generator().manual_seed(b + p + d)
    keys = torch.randn(b, h, n_pages, p, d, generator=gen)
    keys[0, 0, 0, 1, 2] = float("nan")  # read as 0 by both
    keys[-1, -1, -1, 0, -1] = float("inf")
    keys = keys.to(dtype)
    r = b * n_pages + 3
    rows = torch.randperm(r, generator=gen)[: b * n_pages].view(b, n_pages)
    active = torch.ones(b, dtype=torch.bool)
    if b > 1:
        active[1] = False
    got = _fields(r, h, p, d, s, dtype)
    want = _fields(r, h, p, d, s, dtype)
    index_pages(keys, rows, active, *got)
    index_pages_reference(keys, rows, active, *want)
    perm, centres, radii = got
    assert torch.equal(perm, want[0])
    # The means agree to the rounding of the stored dtype; the radii follow them.
    torch.testing.assert_close(centres.float(), want[1].float(), rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(radii, want[2], rtol=1e-2, atol=1e-2)
    untouched = torch.ones(r, dtype=torch.bool)
    untouched[rows[active].reshape(-1)] = False
    assert bool((perm[untouched] == -7).all()) and bool((radii[untouched] == 5.0).all())
    assert bool((centres[untouched] == 9.0).all())
    # What matters: the written bound is above every member's logit.
    k = torch.where(torch.isfinite(keys.float()), keys.float(), 0.0)
    q = torch.randn(b, h, 5, d, generator=gen) * 3
    for bi in range(b):
        if not active[bi]:
            continue
        for pi in range(n_pages):
            row = rows[bi, pi]
            order = perm[row].long()  # [Hkv, P]
            members = torch.gather(k[bi, :, pi], 1, order.unsqueeze(-1).expand(h, p, d))
            logits = torch.einsum(
                "hgd,hcmd->hgcm", q[bi].double(), members.view(h, -1, 4, d).double()
            )
            ub = cluster_upper_bounds(q[bi], centres[row], radii[row]).double()
            assert bool((ub.unsqueeze(-1) >= logits).all())
