"""Torch reference of compressed keys: 4-bit codes per key with the key's own minimum and step.

A key is coded around a centre ``c`` (one vector per layer and KV head for the whole pool, the
mean of a prompt's keys or one a host pins; 0 when none is given): ``k = k − c`` below. Any
fixed centre gives correct codes, since ``q · c`` is the same for every key of a query head
and no score depends on it; a good one makes them finer (keys share a large common part, e.g.
a projection bias, which would otherwise set every key's range).

A key ``k [D]`` is stored as a row of ``D/2 + 8`` bytes rounded up to a multiple of 16 (80 at
``D = 128``; one row of a side-cache field, at the key's KV location): ``D`` 4-bit codes
``c_j = ⌊(k_j − min_j k) / step + ½⌋``, ``step = (max k − min k) / 15``, two to a byte (byte
``j`` holds channel ``j`` in its low nibble and channel ``j + D/2`` in its high one), then
``min`` and ``step`` as float32, then zeros to the row's end (rows of a multiple of 16 bytes
start on 16-byte boundaries, so a scorer's tiles of rows load as asynchronous 16-byte copies).
The dequantised key is ``k̂_j = min + step·c_j``, so ``|k_j − k̂_j| ≤ step/2`` for every
channel, and a query's estimated logit is ``scaling · (min · Σ_j q_j + step · Σ_j q_j c_j)``.
No centroid or rotation: a row is a function of the key and the pool's centre alone, so keys
shared between requests (a prefix cache) share their codes. A non-finite key is stored as zeros
(its estimate is 0, not NaN).
"""

from __future__ import annotations

import torch

from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_kernels.kv.reference import written_rows

__all__ = [
    "LEVELS",
    "code_bytes",
    "code_key_layout_reference",
    "dequantize_keys_reference",
    "key_center_reference",
    "quantize_keys_reference",
    "write_key_codes_reference",
]

LEVELS = 15
"""The largest 4-bit code: 16 levels from a key's minimum to its maximum."""


def code_bytes(head_dim: int) -> int:
    """Bytes of one key's code row: ``D/2`` code bytes, the float32 minimum and step, and zeros
    to a multiple of 16 bytes."""
    return -(-(head_dim // 2 + 8) // 16) * 16


def quantize_keys_reference(keys: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., code_bytes(D)]`` uint8 code rows of ``keys [..., D]`` (``D`` even) around ``center``
    (float32, broadcast to the keys; ``None``: 0). A key whose values are not all finite gets a
    row of zeros."""
    d = keys.shape[-1]
    x = keys.float()
    finite = torch.isfinite(x).all(-1, keepdim=True)
    if center is not None:
        x = x - center.float()
    x = torch.where(finite, x, 0.0)
    lo = x.amin(-1, keepdim=True)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which
    # is not the IEEE quotient the Triton write computes (a last bit differs in a third of rows).
    step = (x.amax(-1, keepdim=True) - lo) / torch.full_like(lo, LEVELS)
    safe = torch.where(step > 0, step, 1.0)
    code = torch.floor((x - lo) / safe + 0.5).clamp(0, LEVELS).to(torch.uint8)
    code = torch.where(step > 0, code, 0)
    packed = code[..., : d // 2] | (code[..., d // 2 :] << 4)
    params = torch.cat([lo, step], -1).contiguous().view(torch.uint8)  # [..., 8]
    pad = packed.new_zeros(*packed.shape[:-1], code_bytes(d) - d // 2 - 8)
    return torch.cat([packed, params, pad], -1)


def dequantize_keys_reference(
    rows: torch.Tensor, head_dim: int, center: torch.Tensor | None = None
) -> torch.Tensor:
    """``[..., D]`` float32 keys ``min + step · code`` (plus ``center``, broadcast, when given)
    of code ``rows [..., code_bytes(D)]`` (uint8)."""
    dh = head_dim // 2
    packed = rows[..., :dh]
    params = rows[..., dh : dh + 8].contiguous().view(torch.float32)  # [..., 2]
    code = torch.cat([packed & 15, packed >> 4], -1).float()
    out = params[..., :1] + params[..., 1:2] * code
    return out if center is None else out + center.float()


def write_key_codes_reference(
    codes: torch.Tensor,
    locations: torch.Tensor,
    key: torch.Tensor,
    columns: torch.Tensor | None,
    finite: torch.Tensor | None,
    nonfinite: torch.Tensor | None,
    center: torch.Tensor | None = None,
) -> None:
    """Write the code rows of the keys a host wrote into one layer's field ``codes [R, Hkv,
    code_bytes(D)]`` (``R − 1`` the scratch row) at ``locations [N]`` (``-1``: none). ``key [N, Hkv,
    D]``, or a cache ``[N, Hkv, T, D]`` read at ``columns [N]`` (a column outside ``[0, T)``:
    not written). ``finite [N]``: which keys are finite (``None``: found here, and the written
    ones that are not counted into ``nonfinite``). A non-finite key's row is zeros. ``center
    [Hkv, D]`` float32: the keys are coded around it."""
    written, key = written_rows(locations, key, columns)  # key: [N, Hkv, D]
    loc = torch.where(written, locations.long(), -1)
    if finite is None:
        finite = torch.isfinite(key).flatten(1).all(-1)
        if nonfinite is not None:
            nonfinite.add_((~finite & (loc >= 0)).sum())
    rows = quantize_keys_reference(key, center)
    rows = torch.where(finite.view(-1, 1, 1), rows, 0)
    scratch = codes.shape[0] - 1
    at = torch.where(loc >= 0, loc, scratch)
    codes[at] = rows.to(codes.device)


def key_center_reference(
    locations: torch.Tensor,
    key: torch.Tensor,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[Hkv, D]`` float32: the mean of the finite keys a write holds (the rows written at a
    location, read at their columns; a key with a non-finite value is left out), 0 when there
    is none -- the centre a pool's codes are taken around, set from its first write."""
    ok, key = written_rows(locations, key, columns)
    x = key.float()
    ok = ok & torch.isfinite(x).flatten(1).all(-1)
    x = torch.where(ok.view(-1, 1, 1), x, 0.0)
    return x.sum(0) / ok.sum().clamp(min=1)


def code_key_layout_reference(
    kv: KVLayout, codes: torch.Tensor, row_stride: int, center: torch.Tensor | None = None
) -> KVLayout:
    """The cache as its dequantised keys, float32: a layout whose keys are ``k̂`` (plus
    ``center [Hkv, D]``; without it, each query head's logits are all off by ``q · c``, which no
    probability sees), whose values are unused copies of them, with the lengths (and table) of
    ``kv``. Scoring it is
    scoring the codes, so every exact scorer serves as the codes' reference. Contiguous:
    position ``t`` of row ``b`` reads location ``b · row_stride + t`` (no left padding);
    paged: the token's slot."""
    d = kv.head_dim
    h = kv.num_kv_heads
    if isinstance(kv, ContiguousKV):
        b, t = kv.batch_size, kv.max_len
        rows = codes[: b * row_stride].view(b, row_stride, h, -1)[:, :t]
        k = dequantize_keys_reference(rows, d, center).transpose(1, 2)  # [B, Hkv, T, D]
        return ContiguousKV(k, k, kv.seq_lens)
    assert isinstance(kv, PagedKV)
    k = dequantize_keys_reference(codes[: kv.num_slots], d, center)
    return PagedKV(
        k, k, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, kv.page_size, kv.max_len_hint
    )
