"""PrHS evaluation: transformers integration, tasks, metrics and the prhs-eval CLI.

``prhs_eval.enable(model, "cis", budget=128)`` makes a loaded transformers model decode through
a prhs selector (:mod:`prhs_eval.integration`); :mod:`prhs_eval.models` loads the offline
models, :mod:`prhs_eval.tasks` generates the tasks, :mod:`prhs_eval.runner` compares selectors
and :mod:`prhs_eval.metrics` measures them against dense attention.
"""

__version__ = "0.1.0"

from prhs_eval.integration import PrhsRuntime, UnsupportedModelError, enable

__all__ = ["PrhsRuntime", "UnsupportedModelError", "__version__", "enable"]
