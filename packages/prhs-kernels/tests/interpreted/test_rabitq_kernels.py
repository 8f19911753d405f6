"""RaBitQ's logit estimates (:func:`prhs_kernels.rabitq.rabitq_logits`) on their Triton path
against the torch reference, under Triton's interpreter (run by ``../test_triton.py``): side
caches read through every layout's KV locations, rows of length 1, lengths off the tile, GQA
1 / 4 / 8, D not a power of two, bf16 and fp16."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.rabitq import (
    rabitq_logits,
    rabitq_logits_reference,
    rabitq_path,
    random_rotation,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


# (lens, Hq, Hkv, D)
CASES = [
    ([1], 4, 4, 16),  # a row of one position, GQA 1
    ([37, 5, 1], 8, 2, 16),  # GQA 4, lengths off the tile
    ([130, 3], 8, 1, 64),  # GQA 8, three tiles
    ([50, 33], 6, 2, 24),  # D not a power of two
]
IDS = [f"T{max(c[0])}-B{len(c[0])}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}" for c in CASES]


def test_path_rules():
    assert rabitq_path("cpu", torch.bfloat16) == "triton-interpreter"
    assert rabitq_path("cpu", torch.float32) == "torch"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("lens", "hq", "hkv", "d"), CASES, ids=IDS)
def test_rabitq_logits_match_the_reference(make_kv, dtype, lens, hq, hkv, d):
    gen = torch.Generator().manual_seed(sum(lens) + d)
    data = make_kv(lens, hkv, d, dtype=dtype, seed=d)
    b, t = len(lens), max(lens)
    row_stride = t + 5
    p, u = random_rotation(d, 4)
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    ck = torch.randn(b, hkv, d, generator=gen)
    cq = torch.randn(b, hkv, d, generator=gen)
    for name, kv in data.layouts.items():
        n_loc = b * row_stride if name.startswith("contig") else kv.k_pool.shape[0]
        codes = torch.randint(0, 256, (n_loc + 1, 2, hkv, d // 8), generator=gen)
        codes = codes.to(torch.uint8)[:, 0]  # a strided view, as a side cache holds it
        factor = torch.rand(n_loc + 1, 2, hkv, generator=gen)[:, 1]
        cqk = torch.randn(n_loc + 1, hkv, generator=gen)
        args = (q, kv, codes, factor, cqk, ck, cq, p, u, d**-0.5)
        got = rabitq_logits(*args, row_stride=row_stride)
        want = rabitq_logits_reference(*args, row_stride)
        assert got.shape == (b, hkv, hq // hkv, t) and got.dtype == torch.float32, name
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), name
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5, msg=name)
