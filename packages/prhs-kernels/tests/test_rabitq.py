"""prhs_kernels.rabitq: bit packing, the rotation, and the estimator's unbiasedness over seeds."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_kernels.rabitq import (
    estimate_inner,
    pack_bits,
    quantize_keys,
    quantize_query,
    random_rotation,
    unpack_signs,
)


def test_bits_pack_eight_to_a_byte_and_unpack_to_signs() -> None:
    g = torch.Generator().manual_seed(0)
    bits = torch.rand(5, 3, 64, generator=g) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 8)
    assert torch.equal(unpack_signs(packed), bits.float() * 2 - 1)


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
