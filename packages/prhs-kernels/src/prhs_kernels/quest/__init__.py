"""Quest's step, checked launchers over torch references:

- :func:`quest_page_scores` -- the score Quest's top-k ranks each page by: the largest logit
  upper bound of the group's query heads, from the page's key minimum and maximum kept in a side
  cache, ``-inf`` where Quest may not pick the page;
- :func:`quest_select` -- the selection from those scores: the windows' pages and the top
  ``k`` pages Quest may pick, ascending, written into the plan's buffers.

The path (:func:`prhs_kernels.paths.kernel_path`): ``"triton"`` on CUDA for fp16/bf16 caches
(one launch each: the scores read each eligible page's minimum and maximum once; the selection
ranks a row in one program and writes it without a sort), ``"triton-interpreter"`` on the CPU
under ``TRITON_INTERPRET=1``, else ``"torch"``.
"""

from __future__ import annotations

import math

import torch

from prhs_core.checks import (
    check_bool_mask,
    check_counter,
    check_device,
    check_float_tensor,
    check_index_tensor,
    check_int,
    check_shape,
    shape_str,
)
from prhs_kernels.compose.reference import window_widths
from prhs_kernels.paths import announce
from prhs_kernels.quest.reference import (
    fold_page_bounds_reference,
    page_bounds,
    quest_page_scores_reference,
    quest_select_reference,
)
from prhs_kernels.score.reference import nonfinite_rows

__all__ = [
    "fold_page_bounds",
    "fold_page_bounds_reference",
    "page_bounds",
    "quest_page_scores",
    "quest_page_scores_reference",
    "quest_select",
    "quest_select_reference",
]

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
    if bad is not None:
        check_bool_mask("bad", bad, (b, hkv))
        assert isinstance(bad, torch.Tensor)
        check_device(("query", "bad"), (query, bad))
    check_device(
        ("query", "kmin", "kmax", "pages", "seq_lens"), (query, kmin, kmax, pages, seq_lens)
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
    bad: torch.Tensor | None,
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
        ``[B, Hkv]`` bool: rows that pick nothing (all ``-inf``); ``None``: the rows whose
        group's queries hold a NaN or an infinity (found in the kernel on a Triton path).
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


def quest_select(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    bad: torch.Tensor | None,
    k: int,
    *,
    page_size: int,
    n_sink: int,
    n_local: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    query: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
    path: str = "torch",
) -> None:
    """Write Quest's selection of every (sequence, KV head) row into ``out_indices [B, Hkv, W]``
    and ``out_counts [B, Hkv]`` (int32, e.g. a plan's selection buffers): the pages holding the
    first ``n_sink`` and the last ``n_local`` positions, and the ``k`` pages of largest score
    among those Quest may pick (``scores [B, Hkv, P]`` float32 from :func:`quest_page_scores`;
    pages that exist, hold no window position, on rows that are not ``bad``: NaN and ``-inf``
    scores of such pages rank last but count). Page ids, ascending and distinct, ``-1`` past
    each count; ``W`` at least ``ws + k + wl`` (the windows' static widths,
    :func:`prhs_kernels.compose.window_widths`). Ties: any of the tied pages on the torch path
    (``torch.topk`` on CUDA), the lower page on the Triton path.

    On a Triton path, one launch for rows of up to :data:`prhs_kernels.quest.triton.MAX_PAGES`
    pages: a program per row finds its top ``k`` without sorting and writes the selection as
    it lies (the winners sit between the windows); longer rows take the torch path
    (:func:`.reference.quest_select_reference`: top-k, then the union with the windows).

    ``bad`` ``None``: the rows whose group's queries (``query [B, Hq, D]``, then required) hold
    a NaN or an infinity pick nothing, and are counted into ``nonfinite`` (one int64 element,
    :attr:`prhs_core.state.SelectorState.nonfinite`) when given -- found in the selection's
    own launch on a Triton path, so that a step needs no separate check."""
    check_float_tensor("scores", scores, ndim=3)
    assert isinstance(scores, torch.Tensor)
    if scores.dtype != torch.float32:
        raise TypeError(f"scores must be float32 [B, Hkv, P] page scores, got {scores.dtype}")
    b, h, n_pages = scores.shape
    check_index_tensor("seq_lens", seq_lens, ndim=1)
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"seq_lens must be int32, got {seq_lens.dtype}")
    check_shape("seq_lens", seq_lens, (b,), "[B]")
    if bad is not None:
        check_bool_mask("bad", bad, (b, h))
        check_device(("scores", "bad"), (scores, bad))
    else:
        if not isinstance(query, torch.Tensor):
            raise ValueError("quest_select needs the query [B, Hq, D] to find the bad rows")
        check_float_tensor("query", query, ndim=3)
        if query.shape[0] != b or query.shape[1] % h:
            raise ValueError(
                f"query must be [B={b}, Hq, D] with Hq a multiple of Hkv={h}, got "
                f"{shape_str(query)}"
            )
        check_device(("scores", "query"), (scores, query))
    if nonfinite is not None:
        check_counter("nonfinite", nonfinite, scores.device, " (SelectorState.nonfinite)")
    check_int("k", k, minimum=1)
    check_int("page_size", page_size, minimum=1)
    check_int("n_sink", n_sink, minimum=0)
    check_int("n_local", n_local, minimum=0)
    check_index_tensor("out_indices", out_indices, ndim=3)
    check_index_tensor("out_counts", out_counts, ndim=2)
    if out_indices.dtype != torch.int32 or out_counts.dtype != torch.int32:
        raise TypeError(
            f"out_indices and out_counts must be int32, got {out_indices.dtype} and "
            f"{out_counts.dtype}"
        )
    ws, wl = window_widths(n_sink, n_local, page_size)
    check_shape("out_indices", out_indices, (b, h, None), "[B, Hkv, W]")
    check_shape("out_counts", out_counts, (b, h), "[B, Hkv]")
    if out_indices.shape[-1] < ws + k + wl:
        raise ValueError(
            f"out_indices holds {out_indices.shape[-1]} entries a row; the selection needs "
            f"ws + k + wl = {ws} + {k} + {wl} = {ws + k + wl}"
        )
    check_device(
        ("scores", "seq_lens", "out_indices", "out_counts"),
        (scores, seq_lens, out_indices, out_counts),
    )
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    args = (scores, seq_lens, bad, k, page_size, n_sink, n_local, out_indices, out_counts)
    if path.startswith("triton"):
        from prhs_kernels.quest.triton import quest_select_fits, quest_select_triton

        if quest_select_fits(n_pages):
            announce("quest_select", path, scores.device)
            quest_select_triton(*args, query=query, nonfinite=nonfinite)
            return
    announce("quest_select", "torch", scores.device)
    if bad is None:
        assert query is not None
        bad = nonfinite_rows(query, h)
        if nonfinite is not None:
            nonfinite.add_(bad.sum())
    quest_select_reference(scores, seq_lens, bad, *args[3:])


def fold_page_bounds(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    locations: torch.Tensor,
    key: torch.Tensor,
    *,
    page_size: int,
    columns: torch.Tensor | None = None,
    finite: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
    path: str = "torch",
) -> None:
    """Fold the keys a host wrote into the per-page key minima and maxima Quest's scores read.

    ``kmin`` / ``kmax`` ``[R, Hkv, D]`` (one layer's side-cache fields, written in place: strided
    views such as ``side["quest_kmin"][:, layer]`` are fine) hold page row ``location //
    page_size``; the last row, ``R - 1``, is scratch. ``locations [N]`` (any integer dtype,
    ``-1``: none) are the KV locations written, distinct. ``key`` is ``[N, Hkv, D]`` (row ``i``
    written at ``locations[i]``) or, with ``columns [N]``, a cache ``[N, Hkv, T, D]`` whose row
    ``i`` holds its key at column ``columns[i]`` (e.g. a decode step's new token, read in place:
    no gather); a column outside ``[0, T)`` means the row is not written.

    A page whose first location is written is reset (no metadata of an earlier sequence
    survives its reuse); every written row whose whole ``[Hkv, D]`` key is finite folds in; a
    non-finite key resets its page but is not folded. ``finite [N]`` bool says which keys are
    finite; ``None``: found here, and the written rows whose key is not are counted into
    ``nonfinite`` (one int64 element, :attr:`prhs_core.state.SelectorState.nonfinite`) when
    given. Exact in the fields' dtype (a minimum of cached values is a cached value).

    On a Triton path (``finite`` ``None``, writes of up to
    :data:`prhs_kernels.quest.triton.FOLD_MAX_ROWS` rows, as a decode step's) one launch: a
    program per row checks its key and counts it, and each page's first written row folds the
    page's rows -- so rows of one page may come in any order. Other writes (a prompt's) take
    the torch path (:func:`.reference.fold_page_bounds_reference`). The scratch row is
    whatever either path leaves there.
    """
    check_float_tensor("kmin", kmin, ndim=3)
    check_float_tensor("kmax", kmax, ndim=3)
    if kmin.shape != kmax.shape or kmin.dtype != kmax.dtype:
        raise ValueError(
            f"kmin and kmax must share a shape [R, Hkv, D] and a dtype, got {shape_str(kmin)} "
            f"{kmin.dtype} and {shape_str(kmax)} {kmax.dtype}"
        )
    rows, h, d = kmin.shape
    if rows < 1:
        raise ValueError(f"kmin / kmax [R, Hkv, D] need at least the scratch row, got R={rows}")
    check_index_tensor("locations", locations, ndim=1)
    n = locations.shape[0]
    if columns is None:
        check_float_tensor("key", key, ndim=3)
        check_shape("key", key, (n, h, d), "[N, Hkv, D]")
    else:
        check_float_tensor("key", key, ndim=4)
        check_index_tensor("columns", columns, ndim=1)
        check_shape("key", key, (n, h, None, d), "[N, Hkv, T, D]")
        check_shape("columns", columns, (n,), "[N]")
        check_device(("key", "columns"), (key, columns))
    check_int("page_size", page_size, minimum=1)
    if finite is not None:
        check_bool_mask("finite", finite, (n,))
        check_device(("key", "finite"), (key, finite))
    if nonfinite is not None:
        check_counter("nonfinite", nonfinite, key.device, " (SelectorState.nonfinite)")
    check_device(("kmin", "kmax", "locations", "key"), (kmin, kmax, locations, key))
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path.startswith("triton") and finite is None:
        from prhs_kernels.quest.triton import fold_fits, fold_page_bounds_triton

        if fold_fits(n, h, d):
            announce("fold_page_bounds", path, key.device)
            fold_page_bounds_triton(kmin, kmax, locations, key, page_size, columns, nonfinite)
            return
    announce("fold_page_bounds", "torch", key.device)
    fold_page_bounds_reference(kmin, kmax, locations, key, page_size, columns, finite, nonfinite)
