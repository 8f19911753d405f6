"""What a selector returns for one layer at one decode step: the positions each (sequence, KV
head) reads, as a fixed-width index list plus a count.

A :class:`Selection` is ``indices [B, Hkv, K_max]`` int32 with ``counts [B, Hkv]`` int32: row
``(b, h)`` reads entries ``indices[b, h, :counts[b, h]]``; entries past the count are ignored
(prhs writes ``-1`` there, but no reader relies on it). ``K_max`` is a static function of the
selector's config and never changes between steps, so a step keeps its shapes and can be
captured in a CUDA graph. With ``block_size = s > 1`` the entries are block ids: block ``j``
covers positions ``[j*s, (j+1)*s)`` clipped to the sequence. Index lists, not masks: kernels
read only what is listed. ``None`` in place of a selection means dense: every cached position.

The buffers are owned by the caller (a :class:`~prhs_core.plan.DecodePlan` allocates them once);
a selector writes into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.checks import check_bool_mask, check_index_tensor, check_int, check_shape

__all__ = ["Compensation", "Selection", "StepStats"]


@dataclass(frozen=True)
class StepStats:
    """Per-step statistics of one layer's selection, per (sequence, KV head).

    Opt-in (a plan made with ``stats=True``); written by the selector into these buffers.

    Attributes
    ----------
    retrieved:
        ``[B, Hkv]`` bool: this decision scored every cached key (a "retrieval"); ``False`` for
        a reuse (CIS) and for selectors that never score all keys. ``ρ̂`` is its mean, in %.
    num_selected:
        ``[B, Hkv]`` int32: positions read by attention after block expansion and clipping.
    proxy_bytes:
        ``[B, Hkv]`` float64 bytes of keys, proxies or metadata read to *make* the selection
        (a retrieval reads every cached key).
    delta_hat:
        ``[B, Hkv]`` float32 certified upper bound of the dropped mass, or ``None`` when the
        selector certifies nothing.
    missed:
        ``[B, Hkv]`` bool: a certified retrieval whose own dropped mass is above its target
        (its top-p set was cut by the cap), or ``None`` when the selector certifies nothing.
        Such a decision is no violation (``delta_hat`` is its exact ``δ``), but it is not
        within the target either.
    """

    retrieved: torch.Tensor
    num_selected: torch.Tensor
    proxy_bytes: torch.Tensor
    delta_hat: torch.Tensor | None = None
    missed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.retrieved, torch.Tensor) or self.retrieved.ndim != 2:
            raise ValueError("retrieved must be a [B, Hkv] bool tensor")
        shape = tuple(self.retrieved.shape)
        check_bool_mask("retrieved", self.retrieved, shape)
        check_index_tensor("num_selected", self.num_selected, ndim=2)
        if self.missed is not None:
            check_bool_mask("missed", self.missed, shape)
        for name in ("num_selected", "proxy_bytes", "delta_hat"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} must have the shape of retrieved {list(shape)}, got {list(t.shape)}"
                )

    @classmethod
    def allocate(
        cls, batch_size: int, num_kv_heads: int, device: torch.device | str, *, certified: bool
    ) -> StepStats:
        """Zeroed buffers for ``batch_size`` rows (with ``delta_hat`` and ``missed`` when
        ``certified``)."""
        shape = (batch_size, num_kv_heads)
        return cls(
            torch.zeros(shape, dtype=torch.bool, device=device),
            torch.zeros(shape, dtype=torch.int32, device=device),
            torch.zeros(shape, dtype=torch.float64, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device) if certified else None,
            torch.zeros(shape, dtype=torch.bool, device=device) if certified else None,
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
        return (kv + self.proxy_bytes.to(torch.float64)).sum(dim=1)


@dataclass(frozen=True)
class Compensation:
    """What attention adds for the positions a selection leaves out, per query head: one more
    softmax term with log-mass ``lse`` and value ``out`` (CompKV's block-mean compensation).

    :func:`prhs_kernels.sparse_decode_attention` merges it with the attention over the selected
    positions through their log-sum-exp: with ``(o_s, l_s)`` the selected part,
    ``o = (e^{l_s} o_s + e^{lse} out) / (e^{l_s} + e^{lse})``. ``lse = -inf`` adds nothing.

    Attributes
    ----------
    lse:
        ``[B, Hq]`` float32 log of the compensation's (estimated) softmax mass, in the units of
        the scaled logits.
    out:
        ``[B, Hq, Dv]`` float32 the compensation's value (a weighted mean of value means).
    """

    lse: torch.Tensor
    out: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("lse", "out"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise TypeError(f"compensation {name} must be a float32 tensor")
        if self.lse.ndim != 2 or self.out.ndim != 3 or self.out.shape[:2] != self.lse.shape:
            raise ValueError(
                f"compensation lse must be [B, Hq] and out [B, Hq, Dv], got "
                f"{list(self.lse.shape)} and {list(self.out.shape)}"
            )

    @classmethod
    def allocate(
        cls, batch_size: int, num_q_heads: int, value_dim: int, device: torch.device | str
    ) -> Compensation:
        """Buffers adding nothing (``lse = -inf``, ``out = 0``)."""
        return cls(
            torch.full((batch_size, num_q_heads), float("-inf"), device=device),
            torch.zeros(batch_size, num_q_heads, value_dim, device=device),
        )


@dataclass(frozen=True)
class Selection:
    """The KV positions (or ``s``-blocks) each (sequence, KV head) reads at one decode step.

    Attributes
    ----------
    indices:
        ``[B, Hkv, K_max]`` int32 logical positions (``block_size == 1``) or block ids. Row
        ``(b, h)`` uses its first ``counts[b, h]`` entries, which are distinct; their order is
        unspecified (prhs's own selectors write them ascending).
    counts:
        ``[B, Hkv]`` int32, each in ``[0, K_max]``.
    block_size:
        ``s``; entries are block ids when ``s > 1``.
    stats:
        Per-step statistics, or ``None`` when the plan did not ask for them.
    compensation:
        A :class:`Compensation` attention adds for the positions left out, or ``None`` (the
        positions left out are dropped; every selector but CompKV).
    """

    indices: torch.Tensor
    counts: torch.Tensor
    block_size: int = 1
    stats: StepStats | None = None
    compensation: Compensation | None = None

    def __post_init__(self) -> None:
        check_index_tensor("indices", self.indices, ndim=3)
        if self.indices.dtype != torch.int32:
            raise TypeError(f"indices must be int32, got {self.indices.dtype}")
        check_index_tensor("counts", self.counts, ndim=2)
        if self.counts.dtype != torch.int32:
            raise TypeError(f"counts must be int32, got {self.counts.dtype}")
        check_shape("counts", self.counts, tuple(self.indices.shape[:2]), "[B, Hkv]")
        check_int("block_size", self.block_size, minimum=1)
        if self.compensation is not None:
            if not isinstance(self.compensation, Compensation):
                raise TypeError("compensation must be a Compensation or None")
            if self.compensation.lse.shape[0] != self.indices.shape[0]:
                raise ValueError("compensation must have one row per selection row")

    @classmethod
    def allocate(
        cls,
        batch_size: int,
        num_kv_heads: int,
        width: int,
        block_size: int,
        device: torch.device | str,
        stats: StepStats | None = None,
        compensation: tuple[int, int] | None = None,
    ) -> Selection:
        """Buffers for a selection of static width ``K_max = width`` (indices ``-1``, counts 0);
        ``compensation = (Hq, Dv)``: with :class:`Compensation` buffers too."""
        check_int("width", width, minimum=0)
        comp = None
        if compensation is not None:
            hq, dv = compensation
            check_int("compensation Hq", hq, minimum=1)
            check_int("compensation Dv", dv, minimum=1)
            comp = Compensation.allocate(batch_size, hq, dv, device)
        return cls(
            torch.full((batch_size, num_kv_heads, width), -1, dtype=torch.int32, device=device),
            torch.zeros((batch_size, num_kv_heads), dtype=torch.int32, device=device),
            block_size,
            stats,
            comp,
        )

    @property
    def width(self) -> int:
        """``K_max``, the static width of :attr:`indices`."""
        return self.indices.shape[-1]

    def entry_mask(self) -> torch.Tensor:
        """``[B, Hkv, K_max]`` bool: the entries in use (``k < counts``)."""
        k = torch.arange(self.width, device=self.indices.device, dtype=torch.int32)
        return k.view(1, 1, -1) < self.counts.unsqueeze(-1)

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, K_max * s]`` int64 token positions; ``-1`` for unused entries and for
        positions past each sequence's end."""
        check_index_tensor("seq_lens", seq_lens, ndim=1)
        check_shape("seq_lens", seq_lens, (self.counts.shape[0],), "[B]")
        idx = torch.where(self.entry_mask(), self.indices, -1).to(torch.long)
        s = self.block_size
        if s > 1:
            offs = torch.arange(s, device=idx.device)
            pos = (idx.unsqueeze(-1) * s + offs).flatten(-2)
            pos = torch.where(idx.unsqueeze(-1).expand(*idx.shape, s).flatten(-2) >= 0, pos, -1)
        else:
            pos = idx
        return torch.where(pos < seq_lens.view(-1, 1, 1).to(pos.device), pos, -1)

    def num_tokens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv]`` int32 positions read (blocks expanded and clipped to each length)."""
        return (self.positions(seq_lens) >= 0).sum(-1).to(torch.int32)

    def to_mask(self, seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
        """``[B, Hkv, max_len]`` bool mask of the positions read (for metrics and tests)."""
        check_int("max_len", max_len, minimum=0)
        b, h = self.counts.shape
        pos = self.positions(seq_lens)
        mask = torch.zeros(b, h, max_len + 1, dtype=torch.bool, device=pos.device)
        mask.scatter_(-1, torch.where(pos >= 0, pos.clamp(max=max_len), max_len), True)
        return mask[..., :max_len]

    @classmethod
    def from_mask(cls, mask: torch.Tensor, *, width: int | None = None) -> Selection:
        """A token-granular selection from a ``[B, Hkv, T]`` bool mask, ascending (for tests and
        hosts off the decode path: it reads the widest row's count on the host when ``width``
        is not given)."""
        if not isinstance(mask, torch.Tensor) or mask.ndim != 3:
            raise ValueError("mask must be a [B, Hkv, T] bool tensor")
        check_bool_mask("mask", mask, tuple(mask.shape))
        if width is not None:
            check_int("width", width, minimum=0)
        counts = mask.sum(-1).to(torch.int32)
        if width is None:
            width = int(counts.max()) if counts.numel() else 0
        order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[..., :width]
        keep = torch.gather(mask, -1, order)
        idx = torch.where(keep, order, -1).to(torch.int32)
        if idx.shape[-1] < width:
            idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]), value=-1)
        return cls(idx, counts.clamp(max=width), 1)
