"""Read-only views of one layer's KV cache, in the layouts the hosts store it.

A selector never sees a host's storage directly: it sees a :class:`KVCacheView`, which speaks in
*logical positions* ``0 .. seq_lens[b] - 1`` of each sequence ``b`` and maps them to storage.

- :class:`ContiguousKVCache` -- transformers' per-layer cache ``[B, Hkv, T, D]``. Batched
  ``generate()`` left-pads, so sequence ``b`` may start at storage index ``start[b]``.
- :class:`PagedKVCache` -- SGLang's token pool ``[num_slots, Hkv, D]`` plus a per-request token
  table (``req_to_token[req_pool_indices]``) mapping logical positions to pool slots.
- Standalone kernels and benchmarks build either one from plain tensors.

At a decode step the current token's key/value is already in the cache, so ``seq_lens`` counts
it: the current token is logical position ``seq_lens[b] - 1``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from prhs_core._checks import check_float_tensor, check_index_tensor

__all__ = ["ContiguousKVCache", "KVCacheView", "PagedKVCache"]


@runtime_checkable
class KVCacheView(Protocol):
    """What a selector may read of one layer's cache for a batch of ``B`` sequences."""

    @property
    def batch_size(self) -> int:
        """``B``, the number of sequences in the batch."""
        ...

    @property
    def num_kv_heads(self) -> int:
        """``Hkv``."""
        ...

    @property
    def head_dim(self) -> int:
        """``D`` of the keys."""
        ...

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[B]`` int64: cached positions per sequence (the current token included)."""
        ...

    @property
    def max_seq_len(self) -> int:
        """``max(seq_lens)`` as a Python int (the padded length of :meth:`keys`)."""
        ...

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at logical ``positions`` ``[B, Hkv, K]``.

        Returns ``([B, Hkv, K, D], [B, Hkv, K, Dv])``; entries whose position is negative or
        ``>= seq_lens[b]`` (padding) come back as zeros.
        """
        ...

    def keys(self) -> torch.Tensor:
        """All cached keys ``[B, Hkv, max_seq_len, D]``, zero past each ``seq_lens[b]``."""
        ...

    def values(self) -> torch.Tensor:
        """All cached values ``[B, Hkv, max_seq_len, Dv]``, zero past each ``seq_lens[b]``."""
        ...

    def valid_mask(self) -> torch.Tensor:
        """``[B, max_seq_len]`` bool: which logical positions exist."""
        ...


class _LogicalKVCache:
    """Shared logic: padding, masking and dense materialisation over :meth:`_gather_storage`."""

    _seq_lens: torch.Tensor
    _max_seq_len: int
    _batch: int
    _hkv: int
    _d: int

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def num_kv_heads(self) -> int:
        return self._hkv

    @property
    def head_dim(self) -> int:
        return self._d

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._seq_lens

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    def _gather_storage(
        self, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_index_tensor("positions", positions, ndim=3)
        if positions.shape[0] != self._batch or positions.shape[1] != self._hkv:
            raise ValueError(
                f"positions must have shape [B={self._batch}, Hkv={self._hkv}, K], "
                f"got {list(positions.shape)}"
            )
        positions = positions.to(torch.long)
        ok = (positions >= 0) & (positions < self._seq_lens.view(-1, 1, 1))
        k, v = self._gather_storage(torch.where(ok, positions, 0))
        # where, not a multiply: a padding entry reads whatever storage holds (NaN * 0 = NaN).
        keep = ok.unsqueeze(-1)
        return torch.where(keep, k, 0), torch.where(keep, v, 0)

    def _all_positions(self) -> torch.Tensor:
        t = torch.arange(self._max_seq_len, device=self._seq_lens.device)
        return t.view(1, 1, -1).expand(self._batch, self._hkv, -1)

    def keys(self) -> torch.Tensor:
        return self.gather(self._all_positions())[0]

    def values(self) -> torch.Tensor:
        return self.gather(self._all_positions())[1]

    def valid_mask(self) -> torch.Tensor:
        t = torch.arange(self._max_seq_len, device=self._seq_lens.device)
        return t.view(1, -1) < self._seq_lens.view(-1, 1)


def _check_lens(seq_lens: torch.Tensor, batch: int) -> torch.Tensor:
    check_index_tensor("seq_lens", seq_lens, ndim=1)
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape [B={batch}], got {list(seq_lens.shape)}")
    return seq_lens.to(torch.long)


class ContiguousKVCache(_LogicalKVCache):
    """A per-layer contiguous cache, as transformers stores it.

    Parameters
    ----------
    key:
        ``[B, Hkv, T, D]``.
    value:
        ``[B, Hkv, T, Dv]``.
    seq_lens:
        ``[B]`` cached positions per sequence; defaults to ``T - start``.
    start:
        ``[B]`` storage index of each sequence's logical position 0 (left padding); default 0.
    check_values:
        Check ``0 <= start`` and ``start + seq_lens <= T`` (one host sync). Hosts that build a
        view per layer per step check once and pass ``False``.
    """

    def __init__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        start: torch.Tensor | None = None,
        *,
        check_values: bool = True,
    ) -> None:
        check_float_tensor("key", key, ndim=4)
        check_float_tensor("value", value, ndim=4)
        if key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"key [B, Hkv, T, D] and value [B, Hkv, T, Dv] must agree on B, Hkv and T, "
                f"got {list(key.shape)} and {list(value.shape)}"
            )
        b, hkv, t, d = key.shape
        if start is None:
            start = torch.zeros(b, dtype=torch.long, device=key.device)
        check_index_tensor("start", start, ndim=1)
        if start.shape[0] != b:
            raise ValueError(f"start must have shape [B={b}], got {list(start.shape)}")
        start = start.to(torch.long)
        seq_lens = t - start if seq_lens is None else _check_lens(seq_lens, b)
        if check_values and b > 0:
            if bool((start < 0).any()) or bool((seq_lens < 0).any()):
                raise ValueError("start and seq_lens must be >= 0")
            if bool((start + seq_lens > t).any()):
                raise ValueError(f"start + seq_lens must be <= T={t} (the cache's length)")
        self.key, self.value, self.start = key, value, start
        self._seq_lens = seq_lens
        self._batch, self._hkv, self._d = b, hkv, d
        self._max_seq_len = int(seq_lens.max()) if b > 0 else 0

    def _gather_storage(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # A row with seq_lens 0 may start at T; its (padding) reads must stay inside storage.
        idx = (positions + self.start.view(-1, 1, 1)).clamp(0, max(self.key.shape[2] - 1, 0))
        k = torch.gather(self.key, 2, idx.unsqueeze(-1).expand(-1, -1, -1, self.key.shape[-1]))
        v = torch.gather(self.value, 2, idx.unsqueeze(-1).expand(-1, -1, -1, self.value.shape[-1]))
        return k, v


class PagedKVCache(_LogicalKVCache):
    """A token-pool cache addressed through a per-request token table, as SGLang stores it.

    Parameters
    ----------
    key_pool:
        ``[num_slots, Hkv, D]`` one layer's key buffer.
    value_pool:
        ``[num_slots, Hkv, Dv]``.
    token_table:
        ``[B, M]`` pool slot of each logical position of each request (``M >= max seq_lens``);
        entries past ``seq_lens[b]`` are never read.
    seq_lens:
        ``[B]`` cached positions per request.
    max_seq_len:
        ``max(seq_lens)`` if the host already knows it on the CPU (avoids a device sync).
    check_values:
        Check lengths and slot ids are in range (host syncs).
    """

    def __init__(
        self,
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        token_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        max_seq_len: int | None = None,
        check_values: bool = True,
    ) -> None:
        check_float_tensor("key_pool", key_pool, ndim=3)
        check_float_tensor("value_pool", value_pool, ndim=3)
        if key_pool.shape[:2] != value_pool.shape[:2]:
            raise ValueError(
                f"key_pool [N, Hkv, D] and value_pool [N, Hkv, Dv] must agree on N and Hkv, "
                f"got {list(key_pool.shape)} and {list(value_pool.shape)}"
            )
        check_index_tensor("token_table", token_table, ndim=2)
        b = token_table.shape[0]
        seq_lens = _check_lens(seq_lens, b)
        if check_values and b > 0:
            if bool((seq_lens < 0).any()) or bool((seq_lens > token_table.shape[1]).any()):
                raise ValueError(
                    f"seq_lens must lie in [0, M={token_table.shape[1]}] (the token table's width)"
                )
            width = torch.arange(token_table.shape[1], device=token_table.device)
            used = token_table[width.view(1, -1) < seq_lens.view(-1, 1)]
            if used.numel() and (bool((used < 0).any()) or bool((used >= key_pool.shape[0]).any())):
                raise ValueError(
                    f"token_table slots in use must lie in [0, {key_pool.shape[0]}) (the pool size)"
                )
        self.key_pool, self.value_pool = key_pool, value_pool
        self.token_table = token_table.to(torch.long)
        self._seq_lens = seq_lens
        self._batch, self._hkv, self._d = b, key_pool.shape[1], key_pool.shape[2]
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if b > 0 else 0
        self._max_seq_len = max_seq_len

    def _gather_storage(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, k = positions.shape
        slots = torch.gather(self.token_table, 1, positions.reshape(b, hkv * k)).view(b, hkv, k)
        # Padding entries were clamped to position 0, whose slot may be unset in an idle row.
        slots = slots.clamp(0, self.key_pool.shape[0] - 1)
        heads = torch.arange(hkv, device=positions.device).view(1, hkv, 1)
        return self.key_pool[slots, heads], self.value_pool[slots, heads]
