"""PrHS SGLang plugin: prhs selectors as an attention backend inside the SGLang server.

Importing this package does not import SGLang: the backend loads when SGLang builds it.
"""

from prhs_sglang.config import SparseAttnConfig, SparseConfigError, resolve
from prhs_sglang.plugin import configure, engine_args

__version__ = "0.1.0"

__all__ = [
    "SparseAttnConfig",
    "SparseConfigError",
    "__version__",
    "configure",
    "engine_args",
    "resolve",
]
