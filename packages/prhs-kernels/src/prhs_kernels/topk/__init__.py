"""Top-k and top-p selection into fixed-width index lists (``[..., k]`` int32 plus counts), and
the first pass of a seeded top-k (:func:`seeded_candidates`).

Tie rule: any order among equal scores is valid (see :mod:`prhs_kernels.topk.reference`).

On the CPU both ops run Numba kernels with the CPU references' exact outputs, tie order included
(:mod:`prhs_kernels.topk.numba`, chosen by :func:`~prhs_kernels.paths.numba_path`;
``PRHS_KERNELS=torch`` keeps the references). The first call compiles them (a few seconds), once
per process.

On CUDA :func:`topk_indices` runs a Triton kernel, a program per row
(:func:`.triton.topk_indices_triton`), for float32, bf16 and fp16 scores in rows of up to
:data:`.triton.TOPK_MAX_N` (16 384); longer rows, float64 scores, ``PRHS_KERNELS=torch`` or no
Triton take the reference (``torch.topk``). :func:`topk_path` says which path a call takes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch

from prhs_core.checks import (
    check_bool_mask,
    check_device,
    check_float_tensor,
    check_index_tensor,
    check_int,
    check_probability,
    shape_str,
)
from prhs_kernels.paths import announce, numba_path, triton_path
from prhs_kernels.topk.reference import (
    seeded_candidates_reference,
    top_p_indices_reference,
    topk_indices_reference,
)

__all__ = [
    "seeded_candidates",
    "seeded_candidates_reference",
    "top_p_indices",
    "top_p_indices_reference",
    "topk_indices",
    "topk_indices_reference",
    "topk_path",
]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Score dtypes :func:`topk_indices`' Triton kernel takes (it ranks them in float32)."""

PATHS = ("torch", "triton", "triton-interpreter")
"""The paths :func:`topk_indices` may be asked for."""


@functools.cache
def _numba() -> ModuleType:
    """The Numba kernels, imported and compiled at their first use."""
    from prhs_kernels.topk import numba as kernels

    kernels.warm_up()
    return kernels


@functools.cache
def _triton() -> ModuleType:
    """The Triton kernels' module, imported at its first use (importing Triton is slow)."""
    from prhs_kernels.topk import triton as kernels

    return kernels


def topk_path(
    device: torch.device | str, dtype: torch.dtype, n: int, path: str | None = None
) -> str:
    """The path :func:`topk_indices` takes over rows of ``n`` scores of ``dtype`` on ``device``:
    ``"triton"`` / ``"triton-interpreter"`` (the one-program-per-row kernel), ``"numba"`` or
    ``"torch"`` (the reference). ``path`` ``None`` chooses: the Triton kernel on CUDA
    (:func:`~prhs_kernels.paths.triton_path`); a Triton ``path`` asks for it (tests:
    ``"triton-interpreter"`` on the CPU under ``TRITON_INTERPRET=1``). The kernel applies to
    float32, bf16 and fp16 rows of at most :data:`.triton.TOPK_MAX_N` scores; elsewhere, and
    for ``path="torch"``, the Numba kernel on the CPU (:func:`~prhs_kernels.paths.numba_path`)
    or the reference. A ``path`` not in :data:`PATHS` raises ``ValueError``."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)} or None, got {path!r}")
    dev = torch.device(device)
    if path is None:
        path = "triton" if dev.type == "cuda" and triton_path(dev) == "triton" else "torch"
    if path.startswith("triton") and dtype in TRITON_DTYPES and n <= _triton().TOPK_MAX_N:
        return path
    return "numba" if numba_path(dev) else "torch"


def topk_indices(
    scores: torch.Tensor, k: int, eligible: torch.Tensor | None = None, *, path: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest eligible ``scores [..., N]``: ``(indices [..., k], counts [...])``,
    int32, largest first, ``-1`` past each count (see :func:`.reference.topk_indices_reference`:
    NaN ranks as ``-inf``, an ineligible entry below every eligible one, ``counts =
    min(eligible, k)``; any order among equal scores).

    ``eligible [..., N]`` bool on the scores' device (``None``: every entry). ``path``
    (:func:`topk_path`; ``None``: chosen from the device, dtype and ``N``): on CUDA a Triton
    program per row for float32, bf16 and fp16 rows of up to 16 384 scores, which reads nothing
    on the host; ``torch.topk`` for longer rows. Bad arguments raise before anything runs."""
    check_float_tensor("scores", scores, min_ndim=1)
    check_int("k", k, minimum=0)
    if eligible is not None:
        check_bool_mask("eligible", eligible, tuple(scores.shape))
        check_device(("scores", "eligible"), (scores, eligible))
    chosen = topk_path(scores.device, scores.dtype, scores.shape[-1], path)
    if chosen.startswith("triton"):
        announce("topk_indices", chosen, scores.device)
        return _triton().topk_indices_triton(scores, k, eligible)
    if chosen == "numba":
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


def seeded_candidates(
    scores: torch.Tensor,
    k: int,
    seed: torch.Tensor | Sequence[torch.Tensor],
    *,
    capacity: int,
    active: torch.Tensor | None = None,
    seed_rows: torch.Tensor | None = None,
    whole_rows: bool = False,
    path: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The guess-and-verify passes of a top-``k`` seeded by a nearby set (after TensorRT-LLM's
    Guess-Verify-Refine): ``(values [..., C], ids [..., C] int32, overflow [...] bool)``, ``C =
    capacity`` (see :func:`.reference.seeded_candidates_reference`).

    ``scores [..., N]`` float32; ``seed [..., S]`` integer ids into the last dim (``-1``: none;
    distinct within a row), e.g. the ids an anchor's top-``k`` pool held, or two such tensors
    ``[..., S1]``, ``[..., S2]`` whose ids a row takes together (read in place: no
    concatenation); with ``seed_rows [L]`` (integer, ``L`` the scores' first dim), the seeds'
    first dim is another (``[N_s, ...]``) and row ``b`` reads seed row ``seed_rows[b]`` (a
    state's per-slot pools, read at a batch's slots). ``active [...]``: the rows to rank
    (``None``: all). A row's candidates, the scores reaching the highest of its seed's
    thresholds that ``k`` scores reach, hold its exact top ``k`` wherever ``overflow`` is false:
    rank them (ties toward the lower position, which the candidates' order keeps) and redo only
    the flagged rows over the whole row. ``whole_rows``: no row is flagged; the rows that would
    be are refined here, their candidates exactly their top ``min(k, N)`` in position order
    (ties toward the lower position; on a Triton path by one program that reads the row once a
    search round: a slow path, for rows a seed cannot serve). On a Triton ``path``: three
    launches (the thresholds, a program per row; the counts and the collection, a program per
    chunk of a row), which read each row twice."""
    check_float_tensor("scores", scores, min_ndim=1)
    check_int("k", k, minimum=1)
    check_int("capacity", capacity, minimum=k)
    seeds = (seed,) if isinstance(seed, torch.Tensor) else tuple(seed)
    if not 1 <= len(seeds) <= 2:
        raise ValueError(f"seed must be a tensor or two, got {len(seeds)}")
    lead = tuple(scores.shape[:-1])
    if seed_rows is not None:
        check_index_tensor("seed_rows", seed_rows, ndim=1)
        if scores.ndim < 2 or seed_rows.shape[0] != scores.shape[0]:
            raise ValueError(
                f"seed_rows must be [L] with L the first dim of scores [L, ..., N], got "
                f"{shape_str(seed_rows)} for scores {shape_str(scores)}"
            )
        check_device(("scores", "seed_rows"), (scores, seed_rows))
    for i, s in enumerate(seeds):
        name = "seed" if len(seeds) == 1 else f"seed[{i}]"
        check_index_tensor(name, s, ndim=scores.ndim)
        want = lead if seed_rows is None else lead[1:]
        got = tuple(s.shape[:-1]) if seed_rows is None else tuple(s.shape[1:-1])
        if got != want or s.shape[-1] < 1 or (seed_rows is not None and s.shape[0] < 1):
            where = "scores' leading dims" if seed_rows is None else "scores' dims after the first"
            raise ValueError(
                f"{name} [..., S] must have the {where} {list(want)} and S >= 1, got {shape_str(s)}"
            )
        check_device(("scores", name), (scores, s))
    if active is not None:
        check_bool_mask("active", active, lead)
        check_device(("scores", "active"), (scores, active))
    if path.startswith("triton") and scores.dtype == torch.float32:
        from prhs_kernels.topk.triton import seeded_candidates_triton

        announce("seeded_candidates", path, scores.device)
        on = active if active is not None else torch.ones_like(scores[..., 0], dtype=torch.bool)
        cval, cidx, over, _ = seeded_candidates_triton(
            scores, k, seeds, capacity, on, seed_rows, whole_rows=whole_rows
        )
        return cval.view(*lead, capacity), cidx.view(*lead, capacity), over.view(lead)
    announce("seeded_candidates", "torch", scores.device)
    if seed_rows is not None:
        seeds = tuple(s[seed_rows.long()] for s in seeds)
    whole = seeds[0] if len(seeds) == 1 else torch.cat([s.to(torch.int64) for s in seeds], -1)
    return seeded_candidates_reference(scores, k, whole, capacity, active, whole_rows)
