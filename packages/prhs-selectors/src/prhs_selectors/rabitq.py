"""``rabitq``: RaBitQCache: keys quantised to one bit per channel after a random rotation, logits
estimated from the codes without bias, and the top-p of the estimated attention read exactly.

RaBitQ (Gao and Long, SIGMOD 2024) quantises a vector to the signs of its randomly rotated
coordinates and estimates inner products from them without bias; RaBitQCache applies it to the
KV cache's keys, around per-head centroids, lazily as groups of 128 keys fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prhs_core.checks import check_int, check_probability
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels.kv import gather_kv, token_locations
from prhs_kernels.rabitq import estimate_logits, quantize_keys, rabitq_logits, random_rotation
from prhs_kernels.topk import top_p_indices
from prhs_selectors.base import BaseSelector

__all__ = ["RaBitQ", "RaBitQConfig", "estimate_logits"]


@dataclass(frozen=True)
class RaBitQConfig(SelectorConfig):
    """Hyperparameters of :class:`RaBitQ`.

    Parameters
    ----------
    budget:
        ``k_max``: at most this many quantised positions are read beside the windows.
    n_sink:
        The first positions, always read (RaBitQCache: 128).
    n_local:
        The most recent positions, always read; at least ``group`` (a group is quantised only
        once full, so the positions not yet quantised are always among the last ``group``).
    top_p:
        Read the smallest set of quantised positions whose estimated attention, with the
        windows', reaches ``top_p`` of the total (in ``(0, 1]``), capped at ``budget``.
    group:
        Keys are quantised in groups of ``group`` positions once the group is full (128).
    dense_layers:
        The first layers are dense (2).
    seed:
        Seed of the per-layer random rotations and query dithers.
    prompt_queries:
        The prompt's last queries whose mean is each KV head's query centroid.
    """

    budget: int = 1024
    n_sink: int = 128
    n_local: int = 128
    top_p: float = 0.9
    group: int = 128
    dense_layers: int = 2
    seed: int = 0
    prompt_queries: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("top_p", self.top_p)
        if self.top_p <= 0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        check_int("group", self.group, minimum=1)
        check_int("dense_layers", self.dense_layers, minimum=0)
        check_int("seed", self.seed, minimum=0)
        check_int("prompt_queries", self.prompt_queries, minimum=2)
        if self.block_size != 1:
            raise ValueError(
                f"rabitq selects positions: block_size must be 1, got {self.block_size}"
            )
        if self.n_local < self.group:
            raise ValueError(
                f"n_local ({self.n_local}) must be >= group ({self.group}): the positions not yet "
                "quantised are read through the local window"
            )


@selectors.register(
    "rabitq", config=RaBitQConfig, summary="top-p of 1-bit RaBitQ logit estimates (RaBitQCache)"
)
class RaBitQ(BaseSelector):
    """RaBitQCache: estimate every quantised key's logit from its 1-bit code, read the top-p.

    **Quantisation.** Each layer has a random orthogonal ``P`` and a query dither drawn from
    ``seed`` (:func:`prhs_kernels.rabitq.random_rotation`). Each request has, per layer and KV
    head, a key centroid ``c_k`` (the mean of its prompt's keys) and a query centroid ``c_q``
    (the mean of its group's last ``prompt_queries`` prompt queries), chosen at prefill. A key
    becomes the sign bits of ``Pᵀ(k − c_k)`` (``D`` bits packed in ``D/8`` bytes), one float
    ``‖k − c_k‖/⟨o, x̄⟩`` (norm over the debias factor) and one float ``c_q·k``, all in a side
    cache indexed by KV location. Keys are quantised in groups of ``group`` positions, once a
    group is full: at prefill every full group of the prompt, at decode each group as it fills.
    The positions not yet quantised are among the last ``group`` and are read exactly through
    the local window.

    **Selection.** The query is rotated, ``Pᵀ(q − c_q)``, and quantised to 4 bits with the
    layer's dither; the estimated logit of a quantised key is
    ``s·(‖k − c_k‖·⟨q̄_r, x̄⟩/⟨o, x̄⟩ + q·c_k + c_q·k − c_q·c_k)``, unbiased over the seed
    (:func:`estimate_logits`). The positions of the sink (first ``n_sink``) and local (last
    ``n_local``) windows get their exact logits. Under GQA each query head's softmax is taken
    and the group's mean is the position's mass; the selection is the windows plus the
    smallest top set of the other quantised positions that brings the kept mass to ``top_p``,
    capped at ``budget`` (:func:`prhs_kernels.topk.top_p_indices`). The first
    ``dense_layers`` layers are dense.

    A request whose prompt was not shown to the selector (a cache prefilled without prhs) has
    zero centroids, and its older keys are quantised one group per decode step: until they all
    are, the ones neither quantised nor in a window are not read.

    Stats: never a retrieval. ``proxy_bytes`` counts the codes and the two floats of every
    quantised key, ``D/8 + 8`` bytes per key and KV head, plus the exact keys of the windows.
    The side cache holds per-request data (the codes depend on the request's centroids), so a
    host must not share KV locations between requests (``state_per_location``).
    """

    name = "rabitq"
    config_type = RaBitQConfig
    config: RaBitQConfig
    state_per_location = True

    def __init__(self, config: RaBitQConfig | None = None) -> None:
        super().__init__(config)
        self._rotation: torch.Tensor | None = None  # [N', D, D]
        self._dither: torch.Tensor | None = None  # [N', D]

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + self.config.budget + wl

    def uses_side_cache(self) -> bool:
        return True

    def prompt_queries(self) -> int:
        return self.config.prompt_queries

    def _rows(self, spec: AttentionSpec) -> int:
        return max(spec.num_layers - self.config.dense_layers, 0)

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        d, h = spec.head_dim, spec.num_kv_heads
        if d % 8:
            raise ValueError(
                f"rabitq packs 8 bits a byte: head_dim must be a multiple of 8, got {d}"
            )
        n = self._rows(spec)
        side = state.side
        assert side is not None
        side.add_field("rq_codes", (n, h, d // 8), torch.uint8, 0)
        side.add_field("rq_factor", (n, h), torch.float32, 0.0)
        side.add_field("rq_cqk", (n, h), torch.float32, 0.0)
        pool = state.pool
        pool.add_field("rq_ck", (n, h, d), torch.float32, 0.0)
        pool.add_field("rq_cq", (n, h, d), torch.float32, 0.0)
        pool.add_field("rq_qlen", (n,), torch.int64, 0)  # positions [0, qlen) are quantised
        rot, dith = [], []
        for i in range(n):
            p, u = random_rotation(d, self.config.seed * 1_000_003 + i + self.config.dense_layers)
            rot.append(p)
            dith.append(u)
        self._rotation = torch.stack(rot).to(state.device) if n else None
        self._dither = torch.stack(dith).to(state.device) if n else None

    def rotation(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P [D, D], dither [D])`` of ``layer`` (a sparse layer)."""
        assert self._rotation is not None and self._dither is not None
        row = layer - self.config.dense_layers
        return self._rotation[row], self._dither[row]

    # -- quantisation -----------------------------------------------------------------------
    def _store(
        self,
        state: SelectorState,
        row: int,
        locations: torch.Tensor,
        keys: torch.Tensor,
        ck: torch.Tensor,
        cq: torch.Tensor,
        layer: int,
    ) -> None:
        """Quantise ``keys [..., Hkv, D]`` (centroids broadcast) and write them at
        ``locations [...]`` (``-1``: nowhere)."""
        p, _ = self.rotation(layer)
        finite = torch.isfinite(keys).flatten(-2).all(-1)  # [...]
        k = torch.where(finite.unsqueeze(-1).unsqueeze(-1), keys.float(), ck)
        codes, factor = quantize_keys(k, ck, p)
        cqk = (cq * k).sum(-1)
        side = state.side
        assert side is not None
        at = side.rows_of(locations.reshape(-1))
        side["rq_codes"][at, row] = codes.reshape(-1, *codes.shape[-2:])
        side["rq_factor"][at, row] = factor.reshape(-1, factor.shape[-1])
        side["rq_cqk"][at, row] = cqk.reshape(-1, cqk.shape[-1])

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
        """At prefill: each slot's centroids at ``layer`` from its prompt (the keys' mean, the
        mean of the group's ``queries``), then every full group of the prompt quantised into the
        side cache (at ``locations``, or the locations of ``kv`` itself). A later prompt into
        the slot (the next chunk) chooses the centroids again and re-quantises its full groups.
        A dense layer is a no-op."""
        ids, rows = self.check_prompt_observation(state, layer, slots, queries, kv, scaling, bounds)
        if layer < self.config.dense_layers:
            return
        spec = self._spec()
        h, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
        grp = self.config.group
        if locations is not None and tuple(locations.shape) != (kv.batch_size, kv.k.shape[2]):
            raise ValueError(
                f"locations must be [B={kv.batch_size}, L={kv.k.shape[2]}], got "
                f"{list(locations.shape)}"
            )
        row = layer - self.config.dense_layers
        pool = state.pool
        dev = pool.device
        for i, (slot, (st, n)) in enumerate(zip(ids, rows, strict=True)):
            if n < 1:
                continue
            keys = kv.k[i, :, st : st + n].float()  # [Hkv, n, D]
            ck = keys.mean(1)  # [Hkv, D]
            cq = queries[i].float().view(-1, h, g, d).mean(dim=(0, 2))  # [Hkv, D]
            pool["rq_ck"][slot, row] = ck.to(dev)
            pool["rq_cq"][slot, row] = cq.to(dev)
            full = (n // grp) * grp
            pool["rq_qlen"][slot, row] = full
            if full == 0:
                continue
            if locations is not None:
                loc = locations[i, st : st + full].to(dev)
            else:  # kv is the cache itself: its own locations
                pos = torch.full((kv.batch_size, full), -1, dtype=torch.long, device=kv.k.device)
                pos[i] = torch.arange(full, device=kv.k.device)
                loc = token_locations(kv, pos, state.row_stride)[i]
            self._store(
                state, row, loc.to(dev), keys[:, :full].transpose(0, 1).to(dev),
                ck.to(dev), cq.to(dev), layer,
            )  # fmt: skip

    def _quantize_next_group(
        self, plan: DecodePlan, layer: int, row: int, kv: KVLayout, state: SelectorState
    ) -> torch.Tensor:
        """Quantise, per sequence, the group after its quantised prefix when it is full; return
        the prefix lengths after (``[B]``)."""
        pool = state.pool
        slots = plan.slots
        grp = self.config.group
        b, h = kv.batch_size, kv.num_kv_heads
        qlen = pool["rq_qlen"][slots, row]  # [B]
        full = qlen + grp <= kv.seq_lens.long()
        pos = qlen.view(-1, 1) + torch.arange(grp, device=qlen.device).view(1, -1)  # [B, G]
        pos = torch.where(full.view(-1, 1), pos, -1)
        keys, _ = gather_kv(kv, pos.unsqueeze(1).expand(b, h, grp), values=False)
        loc = token_locations(kv, pos, state.row_stride)  # -1 where not full
        ck = pool["rq_ck"][slots, row].unsqueeze(1)  # [B, 1, Hkv, D]
        cq = pool["rq_cq"][slots, row].unsqueeze(1)
        self._store(state, row, loc, keys.transpose(1, 2), ck, cq, layer)
        qlen = qlen + full.long() * grp
        pool["rq_qlen"][slots, row] = qlen
        return qlen

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
        if layer < c.dense_layers:
            self.record(plan, layer, kv, None, None, None)
            return None
        row = layer - c.dense_layers
        side = state.side
        assert side is not None
        b, h, d, t = kv.batch_size, kv.num_kv_heads, kv.head_dim, kv.max_len
        qlen = self._quantize_next_group(plan, layer, row, kv, state)
        pos = torch.arange(t, device=qlen.device).view(1, -1)
        p, dither = self.rotation(layer)
        slots = plan.slots
        est = rabitq_logits(
            query,
            kv,
            side["rq_codes"][:, row],
            side["rq_factor"][:, row],
            side["rq_cqk"][:, row],
            state.pool["rq_ck"][slots, row],
            state.pool["rq_cq"][slots, row],
            p,
            dither,
            plan.scaling,
            row_stride=state.row_stride,
        )  # [B, Hkv, g, T]
        # Exact logits of the windows' positions, estimated ones of the other quantised ones.
        sink, local = self.windows(kv)
        win = torch.cat([sink, local], -1)  # [B, W] positions (-1: none)
        wpos = win.unsqueeze(1).expand(b, h, -1)
        wkeys, _ = gather_kv(kv, wpos, values=False)
        g = query.shape[1] // h
        q = query.float().view(b, h, g, d)
        exact = torch.einsum("bhgd,bhwd->bhgw", q, wkeys.float()) * plan.scaling
        in_win = self.window_block_mask(kv, t)  # [B, T]
        quantised = pos < qlen.view(-1, 1)
        exists = pos < kv.seq_lens.view(-1, 1)
        logits = torch.where((quantised & exists).view(b, 1, 1, t), est, float("-inf"))
        logits = logits.masked_fill(in_win.view(b, 1, 1, t), float("-inf"))
        wvalid = (win >= 0).view(b, 1, 1, -1)
        exact = torch.where(wvalid, exact, float("-inf"))
        both = torch.cat([logits, exact], -1)
        probs = torch.softmax(both, -1).nan_to_num(0.0).mean(2)  # [B, Hkv, T + W]
        mass, kept = probs[..., :t], probs[..., t:].sum(-1)
        eligible = (quantised & exists & ~in_win).unsqueeze(1) & ~bad.unsqueeze(-1)
        idx, _ = top_p_indices(mass, 1.0 - c.top_p, c.budget, eligible.expand_as(mass), kept)
        sel = self.compose(plan, kv, idx)
        codes_bytes = qlen.view(-1, 1).to(torch.float64) * (d // 8 + 8)
        elem = torch.empty((), dtype=kv.dtype).element_size()
        win_bytes = (win >= 0).sum(-1, keepdim=True).to(torch.float64) * (d * elem)
        self.record(plan, layer, kv, sel, None, codes_bytes + win_bytes)
        return sel
