"""What every decode selector shares: state and plan set-up, input checks, windows, GQA, stats.

A method subclasses :class:`BaseSelector`, names its config class, declares its state in
:meth:`BaseSelector.init_fields`, gives its static selection width in
:meth:`BaseSelector.selection_width` and implements :meth:`BaseSelector.select_layer`. Everything
is batched over sequences and KV heads (no Python loop over either), reads no device value on the
host (except in a plan's ``checked`` mode, before anything changes) and writes the selection
into the plan's buffers.

GQA: one decision per KV head; a position's score for a KV head is the mean of its ``g`` query
heads' attention probabilities (query head ``h`` belongs to KV head ``h // g``).

Non-finite input: a (sequence, KV head) whose query holds a NaN or an infinity is *skipped*: it
reads only the positions its selector picks without looking at the query (the sink and local
windows, and Streaming's and H2O's recent windows), its persistent state is left as it was, and
it is counted in ``state.nonfinite``. A checked plan raises instead, before anything changes. A
non-finite key row written through :meth:`BaseSelector.write_kv` is never folded into a side
cache (its location is still reset, so no stale metadata survives) and is counted;
``checked=True`` raises instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from prhs_core.checks import (
    check_float_tensor,
    check_in_range,
    check_index_tensor,
    check_int,
    check_values_finite,
)
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.selection import Selection
from prhs_core.state import SelectorState, SequenceStatePool, SideCache
from prhs_kernels.blocks import block_reduce
from prhs_kernels.cis.reference import block_eligible_reference, window_block_mask_reference
from prhs_kernels.compose import union_indices, window_indices, window_widths
from prhs_kernels.kv.reference import written_rows
from prhs_kernels.paths import kernel_path
from prhs_kernels.quest import fold_page_bounds as fold_page_bounds_kernel
from prhs_kernels.score import check_query, nonfinite_rows, retrieval_probs
from prhs_kernels.topk import topk_indices

__all__ = [
    "ROW_STRIDE_ALIGN",
    "BaseSelector",
    "fold_page_bounds",
    "group_probs",
    "nonfinite_rows",
]

ROW_STRIDE_ALIGN = 256
"""Contiguous layouts: side-cache rows are ``max_seq_len`` rounded up to a multiple of this many
locations and of the selector's side-cache page size, so every row starts on a page boundary."""


def group_probs(logits: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, T]``: the group-mean attention probability of ``logits [B, Hkv, g, T]``."""
    return torch.softmax(logits, dim=-1).mean(2)


def fold_page_bounds(
    side: SideCache,
    min_field: str,
    max_field: str,
    row: int,
    locations: torch.Tensor,
    key: torch.Tensor,
    finite: torch.Tensor | None,
    *,
    columns: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
    path: str = "torch",
) -> None:
    """Fold keys into the per-page channel minima and maxima of side fields ``min_field`` /
    ``max_field`` (shape ``[pages + 1, rows, Hkv, D]``; ``row``: the layer's row), through
    :func:`prhs_kernels.quest.fold_page_bounds` (its arguments: ``locations [N]``, ``-1`` for
    none; ``key [N, Hkv, D]``, or a cache ``[N, Hkv, T, D]`` read at ``columns [N]``;
    ``finite [N]``, or ``None`` to find the non-finite keys there and count them into
    ``nonfinite``). A page's first location resets it (so no stale metadata survives the
    page's reuse); later ones fold in. A non-finite key resets its page but is not folded in.
    Exact in the cache dtype: a minimum or maximum of cached values is a cached value.
    """
    fold_page_bounds_kernel(
        side[min_field][:, row], side[max_field][:, row], locations, key,
        page_size=side.page_size, columns=columns, finite=finite, nonfinite=nonfinite, path=path,
    )  # fmt: skip


class BaseSelector:
    """Shared machinery of the decode selectors; see the module docstring."""

    name: ClassVar[str] = "base"
    config_type: ClassVar[type[Any]] = SelectorConfig
    certifies: ClassVar[bool] = False
    """Whether :attr:`prhs_core.selection.StepStats.delta_hat` is written."""
    state_per_location: ClassVar[bool] = False
    """Whether the side cache holds per-request data (not a function of the K/V stored at a
    location): hosts that share KV locations between requests (a prefix cache) must not."""

    def __init__(self, config: Any | None = None) -> None:
        if config is None:
            config = self.config_type()
        if not isinstance(config, self.config_type):
            raise TypeError(
                f"{type(self).__name__} takes a {self.config_type.__name__}, "
                f"got {type(config).__name__}"
            )
        self.config = config
        self.spec: AttentionSpec | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # -- static geometry ------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """``s``: entries of this selector's selections are ``s``-blocks."""
        return int(getattr(self.config, "block_size", 1))

    def budget_blocks(self) -> int:
        """The budget in blocks: ``max(1, k // s)``."""
        return max(1, self.config.budget // self.block_size)

    def window_widths(self) -> tuple[int, int]:
        """Static widths of the sink and local block lists."""
        c = self.config
        return window_widths(c.n_sink, c.n_local, self.block_size)

    def selection_width(self) -> int:
        """``K_max``, the static width of this selector's selections (in entries)."""
        raise NotImplementedError

    def side_page_size(self) -> int:
        """Locations per page of this selector's page-level side-cache fields (1: none)."""
        return 1

    # -- state ----------------------------------------------------------------------------
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
        """State for ``capacity`` requests of up to ``max_seq_len`` positions of ``spec``.

        ``num_kv_locations``: slots of the host's KV pool (paged layouts); ``None`` for a
        contiguous cache of ``capacity`` rows, whose locations are ``b * row_stride + t``.
        ``kv_page_size``: the pool's page size. ``kv_dtype``: the cache dtype (side caches that
        hold keys store them in it).
        """
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        check_int("capacity", capacity, minimum=1)
        check_int("max_seq_len", max_seq_len, minimum=1)
        check_int("kv_page_size", kv_page_size, minimum=1)
        if not isinstance(kv_dtype, torch.dtype) or not kv_dtype.is_floating_point:
            raise TypeError(f"kv_dtype must be a floating torch.dtype, got {kv_dtype!r}")
        page = self.side_page_size()
        # A row must start on a page boundary of the side cache: a multiple of the page too.
        align = math.lcm(ROW_STRIDE_ALIGN, page)
        row_stride = -(-max_seq_len // align) * align
        paged = num_kv_locations is not None
        if num_kv_locations is None:
            num_kv_locations = capacity * row_stride
        check_int("num_kv_locations", num_kv_locations, minimum=1)
        if paged and page > 1 and kv_page_size % page:
            raise ValueError(
                f"{self.name} keeps metadata per page of {page} KV slots, so a paged KV pool "
                f"must have a page size that is a multiple of {page} (got {kv_page_size}); "
                f"e.g. run SGLang with --page-size {page}"
            )
        pool = SequenceStatePool(capacity, device)
        side = SideCache(num_kv_locations, page, device) if self.uses_side_cache() else None
        state = SelectorState(pool, side, row_stride, kv_page_size)
        self.init_fields(state, spec, kv_dtype)
        self.spec = spec
        return state

    def kernel_path(self, device: torch.device | str, dtype: torch.dtype) -> str:
        """The path this selector's kernels take for a cache of ``dtype`` on ``device``:
        ``"triton"`` (CUDA, fp16/bf16), ``"triton-interpreter"`` (CPU under
        ``TRITON_INTERPRET=1``) or ``"torch"`` (:func:`prhs_kernels.paths.kernel_path`; on the
        CPU some selection ops take Numba kernels besides, see :doc:`/kernels`)."""
        return kernel_path(device, dtype)

    def uses_side_cache(self) -> bool:
        """Whether this selector keeps metadata per KV location."""
        return False

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        """Declare per-request fields (``state.pool``) and side-cache fields (``state.side``)."""

    # -- plan -----------------------------------------------------------------------------
    def make_plan(
        self,
        state: SelectorState,
        *,
        batch_size: int,
        scaling: float,
        stats: bool = False,
        checked: bool = False,
    ) -> DecodePlan:
        """A plan for batches of ``batch_size`` rows, with this selector's selection buffers."""
        spec = self._spec()
        return DecodePlan(
            state,
            batch_size=batch_size,
            num_kv_heads=spec.num_kv_heads,
            num_layers=spec.num_layers,
            width=self.selection_width(),
            block_size=self.block_size,
            scaling=scaling,
            stats=stats,
            certified=self.certifies,
            checked=checked,
            compensation=self.compensation_dims(),
        )

    def compensation_dims(self) -> tuple[int, int] | None:
        """``(Hq, Dv)`` when this selector's selections carry a
        :class:`~prhs_core.selection.Compensation` (CompKV), else ``None``."""
        return None

    def _spec(self) -> AttentionSpec:
        if self.spec is None:
            raise RuntimeError(f"{self.name}: call init_state(...) first")
        return self.spec

    # -- the two per-layer entry points ---------------------------------------------------
    def select(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
    ) -> Selection | None:
        """Check the inputs (shapes always; values too in a checked plan), then select."""
        spec = self._spec()
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan, got {type(plan).__name__}")
        if plan.state is not state:
            raise ValueError("plan was made for another state: make_plan(state, ...) first")
        check_int("layer", layer, minimum=0)
        if layer >= spec.num_layers:
            raise ValueError(f"layer {layer} is out of range for {spec.num_layers} layers")
        if layer not in spec.selectable_layers:
            raise ValueError(f"layer {layer} is a sliding-window layer; it is not selected")
        check_query(query, kv)
        if kv.max_len < 1:
            raise ValueError(
                "the cache holds no position (max_len = 0): a decode step caches at least its "
                "own token"
            )
        if kv.num_kv_heads != spec.num_kv_heads or query.shape[1] != spec.num_q_heads:
            raise ValueError(
                f"step has Hq={query.shape[1]}, Hkv={kv.num_kv_heads}; the state was made for "
                f"Hq={spec.num_q_heads}, Hkv={spec.num_kv_heads}"
            )
        if kv.batch_size != plan.batch_size:
            raise ValueError(
                f"the cache holds {kv.batch_size} rows but the plan was made for "
                f"batch_size={plan.batch_size}"
            )
        if plan.selection.width != self.selection_width() or plan.selection.block_size != (
            self.block_size
        ):
            raise ValueError("plan was made by another selector: use this selector's make_plan")
        side = state.side
        if isinstance(kv, ContiguousKV) and side is not None:
            rows = side.num_locations // state.row_stride
            if kv.batch_size > rows:  # row b's keys live at b * row_stride + t
                raise ValueError(
                    f"the contiguous cache holds {kv.batch_size} rows but the state's side cache "
                    f"covers {rows}: make the state with capacity >= the cache's rows"
                )
            if kv.max_len > state.row_stride:  # position t >= row_stride would be the next row's
                raise ValueError(
                    f"the contiguous cache holds {kv.max_len} positions but the state's side "
                    f"cache rows hold {state.row_stride}: make the state with max_seq_len >= "
                    f"{kv.max_len}"
                )
        if plan.checked:
            kv.check_values()
            if not torch.equal(kv.seq_lens.cpu(), plan.seq_lens.cpu()):
                raise ValueError("kv.seq_lens differ from the plan's: build kv from plan.seq_lens")
            check_values_finite("query", query, where=f" (layer {layer})")
        if self.finds_nonfinite_queries():
            return self.select_layer(plan, layer, query, kv, state, None)
        bad = nonfinite_rows(query, kv.num_kv_heads)
        state.nonfinite.add_(bad.sum())
        return self.select_layer(plan, layer, query, kv, state, bad)

    def finds_nonfinite_queries(self) -> bool:
        """Whether :meth:`select_layer` finds and counts the rows with a non-finite query itself
        (inside its first kernel, saving the separate check's launches); then it is passed
        ``bad=None``."""
        return False

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor | None,
    ) -> Selection | None:
        """The method itself (inputs checked; ``bad [B, Hkv]`` marks skipped rows, already
        counted in ``state.nonfinite``; ``None`` when :meth:`finds_nonfinite_queries`)."""
        raise NotImplementedError

    def write_kv(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        checked: bool = False,
        columns: torch.Tensor | None = None,
    ) -> None:
        """The host wrote ``key [n, Hkv, D]`` / ``value [n, Hkv, Dv]`` at KV ``locations [n]``
        (int, distinct; ``-1`` for none): update the side caches. With ``columns [n]``, ``key``
        / ``value`` are caches ``[n, Hkv, T, D]`` / ``[n, Hkv, T, Dv]`` whose row ``i`` holds
        what was written at column ``columns[i]`` (a decode step's new tokens, read in place; a
        column outside ``[0, T)`` writes nothing). Non-finite key rows are skipped and counted,
        or raise with ``checked=True`` (a host read, which also checks that every location
        exists)."""
        spec = self._spec()
        check_int("layer", layer, minimum=0)
        if layer >= spec.num_layers:
            raise ValueError(f"layer {layer} is out of range for {spec.num_layers} layers")
        check_index_tensor("locations", locations, ndim=1)
        ndim = 3 if columns is None else 4
        check_float_tensor("key", key, ndim=ndim)
        check_float_tensor("value", value, ndim=ndim)
        n = locations.shape[0]
        if key.shape[0] != n or value.shape[0] != n or key.shape[1] != spec.num_kv_heads:
            what = "[n, Hkv, D] and value [n, Hkv, Dv]"
            if columns is not None:
                what = "[n, Hkv, T, D] and value [n, Hkv, T, Dv]"
            raise ValueError(
                f"key {what} must have n={n} rows (one per location) and "
                f"Hkv={spec.num_kv_heads}, got {list(key.shape)} and {list(value.shape)}"
            )
        if columns is not None:
            check_index_tensor("columns", columns, ndim=1)
            if columns.shape[0] != n or value.shape[2] != key.shape[2]:
                raise ValueError(
                    f"columns [n={n}] and the caches' lengths must match, got columns "
                    f"{list(columns.shape)}, key {list(key.shape)}, value {list(value.shape)}"
                )
        if checked:
            if columns is not None:  # a host read anyway: check the rows as written
                written, key = written_rows(locations, key, columns)
                _, value = written_rows(locations, value, columns)
                locations = torch.where(written, locations, -1)
                columns = None
            check_values_finite("key", key, where=f" (layer {layer})")
            if state.side is not None:
                last = state.side.num_locations - 1
                check_in_range("locations", locations, -1, last, "the side cache's (-1: none)")
        if state.side is None or layer not in spec.selectable_layers:
            return
        if self.counts_nonfinite_keys():
            self.write_side(state, layer, locations, key, value, None, columns=columns)
            return
        if columns is not None:
            written, key = written_rows(locations, key, columns)
            _, value = written_rows(locations, value, columns)
            locations = torch.where(written, locations, -1)
        finite = torch.isfinite(key).flatten(1).all(-1)  # [n]
        state.nonfinite.add_((~finite & (locations >= 0)).sum())
        self.write_side(state, layer, locations.long(), key, value, finite)

    def counts_nonfinite_keys(self) -> bool:
        """Whether :meth:`write_side` takes a write as the host made it and finds and counts
        its non-finite keys itself (in its own launch on a Triton path): then it is passed
        ``finite=None``, ``locations`` of any integer dtype, and the caches with ``columns``
        where the host gave them."""
        return False

    def write_side(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        finite: torch.Tensor | None,
        *,
        columns: torch.Tensor | None = None,
    ) -> None:
        """Update the side cache (selectors that keep one): reset ``locations`` (``-1``: none)
        and fold in the key rows that are ``finite`` (``None`` and ``columns``: see
        :meth:`counts_nonfinite_keys`)."""

    def check_prompt_observation(
        self,
        state: SelectorState,
        layer: int,
        slots: Sequence[int],
        queries: torch.Tensor,
        kv: ContiguousKV,
        scaling: float,
        bounds: Sequence[tuple[int, int]] | None,
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Check the arguments of a :class:`~prhs_core.protocols.PromptObserver`'s
        ``observe_prompt`` (``2 <= W <=`` the selector's ``prompt_queries()``) and return the
        rows' slots and ``(start, length)`` bounds (read from ``kv`` when ``bounds`` is
        ``None``: a host read). Raises before anything changes."""
        spec = self._spec()
        check_int("layer", layer, minimum=0)
        if layer not in spec.selectable_layers:
            raise ValueError(
                f"layer {layer} is not a selectable layer of this model "
                f"({list(spec.selectable_layers)})"
            )
        if not isinstance(kv, ContiguousKV):
            raise TypeError(f"kv must be a ContiguousKV of the prompts, got {type(kv).__name__}")
        b, h, d = kv.batch_size, spec.num_kv_heads, spec.head_dim
        if kv.num_kv_heads != h or kv.k.shape[-1] != d:
            raise ValueError(
                f"kv has {kv.num_kv_heads} KV heads of dim {kv.k.shape[-1]}, the model "
                f"{h} of dim {d}"
            )
        if not isinstance(queries, torch.Tensor) or queries.ndim != 4:
            raise ValueError("queries must be a [B, W, Hq, D] tensor")
        w_max = self.prompt_queries()  # type: ignore[attr-defined]
        if queries.shape[0] != b or queries.shape[2:] != (spec.num_q_heads, d):
            raise ValueError(
                f"queries must be [B={b}, W, Hq={spec.num_q_heads}, D={d}], got "
                f"{list(queries.shape)}"
            )
        w = queries.shape[1]
        if not 2 <= w <= w_max:
            raise ValueError(f"queries must hold 2 to {w_max} positions per row, got {w}")
        if queries.device != kv.k.device:
            raise ValueError(f"queries on {queries.device}, kv on {kv.k.device}: one device")
        if isinstance(scaling, bool) or not isinstance(scaling, int | float) or scaling <= 0:
            raise ValueError(f"scaling must be a positive float, got {scaling!r}")
        ids = [check_int(f"slots[{i}]", x, minimum=0) for i, x in enumerate(slots)]
        if len(ids) != b:
            raise ValueError(f"slots must name one slot per row ({b}), got {len(ids)}")
        outside = [x for x in ids if x >= state.pool.capacity]
        if outside:
            raise ValueError(
                f"slots must lie in [0, {state.pool.capacity}) (the pool's capacity), got {outside}"
            )
        idle = [x for x in ids if not state.pool.is_active(x)]
        if idle:
            raise ValueError(f"slots {idle} hold no sequence (create them first)")
        if bounds is None:
            starts = kv.start.tolist() if kv.start is not None else [0] * b
            return ids, list(zip(starts, kv.seq_lens.tolist(), strict=True))
        if len(bounds) != b or any(
            len(x) != 2 or x[0] < 0 or x[1] < 0 or x[0] + x[1] > kv.k.shape[2] for x in bounds
        ):
            raise ValueError(
                f"bounds must give each of the {b} rows a (start, length) inside kv's "
                f"{kv.k.shape[2]} positions, got {list(bounds)}"
            )
        return ids, [(int(x[0]), int(x[1])) for x in bounds]

    # -- helpers for subclasses -----------------------------------------------------------
    def num_blocks(self, kv: KVLayout) -> torch.Tensor:
        """``[B]`` blocks of each sequence, ``ceil(seq_lens / s)``."""
        s = self.block_size
        return (kv.seq_lens + (s - 1)) // s

    def windows(self, kv: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids of the sink and local windows, ``([B, ws], [B, wl])``."""
        c = self.config
        return window_indices(kv.seq_lens, c.n_sink, c.n_local, self.block_size)

    def window_block_mask(self, kv: KVLayout, n_blocks_total: int) -> torch.Tensor:
        """``[B, NB]`` bool: blocks holding a sink or local position (the lists of
        :meth:`windows`, as a mask)."""
        c = self.config
        return window_block_mask_reference(
            kv.seq_lens, n_blocks_total, self.block_size, c.n_sink, c.n_local
        )

    def block_eligible(self, kv: KVLayout, n_blocks_total: int) -> torch.Tensor:
        """``[B, NB]`` bool: existing blocks outside the windows (what top-k may pick)."""
        c = self.config
        return block_eligible_reference(
            kv.seq_lens, n_blocks_total, self.block_size, c.n_sink, c.n_local
        )

    def exact_probs(self, plan: DecodePlan, query: torch.Tensor, kv: KVLayout) -> torch.Tensor:
        """``[B, Hkv, T]`` float32 group-mean probabilities of every position (a retrieval)."""
        return retrieval_probs(query, kv, plan.scaling)

    def topk_blocks(
        self, kv: KVLayout, probs: torch.Tensor, k_blocks: int, bad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The top ``k_blocks`` blocks by their max group probability outside the windows:
        ``(indices [B, Hkv, k], counts [B, Hkv], block_scores [B, Hkv, NB])``."""
        block_scores = block_reduce(probs, self.block_size, "max")
        eligible = self.block_eligible(kv, block_scores.shape[-1]).unsqueeze(1) & ~bad.unsqueeze(-1)
        idx, cnt = topk_indices(block_scores, k_blocks, eligible.expand_as(block_scores))
        return idx, cnt, block_scores

    def compose(self, plan: DecodePlan, kv: KVLayout, *parts: torch.Tensor) -> Selection:
        """Write ``sink ∪ parts ∪ local`` into the plan's selection and return it."""
        sink, local = self.windows(kv)
        sel = plan.selection
        union_indices([sink, *parts, local], self.num_blocks(kv), sel.indices, sel.counts)
        return sel

    def key_row_bytes(self, kv: KVLayout) -> int:
        """Bytes a retrieval reads per cached key: the key, in the cache dtype."""
        return kv.head_dim * torch.empty((), dtype=kv.dtype).element_size()

    def retrieval_bytes(self, kv: KVLayout) -> torch.Tensor:
        """``[B, 1]`` float64 bytes read by scoring every cached key (:meth:`key_row_bytes`
        each)."""
        return kv.seq_lens.view(-1, 1).to(torch.float64) * self.key_row_bytes(kv)

    def record(
        self,
        plan: DecodePlan,
        layer: int,
        kv: KVLayout,
        selection: Selection | None,
        retrieved: torch.Tensor | None,
        proxy_bytes: torch.Tensor | None,
        delta_hat: torch.Tensor | None = None,
        missed: torch.Tensor | None = None,
    ) -> None:
        """Write the step's statistics into the plan (when it keeps them) and add them to its
        totals. ``retrieved`` / ``proxy_bytes`` / ``missed`` broadcast to ``[B, Hkv]``
        (``None``: none)."""
        st = plan.stats
        if st is None:
            return
        b, h = st.retrieved.shape
        if retrieved is None:
            st.retrieved.zero_()
        else:
            st.retrieved.copy_(retrieved.expand(b, h))
        if proxy_bytes is None:
            st.proxy_bytes.zero_()
        else:
            st.proxy_bytes.copy_(proxy_bytes.expand(b, h))
        if selection is None:
            st.num_selected.copy_(kv.seq_lens.view(-1, 1).expand(b, h))
        else:
            st.num_selected.copy_(selection.num_tokens(kv.seq_lens))
        if st.delta_hat is not None:
            if delta_hat is None:
                st.delta_hat.fill_(float("nan"))
            else:
                st.delta_hat.copy_(delta_hat)
        if st.missed is not None:
            if missed is None:
                st.missed.zero_()
            else:
                st.missed.copy_(missed.expand(b, h))
        assert plan.totals is not None
        live = (plan.slots != plan.state.pool.scratch_slot).view(-1, 1).double()
        row = torch.stack(
            [
                (live * torch.ones(b, h, dtype=torch.float64, device=live.device)).sum(),
                (live * st.retrieved.double()).sum(),
                (live * st.num_selected.double()).sum(),
                (live * st.proxy_bytes).sum(),
            ]
        )
        plan.totals[layer] += row
