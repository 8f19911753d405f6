"""Per-sequence selector state with an explicit lifecycle: create, append, release.

A host owns one :class:`SequenceStatePool` per selector. The pool has a fixed number of *slots*;
each live sequence occupies one. transformers uses slot ``b`` for batch row ``b``; SGLang uses
the request's ``req_pool_idx``, and reuses the slot for a new request after ``release``.

Selectors declare the tensors they keep per sequence with :meth:`SequenceStatePool.add_field`
(e.g. CIS's anchor query ``[L, Hkv, g*D]``); each field is stored as one batched tensor
``[capacity, *shape]`` so a decode step indexes it with the batch's slot ids, with no Python loop
over sequences or heads.

Every method validates all of its input before changing anything: a bad call raises and leaves
the pool exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prhs_core._checks import check_int

__all__ = ["SequenceStatePool", "SlotsLike"]

SlotsLike = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class _FieldSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | int | bool


class SequenceStatePool:
    """Batched per-sequence state for up to ``capacity`` concurrent sequences.

    Parameters
    ----------
    capacity:
        Number of slots (the host's maximum number of live sequences).
    device:
        Where the fields live (the cache's device).
    """

    def __init__(self, capacity: int, device: torch.device | str | None = None) -> None:
        check_int("capacity", capacity, minimum=1)
        self.capacity = capacity
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._specs: dict[str, _FieldSpec] = {}
        self._fields: dict[str, torch.Tensor] = {}
        self._active = torch.zeros(capacity, dtype=torch.bool)  # host-side bookkeeping
        self._lengths_host = torch.zeros(capacity, dtype=torch.long)
        self.lengths = torch.zeros(capacity, dtype=torch.long, device=self.device)
        """``[capacity]`` int64 on ``device``: cached positions per slot (0 when free)."""

    # -- fields ---------------------------------------------------------------------------
    def add_field(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        fill: float | int | bool = 0,
    ) -> torch.Tensor:
        """Declare a per-sequence tensor of ``shape``; slots get ``fill`` when created."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"field name must be an identifier, got {name!r}")
        if name in self._specs:
            raise ValueError(f"field {name!r} already exists in this pool")
        dims = tuple(
            check_int(f"shape[{i}] of field {name!r}", s, minimum=0) for i, s in enumerate(shape)
        )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        # Build the tensor before recording the spec: a bad fill must leave the pool unchanged.
        tensor = torch.full((self.capacity, *dims), fill, dtype=dtype, device=self.device)
        self._specs[name] = _FieldSpec(dims, dtype, fill)
        self._fields[name] = tensor
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        """The field ``name`` as ``[capacity, *shape]`` (index it with slot ids)."""
        try:
            return self._fields[name]
        except KeyError:
            raise KeyError(
                f"no field {name!r} in this pool; fields: {sorted(self._fields)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(self._specs)

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
            raise ValueError(f"{op}: slots must lie in [0, {self.capacity}), got {bad}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{op}: slots must be distinct, got {ids}")
        return ids

    def _counts(self, name: str, value: int | Sequence[int] | torch.Tensor, n: int) -> list[int]:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
            vals = [int(v) for v in value.flatten().tolist()]
        elif isinstance(value, Sequence) and not isinstance(value, str):
            vals = [check_int(name, v) for v in value]
        else:
            vals = [check_int(name, value)] * n
        if len(vals) != n:
            raise ValueError(f"{name} must give one value per slot ({n}), got {len(vals)}")
        if any(v < 0 for v in vals):
            raise ValueError(f"{name} must be >= 0, got {vals}")
        return vals

    def create(self, slots: SlotsLike, lengths: int | Sequence[int] | torch.Tensor = 0) -> None:
        """Start sequences in free ``slots`` with ``lengths`` cached positions (the prompt).

        Every field of those slots is reset to its fill value.
        """
        ids = self._slots(slots, op="create")
        lens = self._counts("lengths", lengths, len(ids))
        busy = [s for s in ids if bool(self._active[s])]
        if busy:
            raise ValueError(f"create: slots {busy} are in use; release them first")
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long)
        self._active[idx] = True
        self._lengths_host[idx] = torch.tensor(lens, dtype=torch.long)
        dev_idx = idx.to(self.device)
        self.lengths[dev_idx] = torch.tensor(lens, dtype=torch.long, device=self.device)
        for name, spec in self._specs.items():
            self._fields[name][dev_idx] = spec.fill

    def append(self, slots: SlotsLike, num_tokens: int | Sequence[int] | torch.Tensor = 1) -> None:
        """Record ``num_tokens`` new cached positions for each live slot."""
        ids = self._slots(slots, op="append")
        counts = self._counts("num_tokens", num_tokens, len(ids))
        idle = [s for s in ids if not bool(self._active[s])]
        if idle:
            raise ValueError(f"append: slots {idle} hold no sequence; create them first")
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long)
        add = torch.tensor(counts, dtype=torch.long)
        self._lengths_host[idx] += add
        self.lengths[idx.to(self.device)] += add.to(self.device)

    def release(self, slots: SlotsLike) -> None:
        """End the sequences in ``slots``; the slots become free for reuse."""
        ids = self._slots(slots, op="release")
        idle = [s for s in ids if not bool(self._active[s])]
        if idle:
            raise ValueError(f"release: slots {idle} hold no sequence")
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long)
        self._active[idx] = False
        self._lengths_host[idx] = 0
        self.lengths[idx.to(self.device)] = 0

    def release_all(self) -> None:
        """End every live sequence (a host resetting its cache)."""
        self.release([int(i) for i in torch.nonzero(self._active).flatten().tolist()])

    # -- queries --------------------------------------------------------------------------
    def is_active(self, slot: int) -> bool:
        """Whether ``slot`` holds a live sequence."""
        return bool(self._active[check_int("slot", slot)]) if 0 <= slot < self.capacity else False

    @property
    def active_slots(self) -> tuple[int, ...]:
        """Slots holding a live sequence, ascending."""
        return tuple(int(i) for i in torch.nonzero(self._active).flatten().tolist())

    def length(self, slot: int) -> int:
        """Cached positions of the sequence in ``slot`` (0 when free), without a device sync."""
        check_int("slot", slot, minimum=0)
        if slot >= self.capacity:
            raise ValueError(f"slot must lie in [0, {self.capacity}), got {slot}")
        return int(self._lengths_host[slot])
