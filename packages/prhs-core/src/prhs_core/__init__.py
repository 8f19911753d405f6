"""prhs-core: the types every prhs host and selector shares, and the dropped-mass theory.

- :mod:`prhs_core.config` -- :class:`~prhs_core.config.AttentionSpec`,
  :class:`~prhs_core.config.SelectorConfig` (frozen, validated).
- :mod:`prhs_core.layout` -- the KV layouts as tensor dataclasses:
  :class:`~prhs_core.layout.ContiguousKV` and :class:`~prhs_core.layout.PagedKV`.
- :mod:`prhs_core.selection` -- :class:`~prhs_core.selection.Selection` (fixed-width index lists
  plus counts) and :class:`~prhs_core.selection.StepStats`, a step's result.
- :mod:`prhs_core.plan` -- :class:`~prhs_core.plan.DecodePlan`: plan once per step, run per
  layer.
- :mod:`prhs_core.state` -- :class:`~prhs_core.state.SelectorState`: per-request state and
  side caches indexed by KV location.
- :mod:`prhs_core.protocols` -- :class:`~prhs_core.protocols.DecodeSelector`, prefill plans.
- :mod:`prhs_core.checks` -- the input checks every entry point uses.
- :mod:`prhs_core.registry` -- the selector registry (:data:`~prhs_core.registry.selectors`).
- :mod:`prhs_core.theory` -- δ, TV, output and entropy bounds, routing MI, the reuse certificate.

prhs-core depends on torch and numpy only.
"""

from prhs_core import checks, theory
from prhs_core.config import AttentionSpec, LayerType, SelectorConfig
from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_core.plan import DecodePlan
from prhs_core.protocols import (
    DecodeSelector,
    DecodeStep,
    PrefillLayerPlan,
    PrefillPlanner,
    PromptObserver,
)
from prhs_core.registry import Registry, RegistryEntry, UnknownSelectorError, selectors
from prhs_core.selection import Compensation, Selection, StepStats
from prhs_core.state import SelectorState, SequenceStatePool, SideCache

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "Compensation",
    "ContiguousKV",
    "DecodePlan",
    "DecodeSelector",
    "DecodeStep",
    "KVLayout",
    "LayerType",
    "PagedKV",
    "PrefillLayerPlan",
    "PrefillPlanner",
    "PromptObserver",
    "Registry",
    "RegistryEntry",
    "Selection",
    "SelectorConfig",
    "SelectorState",
    "SequenceStatePool",
    "SideCache",
    "StepStats",
    "UnknownSelectorError",
    "__version__",
    "checks",
    "selectors",
    "theory",
]
