"""prhs-core: the types every prhs host and selector shares, and the dropped-mass theory.

- :mod:`prhs_core.config` -- :class:`~prhs_core.config.AttentionSpec`,
  :class:`~prhs_core.config.SelectorConfig` (frozen, validated).
- :mod:`prhs_core.cache` -- :class:`~prhs_core.cache.KVCacheView` and its contiguous / paged
  layouts.
- :mod:`prhs_core.selection` -- :class:`~prhs_core.selection.Selection` and
  :class:`~prhs_core.selection.StepStats`, a step's result.
- :mod:`prhs_core.state` -- :class:`~prhs_core.state.SequenceStatePool`, per-sequence state
  (create / append / release).
- :mod:`prhs_core.protocols` -- :class:`~prhs_core.protocols.DecodeSelector`,
  :class:`~prhs_core.protocols.DecodeStep`, prefill plans.
- :mod:`prhs_core.registry` -- the selector registry (:data:`~prhs_core.registry.selectors`).
- :mod:`prhs_core.theory` -- δ, TV, output and entropy bounds, routing MI, the reuse certificate.

prhs-core depends on torch and numpy only.
"""

from prhs_core import theory
from prhs_core.cache import ContiguousKVCache, KVCacheView, PagedKVCache
from prhs_core.config import AttentionSpec, LayerType, SelectorConfig
from prhs_core.protocols import DecodeSelector, DecodeStep, PrefillLayerPlan, PrefillPlanner
from prhs_core.registry import Registry, RegistryEntry, UnknownSelectorError, selectors
from prhs_core.selection import Selection, StepStats
from prhs_core.state import SequenceStatePool

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "ContiguousKVCache",
    "DecodeSelector",
    "DecodeStep",
    "KVCacheView",
    "LayerType",
    "PagedKVCache",
    "PrefillLayerPlan",
    "PrefillPlanner",
    "Registry",
    "RegistryEntry",
    "Selection",
    "SelectorConfig",
    "SequenceStatePool",
    "StepStats",
    "UnknownSelectorError",
    "__version__",
    "selectors",
    "theory",
]
