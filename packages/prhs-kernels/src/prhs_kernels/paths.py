"""Which implementation of an op runs on a device, and a log line saying so.

Every op has a torch reference that runs everywhere. The Triton kernels run

- on CUDA, for half-precision caches (fp16 / bf16), when Triton is installed;
- on the CPU only under ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests and debugging:
  correct, far too slow to serve).

``PRHS_KERNELS=torch`` in the environment forces the torch paths everywhere (to compare, or to
rule a kernel out). A path is chosen from the device, the dtype and the environment only, before
anything runs: an error inside a kernel is raised, never answered by a silent fallback.

:func:`kernel_path` names the path an op takes; the first time an op takes a path on a device
type, :func:`announce` logs it once on the ``prhs_kernels`` logger (level INFO).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys

import torch

__all__ = [
    "HALF_DTYPES",
    "announce",
    "interpreting",
    "kernel_path",
    "numba_path",
    "triton_installed",
    "triton_path",
    "warm_up",
]

logger = logging.getLogger("prhs_kernels")

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Cache dtypes the Triton kernels take (they accumulate in float32)."""


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported (looked up, not imported: importing it is slow)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (read each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _forced_torch() -> bool:
    value = os.environ.get("PRHS_KERNELS", "").strip().lower()
    if value not in ("", "auto", "torch"):
        raise ValueError(f"PRHS_KERNELS must be 'auto' or 'torch' (or unset), got {value!r}")
    return value == "torch"


def triton_path(device: torch.device | str) -> str:
    """``"triton"`` (compiled, CUDA), ``"triton-interpreter"`` (CPU, ``TRITON_INTERPRET=1``) or
    ``"torch"`` for an op on ``device`` whatever its dtype: :func:`kernel_path` without the
    cache dtype's rule, for ops whose kernels take float32 inputs too (a top-k over scores)."""
    dev = torch.device(device)
    if _forced_torch() or not triton_installed():
        return "torch"
    if dev.type == "cuda" and not interpreting():
        return "triton"
    if dev.type == "cpu" and interpreting():
        return "triton-interpreter"
    return "torch"


def kernel_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """``"triton"`` (compiled, CUDA), ``"triton-interpreter"`` (CPU, ``TRITON_INTERPRET=1``) or
    ``"torch"`` for an op on ``device`` over a cache of ``dtype``."""
    path = triton_path(device)
    return path if dtype in HALF_DTYPES else "torch"


def numba_path(device: torch.device | str) -> bool:
    """Whether a CPU selection op with a Numba kernel (union, dilation, top-k, top-p, Louver's
    clustering, RaBitQ's bit packing) takes it on ``device``: on the CPU, when Numba is
    installed (looked up, not imported) and ``PRHS_KERNELS`` is not ``torch``. The kernels
    compile once per process at their first call (``warm_up()`` in each op's ``numba`` module
    does it up front)."""
    if torch.device(device).type != "cpu" or _forced_torch():
        return False
    return "numba" in sys.modules or importlib.util.find_spec("numba") is not None


_announced: set[tuple[str, str, str]] = set()


def announce(op: str, path: str, device: torch.device | str) -> None:
    """Log ``op``'s path on ``device``'s type once per process."""
    key = (op, path, torch.device(device).type)
    if key not in _announced:
        _announced.add(key)
        logger.info("prhs_kernels: %s runs its %s path on %s", op, path, key[2])


def warm_up(device: torch.device | str) -> None:
    """Compile, now, the Numba kernels a decode step on ``device`` will run (on the CPU: union,
    dilation, top-k, top-p; seconds, once per process), so that no step pays for it. Does
    nothing where they do not apply. Louver's clustering and RaBitQ's bit packing compile at
    their first use instead (a prompt's index or codes at prefill, so before any step). Triton
    kernels compile per shape at their first launch (a CUDA-graph capture's warm-up run covers
    them)."""
    if not numba_path(device):
        return
    from prhs_kernels.compose import _numba as compose_kernels
    from prhs_kernels.topk import _numba as topk_kernels

    compose_kernels()
    topk_kernels()
