"""prhs_kernels.rabitq: bit packing, the rotation, the estimator's unbiasedness over seeds, the
integer form of the 4-bit query, and the logits read from side-cache fields on every layout."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_kernels.kv import token_locations
from prhs_kernels.rabitq import (
    estimate_inner,
    estimate_logits,
    pack_bits,
    quantize_keys,
    quantize_query,
    query_codes,
    rabitq_logits,
    random_rotation,
    unpack_signs,
)


def test_bits_pack_eight_to_a_byte_and_unpack_to_signs() -> None:
    g = torch.Generator().manual_seed(0)
    bits = torch.rand(5, 3, 64, generator=g) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 8)
    assert torch.equal(unpack_signs(packed), bits.float() * 2 - 1)


@pytest.mark.parametrize("shape", [(1, 8), (5, 3, 64), (2, 4, 37, 128)], ids=str)
def test_numba_packing_is_the_references_bytes(shape) -> None:
    ln = pytest.importorskip("prhs_kernels.rabitq.numba")
    g = torch.Generator().manual_seed(sum(shape))
    bits = torch.rand(*shape, generator=g) > 0.5
    bits[..., :8] = True  # a full byte (255) and, below, an empty one
    bits[..., -8:] = False
    got = ln.pack_bits_numba(bits)
    assert got.dtype == torch.uint8 and got.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(got, pack_bits(bits))


@pytest.mark.parametrize("forced", [False, True], ids=["auto", "torch"])
def test_quantize_keys_packs_with_numba_on_the_cpu(monkeypatch, caplog, forced) -> None:
    pytest.importorskip("numba")
    import logging

    import prhs_kernels.paths as paths
    import prhs_kernels.rabitq as rabitq

    if forced:
        monkeypatch.setenv("PRHS_KERNELS", "torch")
    else:
        monkeypatch.delenv("PRHS_KERNELS", raising=False)
    monkeypatch.setattr(paths, "_announced", set())
    p, _ = random_rotation(64, 3)
    g = torch.Generator().manual_seed(4)
    keys, centroid = torch.randn(3, 2, 40, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
    with caplog.at_level(logging.INFO, logger="prhs_kernels"):
        codes, factor = quantize_keys(keys, centroid, p)
    want_codes, want_factor = rabitq.quantize_keys_reference(keys, centroid, p)
    assert torch.equal(codes, want_codes) and torch.equal(factor, want_factor)
    assert ("quantize_keys runs its numba path on cpu" in caplog.text) is not forced


def test_the_rotation_is_orthogonal_and_seeded() -> None:
    p, u = random_rotation(32, 7)
    torch.testing.assert_close(p @ p.T, torch.eye(32), atol=1e-5, rtol=0)
    assert torch.equal(p, random_rotation(32, 7)[0])
    assert not torch.equal(p, random_rotation(32, 8)[0])
    assert bool(((u >= 0) & (u < 1)).all())


@pytest.mark.parametrize("quantised_query", [False, True], ids=["exact-q", "4bit-q"])
def test_the_estimator_is_unbiased_over_seeded_rotations(quantised_query) -> None:
    """Mean over 2 000 seeds of (estimate - truth) is within 4 standard errors of 0, for a
    query with its 4-bit dithered codes too (the dither is uniform over the seeds)."""
    d, n = 64, 2000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a thread pool costs more than the work
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(6, d, generator=g, dtype=torch.float64) * 2 + 0.5
    query = torch.randn(d, generator=g, dtype=torch.float64)
    truth = keys @ query
    errs = []
    try:
        for seed in range(n):
            p, u = random_rotation(d, seed)
            codes, factor = quantize_keys(keys.float(), torch.zeros(d), p)
            rotated = (query.float() @ p).view(1, d)
            q_bar = quantize_query(rotated, u) if quantised_query else rotated
            est = estimate_inner(q_bar, codes, factor)[0]
            errs.append(est.double() - truth)
    finally:
        torch.set_num_threads(threads)
    e = torch.stack(errs)  # [n, 6]
    mean, se = e.mean(0), e.std(0) / math.sqrt(n)
    assert bool((mean.abs() < 4 * se + 1e-4).all()), (mean, se)
    # and the error is not trivially zero: each estimate is noisy
    assert bool((e.std(0) > 1e-2).all())


def test_a_key_on_its_centroid_has_factor_zero_and_bad_dims_are_refused() -> None:
    p, _ = random_rotation(16, 0)
    _, factor = quantize_keys(torch.ones(2, 16), torch.ones(16), p)
    assert torch.equal(factor, torch.zeros(2))
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_keys(torch.ones(2, 12), torch.ones(12), torch.eye(12))
    with pytest.raises(ValueError, match="rotation must be"):
        quantize_keys(torch.ones(2, 16), torch.ones(16), torch.eye(8))


def test_the_4bit_query_is_unbiased_in_its_dither() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=g)
    acc = torch.zeros_like(x)
    n = 3000
    for _ in range(n):
        acc += quantize_query(x, torch.rand(32, generator=g))
    scale = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 15
    assert bool(((acc / n - x).abs() < 0.05 * scale).all())


def rabitq_fields(data, name: str, d: int, row_stride: int, gen: torch.Generator):
    """Random side-cache fields of one layer (strided views of two-layer fields) and the
    centroids: ``(codes [R, Hkv, D/8], factor [R, Hkv], cqk [R, Hkv], ck, cq)``."""
    kv = data[name]
    b, hkv = len(data.lens), kv.num_kv_heads
    n_loc = b * row_stride if name.startswith("contig") else kv.k_pool.shape[0]
    codes = torch.randint(0, 256, (n_loc + 1, 2, hkv, d // 8), generator=gen, dtype=torch.uint8)
    factor = torch.rand(n_loc + 1, hkv, 2, generator=gen)
    cqk = torch.randn(n_loc + 1, hkv, generator=gen)
    ck = torch.randn(b, hkv, d, generator=gen)
    cq = torch.randn(b, hkv, d, generator=gen)
    return codes[:, 1], factor[..., 0], cqk, ck, cq


def test_the_integer_query_is_the_dequantised_one() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 32, generator=g)
    ck, cq = torch.randn(2, 2, 32, generator=g), torch.randn(2, 2, 32, generator=g)
    p, u = random_rotation(32, 1)
    code, lo, scale, total, const = query_codes(q, ck, cq, p, u)
    assert bool((code == code.round()).all()) and code.min() >= 0 and code.max() <= 15
    rot = (q.view(2, 2, 3, 32) - cq.unsqueeze(2)) @ p
    q_bar = quantize_query(rot, u).view(2, 6, 32)
    torch.testing.assert_close(lo.unsqueeze(-1) + scale.unsqueeze(-1) * code, q_bar)
    torch.testing.assert_close(total, q_bar.sum(-1), rtol=1e-5, atol=1e-4)
    want = torch.einsum("bhgd,bhd->bhg", q.view(2, 2, 3, 32), ck) - (cq * ck).sum(-1, True)
    torch.testing.assert_close(const, want.view(2, 6))


@pytest.mark.parametrize(("lens", "hq", "hkv", "d"), [([1], 2, 2, 8), ([37, 5, 1], 8, 2, 16)])
def test_logits_from_the_side_cache_are_the_estimates_of_each_position(
    make_kv, layout_name, lens, hq, hkv, d
) -> None:
    data = make_kv(lens, hkv, d)
    kv = data[layout_name]
    b, t = len(lens), max(lens)
    gen = torch.Generator().manual_seed(5)
    row_stride = t + 4
    codes, factor, cqk, ck, cq = rabitq_fields(data, layout_name, d, row_stride, gen)
    q = torch.randn(b, hq, d, generator=gen)
    p, u = random_rotation(d, 2)
    got = rabitq_logits(q, kv, codes, factor, cqk, ck, cq, p, u, 0.3, row_stride=row_stride)
    assert got.shape == (b, hkv, hq // hkv, t) and got.dtype == torch.float32
    loc = token_locations(kv, torch.arange(t).view(1, -1).expand(b, -1), row_stride)
    for i, n in enumerate(lens):
        at = loc[i : i + 1, :n]
        want = estimate_logits(
            q[i : i + 1], codes[at], factor[at], cqk[at], ck[i : i + 1], cq[i : i + 1], p, u, 0.3
        )
        torch.testing.assert_close(got[i : i + 1, ..., :n], want)
        assert bool(torch.isneginf(got[i, ..., n:]).all())


def test_bad_side_cache_fields_are_refused(make_kv) -> None:
    data = make_kv([5], 2, 16)
    kv = data["contig"]
    gen = torch.Generator().manual_seed(0)
    codes, factor, cqk, ck, cq = rabitq_fields(data, "contig", 16, 8, gen)
    q = torch.randn(1, 4, 16)
    p, u = random_rotation(16, 0)
    args = dict(codes=codes, factor=factor, cqk=cqk, ck=ck, cq=cq, rotation=p, dither=u)

    def call(**change):
        kw = {**args, **change}
        return rabitq_logits(q, kv, scaling=1.0, row_stride=8, **kw)

    with pytest.raises(TypeError, match="codes must be a uint8 tensor"):
        call(codes=codes.float())
    with pytest.raises(ValueError, match=r"codes must be \[R, Hkv=2, D/8=2\]"):
        call(codes=codes[:, :1])
    with pytest.raises(ValueError, match=r"factor must be float32 \[R=9, Hkv=2\]"):
        call(factor=factor[:3])
    with pytest.raises(ValueError, match=r"ck must be float32 \[B=1, Hkv=2, D=16\]"):
        call(ck=ck.double())
    with pytest.raises(ValueError, match="rotation must be"):
        call(rotation=p[:8])
    with pytest.raises(ValueError, match="row_stride must be >= 1"):
        rabitq_logits(q, kv, scaling=1.0, row_stride=0, **args)
