"""CUDA path of decode attention for half-precision caches: two batched matmuls that read K
and V in the cache dtype and accumulate in float32 (``bmm(..., out_dtype=float32)``), with no
float32 copy of the keys or values. The probabilities enter the second product in the cache
dtype (bf16/fp16), so the output matches the float32 reference to bf16 operand precision.

Tested against :func:`prhs_kernels.sparse_decode.reference.sparse_decode_attention_reference`
on the GPU; the Triton kernel (one read of each selected row, split-K, no gather) replaces it.
"""

from __future__ import annotations

import torch

from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.selection import Selection
from prhs_kernels.kv.reference import gather_kv_reference
from prhs_kernels.score.cuda import bmm_out_dtype_available

__all__ = ["attend_bmm", "sparse_decode_attention_bmm", "supports_bmm"]


def supports_bmm(query: torch.Tensor, kv: KVLayout) -> bool:
    """Whether the ``bmm`` path applies: CUDA, a half-precision cache, and a torch with
    ``bmm(..., out_dtype=)``."""
    return (
        query.device.type == "cuda"
        and kv.dtype in (torch.float16, torch.bfloat16)
        and bmm_out_dtype_available("cuda")
    )


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
    k, v = gather_kv_reference(kv, pos)
    assert v is not None
    return attend_bmm(query, k, v, (pos < 0).unsqueeze(2), scaling)
