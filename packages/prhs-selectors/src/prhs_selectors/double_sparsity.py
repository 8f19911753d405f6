"""``double_sparsity``: top-k by approximate logits from a few label channels of each key.

Yang, Chen, Zheng, Tang and Shan, "Post-Training Sparse Attention with Double Sparsity",
arXiv:2408.07092 (2024). A few channels of ``q·k`` carry most of its magnitude, and which ones is
stable across inputs: so the logit of every cached key is estimated from ``r = D/8`` *label*
channels, ``s_t = scaling·Σ_{j∈L} q_j·k_{t,j}``, and the top ``k`` positions by that estimate are
read exactly.
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
from prhs_kernels.labels import label_probs
from prhs_selectors.base import BaseSelector

__all__ = [
    "CHANNELS_FORMAT",
    "DoubleSparsity",
    "DoubleSparsityConfig",
    "channel_scores",
    "choose_labels",
]

CHANNELS_FORMAT = "prhs-double-sparsity-channels/1"
"""The ``format`` entry of a calibration file written by ``prhs-eval calibrate``."""

ChannelTable = tuple[tuple[tuple[int, ...], ...] | None, ...]


def _check_channels(table: object) -> ChannelTable | None:
    """The structure of a label table: one entry per layer, each ``None`` (a layer without
    labels: a sliding-window layer) or one list of ``r`` distinct non-negative channel ids per KV
    head, with one ``r`` for the whole table. The ranges are checked against the model later."""
    if table is None:
        return None
    if not isinstance(table, list | tuple) or not table:
        raise ValueError(
            "channels must be a non-empty table: one row per layer, each a list of label "
            "channels per KV head (or null for a layer without labels)"
        )
    rows: list[tuple[tuple[int, ...], ...] | None] = []
    width: int | None = None
    for i, row in enumerate(table):
        if row is None:
            rows.append(None)
            continue
        if not isinstance(row, list | tuple) or not row:
            raise ValueError(f"channels[{i}] must be a non-empty list (one entry per KV head)")
        heads = []
        for j, head in enumerate(row):
            if not isinstance(head, list | tuple) or not head:
                raise ValueError(f"channels[{i}][{j}] must be a non-empty list of channel ids")
            ids = tuple(
                check_int(f"channels[{i}][{j}][{n}]", x, minimum=0) for n, x in enumerate(head)
            )
            if len(set(ids)) != len(ids):
                raise ValueError(f"channels[{i}][{j}] repeats a channel: {list(ids)}")
            if width is None:
                width = len(ids)
            elif len(ids) != width:
                raise ValueError(
                    f"channels[{i}][{j}] holds {len(ids)} channels, earlier rows {width}: one r "
                    "for the whole table"
                )
            heads.append(ids)
        rows.append(tuple(heads))
    if width is None:
        raise ValueError("channels holds no layer with labels")
    return tuple(rows)


@dataclass(frozen=True)
class DoubleSparsityConfig(SelectorConfig):
    """Hyperparameters of :class:`DoubleSparsity` (the shared fields are those of
    :class:`~prhs_core.config.SelectorConfig`).

    Parameters
    ----------
    label_channels:
        ``r``, label channels per KV head; ``None``: ``D // 8`` (the paper's 1/8), at least 1.
        With ``channels`` it must equal the table's ``r`` (or stay ``None``).
    channels:
        The label table from a calibration (``prhs-eval calibrate`` writes one; pass it as
        ``--set double_sparsity.channels=@FILE``): per layer, per KV head, ``r`` channel ids;
        ``None`` (null) for a layer the selector never sees (a sliding-window layer). ``None``
        (the default): each request's labels are chosen from its own prompt at prefill.
    prompt_queries:
        Without ``channels``: how many of the prompt's last queries the labels are chosen from
        (at least 2).
    """

    label_channels: int | None = None
    channels: ChannelTable | None = None
    prompt_queries: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label_channels is not None:
            check_int("label_channels", self.label_channels, minimum=1)
        object.__setattr__(self, "channels", _check_channels(self.channels))
        check_int("prompt_queries", self.prompt_queries, minimum=2)
        if self.channels is not None and self.label_channels is not None:
            r = self.table_width()
            if r != self.label_channels:
                raise ValueError(
                    f"label_channels={self.label_channels} but the channels table holds {r} per "
                    "head: leave label_channels unset with a table"
                )

    def table_width(self) -> int:
        """``r`` of the channels table (which must be given)."""
        assert self.channels is not None
        return next(len(row[0]) for row in self.channels if row is not None)


def channel_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[Hkv, D]`` float32 mean ``|q_j·k_j|`` of channel ``j`` over every pair of a query
    (``queries [W, Hq, D]``, the group's query heads of each KV head) and a key (``keys
    [Hkv, n, D]``). The mean of a product of independent factors factorises:
    ``mean_{i,t} |q_{ij}|·|k_{tj}| = mean_i |q_{ij}| · mean_t |k_{tj}|``."""
    w, hq, d = queries.shape
    h = keys.shape[0]
    q_abs = queries.float().abs().reshape(w, h, hq // h, d).mean(dim=(0, 2))
    return q_abs * keys.float().abs().mean(1)


def choose_labels(scores: torch.Tensor, r: int) -> torch.Tensor:
    """``[..., r]`` int64: the ``r`` channels of largest ``scores [..., D]``, ascending ids."""
    return torch.topk(scores, r, dim=-1).indices.sort(dim=-1).values


@selectors.register(
    "double_sparsity", config=DoubleSparsityConfig, summary="top-k by label-channel logits (DS)"
)
class DoubleSparsity(BaseSelector):
    """Double Sparsity: estimate each cached key's logit from ``r`` label channels, keep the
    top ``k``.

    Each (layer, KV head) has ``r`` label channels, the ones of largest mean ``|q_j·k_j|``
    (:func:`channel_scores`). They come from a calibration table (``channels``: fixed per model,
    chosen on offline text by ``prhs-eval calibrate``) or, without one, from each request's own
    prompt: at prefill the last ``prompt_queries`` queries and every prompt key of each layer
    choose that request's labels (a slot whose prompt was not observed, e.g. one shorter than
    two tokens, uses channels ``0..r−1`` until its next prompt).

    At each decode step the proxy logit of every position is ``scaling·Σ_{j∈L} q_j·k_{t,j}``
    over the KV head's labels ``L`` (:func:`prhs_kernels.labels.label_logits`); under GQA a
    position's score is the mean over the group's query heads of the softmax of their proxy
    logits (the same rule as the exact scores of ``oracle``), and the top ``k`` positions
    (``k/s`` blocks by their largest score) outside the sink and local windows are selected,
    plus the windows. With every channel a label the proxy is the exact logit and the selection
    is ``oracle``'s.

    Stats: never a retrieval (no key is scored exactly). ``proxy_bytes`` counts the label
    channels of every cached key, ``T·r·element_size`` per KV head: what a label cache (the
    paper's contiguous copy of those channels) reads. The torch path gathers them from the key
    rows themselves.
    """

    name = "double_sparsity"
    config_type = DoubleSparsityConfig
    config: DoubleSparsityConfig

    def __init__(self, config: DoubleSparsityConfig | None = None) -> None:
        super().__init__(config)
        self._table: torch.Tensor | None = None  # [N, Hkv, r] int64 with a channels table

    def selection_width(self) -> int:
        ws, wl = self.window_widths()
        return ws + self.budget_blocks() + wl

    def num_labels(self) -> int:
        """``r`` for the model of :meth:`init_state`."""
        c = self.config
        if c.channels is not None:
            return c.table_width()
        d = self._spec().head_dim
        r = c.label_channels if c.label_channels is not None else max(1, d // 8)
        return r

    def uses_side_cache(self) -> bool:
        """With a channels table: a label cache, the ``r`` label channels of every key."""
        return self.config.channels is not None

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        c = self.config
        d, h, n = spec.head_dim, spec.num_kv_heads, spec.num_layers
        if c.label_channels is not None and c.label_channels > d:
            raise ValueError(f"label_channels={c.label_channels} exceeds head_dim={d}")
        if c.channels is None:
            r = c.label_channels if c.label_channels is not None else max(1, d // 8)
            # -1: not chosen yet (the slot uses channels 0..r-1).
            state.pool.add_field("ds_labels", (n, h, r), torch.int64, -1)
            self._table = None
            return
        self._table = self._table_tensor(spec, state.device)
        side = state.side
        assert side is not None
        side.add_field("ds_keys", (n, h, self._table.shape[-1]), kv_dtype, 0)

    def write_side(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        finite: torch.Tensor,
    ) -> None:
        """Copy the label channels of the finite ``key`` rows into the label cache."""
        side, table = state.side, self._table
        assert side is not None and table is not None
        n, h, _ = key.shape
        lab = table[layer].unsqueeze(0).expand(n, h, -1)
        rows = torch.where(finite, side.rows_of(locations), side.scratch_location)
        field = side["ds_keys"][:, layer]  # [R + 1, Hkv, r], a view
        field.index_copy_(0, rows, torch.gather(key, -1, lab).to(field.dtype))

    def _table_tensor(self, spec: AttentionSpec, device: torch.device) -> torch.Tensor:
        table = self.config.channels
        assert table is not None
        n, h, d = spec.num_layers, spec.num_kv_heads, spec.head_dim
        if len(table) != n:
            raise ValueError(f"the channels table has {len(table)} rows; the model {n} layers")
        r = self.config.table_width()
        if r > d:
            raise ValueError(f"the channels table has r={r} labels per head; head_dim is {d}")
        rows = []
        for layer, row in enumerate(table):
            if row is None:
                if layer in spec.selectable_layers:
                    raise ValueError(
                        f"channels[{layer}] is null but layer {layer} is a full-attention layer"
                    )
                rows.append([list(range(r))] * h)
                continue
            if len(row) != h:
                raise ValueError(f"channels[{layer}] has {len(row)} heads; the model {h} KV heads")
            high = [x for head in row for x in head if x >= d]
            if high:
                raise ValueError(
                    f"channels[{layer}] names channels {sorted(set(high))} >= head_dim {d}"
                )
            rows.append([list(head) for head in row])
        return torch.tensor(rows, dtype=torch.int64, device=device)

    def labels_of(self, plan: DecodePlan, layer: int, state: SelectorState) -> torch.Tensor:
        """``[B, Hkv, r]`` int64 label channels of the plan's rows at ``layer``."""
        if self._table is not None:
            b = plan.batch_size
            return self._table[layer].unsqueeze(0).expand(b, -1, -1)
        lab = state.pool["ds_labels"][plan.slots, layer]
        default = torch.arange(lab.shape[-1], device=lab.device)
        return torch.where(lab >= 0, lab, default)

    def proxy_probs(
        self, plan: DecodePlan, layer: int, query: torch.Tensor, kv: KVLayout, state: SelectorState
    ) -> torch.Tensor:
        """``[B, Hkv, T]`` group-mean softmax of the label logits
        (:func:`prhs_kernels.labels.label_probs`), read from the label cache with a channels
        table, else from the key rows."""
        labels = self.labels_of(plan, layer, state)
        cache = None if state.side is None else state.side["ds_keys"][:, layer]
        return label_probs(
            query, kv, labels, plan.scaling, cache=cache, row_stride=state.row_stride
        )

    def proxy_bytes(self, kv: KVLayout) -> torch.Tensor:
        """``[B, 1]`` float64 bytes of label channels read for every cached key."""
        elem = torch.empty((), dtype=kv.dtype).element_size()
        return kv.seq_lens.view(-1, 1).to(torch.float64) * (self.num_labels() * elem)

    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,
    ) -> Selection | None:
        probs = self.proxy_probs(plan, layer, query, kv, state)
        idx, _, _ = self.topk_blocks(kv, probs, self.budget_blocks(), bad)
        sel = self.compose(plan, kv, idx)
        self.record(plan, layer, kv, sel, None, self.proxy_bytes(kv))
        return sel

    # -- labels from the prompt -----------------------------------------------------------
    def prompt_queries(self) -> int:
        """How many of a prompt's last queries :meth:`observe_prompt` wants per layer (0 with a
        channels table: the labels are fixed)."""
        return 0 if self.config.channels is not None else self.config.prompt_queries

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
        """Without a channels table: choose each slot's labels at ``layer`` from its prompt
        (``queries [B, W, Hq, D]``, the prompt's last ``W`` queries, and every prompt key in
        ``kv``; arguments as :meth:`prhs_core.protocols.PromptObserver.observe_prompt`). A later
        prompt into the same slot (the next chunk of a chunked prefill) chooses again. A no-op
        with a table."""
        if self.config.channels is not None:
            return
        ids, rows = self.check_prompt_observation(state, layer, slots, queries, kv, scaling, bounds)
        r = self.num_labels()
        pool = state.pool
        for i, (slot, (st, n)) in enumerate(zip(ids, rows, strict=True)):
            if n < 1:
                continue
            scores = channel_scores(queries[i], kv.k[i, :, st : st + n])
            pool["ds_labels"][slot, layer] = choose_labels(scores, r).to(pool.device)
