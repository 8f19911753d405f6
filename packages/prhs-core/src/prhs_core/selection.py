"""What a selector returns for one decode step: the positions each (sequence, KV head) reads.

Selections are index lists, not masks: hosts and kernels read only what is listed. A list is
padded with ``-1`` to a common length ``K`` across the batch and heads, so one tensor serves a
batch of sequences of different lengths. With ``block_size = s > 1`` the entries are block ids:
block ``j`` covers positions ``[j*s, (j+1)*s)`` clipped to the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core._checks import check_bool_mask, check_index_tensor, check_int

__all__ = ["Selection", "StepStats"]


@dataclass(frozen=True)
class StepStats:
    """Per-step statistics of one layer's selection, per (sequence, KV head).

    Attributes
    ----------
    retrieved:
        ``[B, Hkv]`` bool: this decision scored every cached key (a "retrieval"); ``False`` for
        reuse (CIS) and for selectors that never score all keys. ``ρ̂`` is its mean, in %.
    num_selected:
        ``[B, Hkv]`` int64: positions read by attention after block expansion and clipping.
    delta_hat:
        ``[B, Hkv]`` certified upper bound on the dropped mass (SPEC §2.5), or ``None`` when the
        selector certifies nothing.
    proxy_bytes:
        ``[B, Hkv]`` bytes of keys, proxies or metadata read to *make* the selection (a retrieval
        reads every cached key); ``None`` means zero.
    """

    retrieved: torch.Tensor
    num_selected: torch.Tensor
    delta_hat: torch.Tensor | None = None
    proxy_bytes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.retrieved, torch.Tensor) or self.retrieved.ndim != 2:
            raise ValueError("retrieved must be a [B, Hkv] bool tensor")
        shape = tuple(self.retrieved.shape)
        check_bool_mask("retrieved", self.retrieved, shape)
        check_index_tensor("num_selected", self.num_selected, ndim=2)
        for name in ("num_selected", "delta_hat", "proxy_bytes"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} must have the shape of retrieved {list(shape)}, got {list(t.shape)}"
                )

    def bytes_read(
        self, *, head_dim: int, value_dim: int | None = None, element_size: int = 2
    ) -> torch.Tensor:
        """``[B]`` bytes read this step: selected K and V rows plus proxy/metadata bytes.

        ``element_size`` is the cache dtype's size in bytes (2 for bf16/fp16).
        """
        check_int("head_dim", head_dim, minimum=1)
        check_int("element_size", element_size, minimum=1)
        dv = head_dim if value_dim is None else check_int("value_dim", value_dim, minimum=1)
        kv = self.num_selected.to(torch.float64) * float((head_dim + dv) * element_size)
        if self.proxy_bytes is not None:
            kv = kv + self.proxy_bytes.to(torch.float64)
        return kv.sum(dim=1)


@dataclass(frozen=True)
class Selection:
    """The KV positions (or ``s``-blocks) each (sequence, KV head) reads at one decode step.

    Attributes
    ----------
    indices:
        ``[B, Hkv, K]`` int64 logical positions (``block_size == 1``) or block ids, unique per
        row, in any order, padded with ``-1``. ``None`` means every cached position (dense).
    block_size:
        ``s``; entries of ``indices`` are block ids when ``s > 1``.
    stats:
        Per-step statistics, or ``None`` when the host did not ask for them.
    """

    indices: torch.Tensor | None
    block_size: int = 1
    stats: StepStats | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, minimum=1)
        if self.indices is not None:
            check_index_tensor("indices", self.indices, ndim=3)

    @property
    def is_dense(self) -> bool:
        """True when every cached position is read."""
        return self.indices is None

    @classmethod
    def from_mask(cls, mask: torch.Tensor, *, stats: StepStats | None = None) -> Selection:
        """Build a token-granular selection from a ``[B, Hkv, T]`` bool mask."""
        if not isinstance(mask, torch.Tensor) or mask.ndim != 3:
            raise ValueError("mask must be a [B, Hkv, T] bool tensor")
        check_bool_mask("mask", mask, tuple(mask.shape))
        width = int(mask.sum(-1).max()) if mask.numel() else 0
        # Stable sort puts selected positions first, in increasing order.
        order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[..., :width]
        keep = torch.gather(mask, -1, order)
        return cls(torch.where(keep, order, -1), 1, stats)

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, K*s]`` token positions, ``-1`` for padding and positions past the end."""
        if self.indices is None:
            raise ValueError("a dense selection has no index list; use to_mask()")
        check_index_tensor("seq_lens", seq_lens, ndim=1)
        idx = self.indices.to(torch.long)
        s = self.block_size
        if s > 1:
            offs = torch.arange(s, device=idx.device)
            pos = (idx.unsqueeze(-1) * s + offs).flatten(-2)
            pos = torch.where(idx.unsqueeze(-1).expand(*idx.shape, s).flatten(-2) >= 0, pos, -1)
        else:
            pos = idx
        return torch.where(pos < seq_lens.view(-1, 1, 1).to(pos.device), pos, -1)

    def to_mask(self, seq_lens: torch.Tensor, max_seq_len: int, num_kv_heads: int) -> torch.Tensor:
        """``[B, Hkv, max_seq_len]`` bool mask of the positions read."""
        check_index_tensor("seq_lens", seq_lens, ndim=1)
        b = seq_lens.shape[0]
        t = torch.arange(max_seq_len, device=seq_lens.device)
        valid = (t.view(1, 1, -1) < seq_lens.view(-1, 1, 1)).expand(b, num_kv_heads, -1)
        if self.indices is None:
            return valid.clone()
        if self.indices.shape[:2] != (b, num_kv_heads):
            raise ValueError(
                f"indices must have shape [B={b}, Hkv={num_kv_heads}, K], "
                f"got {list(self.indices.shape)}"
            )
        pos = self.positions(seq_lens)
        mask = torch.zeros(b, num_kv_heads, max_seq_len + 1, dtype=torch.bool, device=pos.device)
        mask.scatter_(-1, torch.where(pos >= 0, pos.clamp(max=max_seq_len), max_seq_len), True)
        return mask[..., :max_seq_len] & valid
