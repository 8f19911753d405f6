"""The CIS step's ops (paper mode), each a checked launcher over a torch reference:

- :func:`cis_decide` -- which (sequence, KV head) rows retrieve: the anchor's age and the cosine
  of the group's queries with the anchor's; rows with a non-finite query are found (and
  counted) here too;
- :func:`retrieval_block_scores` -- a retrieval's block scores (largest group probability per
  block), ``-inf`` where top-k may not pick; keys are read for the retrieving rows only;
- :func:`top_blocks` -- the ``M`` best blocks by score, largest first;
- :func:`cis_decide_compose` -- the decision and, in its launch, the selection of every row
  that does not retrieve (from its anchor's union); ``cis_compose(..., retrieving_only=True)``
  then writes the retrieving rows after their retrieval (:func:`top_blocks_compose`: in the
  top-k's last launch);
- :func:`retrieval_compose` -- :func:`retrieval_block_scores` then :func:`top_blocks_compose` in
  one call: on a Triton path, by block mass, two launches (the logits pass writes block
  log-sum-exps, the top-k scores its rows from them);
- :func:`cis_compose` -- the selection (sink, the new or the anchor's list with its dilation,
  local; ascending and distinct) written into the plan's buffers, and the anchors of the rows
  that retrieve updated. With ``hold_local``, a reusing row's local window starts where its
  anchor's did (:func:`cis_local_width` gives the wider static width); with the anchors' union
  fields (:func:`anchor_union_reference`) a reusing row's selection is copied, not sorted;
- :func:`cis_rescore` -- (the selector's ``rescore`` option) a reusing row's anchor pool, its
  list and the next-best blocks of the same retrieval, re-ranked at the current query from the
  keys of the pool and the windows only: the best ``M`` become the list the reuse reads.

:func:`cis_path` names the path: ``"triton"`` on CUDA for fp16/bf16 caches and power-of-two
block sizes (three launches plus the retrieval's two and a top-k), ``"triton-interpreter"`` on
the CPU under ``TRITON_INTERPRET=1``, else ``"torch"``. :func:`cis_rescore` takes the same paths
(its scores one launch, ranked by the top-k kernel).
"""

from __future__ import annotations

import torch

from prhs_core.checks import (
    check_bool_mask,
    check_counter,
    check_flag,
    check_index_tensor,
    check_int,
    check_shape,
)
from prhs_core.layout import KVLayout
from prhs_kernels.cis.reference import (
    anchor_union_reference,
    block_eligible_reference,
    cis_compose_reference,
    cis_decide_reference,
    cis_rescore_reference,
    held_local_indices,
    retrieval_block_scores_reference,
)
from prhs_kernels.compose.reference import window_widths
from prhs_kernels.keycodes import KeyCodes, check_key_codes, code_key_layout
from prhs_kernels.paths import announce, kernel_path
from prhs_kernels.score import check_query, retrieval_probs
from prhs_kernels.topk import topk_indices

__all__ = [
    "BLOCK_SCORES",
    "anchor_union_reference",
    "block_eligible_reference",
    "check_block_score",
    "cis_compose",
    "cis_compose_reference",
    "cis_decide",
    "cis_decide_compose",
    "cis_decide_reference",
    "cis_local_width",
    "cis_path",
    "cis_rescore",
    "cis_rescore_reference",
    "held_local_indices",
    "retrieval_block_scores",
    "retrieval_block_scores_reference",
    "retrieval_compose",
    "retrieval_pool",
    "top_blocks",
    "top_blocks_compose",
]


def cis_path(device: torch.device | str, dtype: torch.dtype, block_size: int) -> str:
    """The path the CIS ops take for a cache of ``dtype`` on ``device``."""
    path = kernel_path(device, dtype)
    if path != "torch" and block_size & (block_size - 1):
        return "torch"  # the block-score kernel tiles blocks by powers of two
    return path


def cis_local_width(n_local: int, block_size: int, hold_local: bool) -> int:
    """Static width, in blocks, of a CIS selection's local window: ``ceil(n_local/s) + 1``, or
    with ``hold_local`` that of a window twice as long (a reuse is at most ``n_local`` positions
    younger than its anchor, so from the anchor's window start to the end of the sequence spans
    at most ``2·n_local`` positions); 0 for ``n_local = 0``."""
    return window_widths(0, 2 * n_local if hold_local else n_local, block_size)[1]


def _check_anchors(
    anchor_len: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, b: int
) -> int:
    if anchor_len.ndim != 2:
        raise ValueError(f"anchor_len must be [N, Hkv], got {list(anchor_len.shape)}")
    check_shape("slots", slots, (b,), "[B]")
    check_shape("seq_lens", seq_lens, (b,), "[B]")
    return anchor_len.shape[1]


def cis_decide(
    query: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    tau: float | torch.Tensor,
    n_local: int,
    nonfinite: torch.Tensor | None = None,
    any_retrieve: torch.Tensor | None = None,
    path: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(retrieve, bad)``, ``[B, Hkv]`` bool each: the rows that retrieve, and the rows skipped
    because their group's queries hold a non-finite value (a skipped row never retrieves:
    ``retrieve == bad`` marks the reusing rows), counted into ``nonfinite`` (one int64 element)
    when given (see :func:`.reference.cis_decide_reference`).

    ``any_retrieve`` (one bool element, ``SelectorState.retrieving``): set to true when some row
    retrieves, left as it was otherwise; :func:`cis_compose` clears it. Between the two it says
    whether the retrieval's kernels have any work (:func:`prhs_kernels.graphs.run_if`).

    ``anchor_q [N, Hkv, g, D]`` float32 and ``anchor_len [N, Hkv]`` int32 are one layer's
    anchor fields (rows by state slot, strided views allowed); ``slots [B]`` picks each batch
    row's. ``tau`` is one cosine threshold, one per KV head (``[Hkv]``), or one per (slot,
    KV head) (``[N, Hkv]``, rows by state slot like ``anchor_len``; strided views allowed),
    float32 on the query's device."""
    _check_decide_args(query, anchor_q, anchor_len, slots, seq_lens, tau, n_local, nonfinite,
                       any_retrieve)  # fmt: skip
    announce("cis_decide", path, query.device)
    if path.startswith("triton"):
        from prhs_kernels.cis.triton import cis_decide_triton

        return cis_decide_triton(
            query, anchor_q, anchor_len, slots, seq_lens, tau, n_local, nonfinite, any_retrieve
        )
    retrieve, bad = cis_decide_reference(
        query, anchor_q, anchor_len, slots, seq_lens, tau, n_local, nonfinite
    )
    if any_retrieve is not None:
        any_retrieve |= retrieve.any()
    return retrieve, bad


def _check_decide_args(
    query: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    tau: float | torch.Tensor,
    n_local: int,
    nonfinite: torch.Tensor | None,
    any_retrieve: torch.Tensor | None,
) -> None:
    b, hq, d = query.shape
    h = _check_anchors(anchor_len, slots, seq_lens, b)
    check_shape("anchor_q", anchor_q, (anchor_len.shape[0], h, hq // h, d), "[N, Hkv, g, D]")
    check_int("n_local", n_local, minimum=0)
    if isinstance(tau, torch.Tensor):
        if tau.ndim == 2:
            check_shape("tau", tau, (anchor_len.shape[0], h), "[N, Hkv]")
        else:
            check_shape("tau", tau, (h,), "[Hkv]")
        if tau.dtype != torch.float32 or tau.device != query.device:
            raise ValueError(
                f"a tensor tau must be float32 on the query's device ({query.device}), got "
                f"{tau.dtype} on {tau.device}"
            )
    elif isinstance(tau, bool) or not isinstance(tau, int | float):
        raise TypeError(
            f"tau must be a float, a [Hkv] or an [N, Hkv] tensor, got {type(tau).__name__}"
        )
    if nonfinite is not None:
        check_counter("nonfinite", nonfinite, query.device, " (SelectorState.nonfinite)")
    if any_retrieve is not None:
        check_flag("any_retrieve", any_retrieve, query.device, " (SelectorState.retrieving)")


def retrieval_block_scores(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    active: torch.Tensor,
    *,
    block_size: int,
    n_sink: int,
    n_local: int,
    score: str = "max",
    fill_idle: bool = True,
    codes: KeyCodes | None = None,
    path: str = "torch",
) -> torch.Tensor:
    """``[B, Hkv, ceil(T / s)]`` float32: each block's score on the ``active [B, Hkv]`` rows,
    ``-inf`` for blocks that do not exist or hold a sink or local position and on the other rows
    (whose keys the Triton path does not read). ``score="max"``: the block's largest group-mean
    probability; ``"mass"``: the sum of its positions' group-mean probabilities (the attention
    mass the block holds). ``fill_idle=False``: the Triton path leaves the other rows unwritten
    (their values unspecified), for a caller that ranks the active rows only, as
    :func:`top_blocks` and :func:`retrieval_pool` do -- a decode step where most rows reuse then
    writes nothing for them. ``codes``: score the keys' code rows
    (:class:`prhs_kernels.keycodes.KeyCodes`) instead of the keys."""
    check_query(query, kv)
    if codes is not None:
        check_key_codes(kv, codes)
    check_bool_mask("active", active, (kv.batch_size, kv.num_kv_heads))
    check_int("block_size", block_size, minimum=1)
    check_block_score(score)
    announce("retrieval_block_scores", path, query.device)
    if path.startswith("triton"):
        from prhs_kernels.cis.triton import retrieval_block_scores_triton

        return retrieval_block_scores_triton(
            query, kv, scaling, block_size, n_sink, n_local, active, score, fill_idle,
            codes=codes,
        )  # fmt: skip
    probs = retrieval_probs(query, kv, scaling, active, codes=codes)
    return retrieval_block_scores_reference(probs, kv, block_size, n_sink, n_local, active, score)


BLOCK_SCORES = ("max", "mass")
"""How :func:`retrieval_block_scores` scores a block: its largest probability, or its mass."""


def check_block_score(score: object) -> None:
    """Raise ``ValueError`` unless ``score`` is one of :data:`BLOCK_SCORES`."""
    if score not in BLOCK_SCORES:
        raise ValueError(f"block score must be one of {BLOCK_SCORES}, got {score!r}")


def top_blocks(
    scores: torch.Tensor, m: int, active: torch.Tensor | None = None, *, path: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [..., min(m, NB)] int32, values)``: the best blocks of ``scores [..., NB]``,
    largest first (``-inf`` values mark no block; a NaN score counts as ``-inf``). Ties: toward
    the lower id, except on CUDA's torch path (``torch.topk``: any order).

    With ``active [...]`` given, the active rows only are ranked and the others get ``-1`` /
    ``-inf`` whatever their scores hold (they need not be written: ``retrieval_block_scores(...,
    fill_idle=False)``). On a Triton path: one program per row for rows of up to 8192 scores;
    longer rows in two passes or more (the top ``m`` of each chunk of 8192, or of ``2m`` rounded
    up to a power of two, then of their winners, and so on). ``m`` above 8192, or
    ``active=None``: every row is ranked by ``torch.topk``."""
    k = min(m, scores.shape[-1])
    if active is not None:
        check_bool_mask("active", active, tuple(scores.shape[:-1]))
    if path.startswith("triton") and active is not None and k >= 1:
        from prhs_kernels.cis.triton import top_blocks_fits, top_blocks_triton

        if top_blocks_fits(scores.shape[-1], k):
            announce("top_blocks", path, scores.device)
            return top_blocks_triton(scores, k, active)
    drop = scores.isnan()
    if active is not None:
        drop = drop | ~active.unsqueeze(-1)
    scores = scores.masked_fill(drop, float("-inf"))
    if scores.device.type == "cuda":
        vals, idx = torch.topk(scores, k, dim=-1, sorted=True)
        return idx.to(torch.int32), vals
    # The CPU: topk_indices (its Numba kernel where it applies), ties toward the lower id.
    idx, _ = topk_indices(scores, k)
    vals = torch.gather(scores, -1, idx.long().clamp(min=0))
    return idx, vals.masked_fill(idx < 0, float("-inf"))


def retrieval_pool(
    scores: torch.Tensor,
    m: int,
    r: int,
    retrieve: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
    *,
    seed: torch.Tensor | None = None,
    anchor_idx: torch.Tensor | None = None,
    path: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A retrieval that also keeps its next ``r`` blocks for the reuses to re-rank (CIS's
    ``rescore``): ``(indices [B, Hkv, min(m, NB)] int32, values)``, the top ``m`` blocks of each
    ``retrieve [B, Hkv]`` row of ``scores [B, Hkv, NB]`` best first, as :func:`top_blocks`
    returns them; and, written into ``anchor_next [N, Hkv, r]`` (int32) at each retrieving
    row's slot (``slots [B]``), the blocks ranked after them (up to ``r``, those with a finite
    score) in block order, then ``-1``. Rows that do not retrieve keep their ``anchor_next``.
    Ties: toward the lower block, on every path (on CUDA's torch path, as ``torch.topk``
    breaks them). On a Triton path the top ``m + r`` are found unsorted, and only the top ``m``
    of those sorted. ``seed [B, Hkv, S]`` (block ids, distinct per row, ``-1`` for none; a set
    that held the top ``m + r`` of a nearby query, such as the row's current anchor pool):
    on a Triton path over long rows, the top ``m + r`` are found among the scores that reach
    the seed's ``(m + r)``-th best and the whole row is ranked only for the rows where that
    fails (guess, verify, refine); the result is the same, ties included. ``anchor_idx [N,
    Hkv, S]`` (int32, instead of ``seed``): each row's seed is its slot's current pool,
    ``anchor_idx`` and ``anchor_next`` at ``slots``, read in place on a Triton path (no
    gather or concatenation launched)."""
    check_int("m", m, minimum=1)
    check_int("r", r, minimum=1)
    if scores.ndim != 3:
        raise ValueError(f"scores must be [B, Hkv, NB], got {list(scores.shape)}")
    b, h, n = scores.shape
    check_bool_mask("retrieve", retrieve, (b, h))
    if anchor_next.ndim != 3 or anchor_next.shape[1:] != (h, r) or anchor_next.dtype != torch.int32:
        raise ValueError(
            f"anchor_next must be int32 [N, Hkv={h}, r={r}], got {list(anchor_next.shape)} "
            f"{anchor_next.dtype}"
        )
    check_shape("slots", slots, (b,), "[B]")
    if seed is not None:
        check_index_tensor("seed", seed, ndim=3)
        check_shape("seed", seed, (b, h, None), "[B, Hkv, S]")
    if anchor_idx is not None:
        if seed is not None:
            raise ValueError("give seed or anchor_idx (the slots' pools as the seed), not both")
        check_index_tensor("anchor_idx", anchor_idx, ndim=3)
        if anchor_idx.shape[0] != anchor_next.shape[0] or anchor_idx.shape[1] != h:
            raise ValueError(
                f"anchor_idx must be [N={anchor_next.shape[0]}, Hkv={h}, S] as anchor_next, got "
                f"{list(anchor_idx.shape)}"
            )
    k_all = min(m + r, n)
    if path.startswith("triton"):
        from prhs_kernels.cis.triton import retrieval_pool_triton, top_blocks_fits

        if top_blocks_fits(n, k_all) and top_blocks_fits(k_all, min(m, k_all)):
            announce("retrieval_pool", path, scores.device)
            return retrieval_pool_triton(
                scores, m, r, retrieve, anchor_next, slots, seed, anchor_idx
            )
    idx, val = top_blocks(scores, k_all, retrieve, path=path)
    after = torch.where(val[..., m:] > float("-inf"), idx[..., m:], -1)
    big = torch.iinfo(torch.int32).max  # -1 after every block, then block order
    after = torch.sort(torch.where(after < 0, big, after), dim=-1).values
    after = torch.where(after == big, -1, after)
    after = torch.nn.functional.pad(after, (0, r - after.shape[-1]), value=-1).to(torch.int32)
    anchor_next[slots] = torch.where(retrieve.unsqueeze(-1), after, anchor_next[slots])
    return idx[..., :m], val[..., :m]


def cis_compose(
    query: torch.Tensor,
    retrieve: torch.Tensor,
    bad: torch.Tensor,
    new_idx: torch.Tensor,
    new_scores: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    hold_local: bool = False,
    any_retrieve: torch.Tensor | None = None,
    anchor_union: torch.Tensor | None = None,
    anchor_union_cnt: torch.Tensor | None = None,
    retrieving_only: bool = False,
    path: str = "torch",
) -> None:
    """Write the selection into ``out_indices [B, Hkv, W]`` / ``out_counts [B, Hkv]`` and make
    the retrieving rows anchors (see :func:`.reference.cis_compose_reference`). ``W`` must be
    ``ws + M + 2·r·m + wl``: the widths of the sink window, the anchor list, its dilation and
    the local window (``wl`` from :func:`cis_local_width`). ``any_retrieve``: the flag
    :func:`cis_decide` set, cleared here (its retrieval is consumed).

    ``anchor_union [N, Hkv, M + 2·r·m]`` / ``anchor_union_cnt [N, Hkv]`` (int32, one layer's
    anchor fields, both or neither): each anchor's ``S_a ∪ dilate(S_a)``, ascending and
    distinct (:func:`anchor_union_reference`), written by the retrieving rows. On the Triton
    path a reusing row then copies it between its windows instead of sorting its candidates
    (the selection is the same); so whatever else writes an anchor's list (a seeded anchor)
    must write its union too, and a list re-ranked at every reuse (:func:`cis_rescore`) must
    not be composed with them.

    ``retrieving_only``: write the retrieving rows only (selection and anchor), leaving every
    other row's entries as they are -- the second half of :func:`cis_decide_compose`, which wrote
    them (needs the union fields). A step where no row retrieves then has nothing to do here."""
    b = query.shape[0]
    h = _check_anchors(anchor_len, slots, seq_lens, b)
    mm = anchor_idx.shape[-1]
    check_bool_mask("retrieve", retrieve, (b, h))
    check_bool_mask("bad", bad, (b, h))
    if new_idx.shape != new_scores.shape or tuple(new_idx.shape[:2]) != (b, h):
        raise ValueError("new_idx and new_scores must both be [B, Hkv, M']")
    if new_idx.shape[-1] > mm:
        raise ValueError(f"new_idx holds {new_idx.shape[-1]} entries; the anchor list {mm}")
    who = "retrieving_only composes after cis_decide_compose" if retrieving_only else None
    ws, wl = _check_selection_args(
        query, anchor_len, anchor_idx, n_sink, n_local, block_size, m, r, hold_local,
        out_indices, out_counts, anchor_union, anchor_union_cnt, needs_union=who,
    )  # fmt: skip
    if any_retrieve is not None:
        check_flag("any_retrieve", any_retrieve, query.device, " (SelectorState.retrieving)")
    announce("cis_compose", path, query.device)
    union = dict(anchor_union=anchor_union, anchor_union_cnt=anchor_union_cnt)
    args = (query, retrieve, bad, new_idx, new_scores, anchor_q, anchor_len, anchor_idx)
    args += (anchor_cnt, anchor_log_delta, slots, seq_lens)
    kw = dict(
        n_sink=n_sink, n_local=n_local, block_size=block_size, m=m, r=r, hold_local=hold_local
    )
    if path.startswith("triton"):
        from prhs_kernels.cis.triton import cis_compose_triton

        cis_compose_triton(
            *args, **kw, **union, out_indices=out_indices, out_counts=out_counts,
            windows=(ws, wl), any_retrieve=any_retrieve, retrieving_only=retrieving_only,
        )  # fmt: skip
        return
    cis_compose_reference(
        *args, **kw, **union, out_indices=out_indices, out_counts=out_counts,
        rows=retrieve if retrieving_only else None,
    )  # fmt: skip
    if any_retrieve is not None:
        any_retrieve.zero_()


def top_blocks_compose(
    scores: torch.Tensor,
    m_top: int,
    query: torch.Tensor,
    retrieve: torch.Tensor,
    bad: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    anchor_union: torch.Tensor,
    anchor_union_cnt: torch.Tensor,
    hold_local: bool = False,
    any_retrieve: torch.Tensor | None = None,
    path: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_blocks(scores, m_top, retrieve)``, then ``cis_compose(..., retrieving_only=True)``
    of the retrieving rows with those winners (after :func:`cis_decide_compose` wrote the other
    rows); returns the winners as :func:`top_blocks` does. On the Triton path, where the top-k
    kernel ranks the rows, the composition runs in the top-k's last launch, in the program that
    ranked its row: no launch of its own (a step where no row retrieves still launches the
    top-k, which then writes empty winners and composes nothing)."""
    b = query.shape[0]
    h = _check_anchors(anchor_len, slots, seq_lens, b)
    check_bool_mask("retrieve", retrieve, (b, h))
    check_bool_mask("bad", bad, (b, h))
    check_shape("scores", scores, (b, h, scores.shape[-1]), "[B, Hkv, NB]")
    ws, wl = _check_retrieving_compose(
        "top_blocks_compose", query, m_top, anchor_len, anchor_idx, n_sink, n_local,
        block_size, m, r, hold_local, out_indices, out_counts, anchor_union, anchor_union_cnt,
        any_retrieve,
    )  # fmt: skip
    return _top_blocks_compose(
        scores, m_top, query, retrieve, bad, anchor_q, anchor_len, anchor_idx, anchor_cnt,
        anchor_log_delta, slots, seq_lens, n_sink=n_sink, n_local=n_local,
        block_size=block_size, m=m, r=r, out_indices=out_indices, out_counts=out_counts,
        anchor_union=anchor_union, anchor_union_cnt=anchor_union_cnt, hold_local=hold_local,
        any_retrieve=any_retrieve, path=path, windows=(ws, wl),
    )  # fmt: skip


def _top_blocks_compose(
    scores: torch.Tensor,
    m_top: int,
    query: torch.Tensor,
    retrieve: torch.Tensor,
    bad: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    anchor_union: torch.Tensor,
    anchor_union_cnt: torch.Tensor,
    hold_local: bool,
    any_retrieve: torch.Tensor | None,
    path: str,
    windows: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_blocks_compose` once its arguments are checked (``windows``: the ``(ws, wl)``
    the checks gave), also :func:`retrieval_compose`'s path where its fused pass does not
    apply."""
    ws, wl = windows
    k = min(m_top, scores.shape[-1])
    anchors = (anchor_q, anchor_len, anchor_idx, anchor_cnt, anchor_log_delta)
    kw = dict(n_sink=n_sink, n_local=n_local, block_size=block_size, m=m, r=r,
              out_indices=out_indices, out_counts=out_counts, hold_local=hold_local)  # fmt: skip
    if path.startswith("triton") and k >= 1:
        from prhs_kernels.cis.triton import top_blocks_compose_triton, top_blocks_fits

        if top_blocks_fits(scores.shape[-1], k):
            announce("top_blocks_compose", path, query.device)
            return top_blocks_compose_triton(
                scores, k, retrieve, query, *anchors, anchor_union, anchor_union_cnt, slots,
                seq_lens, **kw, windows=(ws, wl), any_retrieve=any_retrieve,
            )  # fmt: skip
    new_idx, new_scores = top_blocks(scores, m_top, retrieve, path=path)
    cis_compose(
        query, retrieve, bad, new_idx, new_scores, *anchors, slots, seq_lens, **kw,
        any_retrieve=any_retrieve, anchor_union=anchor_union, anchor_union_cnt=anchor_union_cnt,
        retrieving_only=True, path=path,
    )  # fmt: skip
    return new_idx, new_scores


def retrieval_compose(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    m_top: int,
    retrieve: torch.Tensor,
    bad: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_log_delta: torch.Tensor,
    slots: torch.Tensor,
    *,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    anchor_union: torch.Tensor,
    anchor_union_cnt: torch.Tensor,
    score: str = "mass",
    hold_local: bool = False,
    any_retrieve: torch.Tensor | None = None,
    codes: KeyCodes | None = None,
    path: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole retrieval after :func:`cis_decide_compose`: the retrieving rows' block scores
    (:func:`retrieval_block_scores`, ``fill_idle=False``), their top ``m_top`` blocks and their
    composition (:func:`top_blocks_compose`, whose winners it returns); the sequence lengths are
    ``kv.seq_lens``.

    On a Triton path with ``score="mass"`` and a block size of at most 64 (a power of two), in
    two launches instead of three: the logits pass writes each block's log-sum-exp instead of
    its positions' logits, and the top-k's first pass scores each retrieving row from them in
    the program that then ranks it (``mean_i exp(block_lse_i - lse_i)``: the block-score pass's
    mass, to float32 rounding). A step where no row retrieves then launches two kernels that
    find nothing to do, and the ``T``-long logits never reach memory. Otherwise it is those two
    calls. ``codes``: the scores from the keys' code rows. Every argument is checked before
    anything is launched or written."""
    b = query.shape[0]
    check_query(query, kv)
    if codes is not None:
        check_key_codes(kv, codes)
    h = _check_anchors(anchor_len, slots, kv.seq_lens, b)
    check_bool_mask("retrieve", retrieve, (b, h))
    check_bool_mask("bad", bad, (b, h))
    check_block_score(score)
    ws, wl = _check_retrieving_compose(
        "retrieval_compose", query, m_top, anchor_len, anchor_idx, n_sink, n_local,
        block_size, m, r, hold_local, out_indices, out_counts, anchor_union, anchor_union_cnt,
        any_retrieve,
    )  # fmt: skip
    nb = -(-kv.max_len // block_size)
    k = min(m_top, nb)
    fused = False
    if path.startswith("triton") and score == "mass" and k >= 1:
        from prhs_kernels.cis.triton import top_blocks_fits
        from prhs_kernels.score.triton import block_lse_fits

        fused = block_lse_fits(block_size) and top_blocks_fits(nb, k)
    if not fused:
        scores = retrieval_block_scores(
            query, kv, scaling, retrieve, block_size=block_size, n_sink=n_sink,
            n_local=n_local, score=score, fill_idle=False, codes=codes, path=path,
        )  # fmt: skip
        return _top_blocks_compose(  # the arguments are checked above
            scores, m_top, query, retrieve, bad, anchor_q, anchor_len, anchor_idx, anchor_cnt,
            anchor_log_delta, slots, kv.seq_lens, n_sink=n_sink, n_local=n_local,
            block_size=block_size, m=m, r=r, out_indices=out_indices, out_counts=out_counts,
            anchor_union=anchor_union, anchor_union_cnt=anchor_union_cnt,
            hold_local=hold_local, any_retrieve=any_retrieve, path=path, windows=(ws, wl),
        )  # fmt: skip
    from prhs_kernels.cis.triton import retrieval_compose_triton

    announce("retrieval_compose", path, query.device)
    return retrieval_compose_triton(
        query, kv, scaling, k, retrieve, anchor_q, anchor_len, anchor_idx, anchor_cnt,
        anchor_log_delta, anchor_union, anchor_union_cnt, slots, kv.seq_lens,
        block_size=block_size, n_sink=n_sink, n_local=n_local, codes=codes, m=m, r=r,
        out_indices=out_indices, out_counts=out_counts, windows=(ws, wl),
        hold_local=hold_local, any_retrieve=any_retrieve,
    )  # fmt: skip


def _check_retrieving_compose(
    who: str,
    query: torch.Tensor,
    m_top: int,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    hold_local: bool,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    anchor_union: torch.Tensor | None,
    anchor_union_cnt: torch.Tensor | None,
    any_retrieve: torch.Tensor | None,
) -> tuple[int, int]:
    """The checks of an op that ranks ``m_top`` winners and composes the retrieving rows with
    them (``who``: its name, for the messages); :func:`_check_selection_args`' ``(ws, wl)``."""
    if m_top > anchor_idx.shape[-1]:
        raise ValueError(
            f"m_top ({m_top}) must not exceed the anchor list's width ({anchor_idx.shape[-1]})"
        )
    ws, wl = _check_selection_args(
        query, anchor_len, anchor_idx, n_sink, n_local, block_size, m, r, hold_local,
        out_indices, out_counts, anchor_union, anchor_union_cnt,
        needs_union=f"{who} composes the retrieving rows only",
    )  # fmt: skip
    if any_retrieve is not None:
        check_flag("any_retrieve", any_retrieve, query.device, " (SelectorState.retrieving)")
    return ws, wl


def _check_selection_args(
    query: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    n_sink: int,
    n_local: int,
    block_size: int,
    m: int,
    r: int,
    hold_local: bool,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    anchor_union: torch.Tensor | None,
    anchor_union_cnt: torch.Tensor | None,
    needs_union: str | None = None,
) -> tuple[int, int]:
    """Check the arguments that shape a CIS selection (its buffers, the dilation, the union
    fields, required when ``needs_union`` says who needs them); ``(ws, wl)``: the sink and
    local windows' widths in blocks."""
    b, h = query.shape[0], anchor_len.shape[1]
    mm = anchor_idx.shape[-1]
    for name, v, least in (("n_sink", n_sink, 0), ("n_local", n_local, 0),
                           ("block_size", block_size, 1), ("m", m, 0), ("r", r, 0)):  # fmt: skip
        check_int(name, v, minimum=least)
    if m > mm:
        raise ValueError(f"m ({m}) must not exceed the anchor list's width ({mm})")
    ws, _ = window_widths(n_sink, n_local, block_size)
    wl = cis_local_width(n_local, block_size, hold_local)
    width = ws + mm + 2 * r * m + wl
    check_shape("out_indices", out_indices, (b, h, width), "[B, Hkv, ws + M + 2rm + wl]")
    check_shape("out_counts", out_counts, (b, h), "[B, Hkv]")
    if needs_union is not None and (anchor_union is None or anchor_union_cnt is None):
        raise ValueError(
            f"{needs_union}: it needs the anchors' union (anchor_union, anchor_union_cnt)"
        )
    if (anchor_union is None) != (anchor_union_cnt is None):
        raise ValueError("anchor_union and anchor_union_cnt go together: give both or neither")
    if anchor_union is not None and anchor_union_cnt is not None:
        n = anchor_len.shape[0]
        for name, t, shape in (
            ("anchor_union", anchor_union, (n, h, mm + 2 * r * m)),
            ("anchor_union_cnt", anchor_union_cnt, (n, h)),
        ):
            if tuple(t.shape) != shape or t.dtype != torch.int32 or t.device != query.device:
                raise ValueError(
                    f"{name} must be int32 {list(shape)} ([N, Hkv] + the union's M + 2·r·m) on "
                    f"{query.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                )
    return ws, wl


def cis_decide_compose(
    query: torch.Tensor,
    anchor_q: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_union: torch.Tensor,
    anchor_union_cnt: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    tau: float | torch.Tensor,
    n_local: int,
    n_sink: int,
    block_size: int,
    m: int,
    r: int,
    out_indices: torch.Tensor,
    out_counts: torch.Tensor,
    hold_local: bool = False,
    nonfinite: torch.Tensor | None = None,
    any_retrieve: torch.Tensor | None = None,
    path: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cis_decide`, and the selection of every row that does not retrieve written as
    :func:`cis_compose` would write it: a reusing row's from its anchor's union
    (``anchor_union`` / ``anchor_union_cnt``, copied between the windows), a ``bad`` row's
    windows only. The retrieving rows' entries are left for ``cis_compose(...,
    retrieving_only=True)`` after their retrieval; no anchor changes here. ``(retrieve, bad)``
    as :func:`cis_decide` returns them.

    On the Triton path this is the decision's launch: a reusing row's selection is ready before
    the retrieval's kernels run, and the composition after them has only the retrieving rows to
    write (nothing, on a step where no row retrieves). The arguments are those of the two ops
    (checked before anything is written or counted)."""
    b = query.shape[0]
    h = _check_anchors(anchor_len, slots, seq_lens, b)
    check_shape("anchor_cnt", anchor_cnt, (anchor_len.shape[0], h), "[N, Hkv]")
    ws, wl = _check_selection_args(
        query, anchor_len, anchor_idx, n_sink, n_local, block_size, m, r, hold_local,
        out_indices, out_counts, anchor_union, anchor_union_cnt,
        needs_union="cis_decide_compose copies each reuse's anchor union",
    )  # fmt: skip
    _check_decide_args(query, anchor_q, anchor_len, slots, seq_lens, tau, n_local, nonfinite,
                       any_retrieve)  # fmt: skip
    if path.startswith("triton"):
        from prhs_kernels.cis.triton import cis_decide_triton

        announce("cis_decide_compose", path, query.device)
        early = dict(
            anchor_union=anchor_union, anchor_union_cnt=anchor_union_cnt, out_indices=out_indices,
            out_counts=out_counts, n_sink=n_sink, block_size=block_size, windows=(ws, wl),
            hold_local=hold_local,
        )  # fmt: skip
        return cis_decide_triton(
            query, anchor_q, anchor_len, slots, seq_lens, tau, n_local, nonfinite, any_retrieve,
            early=early,
        )  # fmt: skip
    retrieve, bad = cis_decide(
        query, anchor_q, anchor_len, slots, seq_lens, tau=tau, n_local=n_local,
        nonfinite=nonfinite, any_retrieve=any_retrieve, path=path,
    )  # fmt: skip
    # The reference composition of the other rows (no row among them becomes an anchor: the
    # anchor fields are written back unchanged; log δ is not one of this op's fields).
    none = anchor_idx.new_empty((b, h, 0))
    log_delta = torch.zeros(anchor_len.shape, dtype=torch.float32, device=anchor_len.device)
    cis_compose_reference(
        query, retrieve, bad, none, none.float(), anchor_q, anchor_len, anchor_idx, anchor_cnt,
        log_delta, slots, seq_lens, n_sink=n_sink, n_local=n_local, block_size=block_size, m=m,
        r=r, out_indices=out_indices, out_counts=out_counts, hold_local=hold_local,
        rows=~retrieve,
    )  # fmt: skip
    return retrieve, bad


def cis_rescore(
    query: torch.Tensor,
    kv: KVLayout,
    scaling: float,
    reuse: torch.Tensor,
    anchor_len: torch.Tensor,
    anchor_idx: torch.Tensor,
    anchor_cnt: torch.Tensor,
    anchor_next: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_size: int,
    n_sink: int,
    n_local: int,
    hold_local: bool = False,
    score: str = "mass",
    codes: KeyCodes | None = None,
    path: str = "torch",
) -> None:
    """Re-rank the anchor pool of each ``reuse [B, Hkv]`` row at the current query, in place
    (see :func:`.reference.cis_rescore_reference`): ``anchor_idx [N, Hkv, M]`` /
    ``anchor_cnt [N, Hkv]`` (the list, int32) and ``anchor_next [N, Hkv, R]`` (its next-best
    blocks, int32, ``-1`` for none) are one layer's anchor fields, rows by state slot. Reads
    the keys of the pool's blocks, the sink and the local window: ``(M + R)·s + n_sink + wl``
    key rows per row. On a Triton ``path`` (:func:`cis_path`): the scores in two launches
    (programs of a row's pool split, keys read in place, logits through a scratch row, each
    split's log-sum-exps merged), then one program per row ranks its pool and rewrites it (a
    pool of more than 8192 entries: the top-k kernel, then a rewriting launch). ``codes``:
    score the keys' code rows (:class:`prhs_kernels.keycodes.KeyCodes`, ``D/2 + 8`` bytes a
    key) instead of the keys."""
    check_query(query, kv)
    if codes is not None:
        check_key_codes(kv, codes)
    b = query.shape[0]
    h = _check_anchors(anchor_len, slots, kv.seq_lens, b)
    n = anchor_len.shape[0]
    check_bool_mask("reuse", reuse, (b, h))
    check_int("block_size", block_size, minimum=1)
    check_int("n_sink", n_sink, minimum=0)
    check_int("n_local", n_local, minimum=0)
    check_block_score(score)
    for name, t in (("anchor_idx", anchor_idx), ("anchor_next", anchor_next)):
        if t.ndim != 3 or tuple(t.shape[:2]) != (n, h) or t.dtype != torch.int32:
            raise ValueError(
                f"{name} must be int32 [N={n}, Hkv={h}, width], got {list(t.shape)} {t.dtype}"
            )
    check_shape("anchor_cnt", anchor_cnt, (n, h), "[N, Hkv]")
    announce("cis_rescore", path, query.device)
    if path.startswith("triton"):
        from prhs_kernels.cis.triton import (
            rescore_rank_fits,
            rescore_rank_write_triton,
            rescore_scores_triton,
            rescore_write_triton,
            top_blocks_fits,
        )
        from prhs_kernels.cis.triton import top_blocks_triton as rank

        fields = (anchor_len, anchor_idx, anchor_cnt, anchor_next, slots)
        scores = rescore_scores_triton(
            query, kv, scaling, reuse, *fields, block_size, n_sink, n_local, hold_local, score,
            codes,
        )  # fmt: skip
        m = anchor_idx.shape[-1]
        if rescore_rank_fits(scores.shape[-1], m):  # ranked and rewritten in one launch
            rescore_rank_write_triton(scores, reuse, anchor_idx, anchor_cnt, anchor_next, slots)
            return
        if top_blocks_fits(scores.shape[-1], m):
            chosen, val = rank(scores, m, reuse)
        else:  # a pool beyond the top-k kernel's reach: the same ranking by torch.topk
            val, chosen = torch.topk(scores, m, dim=-1)
        rescore_write_triton(chosen, val, reuse, anchor_idx, anchor_cnt, anchor_next, slots)
        return
    if codes is not None:  # the dequantised keys, scored in float32
        query, kv = query.float(), code_key_layout(kv, codes)
    cis_rescore_reference(
        query, kv, scaling, reuse, anchor_len, anchor_idx, anchor_cnt, anchor_next, slots,
        block_size=block_size, n_sink=n_sink, n_local=n_local, hold_local=hold_local,
        score=score,
    )  # fmt: skip
