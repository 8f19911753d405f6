"""CompKV's block estimates and compensation on their Triton path against the torch reference,
under Triton's interpreter (run by ``../test_triton.py``): random side-cache fields read through
page rows (strided views, NaN in every row no valid block uses, garbage page ids past each row's
end, empty blocks), rows of one position, lengths off the block, GQA 1 / 4 / 8, D not a power
of two, more blocks than one compensation split."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.compkv import (
    block_compensation,
    block_compensation_reference,
    block_estimates,
    block_estimates_reference,
    compkv_path,
)

# A block whose logit variance is 0 has log 0 = -inf, in both paths, by design.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


# (lens, Hq, Hkv, D, block size)
CASES = [
    ([1], 4, 4, 16, 16),  # a row of one position, GQA 1
    ([37, 5, 1], 8, 2, 16, 4),  # GQA 4, lengths off the block
    ([700, 3], 8, 1, 64, 16),  # GQA 8, more blocks than a tile
    ([50, 33], 6, 2, 24, 8),  # D not a power of two
    ([2100, 9], 4, 2, 16, 4),  # 525 blocks: three compensation splits
]
IDS = [f"T{max(c[0])}-B{len(c[0])}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-b{c[4]}" for c in CASES]


def test_path_rules():
    assert compkv_path("cpu", torch.bfloat16) == "triton-interpreter"
    assert compkv_path("cpu", torch.float32) == "torch"


@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "p"), CASES, ids=IDS)
def test_block_kernels_match_the_reference(lens, hq, hkv, d, p):
    gen = torch.Generator().manual_seed(sum(lens) + d)
    b, t = len(lens), max(lens)
    nb = -(-t // p)
    rows = b * nb + 3
    # Two-layer fields, layer 1 used (strided views); every row starts as NaN.
    ksum = torch.full((rows, 2, hkv, d), float("nan"))
    ksq, vsum = ksum.clone(), ksum.clone()
    count = torch.full((rows, 2), float("nan"))
    perm = torch.randperm(rows - 1, generator=gen)
    pages = torch.randint(-9, 1 << 20, (b, nb), generator=gen)  # garbage past each end
    for i, n in enumerate(lens):
        for j in range(-(-n // p)):
            r = int(perm[i * nb + j])
            pages[i, j] = r
            m = min(p, n - j * p)
            k = torch.randn(m, hkv, d, generator=gen) + torch.randn(1, hkv, d, generator=gen)
            ksum[r, 1], ksq[r, 1] = k.sum(0), (k * k).sum(0)
            vsum[r, 1] = torch.randn(hkv, d, generator=gen) * m
            count[r, 1] = float(m) if (i + j) % 5 else 0.0  # some blocks hold no key
    q = torch.randn(b, hq, d, generator=gen)
    seq = torch.tensor(lens, dtype=torch.int32)
    fields = (ksum[:, 1], ksq[:, 1], count[:, 1], pages, seq)
    got = block_estimates(q, *fields, block_size=p, scaling=d**-0.5, kv_dtype=torch.bfloat16)
    want = block_estimates_reference(q, *fields, p, d**-0.5)
    for x, y in zip(got, want, strict=True):
        assert x.shape == y.shape == (b, hkv, hq // hkv, nb)
        assert torch.equal(torch.isneginf(x), torch.isneginf(y))
        fin = torch.isfinite(y)
        torch.testing.assert_close(x[fin], y[fin], rtol=1e-5, atol=1e-5)
    w = torch.rand(b, hkv, hq // hkv, nb, generator=gen)
    args = (w, vsum[:, 1], count[:, 1], pages, seq)
    out = block_compensation(*args, block_size=p, kv_dtype=torch.bfloat16)
    ref = block_compensation_reference(*args, p)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
