"""Plan once per step, run per layer.

A :class:`DecodePlan` holds what every layer of one decode step shares: the batch's lengths and
state slots, the logit scale, and the buffers a selection is written into. A host makes one plan
per batch size (like a CUDA graph's static inputs), and at every step copies the new metadata in
with :meth:`DecodePlan.update`; then, per layer::

    sel = selector.select(plan, layer, query, kv, state)     # writes plan.selection, or None
    out = prhs_kernels.sparse_decode_attention(query, kv, sel, plan.scaling, out=...)

Neither call reads a device value on the host, keeps every shape static and writes into buffers
made here, so the whole step can be captured in a CUDA graph and replayed after ``update``.

``checked=True`` adds value checks (lengths, slots, finite queries) that read device values on
the host and raise at once with a clear message: for tests and CPU runs, never inside a graph.
"""

from __future__ import annotations

import math

import torch

from prhs_core.checks import check_in_range, check_index_tensor, check_int, check_shape
from prhs_core.selection import Selection, StepStats
from prhs_core.state import SelectorState

__all__ = ["DecodePlan"]

# Columns of DecodePlan.totals.
TOTAL_COLUMNS = ("decisions", "retrievals", "selected", "proxy_bytes")


class DecodePlan:
    """Per-step metadata and preallocated workspaces shared by the layers of a decode step.

    Parameters
    ----------
    state:
        The selector state the plan's slots index (its scratch slot serves padded rows).
    batch_size:
        ``B``, rows of every step run with this plan (padded rows included).
    num_kv_heads:
        ``Hkv``.
    num_layers:
        Layers of the model (rows of :attr:`totals`).
    width:
        ``K_max`` of the selector's selections (``selector.selection_width()``).
    block_size:
        ``s`` of the selector's selections.
    scaling:
        Logit scale of the model (``1/sqrt(D)`` unless the model says otherwise).
    stats:
        Write per-step :class:`~prhs_core.selection.StepStats` and accumulate :attr:`totals`.
    certified:
        Keep a ``delta_hat`` buffer in the stats.
    checked:
        Check values on the host at every :meth:`update` and selection (raises at once).
    compensation:
        ``(Hq, Dv)``: the selection carries :class:`~prhs_core.selection.Compensation`
        buffers (CompKV); ``None``: it does not.
    """

    def __init__(
        self,
        state: SelectorState,
        *,
        batch_size: int,
        num_kv_heads: int,
        num_layers: int,
        width: int,
        block_size: int,
        scaling: float,
        stats: bool = False,
        certified: bool = False,
        checked: bool = False,
        compensation: tuple[int, int] | None = None,
    ) -> None:
        check_int("batch_size", batch_size, minimum=1)
        check_int("num_kv_heads", num_kv_heads, minimum=1)
        check_int("num_layers", num_layers, minimum=1)
        check_int("width", width, minimum=0)
        check_int("block_size", block_size, minimum=1)
        if isinstance(scaling, bool) or not isinstance(scaling, int | float):
            raise TypeError(f"scaling must be a float, got {type(scaling).__name__}")
        if not (math.isfinite(scaling) and scaling > 0):
            raise ValueError(f"scaling must be a positive finite float, got {scaling}")
        if not isinstance(state, SelectorState):
            raise TypeError(f"state must be a SelectorState, got {type(state).__name__}")
        dev = state.device
        self.state = state
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.num_layers = num_layers
        self.scaling = float(scaling)
        self.checked = bool(checked)
        self.seq_lens = torch.ones(batch_size, dtype=torch.int32, device=dev)
        """``[B]`` int32 cached positions per row (the current token included)."""
        self.slots = torch.full(
            (batch_size,), state.pool.scratch_slot, dtype=torch.int64, device=dev
        )
        """``[B]`` int64 state slot per row (padded rows: the scratch slot)."""
        step_stats = (
            StepStats.allocate(batch_size, num_kv_heads, dev, certified=certified)
            if stats
            else None
        )
        self.selection = Selection.allocate(
            batch_size, num_kv_heads, width, block_size, dev, step_stats, compensation
        )
        """The buffers a selector writes its selection (and statistics) into."""
        self.totals = (
            torch.zeros(num_layers, len(TOTAL_COLUMNS), dtype=torch.float64, device=dev)
            if stats
            else None
        )
        """``[num_layers, 4]`` float64 running sums (decisions, retrievals, selected positions,
        proxy bytes), or ``None`` without stats."""
        self.seeding = True
        """Host flag: some row may be at its first decode step (set by :meth:`update`)."""

    @property
    def stats(self) -> StepStats | None:
        return self.selection.stats

    def update(self, seq_lens: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy one step's metadata into the plan's buffers (device copies, no host read).

        ``seq_lens [B]``: cached positions per row, the current token included. ``slots [B]``:
        state slot per row; a negative slot marks a padded row, which uses the scratch slot.
        Pass ``slots`` on the CPU when the host has them there: :attr:`seeding` is then exact
        (true only when a row of this batch is at its first decode step).
        """
        check_index_tensor("seq_lens", seq_lens, ndim=1)
        check_index_tensor("slots", slots, ndim=1)
        check_shape("seq_lens", seq_lens, (self.batch_size,), "[B]")
        check_shape("slots", slots, (self.batch_size,), "[B]")
        if self.checked:
            check_in_range("seq_lens", seq_lens, 1, 2**31 - 1, "a decode step caches >= 1 token")
            check_in_range(
                "slots", slots, -1, self.state.pool.capacity - 1, "state slots (-1: padded row)"
            )
            live = [int(s) for s in slots.tolist() if s >= 0]
            idle = [s for s in live if not self.state.pool.is_active(s)]
            if idle:
                raise ValueError(f"slots {idle} hold no sequence: create them before decoding")
            if len(set(live)) != len(live):
                raise ValueError(f"slots must be distinct, got {live}")
        self.seq_lens.copy_(seq_lens, non_blocking=True)
        dev_slots = slots.to(self.slots.device, non_blocking=True).long()
        self.slots.copy_(torch.where(dev_slots >= 0, dev_slots, self.state.pool.scratch_slot))
        # Slots on the CPU are host metadata: which rows are new is known exactly. Slots on a
        # device are not read: then any sequence created since the last step counts.
        host = [int(s) for s in slots.tolist()] if slots.device.type == "cpu" else None
        self.seeding = self.state.pool.take_created(host)

    def summary(self) -> dict[str, float]:
        """The running totals as host numbers: ``retrieval_ratio`` (%), ``avg_selected`` and the
        sums (a host read; ``{}`` without stats)."""
        if self.totals is None:
            return {}
        t = self.totals.sum(0).tolist()
        out = dict(zip(TOTAL_COLUMNS, t, strict=True))
        n = out["decisions"]
        out["retrieval_ratio"] = 100.0 * out["retrievals"] / n if n else float("nan")
        out["avg_selected"] = out["selected"] / n if n else float("nan")
        return out
