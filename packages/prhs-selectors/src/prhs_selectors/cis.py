"""``cis``: Critical-Index Sharing, PrHS's selector on the time axis (SPEC.md §3).

Consecutive decoding queries of a head are similar, and so are their critical indices. CIS keeps,
per (sequence, layer, KV head), an *anchor*: the query that last scored every key, its critical
set ``S_a`` and when it was made. A new query close enough to the anchor reuses ``S_a`` (dilated
around its strongest entries) instead of scoring the cache again; otherwise it retrieves and
becomes the new anchor.

Two reuse rules:

- paper mode (``delta_max=None``): reuse iff ``cos(q, q_a) ≥ τ`` and ``t − t_a ≤ n_local``;
- certified mode (``delta_max`` set): reuse iff the pre-hoc certificate
  ``δ̂ = δ_a e^{2ε} / (δ_a e^{2ε} + 1 − δ_a) ≤ δ_max`` holds, with
  ``ε = max_h ‖q_h − q_{a,h}‖ · K_max · scaling`` (SPEC §2.5), and also the paper rule unless
  ``require_cosine=False``. A retrieval then picks the smallest top set with
  ``δ ≤ delta_target`` (top-p), capped at ``k_max`` positions.

Reading of the certificate's anchor set (ours): ``δ_a`` is the anchor query's dropped mass of
``A = sink ∪ dilate(S_a)``. Every later reuse reads ``A``, plus the local window, which holds
every position added since the anchor (``t − t_a ≤ n_local``). So ``δ(S_t; q) ≤ δ̂`` holds for
the set actually read, with no assumption on the local window at anchor time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prhs_core._checks import check_int, check_probability
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.protocols import DecodeStep
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SequenceStatePool
from prhs_core.theory import log_reuse_certificate, ranks_from_order
from prhs_selectors.base import (
    BaseSelector,
    GroupScores,
    block_any,
    block_max,
    block_sum,
    exact_group_scores,
    exact_logits64,
    make_selection,
    topk_mask,
)

__all__ = ["CIS", "CISConfig", "dilate_blocks", "group_log_dropped_mass"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class CISConfig(SelectorConfig):
    """Hyperparameters of CIS (defaults from SPEC.md §3).

    Parameters
    ----------
    budget:
        ``k``, positions chosen at a retrieval (``k/s`` blocks), sink and local not counted.
    n_sink, n_local:
        Always-selected windows; ``n_local`` also bounds how long an anchor lives.
    block_size:
        ``s``: selection and reading in aligned blocks (CIS-8, CIS-16); 1 is per token.
    tau:
        Cosine threshold ``τ`` between the group's concatenated queries and the anchor's.
    n_den:
        Dilation density: the top ``m = ⌊k/n_den⌋`` positions (blocks) of ``S_a`` are dilated.
    r:
        Dilation radius: each dilated ``p`` adds ``p ± j`` for ``1 ≤ j ≤ r``.
    delta_max:
        Certified mode when set: reuse only if ``δ̂ ≤ delta_max``.
    require_cosine:
        In certified mode, also require the paper rule (``True``: "additionally") or use the
        certificate alone (``False``: "instead").
    delta_target:
        Certified retrieval: the top-p set's dropped-mass target (default ``delta_max / 2``).
    k_max:
        Certified retrieval: cap on the top-p set, in positions (default ``4·k``).
    """

    budget: int = 64
    n_sink: int = 4
    n_local: int = 32
    block_size: int = 8
    tau: float = 0.8
    n_den: int = 3
    r: int = 1
    delta_max: float | None = None
    require_cosine: bool = True
    delta_target: float | None = None
    k_max: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.tau, bool) or not isinstance(self.tau, int | float):
            raise TypeError(f"tau must be a float, got {type(self.tau).__name__}")
        if not -1.0 <= self.tau <= 1.0:
            raise ValueError(f"tau is a cosine threshold and must lie in [-1, 1], got {self.tau}")
        check_int("n_den", self.n_den, minimum=1)
        check_int("r", self.r, minimum=0)
        if not isinstance(self.require_cosine, bool):
            raise TypeError("require_cosine must be a bool")
        if self.delta_max is None:
            if not self.require_cosine:
                raise ValueError(
                    "require_cosine=False needs delta_max: there would be no reuse rule"
                )
            if self.delta_target is not None or self.k_max is not None:
                raise ValueError("delta_target and k_max apply to certified mode: set delta_max")
            return
        check_probability("delta_max", self.delta_max)
        if not 0.0 < self.delta_max < 1.0:
            raise ValueError(f"delta_max must lie in (0, 1), got {self.delta_max}")
        if self.delta_target is not None:
            check_probability("delta_target", self.delta_target)
            if not 0.0 <= self.delta_target <= self.delta_max:
                raise ValueError(
                    f"delta_target ({self.delta_target}) must lie in "
                    f"[0, delta_max={self.delta_max}]"
                )
        if self.k_max is not None:
            check_int("k_max", self.k_max, minimum=self.budget)

    @property
    def certified(self) -> bool:
        """Whether the certificate gates reuse."""
        return self.delta_max is not None

    @property
    def retrieval_target(self) -> float:
        """Top-p dropped-mass target of a certified retrieval."""
        assert self.delta_max is not None
        return self.delta_target if self.delta_target is not None else self.delta_max / 2

    @property
    def retrieval_cap(self) -> int:
        """Cap of a certified retrieval's set, in positions."""
        return self.k_max if self.k_max is not None else 4 * self.budget


def dilate_blocks(anchor: torch.Tensor, score: torch.Tensor, m: int, r: int) -> torch.Tensor:
    """``dilate(S_a)``: ``S_a`` plus ``p ± j`` (``1 ≤ j ≤ r``) for its top ``m`` entries by score.

    ``anchor``: ``[..., n]`` bool; ``score``: ``[..., n]``. Neighbours past either end are dropped.
    """
    out = anchor.clone()
    if m <= 0 or r <= 0:
        return out
    top = topk_mask(score, m, anchor)
    for j in range(1, r + 1):
        out[..., j:] |= top[..., :-j]
        out[..., :-j] |= top[..., j:]
    return out


def group_log_dropped_mass(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``log`` of the group-mean dropped mass, float64; ``logits [B, H, g, T]``, ``keep [B, H, T]``.

    The group's dropped mass is the mean of its query heads' (GQA, SPEC §1); each head's is
    computed as its dropped set's own mass in log space (SPEC §2.7).
    """
    lg = logits.double()
    lse_all = torch.logsumexp(lg, dim=-1)
    lse_drop = torch.logsumexp(lg.masked_fill(keep.unsqueeze(2), NEG_INF), dim=-1)
    per_head = lse_drop - lse_all  # [B, H, g]
    return torch.logsumexp(per_head, dim=-1) - math.log(per_head.shape[-1])


@selectors.register(
    "cis", config=CISConfig, summary="PrHS time axis: reuse an anchor's critical set"
)
class CIS(BaseSelector):
    """Critical-Index Sharing (Gao et al., "Near-Oracle KV Selection via Pre-hoc Sparsity for
    Long-Context Inference", arXiv:2602.08329), in paper or certified mode; see the module
    docstring for the rules and :class:`CISConfig` for the hyperparameters.

    Per-sequence state (per layer and KV head): the anchor's queries ``[g, D]``, its length
    ``t_a``, its critical blocks and their anchor scores, ``log δ_a`` and ``K_max``.
    """

    name = "cis"
    config_type = CISConfig
    config: CISConfig

    def init_fields(self, pool: SequenceStatePool, spec: AttentionSpec, max_seq_len: int) -> None:
        n_l, h, g, d = spec.num_layers, spec.num_kv_heads, spec.group_size, spec.head_dim
        nb = -(-max_seq_len // self.config.block_size)
        pool.add_field("anchor_q", (n_l, h, g, d), torch.float32)
        pool.add_field("anchor_len", (n_l, h), torch.long, 0)
        pool.add_field("anchor_set", (n_l, h, nb), torch.bool, False)
        pool.add_field("anchor_score", (n_l, h, nb), torch.float32, 0.0)
        pool.add_field("anchor_log_delta", (n_l, h), torch.float64, 0.0)
        pool.add_field("anchor_kmax", (n_l, h), torch.float32, 0.0)

    # -- pieces -----------------------------------------------------------------------------
    def _dilation_m(self) -> int:
        return self.budget_blocks() // self.config.n_den

    def _reuse_blocks(
        self, anchor_set: torch.Tensor, anchor_score: torch.Tensor, nb: int
    ) -> torch.Tensor:
        c = self.config
        return dilate_blocks(anchor_set[..., :nb], anchor_score[..., :nb], self._dilation_m(), c.r)

    def _retrieve_blocks(
        self,
        scores: GroupScores,
        block_score: torch.Tensor,
        win_b: torch.Tensor,
        valid_b: torch.Tensor,
        sink_b: torch.Tensor,
    ) -> torch.Tensor:
        """``S_a`` for a retrieval, ``[B, H, nb]`` blocks (sink and local blocks excluded).

        ``block_score`` is each block's max group probability; the masks are ``[B, H, nb]``.
        """
        c = self.config
        if not c.certified:
            return topk_mask(block_score, self.budget_blocks(), valid_b & ~win_b)
        # Certified: smallest top set of blocks (by mass) with δ(sink ∪ S) ≤ target, capped.
        mass = block_sum(scores.probs.double(), c.block_size)
        kept_sink = (mass * sink_b).sum(-1, keepdim=True)
        cand = mass.masked_fill(~(valid_b & ~sink_b), NEG_INF)
        sorted_mass, order = torch.sort(cand, dim=-1, descending=True, stable=True)
        dropped_after = 1.0 - kept_sink - torch.cumsum(sorted_mass.clamp_min(0), dim=-1)
        need = 1 + (dropped_after > c.retrieval_target).sum(-1, keepdim=True)
        need = need.clamp(max=max(1, c.retrieval_cap // c.block_size))
        return (ranks_from_order(order) < need) & valid_b & ~sink_b

    def _to_tokens(self, blocks: torch.Tensor, t: int) -> torch.Tensor:
        s = self.config.block_size
        return blocks.repeat_interleave(s, dim=-1)[..., :t]

    # -- the step ---------------------------------------------------------------------------
    def select_step(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        c = self.config
        cache = step.cache
        b, hq, d = step.query.shape
        h = cache.num_kv_heads
        g = hq // h
        s = c.block_size
        t_max = cache.max_seq_len
        nb = -(-t_max // s)
        layer, slots = step.layer, step.slots
        dev = step.query.device
        seq_lens = cache.seq_lens.view(-1, 1)  # [B, 1]

        q = step.query.reshape(b, h, g, d).float()
        qa = state["anchor_q"][slots, layer]
        ta = state["anchor_len"][slots, layer]
        a_set = state["anchor_set"][slots, layer]
        a_score = state["anchor_score"][slots, layer]
        a_logd = state["anchor_log_delta"][slots, layer]
        a_kmax = state["anchor_kmax"][slots, layer]

        reuse = (ta > 0) & (seq_lens - ta <= c.n_local) & (seq_lens >= ta)
        if c.require_cosine:
            cos = torch.nn.functional.cosine_similarity(q.flatten(-2), qa.flatten(-2), dim=-1)
            reuse &= cos >= c.tau
        log_dhat: torch.Tensor | None = None
        if c.certified:
            # K_max over every key: the anchor's, and the (at most n_local) keys added since.
            offs = torch.arange(c.n_local + 1, device=dev)
            new_pos = ta.unsqueeze(-1) + offs  # [B, H, n_local+1]
            new_pos = torch.where(new_pos < seq_lens.unsqueeze(-1), new_pos, -1)
            new_keys, _ = cache.gather(new_pos)
            kmax = torch.maximum(a_kmax, new_keys.float().norm(dim=-1).amax(-1))
            eps = (q - qa).norm(dim=-1).amax(-1) * kmax * step.scaling  # max over the group
            log_dhat = log_reuse_certificate(a_logd, eps.double())
            reuse &= log_dhat <= math.log(c.delta_max)  # type: ignore[arg-type]

        win_b = block_any(self.windows(step).expand(b, h, t_max), s)
        valid_b = block_any(cache.valid_mask()[:, None].expand(b, h, t_max), s)
        chosen = (self._reuse_blocks(a_set, a_score, nb) | win_b) & valid_b
        retrieve = ~reuse
        delta_hat = torch.exp(log_dhat).float() if log_dhat is not None else None
        proxy = torch.full((b, h), float(g * d * 4), dtype=torch.float64, device=dev)

        if bool(retrieve.any()):
            scores = exact_group_scores(step)
            sink_b = block_any(self._sink_tokens(b, h, t_max, dev), s)
            new_score = block_max(scores.probs, s)
            new_set = self._retrieve_blocks(scores, new_score, win_b, valid_b, sink_b)
            fresh = (new_set | win_b) & valid_b
            chosen = torch.where(retrieve.unsqueeze(-1), fresh, chosen)
            if c.certified:
                # δ_a (of sink ∪ dilate(S_a)) and a retrieval's own δ are what the bound rests
                # on: float64 logits.
                logits64 = exact_logits64(step)
                valid = scores.valid[:, None]
                anchor_keep = self._to_tokens(
                    self._reuse_blocks(new_set, new_score, nb) | sink_b, t_max
                )
                log_d_anchor = group_log_dropped_mass(logits64, anchor_keep & valid)
                read = self._to_tokens(fresh, t_max) & valid
                exact = torch.exp(group_log_dropped_mass(logits64, read)).float()
                assert delta_hat is not None
                delta_hat = torch.where(retrieve, exact, delta_hat)
            else:
                log_d_anchor = torch.zeros(b, h, dtype=torch.float64, device=dev)
            kmax_all = scores.key_norms.amax(-1)
            self._write_anchor(
                state,
                layer,
                slots,
                retrieve,
                q,
                seq_lens.expand(b, h),
                new_set,
                new_score,
                log_d_anchor,
                kmax_all,
                qa,
                ta,
                a_set,
                a_score,
                a_logd,
                a_kmax,
                nb,
            )
            proxy = torch.where(retrieve, self.retrieval_bytes(step).expand(b, h), proxy)

        return make_selection(
            chosen, s, cache.seq_lens, retrieved=retrieve, proxy_bytes=proxy, delta_hat=delta_hat
        )

    def _sink_tokens(self, b: int, h: int, t: int, dev: torch.device) -> torch.Tensor:
        pos = torch.arange(t, device=dev).view(1, 1, -1)
        return (pos < self.config.n_sink).expand(b, h, t)

    def _write_anchor(
        self,
        state: SequenceStatePool,
        layer: int,
        slots: torch.Tensor,
        retrieve: torch.Tensor,
        q: torch.Tensor,
        t: torch.Tensor,
        new_set: torch.Tensor,
        new_score: torch.Tensor,
        new_logd: torch.Tensor,
        new_kmax: torch.Tensor,
        qa: torch.Tensor,
        ta: torch.Tensor,
        a_set: torch.Tensor,
        a_score: torch.Tensor,
        a_logd: torch.Tensor,
        a_kmax: torch.Tensor,
        nb: int,
    ) -> None:
        """Make the step's query the anchor of every retrieving (sequence, head)."""
        r = retrieve
        width = a_set.shape[-1]
        pad = width - nb
        set_full = torch.nn.functional.pad(new_set, (0, pad), value=False)
        score_full = torch.nn.functional.pad(new_score.float(), (0, pad), value=0.0)
        state["anchor_q"][slots, layer] = torch.where(r[..., None, None], q, qa)
        state["anchor_len"][slots, layer] = torch.where(r, t, ta)
        state["anchor_set"][slots, layer] = torch.where(r.unsqueeze(-1), set_full, a_set)
        state["anchor_score"][slots, layer] = torch.where(r.unsqueeze(-1), score_full, a_score)
        state["anchor_log_delta"][slots, layer] = torch.where(r, new_logd, a_logd)
        state["anchor_kmax"][slots, layer] = torch.where(r, new_kmax.float(), a_kmax)
