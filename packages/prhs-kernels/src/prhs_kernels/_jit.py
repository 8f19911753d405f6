"""The decorator of every Numba (CPU) kernel: ``numba.njit(nogil=True)`` with the compiled code
cached on disk, so only the first process on a machine compiles a kernel (seconds to tens of
seconds on a small CPU) and every later one loads it (a fraction of a second).

Numba keeps the cache beside the module (``__pycache__``) or, where that is not writable, in
``NUMBA_CACHE_DIR`` or the user's cache directory, and recompiles when the module's source
changes. A compiled kernel may therefore use only its own module's globals (a constant from
another module could change without the cache noticing): pass such values as arguments. Where
no location is writable, the kernel compiles once per process, as without a cache.

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
