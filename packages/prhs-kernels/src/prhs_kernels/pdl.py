"""Programmatic dependent launch (PDL) of the decode step's Triton kernels, on Hopper and later.

In a decode step each kernel waits for the one before it, and at a few rows most kernels last
a few microseconds: the gap between two of them (the next grid's launch, its programs placed on
the multiprocessors) is a visible part of the step. With PDL a kernel is launched with the
``programmatic stream serialization`` attribute (Triton's ``launch_pdl``): the GPU may start
its programs before the kernel ahead of it has finished, once every program of that kernel has
signalled. Each kernel of the decode path therefore begins with :func:`pdl_wait`: it first
waits for the whole of the kernel ahead (``griddepcontrol.wait``: that kernel finished, its
writes visible), then signals that the kernel after it may be placed
(``griddepcontrol.launch_dependents``). Nothing is read or written before the wait, so the
semantics are unchanged; what overlaps is the next launch with this kernel's run. CUDA graphs
keep the dependency (stream capture records it as a programmatic edge).

The kernels that take part: the decode GEMM, the CIS decision, logits, block scores, top-k,
composition and re-scoring, the scoring kernels, sparse decode attention (split and merge) and
the row bounds. Off by default (:data:`PDL`, or ``PRHS_PDL=1``); it can be limited to some
kernel families (:data:`KERNELS`, e.g. ``PRHS_PDL=cis,score,merge,rows``): those launch early,
the others in order. :func:`pdl_args` gives a launch's arguments.

Measured on an H200 (CIS-8 reuse, whole decode steps, A/B in one call): it pays where the step
is made of short kernels and loses where it is made of long ones -- Llama-2-7B B1·T4k 4.285 ->
4.228 ms, Llama-3-8B B8·T4k 5.084 -> 5.078, but Llama-3-8B B16·T16k 5.658 -> 5.818 and Llama-2-7B
B8·T16k 6.209 -> 6.513 (the next kernel's programs, placed early, hold multiprocessor resources
while they wait). Hence off by default. Scoped to the short kernels (``cis,score,merge,rows``) it
was faster than PDL off in all five whole-step A/Bs timed on an H100 (0.4-1.2 %), not yet on
an H200. Asking the L2 for the GEMM's first weight tiles before
the wait was slower still (+0.1 ms a step) and is not done.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from prhs_kernels.paths import interpreting

__all__ = ["KERNELS", "PDL", "pdl_args", "pdl_supported", "pdl_wait"]

KERNELS = ("gemm", "cis", "score", "sparse", "merge", "rows")
"""The decode path's kernel families, as :func:`pdl_args` names them: the decode GEMMs, the CIS
decision / logits / block scores / top-k / composition kernels, the scoring kernels, sparse
decode attention's split kernel and its merge, and the row bounds."""


def _from_env(value: str) -> dict:
    value = value.strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return {"enabled": False, "kernels": frozenset(KERNELS)}
    if value in ("1", "true", "on", "yes", "all"):
        return {"enabled": True, "kernels": frozenset(KERNELS)}
    names = frozenset(x.strip() for x in value.split(",") if x.strip())
    unknown = sorted(names - set(KERNELS))
    if unknown:
        raise ValueError(
            f"PRHS_PDL={value!r} names unknown kernel families {unknown}: expected 0, 1, all "
            f"or a comma-separated subset of {', '.join(KERNELS)}"
        )
    return {"enabled": True, "kernels": names}


PDL = _from_env(os.environ.get("PRHS_PDL", "0"))
"""Whether the decode path's kernels use PDL where the GPU and Triton support it, and which of
the :data:`KERNELS` families are launched with it (initially from ``PRHS_PDL``: ``1`` for all,
or a comma-separated list such as ``cis,score,merge,rows``). With PDL enabled every kernel
signals its dependents early; only the listed families are *launched* early. Set before a step
is captured in a CUDA graph: a graph keeps the launches it recorded."""

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL is never used
    gdc_launch_dependents = gdc_wait = None


@triton.jit  # at import, unlike the kernels (a helper; interpreted tests import with the flag)
def pdl_wait(PDL: tl.constexpr):
    """A kernel's first statement: with ``PDL``, wait for the kernel ahead to finish, then let
    the kernel after this one be placed; without, nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _triton_launches_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` can launch with PDL: a CUDA GPU of compute capability 9.0
    or more, compiled (not interpreted) Triton kernels, and a Triton that launches with it."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return False
    return _triton_launches_pdl() and _hopper_or_later(device)


def pdl_args(device: torch.device | str, kernel: str) -> dict[str, bool]:
    """A decode-path launch's keyword arguments for a kernel of family ``kernel`` (one of
    :data:`KERNELS`): the kernel's ``PDL`` flag (on where :data:`PDL` is enabled and
    :func:`pdl_supported`) and, for the families :data:`PDL` lists, Triton's ``launch_pdl``.

    A kernel compiled with the flag but launched without the attribute waits for nothing (its
    ``griddepcontrol.wait`` returns at once) and still lets a listed kernel after it start
    early."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel family {kernel!r}: expected one of {', '.join(KERNELS)}")
    if not (PDL["enabled"] and pdl_supported(device)):
        return {"PDL": False}
    if kernel in PDL["kernels"]:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": True}
