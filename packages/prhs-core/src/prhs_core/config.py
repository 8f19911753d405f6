"""Frozen, validated configuration dataclasses shared by every host and selector.

A config is checked once, in ``__post_init__``: an invalid value raises ``TypeError`` or
``ValueError`` naming the field, the value and what was expected, before any work starts.
Selector packages subclass :class:`SelectorConfig` (also frozen) and call
``super().__post_init__()`` before checking their own fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Self

from prhs_core.checks import check_int

__all__ = ["AttentionSpec", "LayerType", "SelectorConfig", "load_option_file"]

LayerType = Literal["full", "sliding"]


@dataclass(frozen=True)
class AttentionSpec:
    """Attention geometry of one model: what a selector needs to size its per-sequence state.

    Parameters
    ----------
    num_layers:
        Number of decoder layers ``N``.
    num_q_heads:
        Query heads ``Hq`` per layer.
    num_kv_heads:
        Key/value heads ``Hkv`` per layer; ``Hq`` must be a multiple (GQA group ``g = Hq/Hkv``).
    head_dim:
        Per-head dimension ``D``.
    layer_types:
        ``"full"`` or ``"sliding"`` per layer (Gemma3-style local layers). Sliding layers keep
        their own window and are never given to a selector. ``None`` means every layer is full.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[LayerType, ...] | None = None

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("num_q_heads", self.num_q_heads, minimum=1)
        check_int("num_kv_heads", self.num_kv_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers:
                raise ValueError(
                    f"layer_types must give one entry per layer ({self.num_layers}), "
                    f"got {len(types)}"
                )
            bad = sorted({repr(t) for t in types if t not in ("full", "sliding")})
            if bad:
                raise ValueError(
                    f"layer_types entries must be 'full' or 'sliding', got {', '.join(bad)}"
                )
            object.__setattr__(self, "layer_types", types)

    @property
    def group_size(self) -> int:
        """Query heads per KV head, ``g = Hq / Hkv``."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def selectable_layers(self) -> tuple[int, ...]:
        """Indices of the layers a selector acts on (every ``"full"`` layer)."""
        if self.layer_types is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full")


@dataclass(frozen=True)
class SelectorConfig:
    """Hyperparameters every decode selector shares (the "Selectors" docs page).

    Parameters
    ----------
    budget:
        ``k``: positions chosen by the method per (sequence, KV head, step), counted without
        the sink and local windows. Must be ``>= 1``.
    n_sink:
        The first ``n_sink`` positions are always selected (attention sinks).
    n_local:
        The ``n_local`` most recent positions are always selected (local window).
    block_size:
        ``s``: selection and reading happen in aligned blocks of ``s`` positions; ``1`` is
        token granularity.
    """

    budget: int = 64
    n_sink: int = 4
    n_local: int = 32
    block_size: int = 1

    def __post_init__(self) -> None:
        check_int("budget", self.budget, minimum=1)
        check_int("n_sink", self.n_sink, minimum=0)
        check_int("n_local", self.n_local, minimum=0)
        check_int("block_size", self.block_size, minimum=1)

    def replace(self, **changes: Any) -> Self:
        """Return a copy with ``changes`` applied and validated again."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} has no field(s) {unknown}; known fields: {sorted(names)}"
            )
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The hyperparameters as a plain dict (for logs, CLIs and result files)."""
        return dataclasses.asdict(self)


def load_option_file(key: str, path: str) -> Any:
    """The value of selector option ``key`` stored in the JSON file ``path`` (how hosts read
    ``KEY=@FILE``): the file's JSON value, or, when it is an object, its entry ``key`` (so a
    calibration file can carry its provenance beside the value). Raises ``ValueError`` naming
    the file and what was wrong."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read {path!r} ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path!r} is not JSON ({exc})") from None
    if isinstance(data, dict):
        if key not in data:
            raise ValueError(f"{path!r} holds an object without {key!r}")
        return data[key]
    return data
