"""Shared test helpers: a batch of sequences decoding, step by step, in any KV layout.

:class:`DecodeSimulator` plays a host (transformers or SGLang) for a toy model with no weights.
It holds random logical keys, values and queries for every layer and, on the decode contract
of ``prhs_core.protocols``:

- builds each layer's cache as a :class:`~prhs_core.layout.ContiguousKV` (left-padded, as
  transformers stores it) or a :class:`~prhs_core.layout.PagedKV` (a shuffled token pool with
  a request-to-token table, as SGLang stores it; ``"paged16"`` uses page-aligned pages of 16
  slots, so that Quest, whose metadata is per page, runs on a paged layout);
- :meth:`DecodeSimulator.attach` makes a selector's state, creates the batch's slots, writes the
  prompt's K/V through ``selector.write_kv`` and makes a plan;
- :meth:`DecodeSimulator.select` runs ``plan.update`` (once per step) and ``selector.select``;
- :meth:`DecodeSimulator.advance` moves to the next token and writes its K/V through
  ``write_kv`` (the host writes K/V before the step that reads them).

Storage no sequence uses is NaN, so a read of padding shows up as NaN. Each batch row draws its
data from its own generator (seeded by ``seed`` and its ``row_ids`` entry), so two simulators
that share rows hold the same data in them, whatever the other rows and the layout. Every
layout has the same static length ``T_cap``: selections are comparable entry by entry.

Tests may edit ``sim.queries[layer]`` before a select, and ``sim.keys[layer]`` /
``sim.values[layer]`` (logical positions ``[B, Hkv, T_cap, D]``) before :meth:`attach` or at
positions not written yet: the caches are rebuilt from them at every call, but side caches only
see what was written through ``write_kv``.

Tests run with ``--import-mode=importlib``, so this module cannot be imported by name; tests
get the helpers through fixtures: ``make_sim`` (the class), ``layout`` (each layout),
``tools`` (brute-force helpers, :class:`Tools`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import prhs_selectors  # noqa: F401  (registers every selector)
from prhs_core.config import AttentionSpec, LayerType
from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels import sparse_decode_attention, token_locations

LAYOUTS = ("contiguous", "paged", "paged16")

# One small configuration per registered selector (and per mode): what the tests that run every
# selector use. ``(registered name, config fields)``.
SELECTOR_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("dense", {}),
    "oracle": ("oracle", {"budget": 6, "n_sink": 2, "n_local": 4}),
    "oracle-s4": ("oracle", {"budget": 8, "n_sink": 2, "n_local": 4, "block_size": 4}),
    "streaming": ("streaming", {"budget": 6, "n_sink": 2, "n_local": 4}),
    "cis": ("cis", {"budget": 8, "n_sink": 2, "n_local": 4, "block_size": 2, "tau": 0.0}),
    "cis-rescore": (
        "cis",
        {"budget": 8, "n_sink": 2, "n_local": 4, "block_size": 2, "tau": 0.0, "rescore": 6},
    ),
    "cis-reuse": (  # the paper's CIS-8 reuse (Table V): no re-ranking, so anchors keep a union
        "cis",
        {"budget": 8, "n_sink": 2, "n_local": 4, "block_size": 2, "tau": -1.0, "rescore": 0},
    ),
    "cis-random": (
        "cis",
        {
            "budget": 8,
            "n_sink": 2,
            "n_local": 4,
            "block_size": 2,
            "tau": 0.0,
            "rescore": 0,
            "expansion": "random",
        },
    ),
    "cis-certified": (
        "cis",
        {
            "budget": 8,
            "n_sink": 2,
            "n_local": 4,
            "block_size": 2,
            "delta_max": 0.5,
            "k_max": 16,
            "certificate_page": 4,
        },
    ),
    "cis-certified-global": (
        "cis",
        {
            "budget": 8,
            "n_sink": 2,
            "n_local": 4,
            "block_size": 2,
            "delta_max": 0.5,
            "k_max": 16,
            "certificate": "global",
        },
    ),
    "prhs": ("prhs", {"budget": 8, "n_sink": 2, "n_local": 4, "block_size": 1, "tau": 0.0}),
    "psaw": ("psaw", {}),
    "etf": ("etf", {}),
    "h2o": ("h2o", {"budget": 6, "n_sink": 2, "n_local": 4}),
    "quest": ("quest", {"budget": 8, "page_size": 4, "dense_layers": 1, "n_sink": 2, "n_local": 4}),
    "rabitq": (
        "rabitq",
        {"budget": 6, "n_sink": 2, "n_local": 4, "group": 4, "dense_layers": 0, "top_p": 0.8},
    ),
    "louver": (
        "louver",
        {"budget": 8, "n_sink": 2, "n_local": 8, "buffer": 8, "page": 8, "subspaces": 2},
    ),
    "louver-oracle": (
        "louver",
        {
            "budget": 8,
            "n_sink": 2,
            "n_local": 8,
            "buffer": 8,
            "page": 8,
            "threshold": "oracle",
            "oracle_k": 3,
        },
    ),
    "compkv": ("compkv", {"budget": 8, "n_sink": 2, "n_local": 4, "block_size": 4}),
    "double_sparsity": ("double_sparsity", {"budget": 6, "n_sink": 2, "n_local": 4}),
    "hshare": (
        "hshare",
        {"budget": 6, "n_sink": 2, "n_local": 4, "block_size": 2, "label_channels": 3},
    ),
}


def make_selector(case: str) -> Any:
    """A fresh selector of :data:`SELECTOR_CASES` ``case``."""
    name, fields = SELECTOR_CASES[case]
    return selectors.create(name, **fields)


def supports(case: str, layout: str) -> bool:
    """Whether ``case`` runs on ``layout`` (side-cache pages, Quest's or the per-page
    certificate's, need a paged pool of whole pages)."""
    page = make_selector(case).side_page_size()
    return layout == "contiguous" or KV_PAGE_SIZE[layout] % page == 0


KV_PAGE_SIZE = {"contiguous": 1, "paged": 1, "paged16": 16}
JUNK = -12345  # request-to-token entries past a sequence's end: must never be read
SLACK = 2  # contiguous left padding: each row gets 0..SLACK extra columns


def softmax64(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in float64, 0 for a row of ``-inf`` (written out: torch's own
    float64 CPU softmax is much slower than float32's on small rows)."""
    x = logits.double()
    p = torch.exp(x - x.amax(-1, keepdim=True)).nan_to_num(0.0)
    return (p / p.sum(-1, keepdim=True)).nan_to_num(0.0)


@dataclass
class Attachment:
    """One selector running on a simulator: its state and plan."""

    selector: Any
    state: SelectorState
    plan: DecodePlan
    updated_at: int = -1  # the step whose plan.update ran


class DecodeSimulator:
    """A batch of ``B`` sequences decoding through ``num_layers`` attention layers.

    Parameters
    ----------
    lengths:
        Cached positions of each row at the first decode step, the current token included.
    num_q_heads, num_kv_heads, head_dim:
        ``Hq``, ``Hkv`` and ``D`` of every layer.
    num_layers:
        Layers of the model.
    layout:
        ``"contiguous"``, ``"paged"`` (page size 1) or ``"paged16"`` (page size 16).
    max_new_tokens:
        How many times :meth:`advance` may be called.
    dtype:
        Of keys, values and queries (the cache dtype).
    seed:
        Seeds the logical data; the layout's own randomness (left padding, pool slots) comes
        from a second generator.
    slots:
        State slot of each row (default ``0 .. B-1``); ``-1`` marks a padded row (it has data
        and a cache, but no sequence in the state).
    capacity:
        Slots of the states :meth:`attach` makes (default ``max(slots) + 1``).
    layer_types:
        ``AttentionSpec.layer_types``.
    value_dim:
        ``Dv`` (default ``D``).
    row_ids:
        Seed of each row's data (default ``0 .. B-1``): rows with equal ids and lengths hold
        equal data across simulators.
    kv_offset:
        Paged layouts: the first pool slot this simulator uses (a multiple of 16), so that
        simulators sharing one state use disjoint KV locations.
    key_grid:
        Put every key on its own 4-bit grid (:mod:`prhs_kernels.keycodes`): then a selector
        that scores code rows (CIS's ``scorer="int4"``) scores these keys exactly, to float
        rounding, and the brute-force references of exact scoring hold for it too (a
        selector's codes are then taken around 0: the tables it would set from the first keys
        written are marked set).
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
        row_ids: Sequence[int] | None = None,
        kv_offset: int = 0,
        key_grid: bool = False,
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
        self.t_cap = int(self.lengths.max()) + SLACK + max_new_tokens
        self.slots = torch.arange(b) if slots is None else torch.tensor(list(slots))
        live = [s for s in self.slots.tolist() if s >= 0]
        self.live_slots = live
        self.pool_capacity = capacity or (max(live) + 1 if live else 1)
        self.scaling = head_dim**-0.5
        self.kv_page_size = KV_PAGE_SIZE[layout]
        dv = value_dim or head_dim
        ids = list(range(b)) if row_ids is None else list(row_ids)
        self._gens = [torch.Generator().manual_seed(seed * 100_003 + 7 * i + 1) for i in ids]
        m = self.t_cap
        self.keys = [self._rows(num_kv_heads, m, head_dim) for _ in range(num_layers)]
        self.key_grid = key_grid
        if key_grid:
            from prhs_kernels.keycodes import dequantize_keys_reference, quantize_keys_reference

            self.keys = [
                dequantize_keys_reference(quantize_keys_reference(k), head_dim).to(dtype)
                for k in self.keys
            ]
        self.values = [self._rows(num_kv_heads, m, dv) for _ in range(num_layers)]
        self.queries = [self._rows(num_q_heads, head_dim) for _ in range(num_layers)]
        self.attachments: list[Attachment] = []

        lay = torch.Generator().manual_seed(seed + 7919)
        if layout == "contiguous":
            # Left padding: every row ends at the same column, plus 0..SLACK columns.
            extra = torch.randint(0, SLACK + 1, (b,), generator=lay)
            self.start = int(self.lengths.max()) - self.lengths + extra
            self.num_kv_locations: int | None = None
            return
        if kv_offset % 16:
            raise ValueError("kv_offset must be a multiple of 16")
        # Request-to-token table: one row per state slot, plus one per padded row.
        padded = [i for i, s in enumerate(self.slots.tolist()) if s < 0]
        self.req = self.slots.clone()
        for k, i in enumerate(padded):
            self.req[i] = self.pool_capacity + k
        r = self.pool_capacity + len(padded)
        if layout == "paged":
            n = b * m + 5
            phys = kv_offset + torch.randperm(n, generator=lay)[: b * m].view(b, m)
            self.num_kv_locations = kv_offset + n
        else:
            p = 16
            ppr = -(-m // p)
            n_pages = b * ppr + 2
            pages = kv_offset // p + torch.randperm(n_pages, generator=lay)[: b * ppr]
            pages = pages.view(b, ppr).repeat_interleave(p, 1)[:, :m]
            phys = pages * p + torch.arange(m) % p
            self.num_kv_locations = kv_offset + n_pages * p
        self.table = torch.full((r, m), JUNK, dtype=torch.int32)
        self.table[self.req] = phys.to(torch.int32)

    # -- data ----------------------------------------------------------------------------------
    def _rows(self, *shape: int) -> torch.Tensor:
        rows = [torch.randn(*shape, generator=g) for g in self._gens]
        return torch.stack(rows).to(self.dtype)

    @property
    def max_len(self) -> int:
        """``T = max(lengths)``: the width of the brute-force references."""
        return int(self.lengths.max())

    def seq_lens(self) -> torch.Tensor:
        """``[B]`` int32 cached positions (the current token included)."""
        return self.lengths.to(torch.int32)

    def slots_tensor(self) -> torch.Tensor:
        return self.slots.clone()

    def valid(self) -> torch.Tensor:
        """``[B, T]`` bool: positions that exist."""
        return torch.arange(self.max_len).view(1, -1) < self.lengths.view(-1, 1)

    # -- caches --------------------------------------------------------------------------------
    def kv(self, layer: int, seq_lens: torch.Tensor | None = None) -> KVLayout:
        """The layer's cache at the current step (rebuilt from the logical data)."""
        k, v = self.keys[layer], self.values[layer]
        b, hkv, m, d = k.shape
        lens = self.seq_lens() if seq_lens is None else seq_lens
        used = torch.arange(m).view(1, -1) < self.lengths.view(-1, 1)  # [B, M]
        rows, cols = torch.nonzero(used, as_tuple=True)
        nan = float("nan")
        if self.layout == "contiguous":
            key = torch.full((b, hkv, m, d), nan, dtype=self.dtype)
            value = torch.full((b, hkv, m, v.shape[-1]), nan, dtype=self.dtype)
            dst = self.start[rows] + cols
            key[rows, :, dst] = k[rows, :, cols]
            value[rows, :, dst] = v[rows, :, cols]
            return ContiguousKV(key, value, lens, self.start.to(torch.int32))
        assert self.num_kv_locations is not None
        n = self.num_kv_locations
        key = torch.full((n, hkv, d), nan, dtype=self.dtype)
        value = torch.full((n, hkv, v.shape[-1]), nan, dtype=self.dtype)
        at = self.table[self.req[rows], cols].long()
        key[at] = k[rows, :, cols]
        value[at] = v[rows, :, cols]
        table = self.table.clone()
        # Entries past each length are junk that must never be read.
        table[self.req] = torch.where(used, table[self.req], JUNK)
        return PagedKV(
            key,
            value,
            table,
            self.req.to(torch.int32),
            lens,
            page_size=self.kv_page_size,
        )

    def locations(self, row_stride: int) -> torch.Tensor:
        """``[B, T_cap]`` int64 KV location of every position (``-1`` past each length)."""
        b, m = self.batch_size, self.t_cap
        hkv, d = self.spec.num_kv_heads, self.spec.head_dim
        lens = self.seq_lens()
        kv: KVLayout
        if self.layout == "contiguous":
            k = torch.zeros((), dtype=self.dtype).expand(b, hkv, m, d)  # storage is not read
            kv = ContiguousKV(k, k, lens, self.start.to(torch.int32))
        else:
            assert self.num_kv_locations is not None
            k = torch.zeros((), dtype=self.dtype).expand(self.num_kv_locations, hkv, d)
            kv = PagedKV(k, k, self.table, self.req.to(torch.int32), lens, self.kv_page_size)
        pos = torch.arange(m).view(1, -1).expand(b, -1)
        return token_locations(kv, pos, row_stride)

    # -- selectors ------------------------------------------------------------------------------
    def init_state(self, selector: Any) -> SelectorState:
        """A new state of ``selector`` sized for this batch (what :meth:`attach` makes)."""
        return selector.init_state(
            self.spec,
            capacity=self.pool_capacity,
            max_seq_len=self.t_cap,
            num_kv_locations=self.num_kv_locations,
            kv_page_size=self.kv_page_size,
            kv_dtype=self.dtype,
        )

    def attach(
        self,
        selector: Any,
        state: SelectorState | None = None,
        *,
        stats: bool = True,
        checked: bool = True,
    ) -> SelectorState:
        """Start this batch's sequences on ``selector``: a state (new unless given), the slots
        created, the cached K/V written through ``write_kv``, and a plan (``checked``: its
        value checks, and ``write_kv``'s)."""
        if state is None:
            state = self.init_state(selector)
        state.pool.create(self.live_slots)
        if self.key_grid and state.side is not None:
            # Tables set once from the first keys (CIS's code centre) stay at their fill (0),
            # around which the keys lie on their grid.
            state.side.initialized.update(
                f"{name}/{layer}"
                for name in state.side.field_names
                for layer in range(self.spec.num_layers)
            )
        self.write_kv(selector, state, torch.zeros_like(self.lengths), self.lengths, checked)
        plan = selector.make_plan(
            state, batch_size=self.batch_size, scaling=self.scaling, stats=stats, checked=checked
        )
        self.attachments.append(Attachment(selector, state, plan))
        return state

    def write_kv(
        self,
        selector: Any,
        state: SelectorState,
        lo: torch.Tensor,
        hi: torch.Tensor,
        checked: bool = False,
    ) -> None:
        """Write positions ``[lo[b], hi[b])`` of every row and layer through ``write_kv``
        (``checked``: as a checked host does, raising on non-finite keys and bad locations)."""
        pos = torch.arange(self.t_cap).view(1, -1)
        want = (pos >= lo.view(-1, 1)) & (pos < hi.view(-1, 1))  # [B, T_cap]
        loc = self.locations(state.row_stride)
        rows, cols = torch.nonzero(want, as_tuple=True)
        for layer in range(self.spec.num_layers):
            key = self.keys[layer][rows, :, cols]
            value = self.values[layer][rows, :, cols]
            selector.write_kv(state, layer, loc[rows, cols], key, value, checked=checked)

    def _attachment(self, selector: Any | None) -> Attachment:
        if not self.attachments:
            raise RuntimeError("attach(selector) first")
        if selector is None:
            return self.attachments[-1]
        for a in self.attachments:
            if a.selector is selector:
                return a
        raise RuntimeError(f"{selector!r} is not attached")

    def plan(self, selector: Any | None = None) -> DecodePlan:
        return self._attachment(selector).plan

    def state(self, selector: Any | None = None) -> SelectorState:
        return self._attachment(selector).state

    def update(self, selector: Any | None = None) -> DecodePlan:
        """``plan.update(seq_lens, slots)`` once per step."""
        a = self._attachment(selector)
        if a.updated_at != self.steps_taken:
            a.plan.update(self.seq_lens(), self.slots_tensor())
            a.updated_at = self.steps_taken
        return a.plan

    def select(self, layer: int, selector: Any | None = None) -> Selection | None:
        """The selector's selection of ``layer`` at the current step (its plan's buffers)."""
        a = self._attachment(selector)
        plan = self.update(a.selector)
        return a.selector.select(plan, layer, self.queries[layer], self.kv(layer), a.state)

    def attend(self, layer: int, selection: Selection | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Dv], lse [B, Hq])`` of attention over ``selection``."""
        return sparse_decode_attention(self.queries[layer], self.kv(layer), selection, self.scaling)

    def release(self, selector: Any | None = None) -> None:
        """End this batch's sequences on ``selector`` (its slots become free)."""
        a = self._attachment(selector)
        a.state.pool.release(self.live_slots)
        self.attachments.remove(a)

    def advance(self, steps: int = 1) -> None:
        """Move every row to its next token: fresh queries, and the new position's K/V (already
        in the logical data) written through every attached selector's ``write_kv``."""
        for _ in range(steps):
            if self.steps_taken >= self.max_new_tokens:
                raise RuntimeError("advance() called more than max_new_tokens times")
            old = self.lengths
            self.lengths = self.lengths + 1
            for layer in range(self.spec.num_layers):
                self.queries[layer] = self._rows(*self.queries[layer].shape[1:])
            for a in self.attachments:
                self.write_kv(a.selector, a.state, old, self.lengths, a.plan.checked)
            self.steps_taken += 1

    # -- brute-force references ----------------------------------------------------------------
    def logits(self, layer: int) -> torch.Tensor:
        """``[B, Hq, T]`` float64 logits of the current queries, ``-inf`` past each end."""
        return brute_logits(self.queries[layer], self.keys[layer], self.lengths, self.scaling)

    softmax64 = staticmethod(softmax64)

    def group_probs(self, layer: int) -> torch.Tensor:
        """``[B, Hkv, T]`` float64 group-mean attention probabilities."""
        return brute_group_probs(self.logits(layer), self.spec.num_kv_heads)

    def mask(self, selection: Selection | None) -> torch.Tensor:
        """``[B, Hkv, T]`` bool positions read (``None``: every cached position)."""
        if selection is None:
            return self.valid().unsqueeze(1).expand(-1, self.spec.num_kv_heads, -1)
        return selection.to_mask(self.seq_lens(), self.max_len)

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


class Tools:
    """Brute-force helpers shared by the tests (the ``tools`` fixture)."""

    softmax64 = staticmethod(softmax64)
    make_selector = staticmethod(make_selector)
    supports = staticmethod(supports)
    cases = SELECTOR_CASES
    brute_logits = staticmethod(brute_logits)
    brute_group_probs = staticmethod(brute_group_probs)

    @staticmethod
    def chosen(selection: Selection, b: int, h: int) -> set[int]:
        """The entries row ``(b, h)`` uses, checked distinct and in range."""
        n = int(selection.counts[b, h])
        ids = [int(i) for i in selection.indices[b, h, :n]]
        assert len(ids) == len(set(ids)), f"an entry is listed twice: {ids}"
        assert all(i >= 0 for i in ids), f"a used entry is negative: {ids}"
        return set(ids)

    @staticmethod
    def window(n: int, n_sink: int, n_local: int) -> set[int]:
        """Sink and local positions of a sequence of ``n``."""
        return {i for i in range(n) if i < n_sink or i >= n - n_local}

    @staticmethod
    def blocks_of(positions: set[int], s: int) -> set[int]:
        return {p // s for p in positions}

    @staticmethod
    def block_max(values: Sequence[float], s: int) -> list[float]:
        return [max(values[j : j + s]) for j in range(0, len(values), s)]

    @staticmethod
    def assert_same_topk(
        got: set[int], want: set[int], scores: Sequence[float], atol: float = 1e-6
    ) -> None:
        """``got`` and ``want`` are both a top set by ``scores[i]``: equal, or differing only
        by tied entries (their sorted scores agree within ``atol``)."""
        assert len(got) == len(want), (sorted(got), sorted(want))
        if got == want:
            return
        a = sorted(scores[i] for i in got)
        b = sorted(scores[i] for i in want)
        diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
        assert diff <= atol, (
            f"top sets differ beyond ties: got-only {sorted(got - want)}, "
            f"want-only {sorted(want - got)} (max score gap {diff})"
        )

    @staticmethod
    def brute_topk(candidates: Sequence[int], k: int, scores: Sequence[float]) -> set[int]:
        """The ``k`` candidates of largest ``scores[i]`` (ties to the lower index)."""
        return set(sorted(candidates, key=lambda i: (-scores[i], i))[:k])

    @staticmethod
    def snapshot(state: SelectorState) -> dict[str, torch.Tensor]:
        """Clones of every tensor of ``state`` (pool fields, side fields, the counter)."""
        out = {f"pool.{n}": state.pool[n].clone() for n in state.pool.field_names}
        if state.side is not None:
            out |= {f"side.{n}": state.side[n].clone() for n in state.side.field_names}
        out["nonfinite"] = state.nonfinite.clone()
        return out

    @staticmethod
    def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]) or (
                a[name].is_floating_point()
                and torch.equal(a[name].isnan(), b[name].isnan())
                and torch.equal(a[name].nan_to_num(), b[name].nan_to_num())
            ), f"{name} changed"

    @staticmethod
    def dropped_mass(probs: Sequence[float], keep: set[int]) -> float:
        return math.fsum(p for i, p in enumerate(probs) if i not in keep)


@pytest.fixture(autouse=True)
def _one_thread():
    """Run each test on one intra-op thread: these tensors are tiny, and handing them to a
    thread pool costs far more than the work (100x on a 2-core runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def make_sim() -> type[DecodeSimulator]:
    """The :class:`DecodeSimulator` class: ``make_sim(lengths, num_q_heads=..., ...)``."""
    return DecodeSimulator


@pytest.fixture
def tools() -> type[Tools]:
    """Brute-force helpers (:class:`Tools`)."""
    return Tools


@pytest.fixture(params=sorted(SELECTOR_CASES))
def case(request: pytest.FixtureRequest) -> str:
    """Each entry of :data:`SELECTOR_CASES` in turn (build it with ``tools.make_selector``)."""
    return request.param


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    """Each KV layout in turn: ``"contiguous"``, ``"paged"`` and ``"paged16"``."""
    return request.param


class OpLog:
    """A context manager that records the name of every torch op run inside it (``ops``)."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    def __enter__(self) -> OpLog:
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self.ops

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                log.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


@pytest.fixture
def op_log() -> type[OpLog]:
    """:class:`OpLog`: ``with op_log() as log: ...``, then ``log.ops``."""
    return OpLog


@pytest.fixture
def triton_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every Triton launch from then on recorded by its kernel's name instead of run (Triton's
    ``JITFunction.run`` patched): a list the test reads (needs Triton)."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    launches: list[str] = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(self.fn.__name__)

    monkeypatch.setattr(JITFunction, "run", run)
    return launches
