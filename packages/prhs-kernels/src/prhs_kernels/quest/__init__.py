"""Quest's page scoring, a checked launcher over a torch reference:

- :func:`quest_page_scores` -- the score Quest's top-k ranks each page by: the largest logit
  upper bound of the group's query heads, from the page's key minimum and maximum kept in a side
  cache, ``-inf`` where Quest may not pick the page.

The path (:func:`prhs_kernels.paths.kernel_path`): ``"triton"`` on CUDA for fp16/bf16 caches
(one launch that reads each eligible page's minimum and maximum once), ``"triton-interpreter"``
on the CPU under ``TRITON_INTERPRET=1``, else ``"torch"``.
"""

from __future__ import annotations

import math

import torch

from prhs_core.checks import (
    check_bool_mask,
    check_device,
    check_float_tensor,
    check_index_tensor,
    check_int,
    check_shape,
    shape_str,
)
from prhs_kernels.paths import announce
from prhs_kernels.quest.reference import page_bounds, quest_page_scores_reference

__all__ = ["page_bounds", "quest_page_scores", "quest_page_scores_reference"]

PATHS = ("torch", "triton", "triton-interpreter")


def _check(
    query: object,
    kmin: object,
    kmax: object,
    pages: object,
    seq_lens: object,
    bad: object,
    scaling: object,
) -> None:
    check_float_tensor("query", query, ndim=3)
    check_float_tensor("kmin", kmin, ndim=3)
    check_float_tensor("kmax", kmax, ndim=3)
    assert isinstance(query, torch.Tensor)
    assert isinstance(kmin, torch.Tensor) and isinstance(kmax, torch.Tensor)
    b, hq, d = query.shape
    if kmin.shape != kmax.shape or kmin.dtype != kmax.dtype:
        raise ValueError(
            f"kmin and kmax must share a shape [R, Hkv, D] and a dtype, got {shape_str(kmin)} "
            f"{kmin.dtype} and {shape_str(kmax)} {kmax.dtype}"
        )
    rows, hkv, dk = kmin.shape
    if dk != d:
        raise ValueError(
            f"kmin / kmax [R, Hkv, D] = {shape_str(kmin)} must have the query's head size D={d}"
        )
    if rows < 1 or hkv < 1 or hq % hkv:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of kmin / kmax's KV heads ({hkv}), and the "
            f"side fields must hold at least one row, got kmin {shape_str(kmin)}"
        )
    check_index_tensor("pages", pages, ndim=2)
    assert isinstance(pages, torch.Tensor)
    if pages.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pages must be int32 or int64 side-cache page rows, got {pages.dtype}")
    check_shape("pages", pages, (b, None), "[B, P]")
    check_index_tensor("seq_lens", seq_lens, ndim=1)
    assert isinstance(seq_lens, torch.Tensor)
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"seq_lens must be int32, got {seq_lens.dtype}")
    check_shape("seq_lens", seq_lens, (b,), "[B]")
    check_bool_mask("bad", bad, (b, hkv))
    assert isinstance(bad, torch.Tensor)
    check_device(
        ("query", "kmin", "kmax", "pages", "seq_lens", "bad"),
        (query, kmin, kmax, pages, seq_lens, bad),
    )
    if isinstance(scaling, bool) or not isinstance(scaling, int | float):
        raise TypeError(f"scaling must be a float, got {type(scaling).__name__}")
    if not math.isfinite(scaling):
        raise ValueError(f"scaling must be finite, got {scaling}")


def quest_page_scores(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    bad: torch.Tensor,
    scaling: float,
    *,
    page_size: int,
    n_sink: int,
    n_local: int,
    path: str = "torch",
) -> torch.Tensor:
    """``[B, Hkv, P]`` float32: the score Quest's top-k ranks each page by.

    For page ``j`` of row ``b`` and KV head ``h``: the largest bound
    ``scaling · Σ_d max(q_d·max_d, q_d·min_d)`` over the group's ``g = Hq / Hkv`` query heads
    (:func:`.reference.page_bounds`), an upper bound of every logit of the group in the page;
    ``-inf`` where Quest may not pick the page (it does not exist, holds a sink or local
    position, or the row is ``bad``); NaN for a page that no finite key was folded into. See
    :func:`.reference.quest_page_scores_reference`.

    Parameters
    ----------
    query:
        ``[B, Hq, D]`` queries of the step (any float dtype; read as float32).
    kmin, kmax:
        ``[R, Hkv, D]`` one layer's side-cache fields: the element-wise key minimum and maximum
        of each side-cache page row (strided views, e.g. ``side["quest_kmin"][:, layer]``, are
        read in place).
    pages:
        ``[B, P]`` int32 or int64: the side-cache page row of page ``j`` (positions
        ``j·page_size ..``) of each row; read only where the page exists
        (``j · page_size < seq_lens[b]``), and there it must lie in ``[0, R)``.
    seq_lens:
        ``[B]`` int32 cached positions per row.
    bad:
        ``[B, Hkv]`` bool: rows that pick nothing (all ``-inf``).
    scaling:
        Logit scale.
    page_size, n_sink, n_local:
        Positions per page and the always-selected windows (their pages are ``-inf``).
    path:
        ``"torch"``, ``"triton"`` or ``"triton-interpreter"``
        (:func:`prhs_kernels.paths.kernel_path`).
    """
    _check(query, kmin, kmax, pages, seq_lens, bad, scaling)
    check_int("page_size", page_size, minimum=1)
    check_int("n_sink", n_sink, minimum=0)
    check_int("n_local", n_local, minimum=0)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    announce("quest_page_scores", path, query.device)
    args = (query, kmin, kmax, pages, seq_lens, bad, float(scaling), page_size, n_sink, n_local)
    if path.startswith("triton"):
        from prhs_kernels.quest.triton import quest_page_scores_triton

        return quest_page_scores_triton(*args)
    return quest_page_scores_reference(*args)
