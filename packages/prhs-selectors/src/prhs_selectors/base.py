"""What every selector shares: budget, sink and local windows, GQA grouping, blocks and stats.

A method subclasses :class:`BaseSelector`, names its config class, declares its per-sequence
fields in :meth:`BaseSelector.init_fields` and implements :meth:`BaseSelector.select_step`.
Everything here is batched over sequences and KV heads: no Python loop over either.

GQA (SPEC.md §1): one decision per KV head; a position's score for a KV head is the mean of
its ``g`` query heads' attention probabilities (query head ``h`` belongs to KV head ``h // g``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prhs_core._checks import check_int
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.protocols import DecodeStep
from prhs_core.selection import Selection, StepStats
from prhs_core.state import SequenceStatePool

__all__ = [
    "BaseSelector",
    "GroupScores",
    "block_any",
    "block_max",
    "block_sum",
    "exact_group_scores",
    "exact_logits64",
    "make_selection",
    "topk_mask",
    "window_mask",
]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class GroupScores:
    """Exact attention scores of every cached key (what a retrieval reads).

    Attributes
    ----------
    logits:
        ``[B, Hkv, g, T]`` float32 logits per query head, ``-inf`` past each sequence's end.
    probs:
        ``[B, Hkv, T]`` the group-mean attention probability of each position.
    valid:
        ``[B, T]`` which positions exist.
    key_norms:
        ``[B, Hkv, T]`` ``‖k_i‖`` (0 past the end).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    valid: torch.Tensor
    key_norms: torch.Tensor


def exact_group_scores(step: DecodeStep) -> GroupScores:
    """Score every cached key of ``step`` exactly (float32)."""
    cache = step.cache
    b, hq, d = step.query.shape
    hkv = cache.num_kv_heads
    keys = cache.keys().float()  # [B, Hkv, T, D]
    q = step.query.reshape(b, hkv, hq // hkv, d).float()
    valid = cache.valid_mask()
    logits = torch.einsum("bhgd,bhtd->bhgt", q, keys) * step.scaling
    logits = logits.masked_fill(~valid.view(b, 1, 1, -1), NEG_INF)
    probs = torch.softmax(logits, dim=-1).mean(2)
    return GroupScores(logits, probs, valid, keys.norm(dim=-1))


def exact_logits64(step: DecodeStep) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float64 logits of every cached key, ``-inf`` past each end.

    For quantities that are certified (a dropped mass that a bound is built on), where float32
    rounding of the logits would show as a spurious violation.
    """
    cache = step.cache
    b, hq, d = step.query.shape
    hkv = cache.num_kv_heads
    q = step.query.reshape(b, hkv, hq // hkv, d).double()
    logits = torch.einsum("bhgd,bhtd->bhgt", q, cache.keys().double()) * step.scaling
    return logits.masked_fill(~cache.valid_mask().view(b, 1, 1, -1), NEG_INF)


def window_mask(seq_lens: torch.Tensor, max_len: int, n_sink: int, n_local: int) -> torch.Tensor:
    """``[B, max_len]`` bool: each row's first ``n_sink`` and last ``n_local`` positions."""
    t = torch.arange(max_len, device=seq_lens.device).view(1, -1)
    lens = seq_lens.view(-1, 1)
    return ((t < n_sink) | (t >= lens - n_local)) & (t < lens)


def topk_mask(scores: torch.Tensor, k: int, eligible: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` bool: the ``k`` highest ``scores`` among ``eligible`` positions (fewer if
    fewer are eligible). Ties go to the lower position."""
    t = scores.shape[-1]
    kk = min(k, t)
    if kk == 0:
        return torch.zeros_like(eligible)
    masked = scores.masked_fill(~eligible, NEG_INF)
    # A stable descending sort breaks ties by position, unlike topk.
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :kk]
    picked = torch.zeros_like(eligible).scatter_(-1, order, True)
    return picked & eligible


def _pad_to_blocks(x: torch.Tensor, s: int, fill: float | bool) -> torch.Tensor:
    t = x.shape[-1]
    nb = -(-t // s)
    if nb * s != t:
        pad = torch.full((*x.shape[:-1], nb * s - t), fill, dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=-1)
    return x.view(*x.shape[:-1], nb, s)


def block_max(scores: torch.Tensor, s: int) -> torch.Tensor:
    """``[..., ceil(T/s)]``: the max score of each aligned block of ``s`` positions."""
    return _pad_to_blocks(scores, s, NEG_INF).amax(-1)


def block_sum(values: torch.Tensor, s: int) -> torch.Tensor:
    """``[..., ceil(T/s)]``: the sum of each aligned block of ``s`` positions."""
    return _pad_to_blocks(values, s, 0.0).sum(-1)


def block_any(mask: torch.Tensor, s: int) -> torch.Tensor:
    """``[..., ceil(T/s)]``: whether any position of each aligned block is set."""
    return _pad_to_blocks(mask, s, False).any(-1)


def make_selection(
    mask: torch.Tensor,
    block_size: int,
    seq_lens: torch.Tensor,
    *,
    retrieved: torch.Tensor,
    proxy_bytes: torch.Tensor | None = None,
    delta_hat: torch.Tensor | None = None,
) -> Selection:
    """A :class:`Selection` (with stats) from a ``[B, Hkv, n]`` mask of positions or blocks."""
    base = Selection.from_mask(mask)
    sel = Selection(base.indices, block_size)
    _, hkv, n = mask.shape
    t = n * block_size
    num = sel.to_mask(seq_lens, t, hkv).sum(-1)
    stats = StepStats(retrieved, num, delta_hat, proxy_bytes)
    return Selection(sel.indices, block_size, stats)


class BaseSelector:
    """Shared machinery of the decode selectors.

    Subclasses set ``name`` and ``config_type`` and implement :meth:`select_step`; those with
    per-sequence memory also implement :meth:`init_fields`.
    """

    name: ClassVar[str] = "base"
    config_type: ClassVar[type[SelectorConfig]] = SelectorConfig

    def __init__(self, config: SelectorConfig | None = None) -> None:
        if config is None:
            config = self.config_type()
        if not isinstance(config, self.config_type):
            raise TypeError(
                f"{type(self).__name__} takes a {self.config_type.__name__}, "
                f"got {type(config).__name__}"
            )
        self.config = config
        self.spec: AttentionSpec | None = None
        self.max_seq_len = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # -- state ----------------------------------------------------------------------------
    def init_state(
        self,
        spec: AttentionSpec,
        capacity: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
    ) -> SequenceStatePool:
        """A pool for ``capacity`` sequences of up to ``max_seq_len`` positions of ``spec``."""
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        check_int("max_seq_len", max_seq_len, minimum=1)
        pool = SequenceStatePool(capacity, device)
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.init_fields(pool, spec, max_seq_len)
        return pool

    def init_fields(self, pool: SequenceStatePool, spec: AttentionSpec, max_seq_len: int) -> None:
        """Declare per-sequence fields (none by default)."""

    # -- selection ------------------------------------------------------------------------
    def select(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        """Validate ``step`` against the model the state was made for, then select."""
        if not isinstance(step, DecodeStep):
            raise TypeError(f"step must be a DecodeStep, got {type(step).__name__}")
        spec = self.spec
        if spec is None:
            raise RuntimeError(f"{self.name}: call init_state(...) before select(...)")
        if step.layer >= spec.num_layers:
            raise ValueError(f"layer {step.layer} is out of range for {spec.num_layers} layers")
        if step.layer not in spec.selectable_layers:
            raise ValueError(f"layer {step.layer} is a sliding-window layer; it is not selected")
        if step.cache.num_kv_heads != spec.num_kv_heads or step.query.shape[1] != spec.num_q_heads:
            raise ValueError(
                f"step has Hq={step.query.shape[1]}, Hkv={step.cache.num_kv_heads}; the state "
                f"was made for Hq={spec.num_q_heads}, Hkv={spec.num_kv_heads}"
            )
        if step.cache.max_seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {step.cache.max_seq_len} exceeds the state's max_seq_len "
                f"{self.max_seq_len}"
            )
        return self.select_step(step, state)

    def select_step(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        """The method itself (``step`` already validated)."""
        raise NotImplementedError

    # -- helpers for subclasses -----------------------------------------------------------
    def windows(self, step: DecodeStep) -> torch.Tensor:
        """``[B, 1, T]`` the sink and local windows, always selected."""
        c = self.config
        return window_mask(step.cache.seq_lens, step.cache.max_seq_len, c.n_sink, c.n_local)[
            :, None
        ]

    def budget_blocks(self) -> int:
        """The budget in blocks: ``max(1, k // s)``."""
        return max(1, self.config.budget // self.config.block_size)

    def retrieval_bytes(self, step: DecodeStep) -> torch.Tensor:
        """``[B, 1]`` bytes of keys read by scoring every cached key."""
        d = step.cache.head_dim
        return step.cache.seq_lens.view(-1, 1).to(torch.float64) * d * step.query.element_size()

    def topk_with_windows(self, step: DecodeStep, scores: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, n]`` (positions, or blocks when ``s > 1``): the windows plus the top
        ``k`` (or ``k/s`` blocks, by their max score) of the remaining positions."""
        win = self.windows(step).expand_as(scores)
        valid = step.cache.valid_mask()[:, None].expand_as(scores)
        s = self.config.block_size
        if s == 1:
            return topk_mask(scores, self.config.budget, valid & ~win) | win
        win_b = block_any(win, s)
        valid_b = block_any(valid, s)
        picked = topk_mask(block_max(scores, s), self.budget_blocks(), valid_b & ~win_b)
        return picked | win_b
