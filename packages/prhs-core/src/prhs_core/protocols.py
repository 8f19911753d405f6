"""The contracts between hosts (transformers, SGLang, benchmarks) and selectors.

Once, per model::

    state = selector.init_state(spec, capacity=..., max_seq_len=..., device=...)
    plan = selector.make_plan(state, batch_size=B, scaling=1 / D**0.5)

Whenever the host writes K/V (prefill, extend, decode), per layer::

    selector.write_kv(state, layer, locations, key, value)   # side caches follow the KV pool

Per decode step::

    plan.update(seq_lens, slots)                # host metadata in; no device value read
    for layer in layers:                        # each layer, select + attend
        sel = selector.select(plan, layer, query, kv, state)     # None: dense
        out = sparse_decode_attention(query, kv, sel, plan.scaling)

Request lifecycle: ``state.pool.create(slots)`` before a request's first decode step,
``state.pool.release(slots)`` when it ends (finished, aborted or retracted).

Prefill (optional, for PSAW / ETF): a selector that also implements :class:`PrefillPlanner`
gives, per layer, a :class:`PrefillLayerPlan` of parameters (a window fraction and sinks, a frozen
fraction) that a varlen prefill kernel takes as they are.

Prefill (optional, for CIS's ``tau="auto"``): a selector that also implements
:class:`PromptObserver` and asks for ``W = selector.prompt_queries() > 0`` queries sees, per
selectable layer and in layer order, the last ``W`` queries of each prompt once its K/V are
written::

    selector.observe_prompt(state, layer, slots, queries, kv, scaling)   # queries [B, W, Hq, D]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from prhs_core.checks import check_int
from prhs_core.config import AttentionSpec
from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.selection import Selection
from prhs_core.state import SelectorState

__all__ = ["DecodeSelector", "DecodeStep", "PrefillLayerPlan", "PrefillPlanner", "PromptObserver"]


@dataclass(frozen=True)
class DecodeStep:
    """What an observer sees of one layer's selection (metrics, logging): the inputs of
    ``select`` as they were. Not used on the decode path itself.

    Attributes
    ----------
    layer:
        Layer index ``ℓ`` (into the model's layers, sliding ones included).
    query:
        ``[B, Hq, D]`` the step's queries, after RoPE.
    kv:
        The layer's cache, the current token's key/value already written.
    plan:
        The step's plan (lengths, slots, scaling).
    """

    layer: int
    query: torch.Tensor
    kv: KVLayout
    plan: DecodePlan

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.kv.seq_lens

    @property
    def scaling(self) -> float:
        return self.plan.scaling

    @property
    def group_size(self) -> int:
        return self.query.shape[1] // self.kv.num_kv_heads


@runtime_checkable
class DecodeSelector(Protocol):
    """Chooses, at each decode step, the positions each (sequence, KV head) reads.

    ``select`` is vectorised over the batch and the heads (no Python loop over either), reads no
    device value on the host unless the plan is ``checked``, keeps every shape static and writes
    into the plan's buffers.
    """

    name: str
    config: Any

    def init_state(
        self,
        spec: AttentionSpec,
        *,
        capacity: int,
        max_seq_len: int,
        num_kv_locations: int | None = None,
        kv_page_size: int = 1,
        kv_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> SelectorState:
        """State for ``capacity`` live requests of up to ``max_seq_len`` positions, with side
        caches sized by the KV pool (``num_kv_locations`` slots; ``capacity × max_seq_len``
        rounded for contiguous layouts when ``None``)."""
        ...

    def selection_width(self) -> int:
        """``K_max``: the static width of this selector's selections."""
        ...

    def make_plan(
        self,
        state: SelectorState,
        *,
        batch_size: int,
        scaling: float,
        stats: bool = False,
        checked: bool = False,
    ) -> DecodePlan:
        """A plan for batches of ``batch_size`` rows, with buffers of this selector's width."""
        ...

    def select(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
    ) -> Selection | None:
        """The selection of ``layer`` for ``query [B, Hq, D]`` (``None``: dense); updates the
        state of ``plan.slots``."""
        ...

    def write_kv(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """The host wrote ``key [n, Hkv, D]`` / ``value [n, Hkv, Dv]`` at KV ``locations [n]``:
        update the side caches (a no-op for selectors that keep none)."""
        ...


def _check_fraction(name: str, value: object, *, upper_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and 0.0 <= v and (v < 1.0 if upper_open else v <= 1.0)):
        raise ValueError(f"{name} must lie in [0, 1), got {value}")
    return v


@dataclass(frozen=True)
class PrefillLayerPlan:
    """How one layer's prefill attention is restricted: parameters, independent of the prompt.

    Attributes
    ----------
    layer:
        Layer index ``ℓ``.
    window_fraction:
        ``f_ℓ``: prompt row ``t`` attends to ``[⌊f_ℓ·t⌋, t]`` beside the sinks (PSAW);
        ``0`` is plain causal attention.
    n_sink:
        Row ``t`` always sees positions ``[0, min(n_sink, t + 1))``, and the first ``n_sink``
        rows are never frozen (the attention sinks every later row reads; see
        :meth:`frozen_rows`).
    frozen_fraction:
        ``e_ℓ``: rows ``[n_sink, ⌊e_ℓ·L⌋)`` of a prompt of ``L`` tokens are frozen at this layer
        (ETF): no query, attention output or MLP is computed for them; their keys/values are
        still computed from the frozen hidden state. ``0`` freezes nothing.
    """

    layer: int
    window_fraction: float = 0.0
    n_sink: int = 0
    frozen_fraction: float = 0.0

    def __post_init__(self) -> None:
        check_int("layer", self.layer, minimum=0)
        check_int("n_sink", self.n_sink, minimum=0)
        object.__setattr__(
            self, "window_fraction", _check_fraction("window_fraction", self.window_fraction)
        )
        object.__setattr__(
            self, "frozen_fraction", _check_fraction("frozen_fraction", self.frozen_fraction)
        )

    @property
    def is_dense(self) -> bool:
        """True when the layer's prefill is plain causal attention over every row."""
        return self.window_fraction == 0.0 and self.frozen_fraction == 0.0

    def window_start(
        self, prompt_len: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``[L]`` int64 ``⌊f_ℓ·t⌋`` for rows ``t = 0..L−1`` (float64 arithmetic)."""
        check_int("prompt_len", prompt_len, minimum=0)
        t = torch.arange(prompt_len, dtype=torch.float64, device=device)
        return torch.floor(self.window_fraction * t).to(torch.long)

    def frozen_prefix(self, prompt_len: int) -> int:
        """``E_ℓ = ⌊e_ℓ·L⌋``: where the frozen rows of a prompt of ``prompt_len`` tokens end."""
        check_int("prompt_len", prompt_len, minimum=0)
        return math.floor(self.frozen_fraction * prompt_len)

    def frozen_rows(self, prompt_len: int) -> tuple[int, int]:
        """``(start, end)``: the rows ``[start, end)`` frozen at this layer, ``end = E_ℓ`` and
        ``start = min(n_sink, E_ℓ)`` (the sink rows stay live); ``start == end`` freezes
        nothing."""
        end = self.frozen_prefix(prompt_len)
        return min(self.n_sink, end), end

    def attention_mask(
        self, prompt_len: int, device: torch.device | str | None = None, first_row: int = 0
    ) -> torch.Tensor:
        """``[L − first_row, L]`` bool, ``True`` where row ``i`` (``first_row <= i < L``) may
        attend to column ``j`` (the reference a prefill kernel is tested against; ``first_row``
        gives the rows of a chunk whose earlier rows are cached)."""
        n = check_int("prompt_len", prompt_len, minimum=0)
        check_int("first_row", first_row, minimum=0)
        if first_row > n:
            raise ValueError(f"first_row ({first_row}) must be <= prompt_len ({n})")
        i = torch.arange(first_row, n, device=device).view(-1, 1)
        j = torch.arange(n, device=device).view(1, -1)
        mask = j <= i
        if self.window_fraction > 0.0:
            lo = self.window_start(n, device)[first_row:].view(-1, 1)
            mask = mask & ((j >= lo) | (j < self.n_sink))
        return mask


@runtime_checkable
class PrefillPlanner(Protocol):
    """Optional: a selector that also changes prefill (PSAW, ETF, PrHS)."""

    def plan_prefill(self, layer: int, num_layers: int) -> PrefillLayerPlan:
        """The plan of ``layer`` of a model of ``num_layers`` layers."""
        ...


@runtime_checkable
class PromptObserver(Protocol):
    """Optional: a selector that learns from each prompt at prefill (CIS with ``tau="auto"``
    calibrates its reuse thresholds there)."""

    def prompt_queries(self) -> int:
        """``W``: how many of a prompt's last queries it wants per layer (0: none)."""
        ...

    def observe_prompt(
        self,
        state: SelectorState,
        layer: int,
        slots: list[int] | tuple[int, ...],
        queries: torch.Tensor,
        kv: ContiguousKV,
        scaling: float,
        bounds: Sequence[tuple[int, int]] | None = None,
        locations: torch.Tensor | None = None,
    ) -> None:
        """The last ``W`` queries ``[B, W, Hq, D]`` (after RoPE) of the prompts of ``slots``
        (host ints), at ``layer``, whose K/V ``kv`` holds (``B`` rows, lengths = the prompts');
        called for every selectable layer in order, after that layer's K/V are written.
        ``bounds``: each row's ``(start, length)`` in ``kv`` as host ints (hosts know them;
        without them the selector reads them from ``kv``). ``locations [B, L]`` int64: the KV
        location of each logical position of each row (``-1``: none), for a host whose ``kv``
        is a gathered copy (SGLang); ``None``: ``kv`` is the cache itself, whose locations
        :func:`prhs_kernels.token_locations` gives."""
        ...
