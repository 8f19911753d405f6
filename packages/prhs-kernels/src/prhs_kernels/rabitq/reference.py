"""Torch reference of RaBitQ for keys: a seeded rotation, 1-bit codes packed eight to a byte,
a 4-bit dithered query and the unbiased inner-product estimator.

For a key ``k`` with centroid ``c_k`` let ``k' = k − c_k`` and ``o = Pᵀ k' / ‖k'‖`` (``P`` a
random orthogonal matrix). The code is ``b = [o > 0]`` (``D`` bits), i.e. the unit vector
``x̄ = (2b − 1)/√D``. For a rotated query ``q_r = Pᵀ q'`` the estimator
``⟨q', k'⟩ ≈ ‖k'‖·⟨q_r, x̄⟩/⟨o, x̄⟩`` is unbiased over the rotation (RaBitQ's theorem).
``factor = ‖k'‖/⟨o, x̄⟩`` is stored per key, so the estimate is ``factor·⟨q_r, x̄⟩``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "estimate_inner",
    "pack_bits",
    "quantize_keys_reference",
    "quantize_query",
    "random_rotation",
    "unpack_signs",
]

QUERY_LEVELS = 15  # 4-bit codes 0..15


def random_rotation(dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P [D, D], dither [D])`` float32 on the CPU from ``seed``: ``P`` Haar-distributed
    orthogonal (QR of a Gaussian matrix, signs fixed by ``R``'s diagonal), ``dither`` uniform in
    ``[0, 1)`` (the 4-bit query's rounding offsets)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    dither = torch.rand(dim, generator=g, dtype=torch.float64)
    return q.float(), dither.float()


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` bool to ``[..., D/8]`` uint8, bit ``j % 8`` of byte ``j // 8`` = ``bits[j]``."""
    d = bits.shape[-1]
    weights = (2 ** torch.arange(8, device=bits.device, dtype=torch.int32)).view(1, 8)
    b = bits.to(torch.int32).reshape(*bits.shape[:-1], d // 8, 8)
    return (b * weights).sum(-1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/8]`` uint8 to ``[..., D]`` float32 ``±1`` (``+1`` for a set bit)."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return (bits.flatten(-2).float() * 2.0) - 1.0


def quantize_keys_reference(
    keys: torch.Tensor, centroid: torch.Tensor, rotation: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., D/8] uint8, factor [...] float32)`` of ``keys [..., D]`` around
    ``centroid`` (broadcast to ``keys``) under ``rotation [D, D]``. A key equal to its centroid
    gets ``factor = 0``."""
    d = keys.shape[-1]
    resid = keys.float() - centroid.float()
    norm = resid.norm(dim=-1)
    o = (resid @ rotation) / norm.clamp_min(1e-30).unsqueeze(-1)  # Pᵀ k' / ‖k'‖ (row form)
    bits = o > 0
    align = o.abs().sum(-1) / math.sqrt(d)  # ⟨o, x̄⟩ > 0 for every non-zero o
    factor = torch.where(norm > 0, norm / align.clamp_min(1e-30), torch.zeros_like(norm))
    return pack_bits(bits), factor


def quantize_query(rotated: torch.Tensor, dither: torch.Tensor) -> torch.Tensor:
    """4-bit dithered quantisation of ``rotated [..., D]`` (float32): per vector, 16 levels from
    its minimum to its maximum, rounded down after adding ``dither [D]``; unbiased when the
    dither is uniform in ``[0, 1)``. Returns the dequantised values."""
    x = rotated.float()
    lo = x.amin(-1, keepdim=True)
    scale = (x.amax(-1, keepdim=True) - lo) / QUERY_LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    code = torch.floor((x - lo) / safe + dither).clamp(0, QUERY_LEVELS)
    return torch.where(scale > 0, lo + code * scale, x)


def estimate_inner(
    query_bar: torch.Tensor, codes: torch.Tensor, factor: torch.Tensor
) -> torch.Tensor:
    """``[..., g, T]`` estimated ``⟨q', k'⟩``: ``factor·⟨q̄_r, x̄⟩`` for the dequantised rotated
    queries ``query_bar [..., g, D]`` and the keys' ``codes [..., T, D/8]`` / ``factor
    [..., T]``."""
    d = query_bar.shape[-1]
    signs = unpack_signs(codes) / math.sqrt(d)  # x̄ [..., T, D]
    ip = torch.einsum("...gd,...td->...gt", query_bar.float(), signs)
    return ip * factor.unsqueeze(-2)
