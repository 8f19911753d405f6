"""Selector state in two parts, sized so that neither grows with requests × maximum length.

- :class:`SequenceStatePool`: per-request state whose size does not depend on the context length
  (CIS's anchor queries and anchor index lists, H2O's per-layer "seeded" flags), one row per
  request slot. transformers uses batch row ``b`` as the slot; SGLang uses the request's
  ``req_pool_idx`` and reuses it after ``release``. One extra row, :attr:`scratch_slot`, is
  reserved for padded batch rows (SGLang pads CUDA-graph batches): a padded row reads and writes
  it, harmlessly.
- :class:`SideCache`: metadata indexed by the physical location of a key (a pool slot, or a page
  of slots), written when the host writes K/V, so it follows the KV pool: Quest's page bounds,
  H2O's accumulated scores.

:class:`SelectorState` holds both, with the location geometry and the device-side counter of
non-finite inputs that were skipped.

The pool keeps no copy of sequence lengths: lengths come from the host with every step.
Every lifecycle call validates all of its input before changing anything: a bad call raises and
leaves the state exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prhs_core.checks import check_int

__all__ = ["SelectorState", "SequenceStatePool", "SideCache", "SlotsLike"]

SlotsLike = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class _FieldSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | int | bool


class _Fields:
    """Named tensors ``[rows, *shape]`` declared with :meth:`add_field`."""

    rows: int
    device: torch.device

    def __init__(self, rows: int, device: torch.device | str | None) -> None:
        self.rows = rows
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._specs: dict[str, _FieldSpec] = {}
        self._fields: dict[str, torch.Tensor] = {}

    def add_field(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        fill: float | int | bool = 0,
    ) -> torch.Tensor:
        """Declare a tensor of ``shape`` per row, filled with ``fill``."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"field name must be an identifier, got {name!r}")
        if name in self._specs:
            raise ValueError(f"field {name!r} already exists")
        dims = tuple(
            check_int(f"shape[{i}] of field {name!r}", s, minimum=0) for i, s in enumerate(shape)
        )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        # Build the tensor before recording the spec: a bad fill must leave the pool unchanged.
        tensor = torch.full((self.rows, *dims), fill, dtype=dtype, device=self.device)
        self._specs[name] = _FieldSpec(dims, dtype, fill)
        self._fields[name] = tensor
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._fields[name]
        except KeyError:
            raise KeyError(f"no field {name!r}; fields: {sorted(self._fields)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def nbytes(self) -> int:
        """Bytes held by every field (sizes from shapes: works on the ``meta`` device)."""
        return sum(t.numel() * t.element_size() for t in self._fields.values())

    def _reset_rows(self, idx: torch.Tensor) -> None:
        for name, spec in self._specs.items():
            self._fields[name][idx] = spec.fill


class SequenceStatePool(_Fields):
    """Per-request state for up to ``capacity`` live sequences, plus one scratch row.

    Parameters
    ----------
    capacity:
        Number of request slots (the host's maximum number of live sequences).
    device:
        Where the fields live (the cache's device).

    Notes
    -----
    Fields are ``[capacity + 1, *shape]``: index them with slot ids; row ``capacity`` is
    :attr:`scratch_slot`.
    """

    def __init__(self, capacity: int, device: torch.device | str | None = None) -> None:
        check_int("capacity", capacity, minimum=1)
        super().__init__(capacity + 1, device)
        self.capacity = capacity
        self._active = [False] * capacity  # host-side bookkeeping
        self._pending: set[int] = set()  # created, not yet seen by a plan

    @property
    def scratch_slot(self) -> int:
        """The row that padded batch rows use (never a live sequence)."""
        return self.capacity

    def nbytes_per_request(self) -> float:
        """Bytes of state per request slot."""
        return self.nbytes() / self.rows

    # -- lifecycle ------------------------------------------------------------------------
    def _slots(self, slots: SlotsLike, *, op: str) -> list[int]:
        if isinstance(slots, torch.Tensor):
            if slots.ndim != 1 or slots.is_floating_point() or slots.dtype == torch.bool:
                raise ValueError(f"{op}: slots must be a 1-D integer tensor or a list of ints")
            ids = [int(s) for s in slots.tolist()]
        else:
            ids = [check_int(f"{op}: slot", s) for s in slots]
        bad = [s for s in ids if not 0 <= s < self.capacity]
        if bad:
            raise ValueError(
                f"{op}: slots must lie in [0, {self.capacity}) (the pool's capacity), got {bad}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"{op}: slots must be distinct, got {ids}")
        return ids

    def create(self, slots: SlotsLike) -> None:
        """Start sequences in free ``slots``: every field of those rows is reset to its fill."""
        ids = self._slots(slots, op="create")
        busy = [s for s in ids if self._active[s]]
        if busy:
            raise ValueError(f"create: slots {busy} are in use; release them first")
        if not ids:
            return
        for s in ids:
            self._active[s] = True
        self._reset_rows(torch.tensor(ids, dtype=torch.long, device=self.device))
        self._pending.update(ids)

    def release(self, slots: SlotsLike) -> None:
        """End the sequences in ``slots``; the slots become free for reuse."""
        ids = self._slots(slots, op="release")
        idle = [s for s in ids if not self._active[s]]
        if idle:
            raise ValueError(f"release: slots {idle} hold no sequence")
        for s in ids:
            self._active[s] = False
        self._pending.difference_update(ids)

    def release_all(self) -> None:
        """End every live sequence (a host resetting its cache)."""
        self.release(list(self.active_slots))

    def take_created(self, slots: Sequence[int] | None = None) -> bool:
        """Whether a sequence created since it was last asked about is among ``slots`` (host
        ints; ``None``: any slot), forgetting the ones asked about. Host bookkeeping, no device
        read: a plan asks once per step, so selectors that seed state at a sequence's first
        decode step (H2O) know whether to score this step."""
        if slots is None:
            hit = bool(self._pending)
            self._pending.clear()
            return hit
        hit = any(s in self._pending for s in slots)
        self._pending.difference_update(slots)
        return hit

    # -- queries --------------------------------------------------------------------------
    def is_active(self, slot: int) -> bool:
        """Whether ``slot`` holds a live sequence."""
        check_int("slot", slot)
        return 0 <= slot < self.capacity and self._active[slot]

    @property
    def active_slots(self) -> tuple[int, ...]:
        """Slots holding a live sequence, ascending."""
        return tuple(i for i, a in enumerate(self._active) if a)

    @property
    def num_active(self) -> int:
        """How many sequences are live."""
        return sum(self._active)


class SideCache(_Fields):
    """Metadata indexed by KV location, written when K/V are written.

    Parameters
    ----------
    num_locations:
        Token locations of the KV pool the host keeps (see :mod:`prhs_core.layout`).
    page_size:
        Locations per page: page-level fields have ``ceil(num_locations / page_size)`` rows
        (:meth:`add_page_field`).
    device:
        Where the fields live.

    Notes
    -----
    Token fields (:meth:`add_field`) are ``[num_locations + 1, *shape]`` and page fields
    (:meth:`add_page_field`) ``[num_pages + 1, *shape]``: the last row of each is scratch
    (:attr:`scratch_location`, :attr:`scratch_page`), where reads and writes of locations that
    do not exist (``-1``) are sent, so no op needs a data-dependent shape.
    """

    def __init__(
        self, num_locations: int, page_size: int = 1, device: torch.device | str | None = None
    ) -> None:
        check_int("num_locations", num_locations, minimum=1)
        check_int("page_size", page_size, minimum=1)
        super().__init__(num_locations + 1, device)
        self.num_locations = num_locations
        self.page_size = page_size
        self.num_pages = -(-num_locations // page_size)
        self.initialized: set[str] = set()
        """Host bookkeeping: names of tables (:meth:`add_table`) a selector has set once (e.g.
        from the first keys written), so that it need not read the device to know."""

    @property
    def scratch_location(self) -> int:
        """The token row that location ``-1`` maps to."""
        return self.num_locations

    @property
    def scratch_page(self) -> int:
        """The page row that a page of location ``-1`` maps to."""
        return self.num_pages

    def add_page_field(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        fill: float | int | bool = 0,
    ) -> torch.Tensor:
        """Declare a tensor of ``shape`` per page of ``page_size`` locations."""
        return self._add_field_of(self.num_pages + 1, name, shape, dtype, fill)

    def add_table(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        fill: float | int | bool = 0,
    ) -> torch.Tensor:
        """Declare a tensor of exactly ``shape``, not indexed by location: metadata of the whole
        pool that describes how its rows are stored (e.g. the centre its keys' codes are taken
        around), set by a selector once and shared by every request."""
        table = self._add_field_of(1, name, shape, dtype, fill)[0]
        self._fields[name] = table
        return table

    def _add_field_of(
        self,
        rows: int,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        fill: float | int | bool,
    ) -> torch.Tensor:
        """:meth:`add_field` with ``rows`` rows instead of one per location."""
        saved, self.rows = self.rows, rows
        try:
            return self.add_field(name, shape, dtype, fill)
        finally:
            self.rows = saved

    def rows_of(self, locations: torch.Tensor) -> torch.Tensor:
        """Token rows of ``locations`` (``-1`` → the scratch row), int64."""
        loc = locations.long()
        return torch.where(loc >= 0, loc, self.scratch_location)

    def pages_of(self, locations: torch.Tensor) -> torch.Tensor:
        """Page rows of ``locations`` (``-1`` → the scratch page), int64."""
        loc = locations.long()
        return torch.where(loc >= 0, loc // self.page_size, self.scratch_page)


@dataclass
class SelectorState:
    """Everything a selector keeps between steps, for one model.

    Attributes
    ----------
    pool:
        Per-request state (size independent of the context length).
    side:
        Per-KV-location metadata (follows the KV pool), or ``None`` when the selector keeps none.
    row_stride:
        For contiguous layouts: the location of position ``t`` of row ``b`` is
        ``b * row_stride + t``.
    kv_page_size:
        The host's KV page size for paged layouts (1 for contiguous ones).
    nonfinite:
        ``[1]`` int64 on the state's device: (sequence, KV head) decisions and key rows whose
        non-finite input was skipped instead of stored. Read it when you choose
        (:meth:`nonfinite_count` reads it on the host).
    retrieving:
        ``[1]`` bool on the state's device, scratch within one layer's selection: a selector's
        decision sets it when some row retrieves and its composition clears it, so that in
        between a captured step can skip the retrieval's kernels when no row needs them.
    """

    pool: SequenceStatePool
    side: SideCache | None
    row_stride: int
    kv_page_size: int = 1
    nonfinite: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int64))
    retrieving: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.bool))

    def __post_init__(self) -> None:
        check_int("row_stride", self.row_stride, minimum=1)
        check_int("kv_page_size", self.kv_page_size, minimum=1)
        if self.nonfinite.device != self.pool.device:
            self.nonfinite = self.nonfinite.to(self.pool.device)
        if self.retrieving.device != self.pool.device:
            self.retrieving = self.retrieving.to(self.pool.device)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def nonfinite_count(self) -> int:
        """How many non-finite inputs were skipped so far (a host read)."""
        return int(self.nonfinite.sum().item())

    def nbytes(self) -> dict[str, int]:
        """``{"per_request": ..., "side_cache": ...}`` bytes (from shapes; meta-safe)."""
        return {
            "per_request": int(self.pool.nbytes_per_request()),
            "side_cache": self.side.nbytes() if self.side is not None else 0,
        }
