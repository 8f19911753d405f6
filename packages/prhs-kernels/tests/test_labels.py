"""prhs_kernels.labels: Double Sparsity's label logits against a float64 einsum over the label
channels, identical on every layout; the probabilities read from a label cache equal those read
from the key rows; bad labels and caches are refused."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.kv import token_locations
from prhs_kernels.labels import label_logits, label_probs

CASES = [([1], 1, 1, 8, 1, 1), ([37, 5], 8, 2, 16, 37, 3), ([20, 1, 64], 4, 4, 8, 70, 8)]
IDS = [f"B{len(c[0])}-T{c[4]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-r{c[5]}" for c in CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "t", "r"), CASES, ids=IDS)
def test_label_logits_match_float64_over_the_label_channels(
    make_kv, layout_name, lens, hq, hkv, d, t, r, dtype
) -> None:
    data = make_kv(lens, hkv, d, dtype=dtype, max_len=t)
    b = len(lens)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(b, hq, d, generator=g).to(dtype)
    labels = torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(b * hkv)])
    labels = labels.view(b, hkv, r)
    scaling = d**-0.5
    got = label_logits(query, data[layout_name], labels, scaling)
    assert got.shape == (b, hkv, hq // hkv, t) and got.dtype == torch.float32
    mask = torch.zeros(b, hkv, d, dtype=torch.float64).scatter_(-1, labels, 1.0)
    q = query.double().view(b, hkv, hq // hkv, d) * mask.unsqueeze(2)
    want = torch.einsum("bhgd,bhtd->bhgt", q, data.keys.double().nan_to_num(0.0)) * scaling
    pos = torch.arange(t).view(1, 1, 1, -1)
    want = want.masked_fill(pos >= data.seq_lens.view(-1, 1, 1, 1), float("-inf"))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    same = label_logits(query, data["contig"], labels, scaling)
    assert torch.equal(got, same)


def test_bad_labels_are_refused(make_kv) -> None:
    data = make_kv([5], 2, 8, max_len=5)
    kv = data["contig"]
    q = torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        label_logits(q, kv, torch.zeros(1, 2, 3), 1.0)
    with pytest.raises(ValueError, match=r"labels must be \[B=1, Hkv=2, r\]"):
        label_logits(q, kv, torch.zeros(1, 1, 3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="1 <= r <= D=8"):
        label_logits(q, kv, torch.zeros(1, 2, 9, dtype=torch.long), 1.0)


@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "t", "r"), CASES, ids=IDS)
def test_label_probs_from_a_label_cache_equal_those_from_the_key_rows(
    make_kv, layout_name, lens, hq, hkv, d, t, r
) -> None:
    data = make_kv(lens, hkv, d, max_len=t)
    kv = data[layout_name]
    b = len(lens)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(b, hq, d, generator=g)
    labels = torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(b * hkv)])
    labels = labels.view(b, hkv, r)
    row_stride = t + 2
    n_loc = b * row_stride if layout_name.startswith("contig") else kv.k_pool.shape[0]
    cache = torch.full((n_loc + 1, hkv, r), float("nan"))  # unused rows must not be read
    loc = token_locations(kv, torch.arange(t).view(1, -1).expand(b, -1), row_stride)
    for bi, n in enumerate(lens):
        lab = labels[bi].unsqueeze(1).expand(-1, n, -1)
        cache[loc[bi, :n]] = data.keys[bi, :, :n].gather(-1, lab).transpose(0, 1)
    want = label_probs(query, kv, labels, d**-0.5)
    got = label_probs(query, kv, labels, d**-0.5, cache=cache, row_stride=row_stride)
    assert got.shape == (b, hkv, t)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    logits = label_logits(query, kv, labels, d**-0.5)
    torch.testing.assert_close(want, torch.softmax(logits, -1).mean(2))


def test_bad_label_caches_are_refused(make_kv) -> None:
    kv = make_kv([5], 2, 8, max_len=5)["contig"]
    q = torch.randn(1, 4, 8)
    lab = torch.zeros(1, 2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="cache must be a tensor"):
        label_probs(q, kv, lab, 1.0, cache=[0.0])
    with pytest.raises(ValueError, match=r"cache must be \[R, Hkv=2, r=3\]"):
        label_probs(q, kv, lab, 1.0, cache=torch.zeros(6, 2, 4))
    with pytest.raises(TypeError, match=r"cache dtype torch\.float16 differs"):
        label_probs(q, kv, lab, 1.0, cache=torch.zeros(6, 2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous last dim"):
        label_probs(q, kv, lab, 1.0, cache=torch.zeros(6, 3, 2).transpose(1, 2))
    with pytest.raises(ValueError, match="row_stride must be >= 1"):
        label_probs(q, kv, lab, 1.0, cache=torch.zeros(6, 2, 3), row_stride=0)
