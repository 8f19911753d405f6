"""prhs_kernels.score: exact logits of every cached key and the largest key norm, against float64
einsums, identical on every layout."""

from __future__ import annotations

import pytest
import torch

import prhs_kernels.score.reference as score_reference
from prhs_kernels.score import chunk_len, max_key_norm, score_keys

# (lens, Hq, Hkv, D, max_len)
CASES = [
    ([1], 1, 1, 8, 1),
    ([37, 5], 8, 2, 16, 37),
    ([20, 1, 64], 4, 4, 8, 70),
    ([9, 30], 8, 1, 32, 33),
]
IDS = [f"B{len(c[0])}-T{c[4]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}" for c in CASES]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACC = {"acc32": torch.float32, "acc64": torch.float64}
# Keys and queries are read exactly in any cache dtype; only the accumulation rounds.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float64: {"rtol": 1e-12, "atol": 1e-12}}


def _query(b, hq, d, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, d, generator=g, dtype=torch.float64).to(dtype)


def _brute_logits(query, data, scaling):
    """float64 ``[B, Hkv, g, T]``: ``scaling · q·k`` from the stored values, ``-inf`` past lens."""
    b, hq, d = query.shape
    hkv = data.keys.shape[1]
    g = hq // hkv
    q = query.double().view(b, hkv, g, d)
    k = data.keys.double().nan_to_num(0.0)
    logits = torch.einsum("bhgd,bhtd->bhgt", q, k) * scaling
    t = torch.arange(data.max_len).view(1, 1, 1, -1)
    return logits.masked_fill(t >= data.seq_lens.view(-1, 1, 1, 1), float("-inf"))


@pytest.mark.parametrize("acc", ACC, ids=list(ACC))
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "t"), CASES, ids=IDS)
def test_score_keys_matches_float64(make_kv, layout_name, lens, hq, hkv, d, t, dtype, acc):
    cache_dtype, acc_dtype = DTYPES[dtype], ACC[acc]
    data = make_kv(lens, hkv, d, dtype=cache_dtype, max_len=t)
    query = _query(len(lens), hq, d, cache_dtype)
    scaling = d**-0.5
    got = score_keys(query, data[layout_name], scaling, dtype=acc_dtype)
    assert got.shape == (len(lens), hkv, hq // hkv, t) and got.dtype == acc_dtype
    want = _brute_logits(query, data, scaling)
    past = torch.isinf(want)
    assert torch.equal(torch.isneginf(got), past)  # -inf exactly past each length, else finite
    assert torch.isfinite(got[~past]).all()
    torch.testing.assert_close(got.double(), want, **TOL[acc_dtype])
    # Bit-identical on every layout.
    same = score_keys(query, data["contig"], scaling, dtype=acc_dtype)
    assert torch.equal(got, same)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_score_keys_chunking(make_kv, layout_name, monkeypatch, dtype):
    """A tiny chunk budget splits the scan into several chunks; the logits do not change."""
    lens, hq, hkv, d, t = [700, 333], 4, 2, 8, 700
    data = make_kv(lens, hkv, d, dtype=DTYPES[dtype], max_len=t)
    kv = data[layout_name]
    query = _query(2, hq, d, DTYPES[dtype])
    whole = score_keys(query, kv, 0.5)
    whole_norm = max_key_norm(kv)
    assert chunk_len(kv) >= t  # one chunk by default
    monkeypatch.setattr(score_reference, "_CHUNK_ELEMENTS", 64)
    assert chunk_len(kv) < t // 2  # three chunks or more
    chunked = score_keys(query, kv, 0.5)
    # Each logit is a dot product over D whatever the chunking; the matrix product's blocking
    # may differ with the chunk's shape, so allow rounding.
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        chunked.double(), _brute_logits(query, data, 0.5), **TOL[torch.float32]
    )
    torch.testing.assert_close(max_key_norm(kv), whole_norm, rtol=1e-6, atol=0)
    assert torch.equal(chunked, score_keys(query, data["contig"], 0.5))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "t"), CASES, ids=IDS)
def test_max_key_norm(make_kv, layout_name, lens, hq, hkv, d, t, dtype):
    data = make_kv(lens, hkv, d, dtype=DTYPES[dtype], max_len=t)
    got = max_key_norm(data[layout_name])
    assert got.shape == (len(lens), hkv) and got.dtype == torch.float32
    want = torch.zeros(len(lens), hkv, dtype=torch.float64)
    for b, n in enumerate(lens):
        want[b] = data.keys[b, :, :n].double().norm(dim=-1).amax(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got, max_key_norm(data["contig"]))


def test_check_query(make_kv):
    data = make_kv([5, 9], 2, 8)
    kv = data["paged1"]
    q = _query(2, 4, 8, torch.float32)
    with pytest.raises(TypeError, match="cast the query"):
        score_keys(q.to(torch.bfloat16), kv, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        score_keys(_query(2, 3, 8, torch.float32), kv, 1.0)
    with pytest.raises(ValueError, match="does not match the cache"):
        score_keys(q[:1], kv, 1.0)
    with pytest.raises(ValueError, match="does not match the cache"):
        score_keys(q[..., :4], kv, 1.0)
    with pytest.raises(ValueError, match="dimensions"):
        score_keys(q[0], kv, 1.0)
    with pytest.raises(TypeError, match="float32 or float64"):
        score_keys(q, kv, 1.0, dtype=torch.float16)
    with pytest.raises(TypeError, match="ContiguousKV or a PagedKV"):
        score_keys(q, object(), 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ContiguousKV or a PagedKV"):
        max_key_norm(object())  # type: ignore[arg-type]


def test_meta_shapes(make_meta_layouts):
    """No value is read on the host: both ops run on ``meta`` tensors."""
    b, hq, hkv, t, d = 2, 8, 2, 40, 16
    for name, kv in make_meta_layouts(b, hkv, t, d, torch.bfloat16).items():
        q = torch.empty(b, hq, d, dtype=torch.bfloat16, device="meta")
        for acc in (torch.float32, torch.float64):
            s = score_keys(q, kv, 0.25, dtype=acc)
            assert (s.shape, s.dtype, s.device.type) == ((b, hkv, 4, t), acc, "meta"), name
        n = max_key_norm(kv)
        assert (n.shape, n.dtype, n.device.type) == ((b, hkv), torch.float32, "meta"), name
