"""``louver``: a cluster index over the cached keys whose per-cluster bound lets a threshold
query find *every* key above the threshold, reading clusters instead of keys.

Louver (UIC InDeXLab) indexes each KV head's keys in clusters of four with a centre and a radius
per channel subspace; a query reads every cluster whose upper bound reaches a threshold taken
from a small sample of exact logits, so no key above the threshold is missed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prhs_core.checks import check_int
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels.kv import gather_kv, token_locations
from prhs_kernels.louver import cluster_scores, index_pages
from prhs_kernels.score import score_keys
from prhs_kernels.topk import topk_indices
from prhs_selectors.base import BaseSelector

__all__ = ["CLUSTER", "Louver", "LouverConfig", "sample_offsets", "sample_positions"]

CLUSTER = 4
"""Keys per cluster."""

THRESHOLDS = ("sample", "oracle")


def sample_offsets(size: int, seed: int) -> torch.Tensor:
    """``[size]`` float64 offsets in ``[0, 1)`` from ``seed``: where in its stratum each sampled
    position lies (:func:`sample_positions`)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(size, generator=g, dtype=torch.float64)


def sample_positions(
    length: torch.Tensor, size: int, seed: int, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, size]`` int64 positions, a stratified uniform sample of ``[0, length[b])``: one per
    stratum of ``length/size`` positions, at a fixed pseudo-random offset in it (``offsets``,
    or :func:`sample_offsets` of ``seed``), so every indexed position is equally likely and no
    random number is drawn at the step. ``-1`` where ``length`` is 0."""
    if offsets is None:
        offsets = sample_offsets(size, seed).to(length.device)
    j = torch.arange(size, device=length.device, dtype=torch.float64)
    pos = torch.floor((j + offsets) * length.double().unsqueeze(-1) / size).long()
    return torch.where(length.unsqueeze(-1) > 0, pos, -1)


@dataclass(frozen=True)
class LouverConfig(SelectorConfig):
    """Hyperparameters of :class:`Louver`.

    Parameters
    ----------
    budget:
        At most this many indexed positions (``budget // 4`` clusters) are read beside the
        windows: the static width of a selection. Above it the clusters furthest above the
        threshold are kept, and the guarantee holds only for those.
    n_local:
        The recent buffer, read exactly; at least ``buffer`` (the keys not yet indexed are
        among the last ``buffer``).
    buffer:
        Keys are indexed ``buffer`` positions at a time, once the buffer is full (256).
    page:
        Clusters are formed among ``page`` consecutive positions (a divisor of ``buffer``;
        ``page / 4`` a power of two); a paged KV pool needs pages of a multiple of it.
    subspaces:
        ``S``, contiguous channel slices with a centre and radius each (4).
    threshold:
        ``"sample"``: per query head, the largest exact logit of ``sample_size`` sampled indexed
        keys; ``"oracle"``: the ``oracle_k``-th largest exact logit of all indexed keys (scores
        every key: for measurement).
    sample_size:
        Keys sampled for the threshold (100).
    oracle_k:
        ``k`` of the oracle threshold.
    seed:
        Seed of the sample's offsets.
    prompt_queries:
        Queries a host shows at prefill (Louver uses none; the prompt's keys are indexed then).
    """

    budget: int = 2048
    n_local: int = 256
    buffer: int = 256
    page: int = 256
    subspaces: int = 4
    threshold: str = "sample"
    sample_size: int = 100
    oracle_k: int = 64
    seed: int = 0
    prompt_queries: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("buffer", self.buffer, minimum=CLUSTER)
        check_int("page", self.page, minimum=CLUSTER)
        check_int("subspaces", self.subspaces, minimum=1)
        check_int("sample_size", self.sample_size, minimum=1)
        check_int("oracle_k", self.oracle_k, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_int("prompt_queries", self.prompt_queries, minimum=2)
        c = self.page // CLUSTER
        if self.page % CLUSTER or c & (c - 1):
            raise ValueError(f"page / 4 must be a power of two, got page={self.page}")
        if self.buffer % self.page:
            raise ValueError(f"page ({self.page}) must divide buffer ({self.buffer})")
        if self.n_local < self.buffer:
            raise ValueError(
                f"n_local ({self.n_local}) must be >= buffer ({self.buffer}): the keys not yet "
                "indexed are read through the local window"
            )
        if self.budget < CLUSTER:
            raise ValueError(
                f"budget must hold one cluster ({CLUSTER} positions), got {self.budget}"
            )
        if self.threshold not in THRESHOLDS:
            raise ValueError(f"threshold must be one of {THRESHOLDS}, got {self.threshold!r}")
        if self.block_size != 1:
            raise ValueError(
                f"louver selects positions: block_size must be 1, got {self.block_size}"
            )


@selectors.register(
    "louver", config=LouverConfig, summary="cluster index, every key above a sampled threshold"
)
class Louver(BaseSelector):
    """Louver: read every cluster of keys whose logit bound reaches a threshold.

    **Index.** Per layer and KV head, keys are grouped in clusters of four within pages of
    ``page`` consecutive positions, by a balanced principal-axis tree
    (:func:`prhs_kernels.louver.balanced_clusters`). Each cluster keeps, per channel subspace
    ``s`` (``subspaces`` contiguous slices), its centre ``c_s`` and radius ``ρ_s`` (the largest
    distance of a member to the centre there), so every member's logit is at most
    ``s·Σ_s (q_s·c_s + ‖q_s‖·ρ_s)``. Keys are indexed ``buffer`` positions at a time once the
    buffer is full: at prefill every full buffer of the prompt, at decode each buffer as it
    fills (one per step at most). The keys not yet indexed are among the last ``buffer`` and are
    read exactly through the local window. The index lives in a side cache indexed by KV page
    (permutation, centres in the cache dtype, float32 radii): it depends on the stored keys
    alone, so requests sharing cached pages share it.

    **Query.** The threshold ``T_h`` of each query head is the largest exact logit of a sample of
    ``sample_size`` indexed keys (:func:`sample_positions`), or, with ``threshold="oracle"``, the
    ``oracle_k``-th largest exact logit of all indexed keys. A cluster is read when some query
    head of the group has a bound ``≥ T_h``: so **every key whose logit reaches its head's
    threshold is read** (zero false negatives), as long as the clusters that pass fit the
    ``budget``; beyond it, those furthest above the threshold are kept. The sink and local
    windows are added.

    Stats: a retrieval only with the oracle threshold. ``proxy_bytes`` counts the index of the
    indexed pages (centres, radii and the permutation) and the sampled keys (all keys with the
    oracle threshold).
    """

    name = "louver"
    config_type = LouverConfig
    config: LouverConfig

    def __init__(self, config: LouverConfig | None = None) -> None:
        super().__init__(config)
        self._offsets: torch.Tensor | None = None  # the sample's, on the state's device

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + (self.config.budget // CLUSTER) * CLUSTER + wl

    def side_page_size(self) -> int:
        return self.config.page

    def uses_side_cache(self) -> bool:
        return True

    def prompt_queries(self) -> int:
        return self.config.prompt_queries

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        c = self.config
        d, h, n = spec.head_dim, spec.num_kv_heads, spec.num_layers
        if d % c.subspaces:
            raise ValueError(f"subspaces ({c.subspaces}) must divide head_dim ({d})")
        side = state.side
        assert side is not None
        nc = c.page // CLUSTER
        side.add_page_field("lv_perm", (n, h, c.page), torch.int16, 0)
        side.add_page_field("lv_center", (n, h, nc, d), kv_dtype, 0.0)
        side.add_page_field("lv_radius", (n, h, nc, c.subspaces), torch.float32, 0.0)
        state.pool.add_field("lv_len", (n,), torch.int64, 0)  # positions [0, len) are indexed
        # Made once here: a host-to-device copy inside a step would not replay in a CUDA graph.
        self._offsets = sample_offsets(c.sample_size, c.seed).to(state.device)

    # -- index ------------------------------------------------------------------------------
    def _index(
        self,
        state: SelectorState,
        layer: int,
        keys: torch.Tensor,
        page_locations: torch.Tensor,
        active: torch.Tensor,
    ) -> None:
        """Cluster ``keys [B, Hkv, n_pages, page, D]`` and write each page's index at
        ``page_locations [B, n_pages]`` (the location of the page's first position), for the
        sequences whose ``active [B]`` flag is set (the others write nothing)."""
        side = state.side
        assert side is not None
        index_pages(
            keys,
            side.pages_of(page_locations),
            active,
            side["lv_perm"][:, layer],
            side["lv_center"][:, layer],
            side["lv_radius"][:, layer],
            CLUSTER,
        )

    def observe_prompt(
        self,
        state: SelectorState,
        layer: int,
        slots: Sequence[int],
        queries: torch.Tensor,
        kv: ContiguousKV,
        scaling: float,
        bounds: Sequence[tuple[int, int]] | None = None,
        locations: torch.Tensor | None = None,
    ) -> None:
        """At prefill: index every full buffer of each prompt (at ``locations``, or the
        locations of ``kv`` itself). The queries are not used."""
        ids, rows = self.check_prompt_observation(state, layer, slots, queries, kv, scaling, bounds)
        c = self.config
        if locations is not None and tuple(locations.shape) != (kv.batch_size, kv.k.shape[2]):
            raise ValueError(
                f"locations must be [B={kv.batch_size}, L={kv.k.shape[2]}], got "
                f"{list(locations.shape)}"
            )
        pool = state.pool
        dev = pool.device
        for i, (slot, (st, n)) in enumerate(zip(ids, rows, strict=True)):
            full = (n // c.buffer) * c.buffer
            pool["lv_len"][slot, layer] = full
            if full == 0:
                continue
            starts = torch.arange(0, full, c.page, device=kv.k.device)
            if locations is not None:
                loc = locations[i, st + starts]
            else:
                pos = torch.full((kv.batch_size, starts.shape[0]), -1, device=kv.k.device)
                pos[i] = starts
                loc = token_locations(kv, pos.long(), state.row_stride)[i]
            keys = kv.k[i, :, st : st + full].reshape(kv.num_kv_heads, -1, c.page, kv.head_dim)
            on = torch.ones(1, dtype=torch.bool, device=dev)
            self._index(state, layer, keys.unsqueeze(0).to(dev), loc.view(1, -1).to(dev), on)

    def _fold(
        self, plan: DecodePlan, layer: int, kv: KVLayout, state: SelectorState
    ) -> torch.Tensor:
        """Index, per sequence, the buffer after its indexed prefix when it is full; return the
        indexed lengths after (``[B]``)."""
        c = self.config
        pool = state.pool
        slots = plan.slots
        b, h, d = kv.batch_size, kv.num_kv_heads, kv.head_dim
        length = pool["lv_len"][slots, layer]
        full = length + c.buffer <= kv.seq_lens.long()
        pos = length.view(-1, 1) + torch.arange(c.buffer, device=length.device).view(1, -1)
        pos = torch.where(full.view(-1, 1), pos, -1)
        keys, _ = gather_kv(kv, pos.unsqueeze(1).expand(b, h, -1), values=False)
        n_pages = c.buffer // c.page
        firsts = pos[:, :: c.page]  # [B, NP]
        loc = token_locations(kv, firsts, state.row_stride)
        self._index(state, layer, keys.view(b, h, n_pages, c.page, d), loc, full)
        length = length + full.long() * c.buffer
        pool["lv_len"][slots, layer] = length
        return length

    # -- selection --------------------------------------------------------------------------
    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,
    ) -> Selection | None:
        c = self.config
        side = state.side
        assert side is not None
        b, h, d, t = kv.batch_size, kv.num_kv_heads, kv.head_dim, kv.max_len
        g = query.shape[1] // h
        length = self._fold(plan, layer, kv, state)
        n_pages = -(-t // c.page)
        nc = c.page // CLUSTER
        firsts = torch.arange(n_pages, device=length.device) * c.page
        loc = token_locations(kv, firsts.view(1, -1).expand(b, -1), state.row_stride)
        rows = side.pages_of(loc)  # [B, NP]
        indexed = firsts.view(1, -1) < length.view(-1, 1)  # [B, NP]
        q = query.float().view(b, h, g, d)
        elem = torch.empty((), dtype=kv.dtype).element_size()
        if c.threshold == "oracle":
            logits = score_keys(query, kv, plan.scaling)  # [B, Hkv, g, T]
            pos = torch.arange(t, device=length.device).view(1, 1, 1, -1)
            logits = logits.masked_fill(pos >= length.view(-1, 1, 1, 1), float("-inf"))
            k = min(c.oracle_k, t)
            thr = logits.topk(k, dim=-1).values[..., -1]  # [B, Hkv, g]
            retrieved = torch.ones(b, h, dtype=torch.bool, device=length.device)
            read = kv.seq_lens.view(-1, 1).to(torch.float64) * (d * elem)
        else:
            assert self._offsets is not None
            sample = sample_positions(length, c.sample_size, c.seed, self._offsets)  # [B, S]
            skeys, _ = gather_kv(kv, sample.unsqueeze(1).expand(b, h, -1), values=False)
            logits = torch.einsum("bhgd,bhsd->bhgs", q, skeys.float()) * plan.scaling
            logits = logits.masked_fill((sample < 0).view(b, 1, 1, -1), float("-inf"))
            thr = logits.amax(-1)
            retrieved = None
            read = (length > 0).view(-1, 1).to(torch.float64) * (c.sample_size * d * elem)
        # Per cluster, max over the group of (bound - threshold): >= 0 when some head's reaches.
        score = cluster_scores(
            query,
            side["lv_center"][:, layer],
            side["lv_radius"][:, layer],
            rows,
            thr,
            plan.scaling,
        )  # fmt: skip  [B, Hkv, NP*C]
        passes = score >= 0
        live = indexed.repeat_interleave(nc, 1).unsqueeze(1) & ~bad.unsqueeze(-1)
        eligible = passes & live
        ids, _ = topk_indices(score, c.budget // CLUSTER, eligible)  # [B, Hkv, K] cluster ids
        # Members: page p = id // C, cluster j = id % C; positions p*page + perm[4j .. 4j+3].
        # Only the chosen clusters' entries of the permutation are read (4 per cluster), at the
        # page row of each, not every page's permutation.
        safe = ids.clamp_min(0).long()
        page_of = safe // nc
        page_row = torch.gather(rows, 1, page_of.view(b, -1)).view(b, h, -1, 1)
        slot = (safe % nc).unsqueeze(-1) * CLUSTER + torch.arange(CLUSTER, device=ids.device)
        head = torch.arange(h, device=ids.device).view(1, h, 1, 1)
        offs = side["lv_perm"][page_row, layer, head, slot].long()  # [B, Hkv, K, 4]
        members = page_of.unsqueeze(-1) * c.page + offs
        members = torch.where(ids.unsqueeze(-1) >= 0, members, -1).reshape(b, h, -1)
        sel = self.compose(plan, kv, members)
        index_bytes = (length // c.page).view(-1, 1).to(torch.float64) * (
            nc * (d * elem + c.subspaces * 4) + c.page * 2
        )
        self.record(plan, layer, kv, sel, retrieved, index_bytes + read)
        return sel
