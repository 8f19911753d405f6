"""``hshare``: Double Sparsity's selection, shared across decoding queries, heads and layers.

Wu, Li, Dong, Li, Sun, Wang and Zhang, "HShare: Fast LLM Decoding by Hierarchical Key-Value
Sharing", ICLR 2025. The critical positions of one query, head or layer are largely those of its
neighbours, so many of them need not be searched for: a selection is made every ``query_share``
steps and reused in between, half of the heads copy the selection of the head whose critical
set overlapped theirs most at prefill, and half of the layers copy an earlier layer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prhs_core.checks import check_int
from prhs_core.config import AttentionSpec
from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels.topk import topk_indices
from prhs_selectors.double_sparsity import DoubleSparsity, DoubleSparsityConfig

__all__ = ["HShare", "HShareConfig", "greedy_pairs"]


def _check_share(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0.0 <= value <= 0.5:
        raise ValueError(
            f"{name} is the share of followers and must lie in [0, 0.5] (a follower copies a "
            f"leader, so at most half can follow), got {value}"
        )
    return float(value)


@dataclass(frozen=True)
class HShareConfig(DoubleSparsityConfig):
    """Hyperparameters of :class:`HShare`: those of
    :class:`~prhs_selectors.double_sparsity.DoubleSparsityConfig` (its proxy) and three sharing
    levels. ``query_share=1, head_share=0, layer_share=0`` switches sharing off (the selection
    is then Double Sparsity's).

    Parameters
    ----------
    query_share:
        ``n_q``: a (layer, KV head) searches at every ``n_q``-th decode step and reuses that
        selection in between (at least 1).
    head_share:
        Share of each layer's KV heads that copy another head's selection, in ``[0, 0.5]``
        (the paper's 16 of 32 heads: 0.5); ``⌊share·Hkv⌋`` followers.
    layer_share:
        Share of the selectable layers that copy an earlier layer's selection, in ``[0, 0.5]``
        (the paper's 16 of 32 layers: 0.5).
    """

    query_share: int = 2
    head_share: float = 0.5
    layer_share: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("query_share", self.query_share, minimum=1)
        object.__setattr__(self, "head_share", _check_share("head_share", self.head_share))
        object.__setattr__(self, "layer_share", _check_share("layer_share", self.layer_share))

    def sharing(self) -> bool:
        """Whether the pattern is computed at prefill (head or layer sharing is on)."""
        return self.head_share > 0 or self.layer_share > 0


def greedy_pairs(overlap: torch.Tensor, followers: int) -> list[int]:
    """Pair items greedily by largest ``overlap [N, N]`` (symmetric; the diagonal is ignored):
    take the pair of largest overlap among items not yet paired and make its later item follow
    the earlier one (layers run in order, so a follower layer's leader has already selected),
    until ``followers`` pairs are made (at most ``N // 2``). Returns ``src [N]``: ``src[i]`` is
    the item ``i`` copies (``i`` for a leader). Ties go to the smaller indices."""
    n = overlap.shape[0]
    src = list(range(n))
    want = min(followers, n // 2)
    if want <= 0:
        return src
    pairs = [
        (-float(overlap[i, j]), i, j) for i in range(n) for j in range(i + 1, n)
    ]  # i < j: j follows i
    pairs.sort()
    used: set[int] = set()
    made = 0
    for _, i, j in pairs:
        if made == want:
            break
        if i in used or j in used:
            continue
        src[j] = i
        used.update((i, j))
        made += 1
    return src


@selectors.register(
    "hshare", config=HShareConfig, summary="DS selection shared over queries, heads, layers"
)
class HShare(DoubleSparsity):
    """HShare: Double Sparsity's top-k, searched for only where no neighbour's can be reused.

    **Pattern (at prefill).** For every selectable layer and KV head the critical set of the
    prompt's last query is its top ``k`` positions by exact group-mean attention outside the
    sink and local windows. Within each layer, the KV heads are paired greedily by the overlap
    of their critical sets (:func:`greedy_pairs`): ``⌊head_share·Hkv⌋`` heads become followers
    of their pair's other head. The selectable layers are paired the same way by their overlap
    summed over heads, and ``⌊layer_share·N⌋`` later layers follow an earlier one. The pattern is
    per request (chosen from its own prompt); a slot whose prompt was not observed shares
    nothing across heads and layers. Choosing it reads the overlaps on the host, once per
    prompt and layer (a prefill-time sync).

    **Decode.** A (layer, KV head) searches at the steps where its step count is a multiple of
    ``query_share`` and otherwise reuses its last selection. A search is Double Sparsity's: the
    top ``k`` positions by label-channel proxy (``k/s`` blocks); a follower head takes its
    leader's search of the same step, and a follower layer takes its leader layer's selection of
    the same step. The sink and local windows are added to every selection. A row with a
    non-finite query keeps its last selection in the state and reads only the windows and what
    it copies.

    Stats: never a retrieval. ``proxy_bytes`` counts the label channels read by the rows that
    search at the step (leader heads of leader layers at a search step), as Double Sparsity's;
    the torch path computes the proxy for every row and uses the leaders'.
    """

    name = "hshare"
    config_type = HShareConfig
    config: HShareConfig

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        super().init_fields(state, spec, kv_dtype)
        n, h = spec.num_layers, spec.num_kv_heads
        kb = self.budget_blocks()
        pool = state.pool
        pool.add_field("hs_idx", (n, h, kb), torch.int32, -1)  # last top-k blocks, -1: none
        pool.add_field("hs_step", (n,), torch.int64, 0)
        pool.add_field("hs_head_src", (n, h), torch.int64, -1)  # -1: itself
        pool.add_field("hs_layer_src", (n,), torch.int64, -1)

    def prompt_queries(self) -> int:
        c = self.config
        own = super().prompt_queries()
        return max(own, 2) if c.sharing() else own

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
        pool = state.pool
        slots = plan.slots
        h = kv.num_kv_heads
        kb = self.budget_blocks()
        probs = self.proxy_probs(plan, layer, query, kv, state)
        fresh_idx, _, _ = self.topk_blocks(kv, probs, kb, bad)  # [B, Hkv, kb] int32
        heads = torch.arange(h, device=slots.device)
        head_src = pool["hs_head_src"][slots, layer]  # [B, Hkv]
        head_src = torch.where(head_src >= 0, head_src, heads)
        shared = torch.gather(fresh_idx, 1, head_src.unsqueeze(-1).expand(-1, -1, kb))
        layer_src = pool["hs_layer_src"][slots, layer]  # [B]
        follows = (layer_src >= 0).view(-1, 1, 1)
        from_leader = pool["hs_idx"][slots, layer_src.clamp(min=0)]  # this step's, written
        shared = torch.where(follows, from_leader, shared)
        step = pool["hs_step"][slots, layer]  # [B]
        search = (step % c.query_share == 0).view(-1, 1, 1)
        last = pool["hs_idx"][slots, layer]
        idx = torch.where(search, shared, last)
        pool["hs_idx"][slots, layer] = torch.where(bad.unsqueeze(-1), last, idx)
        pool["hs_step"][slots, layer] = step + 1
        sel = self.compose(plan, kv, idx)
        searched = search.view(-1, 1) & (head_src == heads) & ~follows.view(-1, 1)
        self.record(plan, layer, kv, sel, None, self.proxy_bytes(kv) * searched)
        return sel

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
        """Choose each slot's labels (without a channels table, as Double Sparsity) and its
        sharing pattern at ``layer``: the head pairs from the critical sets of the prompt's last
        query; at the last selectable layer, the layer pairs. Every step count restarts, so
        the first decode step searches."""
        if not self.prompt_queries():
            return
        ids, rows = self.check_prompt_observation(state, layer, slots, queries, kv, scaling, bounds)
        super().observe_prompt(state, layer, slots, queries, kv, scaling, rows)
        c = self.config
        spec = self._spec()
        pool = state.pool
        h, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
        kb = self.budget_blocks()
        s = self.block_size
        for i, (slot, (st, n)) in enumerate(zip(ids, rows, strict=True)):
            pool["hs_step"][slot] = 0
            if not c.sharing() or n < 1:
                continue
            keys = kv.k[i, :, st : st + n].float()  # [Hkv, n, D]
            q = queries[i, -1].float().reshape(h, g, d)
            probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * scaling, -1).mean(1)
            one = ContiguousKV(
                kv.k[i : i + 1, :, st : st + n],
                kv.v[i : i + 1, :, st : st + n],
                torch.full((1,), n, dtype=torch.int32, device=kv.k.device),
            )
            blocks = self.block_eligible(one, -(-n // s))[0]  # [NB]
            block_probs = probs.new_full((h, blocks.shape[0] * s), float("-inf"))
            block_probs[:, :n] = probs
            block_probs = block_probs.view(h, -1, s).amax(-1)
            crit, _ = topk_indices(block_probs, kb, blocks.expand(h, -1).contiguous())
            pool["hs_idx"][slot, layer] = crit.to(pool.device, torch.int32)
            member = torch.zeros(h, blocks.shape[0] + 1, device=crit.device)
            member.scatter_(1, torch.where(crit >= 0, crit, blocks.shape[0]).long(), 1.0)
            member = member[:, :-1]
            overlap = member @ member.T
            src = greedy_pairs(overlap.cpu(), int(c.head_share * h))
            pool["hs_head_src"][slot, layer] = torch.tensor(
                [x if x != j else -1 for j, x in enumerate(src)], device=pool.device
            )
            if layer == max(spec.selectable_layers):
                self._pair_layers(state, slot, n)

    def _pair_layers(self, state: SelectorState, slot: int, n: int) -> None:
        """The layer pattern of ``slot`` from every selectable layer's critical sets (held in
        ``hs_idx`` since prefill)."""
        spec = self._spec()
        pool = state.pool
        layers = list(spec.selectable_layers)
        nb = -(-n // self.block_size)
        crit = pool["hs_idx"][slot, layers].long()  # [L, Hkv, kb]
        member = torch.zeros(*crit.shape[:2], nb + 1, device=crit.device)
        member.scatter_(2, torch.where(crit >= 0, crit, nb), 1.0)
        member = member[..., :-1].flatten(1)  # [L, Hkv * NB]
        overlap = (member @ member.T).cpu()
        src = greedy_pairs(overlap, int(self.config.layer_share * len(layers)))
        table = torch.full((spec.num_layers,), -1, dtype=torch.int64)
        for j, x in enumerate(src):
            if x != j:
                table[layers[j]] = layers[x]
        pool["hs_layer_src"][slot] = table.to(pool.device)
