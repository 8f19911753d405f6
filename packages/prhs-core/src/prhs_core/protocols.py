"""The contracts between hosts (transformers, SGLang, benchmarks) and selectors.

One decode step, per selectable layer::

    host: writes the new K/V into its cache, builds a KVCacheView and a DecodeStep
    selector.select(step, state) -> Selection   (indices [B, Hkv, K] + StepStats)
    host: sparse attention over the selection (prhs-kernels), then pool.append(slots, 1)
          once per step after the last layer.

Prefill (optional, for PSAW / ETF): a selector that also implements :class:`PrefillPlanner`
gives, per layer, a :class:`PrefillLayerPlan`: a per-row window lower bound and/or a frozen
prefix that the host's prefill attention and decoder layer honour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from prhs_core._checks import check_float_tensor, check_index_tensor, check_int
from prhs_core.cache import KVCacheView
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.selection import Selection
from prhs_core.state import SequenceStatePool

__all__ = ["DecodeSelector", "DecodeStep", "PrefillLayerPlan", "PrefillPlanner"]


@dataclass(frozen=True)
class DecodeStep:
    """The inputs of one layer's selection at one decode step.

    Attributes
    ----------
    layer:
        Layer index ``ℓ`` (into the model's layers, sliding ones included).
    query:
        ``[B, Hq, D]`` the step's queries, after RoPE (what attention will use).
    cache:
        The layer's cache, the current token's key/value already written.
    slots:
        ``[B]`` int64 the state-pool slot of each sequence in the batch.
    scaling:
        Logit scale (``1/sqrt(D)`` unless the model says otherwise).
    """

    layer: int
    query: torch.Tensor
    cache: KVCacheView
    slots: torch.Tensor
    scaling: float

    def __post_init__(self) -> None:
        check_int("layer", self.layer, minimum=0)
        check_float_tensor("query", self.query, ndim=3)
        if not isinstance(self.cache, KVCacheView):
            raise TypeError(f"cache must be a KVCacheView, got {type(self.cache).__name__}")
        b, hq, d = self.query.shape
        c = self.cache
        if b != c.batch_size or d != c.head_dim:
            raise ValueError(
                f"query [B, Hq, D] = {list(self.query.shape)} does not match the cache "
                f"(B={c.batch_size}, D={c.head_dim})"
            )
        if hq % c.num_kv_heads:
            raise ValueError(
                f"query heads ({hq}) must be a multiple of the cache's KV heads ({c.num_kv_heads})"
            )
        check_index_tensor("slots", self.slots, ndim=1)
        if self.slots.shape[0] != b:
            raise ValueError(f"slots must have shape [B={b}], got {list(self.slots.shape)}")
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, int | float):
            raise TypeError(f"scaling must be a float, got {type(self.scaling).__name__}")
        if not (math.isfinite(self.scaling) and self.scaling > 0):
            raise ValueError(f"scaling must be a positive finite float, got {self.scaling}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.query.shape[1] // self.cache.num_kv_heads


@runtime_checkable
class DecodeSelector(Protocol):
    """Chooses, at each decode step, the positions each (sequence, KV head) reads.

    ``select`` is vectorised over the batch and the heads, never looping in Python over either;
    all per-sequence memory lives in the pool made by ``init_state``.
    """

    config: SelectorConfig

    def init_state(
        self,
        spec: AttentionSpec,
        capacity: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
    ) -> SequenceStatePool:
        """A pool sized for ``capacity`` live sequences of up to ``max_seq_len`` positions."""
        ...

    def select(self, step: DecodeStep, state: SequenceStatePool) -> Selection:
        """The selection for ``step``; may update the state of ``step.slots`` (anchors, scores)."""
        ...


@dataclass(frozen=True)
class PrefillLayerPlan:
    """How one layer's prefill attention is restricted (SPEC.md §3, PSAW and ETF).

    Attributes
    ----------
    layer:
        Layer index ``ℓ``.
    prompt_len:
        ``L``, the prompt length the plan was made for.
    n_sink:
        Row ``i`` always sees positions ``[0, min(n_sink, i + 1))``.
    window_start:
        ``[L]`` int64 ``P_ℓ(i)``: row ``i`` sees ``[P_ℓ(i), i]`` beside the sinks; ``None``
        means the usual causal row ``[0, i]`` (PSAW off at this layer).
    frozen_prefix:
        ``E_ℓ``: rows ``[0, E_ℓ)`` are frozen at this layer (ETF): no query, attention output or
        MLP is computed for them; their keys/values are still computed from the frozen hidden
        state. ``0`` means no row is frozen.
    """

    layer: int
    prompt_len: int
    n_sink: int = 0
    window_start: torch.Tensor | None = None
    frozen_prefix: int = 0

    def __post_init__(self) -> None:
        check_int("layer", self.layer, minimum=0)
        check_int("prompt_len", self.prompt_len, minimum=0)
        check_int("n_sink", self.n_sink, minimum=0)
        check_int("frozen_prefix", self.frozen_prefix, minimum=0)
        if self.frozen_prefix > self.prompt_len:
            raise ValueError(
                f"frozen_prefix ({self.frozen_prefix}) must be <= prompt_len ({self.prompt_len})"
            )
        if self.window_start is not None:
            check_index_tensor("window_start", self.window_start, ndim=1)
            if self.window_start.shape[0] != self.prompt_len:
                raise ValueError(
                    f"window_start must have shape [L={self.prompt_len}], "
                    f"got {list(self.window_start.shape)}"
                )
            rows = torch.arange(self.prompt_len, device=self.window_start.device)
            if bool(((self.window_start < 0) | (self.window_start > rows)).any()):
                raise ValueError("window_start[i] must lie in [0, i] for every row i")

    @property
    def is_dense(self) -> bool:
        """True when the layer's prefill is plain causal attention over every row."""
        return self.window_start is None and self.frozen_prefix == 0

    def attention_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[L, L]`` bool, ``True`` where row ``i`` may attend to column ``j`` (reference)."""
        n = self.prompt_len
        i = torch.arange(n, device=device).view(-1, 1)
        j = torch.arange(n, device=device).view(1, -1)
        mask = j <= i
        if self.window_start is not None:
            lo = self.window_start.to(device).view(-1, 1)
            mask = mask & ((j >= lo) | (j < self.n_sink))
        return mask


@runtime_checkable
class PrefillPlanner(Protocol):
    """Optional: a selector that also changes prefill (PSAW, ETF, CPE)."""

    def plan_prefill(self, layer: int, num_layers: int, prompt_len: int) -> PrefillLayerPlan:
        """The plan for ``layer`` of ``num_layers`` on a prompt of ``prompt_len`` tokens."""
        ...
