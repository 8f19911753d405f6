"""RaBitQ for keys: 1-bit codes packed eight to a byte, a 4-bit query, an unbiased estimator.

:func:`quantize_keys` turns keys into codes and one float per key; :func:`estimate_inner`
estimates the query–key inner products from them (:mod:`.reference` states the maths). The
torch reference is the only path so far.
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_float_tensor
from prhs_kernels.rabitq.reference import (
    estimate_inner,
    pack_bits,
    quantize_keys_reference,
    quantize_query,
    random_rotation,
    unpack_signs,
)

__all__ = [
    "estimate_inner",
    "pack_bits",
    "quantize_keys",
    "quantize_query",
    "random_rotation",
    "unpack_signs",
]


def quantize_keys(
    keys: torch.Tensor, centroid: torch.Tensor, rotation: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., D/8] uint8, factor [...] float32)`` of ``keys [..., D]`` around
    ``centroid`` (broadcast) under the orthogonal ``rotation [D, D]``; ``D`` a multiple of 8."""
    check_float_tensor("keys", keys, min_ndim=1)
    d = keys.shape[-1]
    if d % 8:
        raise ValueError(
            f"RaBitQ packs 8 bits a byte: the head dim must be a multiple of 8, got {d}"
        )
    if tuple(rotation.shape) != (d, d):
        raise ValueError(f"rotation must be [D, D] = [{d}, {d}], got {list(rotation.shape)}")
    return quantize_keys_reference(keys, centroid, rotation)
