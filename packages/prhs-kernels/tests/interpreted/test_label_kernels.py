"""Double Sparsity's label scorer (:func:`prhs_kernels.labels.label_probs`) on its Triton path
against the torch reference, under Triton's interpreter (run by ``../test_triton.py``): label
channels read from the key rows and from a label cache built through every layout's KV
locations; rows of length 1, lengths off the tile, two spans, GQA 1 / 4 / 8, r from 1 to D,
bf16 and fp16."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.kv import token_locations
from prhs_kernels.labels import label_path, label_probs, label_probs_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


def _label_cache(data, name: str, labels: torch.Tensor, gen: torch.Generator):
    """One layer's label cache as a side cache holds it (layer 1 of a two-layer field, a
    strided ``[R, Hkv, r]`` view), built through ``name``'s KV locations; rows no position uses
    hold NaN (a read of one shows). Returns ``(cache, row_stride)``."""
    kv = data[name]
    b, hkv, t, _ = data.keys.shape
    r = labels.shape[-1]
    row_stride = t + 3
    n_loc = b * row_stride if name.startswith("contig") else kv.k_pool.shape[0]
    field = torch.full((n_loc + 1, 2, hkv, r), float("nan"), dtype=data.keys.dtype)
    pos = torch.arange(t).view(1, -1).expand(b, -1)
    loc = token_locations(kv, pos, row_stride)  # [B, T]
    for bi, n in enumerate(data.lens):
        lab = labels[bi].unsqueeze(1).expand(-1, n, -1)  # [Hkv, n, r]
        field[loc[bi, :n], 1] = data.keys[bi, :, :n].gather(-1, lab).transpose(0, 1)
    return field[:, 1], row_stride


# (lens, Hq, Hkv, D, r)
CASES = [
    ([1], 4, 4, 16, 1),  # a row of one position, GQA 1, one label
    ([37, 5, 1], 8, 2, 16, 3),  # GQA 4, lengths off the tile, a row of 1
    ([70, 3], 8, 1, 32, 32),  # GQA 8, every channel a label
    ([600, 61], 4, 1, 64, 8),  # two spans of positions
    ([50, 33], 6, 2, 24, 5),  # D not a power of two
]
IDS = [f"T{max(c[0])}-B{len(c[0])}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-r{c[4]}" for c in CASES]


def test_path_rules():
    assert label_path("cpu", torch.bfloat16) == "triton-interpreter"
    assert label_path("cpu", torch.float32) == "torch"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "r"), CASES, ids=IDS)
def test_label_probs_match_the_reference(make_kv, dtype, lens, hq, hkv, d, r):
    gen = torch.Generator().manual_seed(sum(lens) + r)
    data = make_kv(lens, hkv, d, dtype=dtype, seed=d + r)
    b = len(lens)
    query = torch.randn(b, hq, d, generator=gen).to(dtype)
    labels = torch.stack([torch.randperm(d, generator=gen)[:r] for _ in range(b * hkv)])
    labels = labels.view(b, hkv, r)
    scaling = d**-0.5
    for name, kv in data.layouts.items():
        want = label_probs_reference(query, kv, labels, scaling)
        got = label_probs(query, kv, labels, scaling)
        assert got.shape == (b, hkv, max(lens)) and got.dtype == torch.float32, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        for bi, n in enumerate(lens):
            assert bool((got[bi, :, n:] == 0).all()), name
        cache, row_stride = _label_cache(data, name, labels, gen)
        from_cache = label_probs(query, kv, labels, scaling, cache=cache, row_stride=row_stride)
        torch.testing.assert_close(from_cache, want, rtol=1e-5, atol=1e-6, msg=name)
        # int32 labels shared by every row (a table's expand) read the same.
        shared = labels[:1].expand(b, -1, -1).int()
        got32 = label_probs(query, kv, shared, scaling)
        want32 = label_probs_reference(query, kv, shared.long(), scaling)
        torch.testing.assert_close(got32, want32, rtol=1e-5, atol=1e-6, msg=name)
