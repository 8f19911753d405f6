"""KV-cache layouts as plain tensor dataclasses: what the hosts store, as they store it.

A layout holds tensors and static sizes, nothing else: no method copies or gathers. Reading,
scoring and gathering are ops of ``prhs-kernels`` (``prhs_kernels.kv``, ``prhs_kernels.score``)
that take a layout as it is, with a torch reference beside every fast path.

Selectors speak in *logical positions* ``0 .. seq_lens[b] - 1`` of each sequence ``b``; only the
layout knows where a position is stored.

- :class:`ContiguousKV` -- transformers' per-layer cache ``[B, Hkv, T_cap, D]``. Batched
  ``generate()`` left-pads, so sequence ``b`` may start at storage index ``start[b]``.
- :class:`PagedKV` -- SGLang's token pool ``[N, Hkv, D]`` with its request-to-token table:
  position ``t`` of batch row ``b`` lives in pool slot ``req_to_token[req_pool_indices[b], t]``.

At a decode step the current token's key/value is already written, so ``seq_lens`` counts it.

**KV locations.** Metadata that describes keys (Quest's page bounds, H2O's scores, ...) lives in
a *side cache* indexed by the physical location of a key, not by request and position, so it
follows the KV pool (see :class:`prhs_core.state.SideCache`). The location of position ``t`` of
row ``b`` is ``req_to_token[req_pool_indices[b], t]`` for a paged layout and
``b * row_stride + t`` for a contiguous one (``row_stride`` is the side cache's, fixed at
``init_state``). ``prhs_kernels.kv.token_locations`` computes them.

Construction checks shapes and dtypes only (free, no device value read). :meth:`check_values`
checks lengths and table entries on the host: for set-up and for a plan's checked mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.checks import (
    check_float_tensor,
    check_in_range,
    check_index_tensor,
    check_int,
    check_shape,
    shape_str,
)

__all__ = ["ContiguousKV", "KVLayout", "PagedKV"]


def _check_int32_lens(name: str, t: torch.Tensor, batch: int) -> None:
    check_index_tensor(name, t, ndim=1)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (what kernels index with), got {t.dtype}")
    check_shape(name, t, (batch,), "[B]")


@dataclass(frozen=True)
class ContiguousKV:
    """A per-layer contiguous cache, as transformers stores it.

    Attributes
    ----------
    k:
        ``[B, Hkv, T_cap, D]`` keys.
    v:
        ``[B, Hkv, T_cap, Dv]`` values, same dtype as ``k``.
    seq_lens:
        ``[B]`` int32 cached positions per row, the current token included.
    start:
        ``[B]`` int32 storage index of each row's logical position 0 (left padding), or ``None``
        for 0.
    """

    k: torch.Tensor
    v: torch.Tensor
    seq_lens: torch.Tensor
    start: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_float_tensor("k", self.k, ndim=4)
        check_float_tensor("v", self.v, ndim=4)
        if self.k.shape[:3] != self.v.shape[:3]:
            raise ValueError(
                f"k [B, Hkv, T_cap, D] and v [B, Hkv, T_cap, Dv] must agree on B, Hkv and T_cap, "
                f"got {shape_str(self.k)} and {shape_str(self.v)}"
            )
        if self.k.dtype != self.v.dtype:
            raise TypeError(f"k and v must share a dtype, got {self.k.dtype} and {self.v.dtype}")
        _check_int32_lens("seq_lens", self.seq_lens, self.k.shape[0])
        if self.start is not None:
            _check_int32_lens("start", self.start, self.k.shape[0])

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def value_dim(self) -> int:
        return self.v.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def max_len(self) -> int:
        """Static upper bound of ``seq_lens``: ``T_cap`` (from the shape, not from values)."""
        return self.k.shape[2]

    def check_values(self) -> None:
        """Check ``0 <= start``, ``1 <= seq_lens`` and ``start + seq_lens <= T_cap`` on the host."""
        t = self.max_len
        start = self.start if self.start is not None else torch.zeros_like(self.seq_lens)
        check_in_range("start", start, 0, t, f"storage indices of a cache of T_cap={t}")
        check_in_range(
            "seq_lens", self.seq_lens, 1, t - start, "a decode step caches 1 to T_cap - start"
        )


@dataclass(frozen=True)
class PagedKV:
    """One layer of a token pool addressed through a request-to-token table, as SGLang stores it.

    Attributes
    ----------
    k_pool:
        ``[N, Hkv, D]`` the layer's key buffer (SGLang's ``k_buffer[layer]``).
    v_pool:
        ``[N, Hkv, Dv]``.
    req_to_token:
        ``[R, M]`` int32: pool slot of each position of each request slot.
    req_pool_indices:
        ``[B]`` int32 or int64: the request slot of each batch row.
    seq_lens:
        ``[B]`` int32 cached positions per row, the current token included.
    page_size:
        Slots per page of the pool (SGLang's ``--page-size``, ``>= 1``): a page's slots are
        ``[p * page_size, (p + 1) * page_size)`` and hold consecutive positions of one request,
        the first of them page-aligned.
    max_len_hint:
        Static upper bound of ``seq_lens`` (SGLang's ``max_context_len``, or the longest length of
        the batch when the host knows it); ``M`` when ``None``. It fixes the shapes of a step
        (:attr:`max_len`).
    """

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int = 1
    max_len_hint: int | None = None

    def __post_init__(self) -> None:
        check_float_tensor("k_pool", self.k_pool, ndim=3)
        check_float_tensor("v_pool", self.v_pool, ndim=3)
        if self.k_pool.shape[:2] != self.v_pool.shape[:2]:
            raise ValueError(
                f"k_pool [N, Hkv, D] and v_pool [N, Hkv, Dv] must agree on N and Hkv, "
                f"got {shape_str(self.k_pool)} and {shape_str(self.v_pool)}"
            )
        if self.k_pool.dtype != self.v_pool.dtype:
            raise TypeError(
                f"k_pool and v_pool must share a dtype, got {self.k_pool.dtype} and "
                f"{self.v_pool.dtype}"
            )
        check_index_tensor("req_to_token", self.req_to_token, ndim=2)
        if self.req_to_token.dtype != torch.int32:
            raise TypeError(f"req_to_token must be int32, got {self.req_to_token.dtype}")
        check_index_tensor("req_pool_indices", self.req_pool_indices, ndim=1)
        _check_int32_lens("seq_lens", self.seq_lens, self.req_pool_indices.shape[0])
        check_int("page_size", self.page_size, minimum=1)
        if self.max_len_hint is not None:
            check_int("max_len_hint", self.max_len_hint, minimum=1)
            if self.max_len_hint > self.req_to_token.shape[1]:
                raise ValueError(
                    f"max_len_hint ({self.max_len_hint}) must be <= the width of req_to_token "
                    f"({self.req_to_token.shape[1]})"
                )

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pool.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_pool.shape[2]

    @property
    def value_dim(self) -> int:
        return self.v_pool.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pool.dtype

    @property
    def device(self) -> torch.device:
        return self.k_pool.device

    @property
    def num_slots(self) -> int:
        """``N``, the pool's token slots."""
        return self.k_pool.shape[0]

    @property
    def max_len(self) -> int:
        """Static upper bound of ``seq_lens`` (``max_len_hint``, else the table's width)."""
        return self.max_len_hint if self.max_len_hint is not None else self.req_to_token.shape[1]

    def check_values(self) -> None:
        """Check request slots, lengths and every used table entry on the host."""
        if self.req_to_token.device.type == "meta":
            return  # no values to check (and boolean indexing has no meta kernel)
        r, m = self.req_to_token.shape
        check_in_range("req_pool_indices", self.req_pool_indices, 0, r - 1, "request slots")
        check_in_range(
            "seq_lens", self.seq_lens, 1, self.max_len, "a decode step caches 1 to max_len"
        )
        rows = self.req_to_token[self.req_pool_indices.long()]
        used = torch.arange(m, device=rows.device).view(1, -1) < self.seq_lens.view(-1, 1)
        check_in_range(
            "req_to_token (used entries)", rows[used], 0, self.num_slots - 1, "pool slots"
        )


KVLayout = ContiguousKV | PagedKV
"""Either layout; every prhs op takes both."""
