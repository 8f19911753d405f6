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
from collections.abc import Callable

import torch

from prhs_core.layout import KVLayout
from prhs_kernels.kv.reference import token_locations_reference

__all__ = [
    "estimate_inner",
    "estimate_logits",
    "pack_bits",
    "quantize_keys_reference",
    "quantize_query",
    "query_codes",
    "rabitq_logits_reference",
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
    keys: torch.Tensor,
    centroid: torch.Tensor,
    rotation: torch.Tensor,
    *,
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., D/8] uint8, factor [...] float32)`` of ``keys [..., D]`` around
    ``centroid`` (broadcast to ``keys``) under ``rotation [D, D]``. A key equal to its centroid
    gets ``factor = 0``. ``pack``: the bit packing to run (default :func:`pack_bits`; the
    launcher passes its CPU kernel)."""
    d = keys.shape[-1]
    resid = keys.float() - centroid.float()
    norm = resid.norm(dim=-1)
    o = (resid @ rotation) / norm.clamp_min(1e-30).unsqueeze(-1)  # Pᵀ k' / ‖k'‖ (row form)
    bits = o > 0
    align = o.abs().sum(-1) / math.sqrt(d)  # ⟨o, x̄⟩ > 0 for every non-zero o
    factor = torch.where(norm > 0, norm / align.clamp_min(1e-30), torch.zeros_like(norm))
    return (pack_bits if pack is None else pack)(bits), factor


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


def estimate_logits(
    query: torch.Tensor,
    codes: torch.Tensor,
    factor: torch.Tensor,
    cqk: torch.Tensor,
    ck: torch.Tensor,
    cq: torch.Tensor,
    rotation: torch.Tensor,
    dither: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 estimated logits ``s·⟨q, k⟩`` of quantised keys.

    ``query [B, Hq, D]``; per key ``codes [B, T, Hkv, D/8]``, ``factor [B, T, Hkv]`` and
    ``cqk = c_q·k`` ``[B, T, Hkv]``; per (sequence, KV head) the centroids ``ck``, ``cq``
    ``[B, Hkv, D]``. ``⟨q, k⟩ = ⟨q − c_q, k − c_k⟩ + q·c_k + c_q·k − c_q·c_k``, the first term
    estimated by RaBitQ from the 4-bit dithered rotated query ``Pᵀ(q − c_q)``."""
    b, hq, d = query.shape
    h = ck.shape[1]
    q = query.float().view(b, h, hq // h, d)
    rotated = (q - cq.unsqueeze(2)) @ rotation
    q_bar = quantize_query(rotated, dither)
    inner = estimate_inner(q_bar, codes.transpose(1, 2), factor.transpose(1, 2))
    qck = torch.einsum("bhgd,bhd->bhg", q, ck).unsqueeze(-1)
    cqck = (cq * ck).sum(-1).view(b, h, 1, 1)
    return (inner + qck + cqk.transpose(1, 2).unsqueeze(2) - cqck) * scaling


def query_codes(
    query: torch.Tensor,
    ck: torch.Tensor,
    cq: torch.Tensor,
    rotation: torch.Tensor,
    dither: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit query of :func:`estimate_logits` as integers: ``(code [B, Hq, D], lo, scale,
    total, const)``, the last four ``[B, Hq]`` float32, with the dequantised rotated query
    ``q̄ = lo + scale·code`` (``code`` integers 0..15 held in float32), ``total = Σ_j q̄_j`` and
    ``const = q·c_k − c_q·c_k``. Then ``⟨q̄, x̄⟩ = (2·(lo·popcount + scale·⟨code, bits⟩) −
    total)/√D`` for a key's bits: a binary × 4-bit product that is exact in half precision."""
    b, hq, d = query.shape
    h = ck.shape[1]
    q = query.float().view(b, h, hq // h, d)
    x = (q - cq.unsqueeze(2)) @ rotation
    lo = x.amin(-1)
    scale = (x.amax(-1) - lo) / QUERY_LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    code = torch.floor((x - lo.unsqueeze(-1)) / safe.unsqueeze(-1) + dither).clamp(0, QUERY_LEVELS)
    code = torch.where(scale.unsqueeze(-1) > 0, code, torch.zeros_like(code))
    total = lo * d + scale * code.sum(-1)
    const = torch.einsum("bhgd,bhd->bhg", q, ck) - (cq * ck).sum(-1).unsqueeze(-1)
    flat = (b, hq)
    return code.view(b, hq, d), lo.view(flat), scale.view(flat), total.view(flat), const.view(flat)


def rabitq_logits_reference(
    query: torch.Tensor,
    kv: KVLayout,
    codes: torch.Tensor,
    factor: torch.Tensor,
    cqk: torch.Tensor,
    ck: torch.Tensor,
    cq: torch.Tensor,
    rotation: torch.Tensor,
    dither: torch.Tensor,
    scaling: float,
    row_stride: int,
) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 :func:`estimate_logits` of every position ``t < T =
    kv.max_len`` (``-inf`` past each sequence's end), reading one layer's side-cache fields
    ``codes [R, Hkv, D/8]``, ``factor [R, Hkv]``, ``cqk [R, Hkv]`` at each position's KV
    location (:func:`prhs_kernels.kv.token_locations`), a chunk of positions at a time."""
    b, _, d = query.shape
    h, t = kv.num_kv_heads, kv.max_len
    step = max(256, (1 << 24) // max(b * h * d, 1))
    parts = []
    for lo in range(0, t, step):
        hi = min(lo + step, t)
        pos = torch.arange(lo, hi, device=kv.seq_lens.device).view(1, -1).expand(b, -1)
        loc = token_locations_reference(kv, pos, row_stride)  # [B, n]
        at = loc.clamp_min(0)
        est = estimate_logits(
            query, codes[at], factor[at], cqk[at], ck, cq, rotation, dither, scaling
        )
        parts.append(est.masked_fill((loc < 0).view(b, 1, 1, -1), float("-inf")))
    return torch.cat(parts, -1) if len(parts) > 1 else parts[0]
