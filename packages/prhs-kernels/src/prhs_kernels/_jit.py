"""The decorator of every Numba (CPU) kernel: ``numba.njit(nogil=True)`` with the compiled code
cached on disk, so only the first process on a machine compiles the kernels and every later one
loads them (``prhs_kernels.paths.warm_up("cpu")`` on a 2-core machine: 31 s compiling, 7 s
loading, Numba's import included).

Numba keeps the cache in ``NUMBA_CACHE_DIR`` when it is set, else beside the module
(``__pycache__``), else, where that is not writable, in the user's cache directory; it
recompiles when the module's source or Numba's version changes. A compiled kernel may therefore
use only its own module's globals (a constant from another module could change without the
cache noticing): pass such values as arguments. Where no location is writable, the kernel
compiles once per process, as without a cache.

Importing this module imports Numba: only the ``numba`` modules of each op import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba

__all__ = ["njit"]


def njit(fn: Callable[..., Any]) -> Any:
    """``fn`` compiled by Numba in nopython mode without the GIL, cached on disk where it can be."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError as e:  # Numba found no writable cache location for the module
        if "cannot cache" not in str(e):
            raise
        return numba.njit(cache=False, nogil=True)(fn)
