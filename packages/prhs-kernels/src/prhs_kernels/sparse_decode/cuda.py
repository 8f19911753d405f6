"""CUDA path of decode attention for half-precision caches: two batched matmuls that read K
and V in the cache dtype and accumulate in float32 (``bmm(..., out_dtype=float32)``), with no
float32 copy of the keys or values. The probabilities enter the second product in the cache
dtype (bf16/fp16), so the output matches the float32 reference to bf16 operand precision.

Tested against :func:`prhs_kernels.sparse_decode.reference.sparse_decode_attention_reference`
on the GPU. It runs where the Triton kernel does not (``PRHS_KERNELS=torch``, no Triton).
"""

from __future__ import annotations

import torch

from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.selection import Selection
from prhs_kernels.kv.reference import gather_kv_reference

__all__ = ["attend_bmm", "gather_rows", "sparse_decode_attention_bmm"]


def attend_bmm(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    unused: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [B, Hq, D]`` over ``k [B, Hkv, P, D]`` / ``v [B, Hkv, P, Dv]``
    except the entries ``unused [B, Hkv, 1, P]``: ``(out [B, Hq, Dv], lse [B, Hq])``."""
    b, hq, d = query.shape
    h, p = k.shape[1], k.shape[2]
    g = hq // h
    q = query.reshape(b * h, g, d)
    kt = k.reshape(b * h, p, d).transpose(1, 2)
    logits = torch.bmm(q, kt, out_dtype=torch.float32).view(b, h, g, p) * scaling
    logits = logits.masked_fill(unused, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    empty = unused.all(-1)  # [B, Hkv, 1]
    w = torch.exp(logits - torch.where(empty, 0.0, lse).unsqueeze(-1)).masked_fill(unused, 0.0)
    out = torch.bmm(
        w.to(v.dtype).view(b * h, g, p), v.reshape(b * h, p, -1), out_dtype=torch.float32
    )
    return out.view(b, hq, -1).to(query.dtype), lse.view(b, hq)


def gather_rows(kv: KVLayout, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows at ``positions [B, Hkv, P]`` by ``index_select`` on the flattened storage
    (one vectorised gather per tensor). A position that does not exist reads the row of
    position 0 of its sequence instead of zeros: every caller masks those entries' logits, so
    their (finite) values get weight 0."""
    b, h, p = positions.shape
    pos = torch.where(positions >= 0, positions, 0).long()
    heads = torch.arange(h, device=pos.device).view(1, h, 1)
    if isinstance(kv, ContiguousKV):
        if kv.start is not None:
            pos = pos + kv.start.view(b, 1, 1).long()
        pos = pos.clamp(0, kv.max_len - 1)
        rows = torch.arange(b, device=pos.device).view(b, 1, 1)
        flat = (rows * h + heads) * kv.max_len + pos
        k_src, v_src = kv.k, kv.v
    else:
        slot = kv.req_to_token[kv.req_pool_indices.long().view(b, 1, 1), pos].long()
        flat = slot.clamp(0, kv.num_slots - 1) * h + heads
        k_src, v_src = kv.k_pool, kv.v_pool
    idx = flat.view(-1)
    k = k_src.reshape(-1, k_src.shape[-1]).index_select(0, idx).view(b, h, p, -1)
    v = v_src.reshape(-1, v_src.shape[-1]).index_select(0, idx).view(b, h, p, -1)
    return k, v


def sparse_decode_attention_bmm(
    query: torch.Tensor, kv: KVLayout, selection: Selection | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher's CUDA path: a dense step on a contiguous unpadded cache reads the cache in
    place; otherwise the selected rows are gathered first."""
    if selection is None and isinstance(kv, ContiguousKV) and kv.start is None:
        t = kv.max_len
        pos = torch.arange(t, device=query.device, dtype=torch.int32)
        unused = (pos.view(1, 1, 1, -1) >= kv.seq_lens.view(-1, 1, 1, 1)).expand(
            kv.batch_size, kv.num_kv_heads, 1, t
        )
        return attend_bmm(query, kv.k, kv.v, unused, scaling)
    if selection is None:
        t = torch.arange(kv.max_len, device=query.device)
        pos = torch.where(t.view(1, 1, -1) < kv.seq_lens.view(-1, 1, 1), t, -1)
        pos = pos.expand(kv.batch_size, kv.num_kv_heads, -1)
    else:
        pos = selection.positions(kv.seq_lens)
    storage = (kv.k, kv.v) if isinstance(kv, ContiguousKV) else (kv.k_pool, kv.v_pool)
    if all(t.is_contiguous() for t in storage):
        k, v = gather_rows(kv, pos)
    else:  # a strided view: reshape would copy the whole cache, so gather by indexing
        k, v = gather_kv_reference(kv, pos)  # type: ignore[assignment]
        assert v is not None
    return attend_bmm(query, k, v, (pos < 0).unsqueeze(2), scaling)
