"""``compkv``: compensation-aware block selection; every block left out still enters the softmax
as one term built from its key and value means.

A block of keys whose logits are nearly equal is summarised well by its mean key and mean value:
``Σ_{i∈B} e^{ℓ_i} v_i ≈ |B|·e^{q·μ_B·s}·v̄_B``. What such a summary misses grows with the spread
of the block's logits, estimated from the per-channel key variance. So CompKV reads exactly the
blocks whose summary would be worst (largest estimated mass times estimated logit variance) and
adds every other block as its one-term summary, merged with the exact part through the
log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels.compkv import block_compensation, block_estimates, block_validity
from prhs_kernels.kv import token_locations
from prhs_kernels.topk import topk_indices
from prhs_selectors.base import BaseSelector

__all__ = ["CompKV", "CompKVConfig"]

_FIELDS = ("ck_ksum", "ck_ksq", "ck_vsum")


@dataclass(frozen=True)
class CompKVConfig(SelectorConfig):
    """Hyperparameters of :class:`CompKV`: the shared fields, with ``block_size`` (``b``, the
    positions summarised by one mean) 16 by default. The budget ``k`` buys ``max(1, k // b)``
    blocks besides the blocks of the sink and local windows."""

    block_size: int = 16


@selectors.register(
    "compkv", config=CompKVConfig, summary="blocks by compensation residual + block-mean terms"
)
class CompKV(BaseSelector):
    """CompKV: read the blocks whose mean-key summary would err most; summarise the others.

    Keys are grouped in aligned blocks of ``b = block_size`` positions. Per block a side cache
    indexed by KV location keeps the key sum, the key sum of squares and the value sum (float32)
    and the count of keys, written by :meth:`write_kv` whenever the host writes K/V (a block's
    first slot resets them, later slots add in), so the key mean ``μ_B``, per-channel variance
    ``σ²_B`` and value mean ``v̄_B`` of every block are at hand without reading a key.

    For query head ``q`` with logit scale ``s``, block ``B``'s estimated softmax mass (up to the
    partition function) is ``|B|·e^{s·q·μ_B}`` and the estimated variance of its logits
    ``s²·Σ_j q_j²·σ²_{B,j}``; their product is the *compensation residual*, how much a one-term
    summary of the block can miss. Under GQA a block's score is the sum over the group's query
    heads of the residual divided by that head's estimated partition function ``Σ_B
    |B|·e^{s·q·μ_B}``, so every head weighs the same. The selection is the blocks of the sink
    and local windows plus the ``max(1, k // b)`` other blocks of largest score.

    Every block left out enters attention as one softmax term per query head, log-mass
    ``log|B| + s·q·μ_B`` and value ``v̄_B``: the selection's
    :class:`~prhs_core.selection.Compensation` is their log-sum-exp and their mass-weighted
    mean value, which :func:`prhs_kernels.sparse_decode_attention` merges with the attention
    over the selected blocks. With every block selected there is no compensation and the output
    is dense attention's.

    Stats: never a retrieval. ``proxy_bytes`` is the metadata read, ``(3·D + 1)·4`` bytes per
    block per KV head (three float32 vectors and the count). The value dimension must equal the
    key dimension. A paged KV pool must use pages of a multiple of ``block_size`` slots.
    """

    name = "compkv"
    config_type = CompKVConfig
    config: CompKVConfig

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + self.budget_blocks() + wl

    def side_page_size(self) -> int:
        return self.config.block_size

    def uses_side_cache(self) -> bool:
        return True

    def compensation_dims(self) -> tuple[int, int] | None:
        spec = self._spec()
        return spec.num_q_heads, spec.head_dim

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        side = state.side
        assert side is not None
        for name in _FIELDS:
            side.add_page_field(name, shape, torch.float32, 0.0)
        side.add_page_field("ck_count", (spec.num_layers,), torch.float32, 0.0)

    def write_side(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        finite: torch.Tensor,
    ) -> None:
        d = key.shape[-1]
        if value.shape[-1] != d:
            raise ValueError(
                f"compkv keeps value means beside key statistics of the same width: the value "
                f"dim must equal the key dim ({d}), got {value.shape[-1]}"
            )
        side = state.side
        assert side is not None
        ok = finite & torch.isfinite(value).flatten(1).all(-1)
        state.nonfinite.add_((finite & ~ok & (locations >= 0)).sum())
        page = side.pages_of(locations)
        first = torch.where(
            (locations >= 0) & (locations % side.page_size == 0), page, side.scratch_page
        )
        at = torch.where(ok, page, side.scratch_page)
        k = key.float()
        for name, rows in (("ck_ksum", k), ("ck_ksq", k * k), ("ck_vsum", value.float())):
            field = side[name][:, layer]  # [P + 1, Hkv, D], a view
            field.index_fill_(0, first, 0.0)
            field.index_add_(0, at, rows)
        count = side["ck_count"][:, layer]
        count.index_fill_(0, first, 0.0)
        count.index_add_(0, at, torch.ones_like(at, dtype=torch.float32))

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,
    ) -> Selection | None:
        side = state.side
        assert side is not None
        p = self.config.block_size
        b, h, d = kv.batch_size, kv.num_kv_heads, kv.head_dim
        hq = query.shape[1]
        if kv.value_dim != d:
            raise ValueError(
                f"compkv needs the value dim to equal the key dim ({d}), got {kv.value_dim}"
            )
        n_blocks = -(-kv.max_len // p)
        first_pos = torch.arange(n_blocks, device=kv.seq_lens.device) * p
        loc = token_locations(kv, first_pos.view(1, -1).expand(b, -1), state.row_stride)
        pages = side.pages_of(loc)  # [B, NB]
        count = side["ck_count"][:, layer]  # [P + 1], views: read in place
        fields = dict(block_size=p, kv_dtype=kv.dtype)
        log_mass, log_var = block_estimates(
            query, side["ck_ksum"][:, layer], side["ck_ksq"][:, layer], count, pages,
            kv.seq_lens, scaling=plan.scaling, **fields,
        )  # fmt: skip
        _, valid = block_validity(count, pages, kv.seq_lens, p)  # [B, NB]: exists, holds a key
        log_z = torch.logsumexp(log_mass, -1, keepdim=True)
        log_z = torch.where(torch.isfinite(log_z), log_z, torch.zeros_like(log_z))
        score = torch.exp(log_mass + log_var - log_z).sum(2)  # [B, Hkv, NB]
        eligible = self.block_eligible(kv, n_blocks) & valid
        eligible = eligible.unsqueeze(1) & ~bad.unsqueeze(-1)
        idx, _ = topk_indices(score, self.budget_blocks(), eligible.expand_as(score))
        sel = self.compose(plan, kv, idx)

        # Every valid block left out: one term per query head, merged by the attention.
        used = torch.where(sel.entry_mask(), sel.indices.long(), n_blocks)
        chosen = torch.zeros(b, h, n_blocks + 1, dtype=torch.bool, device=used.device)
        chosen.scatter_(-1, used, True)
        left = valid.unsqueeze(1) & ~chosen[..., :n_blocks] & ~bad.unsqueeze(-1)
        lm = log_mass.masked_fill(~left.unsqueeze(2), float("-inf"))
        c_lse = torch.logsumexp(lm, -1)  # [B, Hkv, g]
        c_safe = torch.where(torch.isfinite(c_lse), c_lse, torch.zeros_like(c_lse))
        weight = torch.exp(lm - c_safe.unsqueeze(-1))
        c_out = block_compensation(
            weight, side["ck_vsum"][:, layer], count, pages, kv.seq_lens, **fields
        )  # [B, Hkv, g, D]
        comp = sel.compensation
        assert comp is not None
        comp.lse.copy_(c_lse.reshape(b, hq))
        comp.out.copy_(c_out.reshape(b, hq, d))
        per_block = (3 * d + 1) * 4
        meta = self.num_blocks(kv).view(-1, 1).to(torch.float64) * per_block
        self.record(plan, layer, kv, sel, None, meta)
        return sel
