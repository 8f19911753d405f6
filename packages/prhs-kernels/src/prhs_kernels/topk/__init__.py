"""Top-k and top-p selection into fixed-width index lists (``[..., k]`` int32 plus counts).

Tie rule: any order among equal scores is valid (see :mod:`prhs_kernels.topk.reference`).

On the CPU both ops run Numba kernels with the CPU references' exact outputs, tie order included
(:mod:`prhs_kernels.topk.numba`, chosen by :func:`~prhs_kernels.paths.numba_path`;
``PRHS_KERNELS=torch`` keeps the references). The first call compiles them (a few seconds), once
per process.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from prhs_core.checks import check_bool_mask, check_float_tensor, check_int, check_probability
from prhs_kernels.paths import announce, numba_path
from prhs_kernels.topk.reference import top_p_indices_reference, topk_indices_reference

__all__ = [
    "top_p_indices",
    "top_p_indices_reference",
    "topk_indices",
    "topk_indices_reference",
]


@functools.cache
def _numba() -> ModuleType:
    """The Numba kernels, imported and compiled at their first use."""
    from prhs_kernels.topk import numba as kernels

    kernels.warm_up()
    return kernels


def topk_indices(
    scores: torch.Tensor, k: int, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest eligible ``scores [..., N]``: ``(indices [..., k], counts [...])``,
    int32, largest first, ``-1`` past each count."""
    check_float_tensor("scores", scores, min_ndim=1)
    check_int("k", k, minimum=0)
    if eligible is not None:
        check_bool_mask("eligible", eligible, tuple(scores.shape))
    if numba_path(scores.device):
        announce("topk_indices", "numba", scores.device)
        return _numba().topk_indices_numba(scores, k, eligible)
    return topk_indices_reference(scores, k, eligible)


def top_p_indices(
    mass: torch.Tensor,
    target: float,
    cap: int,
    eligible: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest top set by ``mass [..., N]`` whose dropped mass is ``<= target``, capped at
    ``cap`` entries: ``(indices [..., cap], counts [...])``, int32, largest first."""
    check_float_tensor("mass", mass, min_ndim=1)
    check_probability("target", target)
    check_int("cap", cap, minimum=1)
    if eligible is not None:
        check_bool_mask("eligible", eligible, tuple(mass.shape))
    if kept is not None:
        check_float_tensor("kept", kept, ndim=mass.ndim - 1)
    if numba_path(mass.device):
        announce("top_p_indices", "numba", mass.device)
        return _numba().top_p_indices_numba(mass, target, cap, eligible, kept)
    return top_p_indices_reference(mass, target, cap, eligible, kept)
