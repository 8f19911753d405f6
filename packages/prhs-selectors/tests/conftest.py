"""Shared test helpers: a batch of sequences decoding, step by step, in either cache layout.

:class:`DecodeSimulator` plays the host of ``docs/architecture.rst`` ("One decode step") for a
toy model with no weights: it holds random logical keys, values and queries for every layer,
builds each step's :class:`~prhs_core.protocols.DecodeStep` over a
:class:`~prhs_core.cache.ContiguousKVCache` (left-padded, as transformers stores it) or a
:class:`~prhs_core.cache.PagedKVCache` (a shuffled token pool, as SGLang stores it), and keeps
the selectors' state pools in step (``create`` at the start, ``append`` after every step).

Tests run with ``--import-mode=importlib``, so this module cannot be imported by name; tests
get the helpers through fixtures:

- ``make_sim``: the :class:`DecodeSimulator` class (call it to build one);
- ``layout``: parametrizes a test over ``"contiguous"`` and ``"paged"``.

Typical use::

    def test_something(make_sim, layout):
        sim = make_sim([40, 23], num_q_heads=4, num_kv_heads=2, head_dim=16, layout=layout)
        sel = selectors.create("h2o", budget=8)
        pool = sim.attach(sel)                    # init_state + pool.create(slots, prompt lens)
        for _ in range(5):
            selection = sel.select(sim.step(layer=0), pool)
            out, lse = sim.attend(0, selection)   # prhs_kernels.sparse_decode_attention
            ref = sim.reference_output(0, selection.to_mask(sim.lengths, sim.max_len, 2))
            sim.advance()                         # pool.append, then the next token's K/V, q

Two simulators built with the same arguments except ``layout`` hold identical logical data, so
a selector must return identical selections on both. Storage that no sequence uses is NaN, so a
read of padding shows up as NaN. Tests may edit ``sim.keys[layer]``, ``sim.values[layer]`` and
``sim.queries[layer]`` in place (logical positions) before calling :meth:`DecodeSimulator.step`:
the cache views are rebuilt from them at every call.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from prhs_core.cache import ContiguousKVCache, KVCacheView, PagedKVCache
from prhs_core.config import AttentionSpec, LayerType
from prhs_core.protocols import DecodeSelector, DecodeStep
from prhs_core.selection import Selection
from prhs_core.state import SequenceStatePool
from prhs_kernels import sparse_decode_attention

LAYOUTS = ("contiguous", "paged")


def softmax64(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in float64, 0 for a row of ``-inf`` (written out: torch's own
    float64 CPU softmax is ~1000x slower than float32's on small rows)."""
    x = logits.double()
    p = torch.exp(x - x.amax(-1, keepdim=True)).nan_to_num(0.0)
    return (p / p.sum(-1, keepdim=True)).nan_to_num(0.0)


class DecodeSimulator:
    """A batch of ``B`` sequences decoding through ``num_layers`` attention layers.

    Parameters
    ----------
    lengths:
        Cached positions of each sequence at the first decode step, the current token included
        (so its prompt is ``lengths[b] - 1`` tokens).
    num_q_heads, num_kv_heads, head_dim:
        ``Hq``, ``Hkv`` and ``D`` of every layer.
    num_layers:
        Layers of the model (``AttentionSpec.num_layers``).
    layout:
        ``"contiguous"`` (left-padded ``[B, Hkv, T, D]``) or ``"paged"`` (token pool).
    max_new_tokens:
        How many times :meth:`advance` may be called.
    dtype:
        Of keys, values and queries.
    seed:
        Seeds the logical data (identical across layouts); the layout's own randomness (left
        padding, pool slots) comes from a second generator.
    slots:
        State-pool slot of each sequence (default ``0 .. B-1``).
    capacity:
        Slots of the pools :meth:`attach` makes (default ``max(slots) + 1``).
    layer_types:
        ``AttentionSpec.layer_types``.
    value_dim:
        ``Dv`` (default ``D``).

    Attributes
    ----------
    spec:
        The model's :class:`~prhs_core.config.AttentionSpec`.
    lengths:
        ``[B]`` int64 cached positions at the current step (the current token included).
    keys, values:
        Per layer, ``[B, Hkv, M, D]`` logical keys/values (``M = max(lengths) +
        max_new_tokens``); entries ``>= lengths[b]`` are not yet written.
    queries:
        Per layer, ``[B, Hq, D]`` the current step's queries.
    scaling:
        ``1 / sqrt(D)``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        layout: str = "contiguous",
        max_new_tokens: int = 8,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        slots: Sequence[int] | None = None,
        capacity: int | None = None,
        layer_types: tuple[LayerType, ...] | None = None,
        value_dim: int | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.spec = AttentionSpec(num_layers, num_q_heads, num_kv_heads, head_dim, layer_types)
        self.layout = layout
        self.dtype = dtype
        self.lengths = torch.tensor(list(lengths), dtype=torch.long)
        b = self.batch_size = int(self.lengths.shape[0])
        self.max_new_tokens = max_new_tokens
        self.steps_taken = 0
        self.capacity_len = int(self.lengths.max()) + max_new_tokens
        self.slots = torch.arange(b) if slots is None else torch.tensor(list(slots))
        self.pool_capacity = capacity or int(self.slots.max()) + 1
        self.scaling = head_dim**-0.5
        dv = value_dim or head_dim
        self._gen = torch.Generator().manual_seed(seed)
        m = self.capacity_len
        self.keys = [self._randn(b, num_kv_heads, m, head_dim) for _ in range(num_layers)]
        self.values = [self._randn(b, num_kv_heads, m, dv) for _ in range(num_layers)]
        self.queries = [self._randn(b, num_q_heads, head_dim) for _ in range(num_layers)]
        self.pools: list[SequenceStatePool] = []
        # Layout: a storage slot (contiguous) or pool slot (paged) per logical position.
        lay = torch.Generator().manual_seed(seed + 7919)
        if layout == "contiguous":
            # transformers left-pads so every row ends at the same column; add some slack.
            extra = torch.randint(0, 3, (b,), generator=lay)
            self.start = int(self.lengths.max()) - self.lengths + extra
            self._storage_len = int((self.start + self.lengths).max()) + max_new_tokens
        else:
            n_slots = b * m + 7
            self._n_slots = n_slots
            self._table = torch.randperm(n_slots, generator=lay)[: b * m].view(b, m)

    @property
    def max_len(self) -> int:
        """``T = max(lengths)``, the padded length of this step's cache views."""
        return int(self.lengths.max())

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self._gen).to(self.dtype)

    # -- state pools -------------------------------------------------------------------------
    def attach(
        self, selector: DecodeSelector, pool: SequenceStatePool | None = None
    ) -> SequenceStatePool:
        """Start this batch's sequences in ``pool`` (a new pool of ``selector`` by default).

        Calls ``pool.create(slots, lengths - 1)`` (the prompts); :meth:`advance` then appends.
        """
        if pool is None:
            pool = selector.init_state(self.spec, self.pool_capacity, self.capacity_len)
        pool.create(self.slots, self.lengths - 1)
        self.pools.append(pool)
        return pool

    def release(self) -> None:
        """End this batch's sequences in every attached pool (the slots become free)."""
        for pool in self.pools:
            pool.release(self.slots)
        self.pools = []

    # -- one step ----------------------------------------------------------------------------
    def cache(self, layer: int) -> KVCacheView:
        """The layer's cache view at the current step, in this simulator's layout."""
        k, v = self.keys[layer], self.values[layer]
        b, hkv, m, d = k.shape
        t = torch.arange(m)
        used = t.view(1, -1) < self.lengths.view(-1, 1)  # [B, M]
        if self.layout == "contiguous":
            shape = (b, hkv, self._storage_len)
            key = torch.full((*shape, d), float("nan"), dtype=self.dtype)
            value = torch.full((*shape, v.shape[-1]), float("nan"), dtype=self.dtype)
            rows, cols = torch.nonzero(used, as_tuple=True)
            dst = self.start[rows] + cols
            key[rows, :, dst] = k[rows, :, cols]
            value[rows, :, dst] = v[rows, :, cols]
            return ContiguousKVCache(key, value, self.lengths.clone(), self.start.clone())
        key = torch.full((self._n_slots, hkv, d), float("nan"), dtype=self.dtype)
        value = torch.full((self._n_slots, hkv, v.shape[-1]), float("nan"), dtype=self.dtype)
        rows, cols = torch.nonzero(used, as_tuple=True)
        key[self._table[rows, cols]] = k[rows, :, cols]
        value[self._table[rows, cols]] = v[rows, :, cols]
        # Entries past each length are junk that must never be read.
        table = torch.where(used, self._table, -12345)
        return PagedKVCache(key, value, table, self.lengths.clone())

    def step(self, layer: int) -> DecodeStep:
        """The layer's :class:`DecodeStep` at the current step."""
        return DecodeStep(layer, self.queries[layer], self.cache(layer), self.slots, self.scaling)

    def attend(self, layer: int, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Dv], lse [B, Hq])`` of attention over ``selection``."""
        return sparse_decode_attention(
            self.queries[layer], self.cache(layer), selection, self.scaling
        )

    def advance(self, steps: int = 1) -> None:
        """End the step (``pool.append(slots, 1)``), then write each sequence's next token:
        fresh random keys/values at position ``lengths[b]`` of every layer and fresh queries."""
        for _ in range(steps):
            if self.steps_taken >= self.max_new_tokens:
                raise RuntimeError("advance() called more than max_new_tokens times")
            for pool in self.pools:
                pool.append(self.slots, 1)
            rows = torch.arange(self.batch_size)
            for layer in range(self.spec.num_layers):
                k, v = self.keys[layer], self.values[layer]
                k[rows, :, self.lengths] = self._randn(*k[rows, :, 0].shape)
                v[rows, :, self.lengths] = self._randn(*v[rows, :, 0].shape)
                self.queries[layer] = self._randn(*self.queries[layer].shape)
            self.lengths = self.lengths + 1
            self.steps_taken += 1

    # -- brute-force references --------------------------------------------------------------
    def logits(self, layer: int) -> torch.Tensor:
        """``[B, Hq, T]`` float64 logits of the current queries, ``-inf`` past each end."""
        return brute_logits(self.queries[layer], self.keys[layer], self.lengths, self.scaling)

    softmax64 = staticmethod(softmax64)

    def group_probs(self, layer: int) -> torch.Tensor:
        """``[B, Hkv, T]`` float64 group-mean attention probabilities (SPEC.md §1, GQA)."""
        return brute_group_probs(self.logits(layer), self.spec.num_kv_heads)

    def reference_output(self, layer: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, Hq, Dv]`` float64 attention of the current queries over the positions of
        ``mask [B, Hkv, T]`` (every cached position when ``None``)."""
        logits = self.logits(layer)
        _, hq, t = logits.shape
        g = hq // self.spec.num_kv_heads
        if mask is not None:
            logits = logits.masked_fill(~mask[..., :t].repeat_interleave(g, dim=1), float("-inf"))
        p = softmax64(logits)
        v = self.values[layer][:, :, :t].double().repeat_interleave(g, dim=1)
        return torch.einsum("bht,bhtd->bhd", p, v)


def brute_logits(
    query: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``[B, Hq, T]`` float64 logits (``T = max(lengths)``), query head ``h`` against KV head
    ``h // g``, ``-inf`` past each length. ``query [B, Hq, D]``, ``keys [B, Hkv, >=T, D]``."""
    hq, hkv = query.shape[1], keys.shape[1]
    t = int(lengths.max())
    k = keys[:, :, :t].double().repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", query.double(), k) * scaling
    pad = torch.arange(t).view(1, 1, -1) >= lengths.view(-1, 1, 1)
    return logits.masked_fill(pad, float("-inf"))


def brute_group_probs(logits: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hkv, T]``: the mean over each group of its heads' softmax of ``logits [B, Hq, T]``."""
    b, hq, t = logits.shape
    p = softmax64(logits)
    return p.view(b, num_kv_heads, hq // num_kv_heads, t).mean(2)


@pytest.fixture
def make_sim() -> type[DecodeSimulator]:
    """The :class:`DecodeSimulator` class: ``make_sim(lengths, num_q_heads=..., ...)``."""
    return DecodeSimulator


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    """Each cache layout in turn: ``"contiguous"`` and ``"paged"``."""
    return request.param
