"""PrHS evaluation: transformers integration, tasks, metrics and the prhs-eval CLI.

``prhs_eval.enable(model, "cis", budget=128)`` makes a loaded transformers model decode through
a prhs selector (:mod:`prhs_eval.integration`); :mod:`prhs_eval.models` loads the offline
models, :mod:`prhs_eval.tasks` generates the tasks, :mod:`prhs_eval.runner` compares selectors
and :mod:`prhs_eval.metrics` measures them against dense attention.

Importing the package is cheap: :func:`enable`, :class:`PrhsRuntime` and
:class:`UnsupportedModelError` load :mod:`prhs_eval.integration` (and torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from prhs_eval.integration import PrhsRuntime, UnsupportedModelError, enable

__all__ = ["PrhsRuntime", "UnsupportedModelError", "__version__", "enable"]

_LAZY = frozenset({"PrhsRuntime", "UnsupportedModelError", "enable"})


def __getattr__(name: str) -> Any:
    """Import :mod:`prhs_eval.integration` when one of its names is first asked for."""
    if name in _LAZY:
        from prhs_eval import integration

        value = getattr(integration, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prhs_eval' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
