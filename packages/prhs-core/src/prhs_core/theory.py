"""The dropped-mass theory of the docs' *Theory* page, batched in torch.

Conventions
-----------
Every function works on a batch: the last dimension ``T`` indexes cached positions and any
leading dimensions (batch, heads, steps) are carried through.

- ``logits``: ``[..., T]`` attention logits ``l_i = q·k_i · scaling``.
- ``selected``: ``[..., T]`` bool, the set ``S``.
- ``valid``: optional ``[..., T]`` bool, which positions exist (rows of a batch of different
  lengths); ``None`` means all. ``t`` is ``valid.sum(-1)``; every row needs ``t >= 1``.
  Selected positions outside ``valid`` are ignored.
- ``values``: ``[..., T, Dv]``.

Half-precision inputs are computed in float32; float64 inputs stay float64. The dropped mass is
always computed as the dropped set's own mass in log space, never as ``1 - τ``.

Functions whose result is undefined for an empty selection (``p_S``, ``o_S``) raise on one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from prhs_core.checks import (
    check_bool_mask,
    check_device,
    check_float_tensor,
    check_int,
    check_probability,
    check_same_shape,
    check_values_finite,
)

__all__ = [
    "TopPSelection",
    "attention_probs",
    "binary_entropy",
    "dense_output",
    "dropped_mass",
    "entropy",
    "entropy_continuity_bound",
    "group_query_heads",
    "log_dropped_mass",
    "log_page_reuse_certificate",
    "log_reuse_certificate",
    "logit_shift_bound",
    "mi_loss_bound",
    "oracle_overlap",
    "oracle_topk_mask",
    "output_error",
    "output_error_bound",
    "page_ball_shift_bounds",
    "page_box_shift_bounds",
    "page_log_masses",
    "ranks_from_order",
    "restricted_probs",
    "retained_mass",
    "retained_mass_gap",
    "reuse_certificate",
    "round_to_float32",
    "routing_mutual_information",
    "sparse_output",
    "tail_mean",
    "top_mass_recall",
    "top_p_budget",
    "total_variation",
]

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# input handling
# --------------------------------------------------------------------------------------------
def _work_dtype(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.to(torch.float32)


def _prep(
    logits: torch.Tensor, selected: torch.Tensor | None, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    check_float_tensor("logits", logits, min_ndim=1)
    shape = tuple(logits.shape)
    if selected is not None:
        check_bool_mask("selected", selected, shape)
    if valid is None:
        valid = torch.ones(shape, dtype=torch.bool, device=logits.device)
    else:
        check_bool_mask("valid", valid, shape)
    _same_device(("logits", "selected", "valid"), (logits, selected, valid))
    if shape[-1] == 0 or not bool(valid.any(-1).all()):
        raise ValueError("every row needs at least one valid position (t >= 1)")
    work = _work_dtype(logits)
    if not bool(torch.isfinite(work[valid]).all()):
        raise ValueError("logits at valid positions must be finite (no NaN or inf)")
    work = work.masked_fill(~valid, _NEG_INF)
    # Every mass is a difference of log-sum-exps: taken relative to the row's largest logit,
    # they do not lose digits to a large common shift (logits + 1e4 give the same masses).
    work = work - work.amax(-1, keepdim=True)
    if selected is not None:
        selected = selected & valid
    return work, selected, valid


def _same_device(names: tuple[str, ...], tensors: tuple[torch.Tensor | None, ...]) -> None:
    """:func:`check_device` over the tensors given (``None``: an optional one left out)."""
    given = [(n, t) for n, t in zip(names, tensors, strict=True) if t is not None]
    check_device([n for n, _ in given], [t for _, t in given])


def _check_values(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    check_float_tensor("values", values, min_ndim=2)
    check_device(("logits", "values"), (logits, values))
    if tuple(values.shape[:-1]) != tuple(logits.shape):
        raise ValueError(
            f"values must have shape [..., T, Dv] matching logits {list(logits.shape)}, "
            f"got {list(values.shape)}"
        )
    return _work_dtype(values)


def _require_nonempty(selected: torch.Tensor, what: str) -> None:
    if not bool(selected.any(-1).all()):
        raise ValueError(f"{what} is undefined for an empty selection: every row must select >= 1")


def _as_tensor(x: float | torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x if x.is_floating_point() else x.to(torch.float64)
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"expected a float or a tensor, got {type(x).__name__}")
    dtype = like.dtype if like is not None and like.is_floating_point() else torch.float64
    device = like.device if like is not None else None
    return torch.tensor(float(x), dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------
# masses and distributions
# --------------------------------------------------------------------------------------------
def attention_probs(logits: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``p = softmax(l)`` over valid positions; ``[..., T]``, zero at invalid positions."""
    work, _, _ = _prep(logits, None, valid)
    return torch.softmax(work, dim=-1)


def log_dropped_mass(
    logits: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``log δ(S) = logsumexp(l_{∉S}) − logsumexp(l)``; ``[...]``, ``-inf`` when nothing drops."""
    work, sel, _ = _prep(logits, selected, valid)
    assert sel is not None
    lse_all = torch.logsumexp(work, dim=-1)
    lse_drop = torch.logsumexp(work.masked_fill(sel, _NEG_INF), dim=-1)
    return lse_drop - lse_all


def dropped_mass(
    logits: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``δ(S) = Σ_{i∉S} p_i``, computed as the dropped set's own mass; ``[...]``."""
    return torch.exp(log_dropped_mass(logits, selected, valid))


def retained_mass(
    logits: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``τ(S) = Σ_{i∈S} p_i``; ``[...]``."""
    work, sel, _ = _prep(logits, selected, valid)
    assert sel is not None
    lse_sel = torch.logsumexp(work.masked_fill(~sel, _NEG_INF), dim=-1)
    return torch.exp(lse_sel - torch.logsumexp(work, dim=-1))


def restricted_probs(
    logits: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``p_S``: ``p`` restricted to ``S`` and renormalised; ``[..., T]``.

    ``S`` must be non-empty.
    """
    work, sel, _ = _prep(logits, selected, valid)
    assert sel is not None
    _require_nonempty(sel, "p_S")
    return torch.softmax(work.masked_fill(~sel, _NEG_INF), dim=-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``TV(p, q) = ½ Σ_i |p_i − q_i|`` over the last dimension; ``[...]``."""
    check_float_tensor("p", p, min_ndim=1)
    check_float_tensor("q", q, min_ndim=1)
    check_same_shape(("p", "q"), (p, q))
    check_device(("p", "q"), (p, q))
    return 0.5 * (_work_dtype(p) - _work_dtype(q)).abs().sum(-1)


# --------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------
def sparse_output(
    logits: torch.Tensor,
    values: torch.Tensor,
    selected: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``o_S = Σ_{i∈S} p_i v_i / τ(S)``; ``[..., Dv]``. ``S`` must be non-empty."""
    v = _check_values(values, logits)
    ps = restricted_probs(logits, selected, valid)
    return torch.einsum("...t,...td->...d", ps.to(v.dtype), v)


def dense_output(
    logits: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``o = Σ_i p_i v_i``; ``[..., Dv]``."""
    v = _check_values(values, logits)
    p = attention_probs(logits, valid)
    return torch.einsum("...t,...td->...d", p.to(v.dtype), v)


def tail_mean(
    logits: torch.Tensor,
    values: torch.Tensor,
    selected: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``μ_tail = Σ_{i∉S} p_i v_i / δ``; ``[..., Dv]``.

    Rows where nothing is dropped (``δ = 0``) get zeros: ``o − o_S = δ·(μ_tail − o_S)`` then
    holds for any ``μ_tail``.
    """
    v = _check_values(values, logits)
    work, sel, valid_ = _prep(logits, selected, valid)
    assert sel is not None
    dropped = valid_ & ~sel
    pd = torch.softmax(work.masked_fill(~dropped, _NEG_INF), dim=-1)
    pd = torch.where(dropped.any(-1, keepdim=True), pd, torch.zeros_like(pd))
    return torch.einsum("...t,...td->...d", pd.to(v.dtype), v)


def output_error(
    logits: torch.Tensor,
    values: torch.Tensor,
    selected: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``‖o − o_S‖₂``; ``[...]``."""
    return (
        dense_output(logits, values, valid) - sparse_output(logits, values, selected, valid)
    ).norm(dim=-1)


def output_error_bound(
    delta: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``2δ · max_i ‖v_i‖``, an upper bound on ``‖o − o_S‖``; ``[...]``.

    ``delta``: ``[...]`` dropped masses; ``values``: ``[..., T, Dv]``.
    """
    check_float_tensor("delta", delta)
    check_probability("delta", delta)
    check_float_tensor("values", values, min_ndim=2)
    _same_device(("delta", "values", "valid"), (delta, values, valid))
    if tuple(values.shape[:-2]) != tuple(delta.shape):
        raise ValueError(
            f"values [..., T, Dv] must have leading shape {list(delta.shape)} (delta's), "
            f"got {list(values.shape)}"
        )
    norms = _work_dtype(values).norm(dim=-1)
    if valid is not None:
        check_bool_mask("valid", valid, tuple(values.shape[:-1]))
        norms = norms.masked_fill(~valid, 0.0)
    return 2.0 * _work_dtype(delta) * norms.amax(dim=-1)


# --------------------------------------------------------------------------------------------
# entropy and routing mutual information
# --------------------------------------------------------------------------------------------
def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dimension, ``0·ln 0 = 0``; ``[...]``."""
    check_float_tensor("p", p, min_ndim=1)
    p = _work_dtype(p)
    return -torch.special.xlogy(p, p).sum(-1)


def binary_entropy(x: float | torch.Tensor) -> torch.Tensor:
    """``h(x) = −x ln x − (1−x) ln(1−x)`` in nats, for ``x ∈ [0, 1]``.

    ``ln(1−x)`` is ``log1p(−x)``: for a tiny ``x`` the second term is ``≈ x``, which
    ``ln(1 − x)`` would round to 0 (``h(1e-20)`` would be 2 % low)."""
    x = _as_tensor(x)
    check_probability("x", x)
    second = torch.where(x < 1, (1 - x) * torch.log1p(-x), torch.zeros_like(x))
    return -torch.special.xlogy(x, x) - second


def entropy_continuity_bound(tv: float | torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """Fannes–Audenaert: ``|H(p) − H(q)| ≤ TV·ln(t−1) + h(TV)`` for ``TV ≤ 1 − 1/t``.

    ``t`` is the support size (``>= 1``). Past ``1 − 1/t`` the bound is the trivial ``ln t``,
    which the formula reaches at ``TV = 1 − 1/t``; so the returned function is continuous,
    non-decreasing and concave in ``TV``.
    """
    tv = _as_tensor(tv)
    check_probability("tv", tv)
    if isinstance(t, torch.Tensor):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"t must be an integer tensor, got dtype {t.dtype}")
        if t.numel() and bool((t < 1).any()):
            raise ValueError("t (the support size) must be >= 1")
        tt = t.to(device=tv.device, dtype=tv.dtype)
    else:
        check_int("t", t, minimum=1)
        tt = torch.tensor(float(t), dtype=tv.dtype, device=tv.device)
    formula = torch.special.xlogy(tv, tt - 1) + binary_entropy(tv)
    return torch.where(tv <= 1 - 1 / tt, formula, torch.log(tt))


def routing_mutual_information(probs: torch.Tensor) -> torch.Tensor:
    """``I(Q;J) = H(mean_q p(·|q)) − mean_q H(p(·|q))`` for uniform ``Q``.

    ``probs``: ``[..., Q, T]`` one routing distribution per query; returns ``[...]``.
    """
    check_float_tensor("probs", probs, min_ndim=2)
    p = _work_dtype(probs)
    return entropy(p.mean(-2)) - entropy(p).mean(-1)


def mi_loss_bound(deltas: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """``B_MI = f(δ̄) + mean_q f(δ_q)`` with ``f`` the entropy bound.

    ``|I_full − I_S| ≤ B_MI ≤ 2 f(δ̄)``, where ``δ_q`` is each query's dropped mass (its TV),
    ``δ̄`` their mean and ``t`` the number of cached positions.
    ``deltas``: ``[..., Q]``; ``t``: int or ``[...]``; returns ``[...]``.
    """
    check_float_tensor("deltas", deltas, min_ndim=1)
    check_probability("deltas", deltas)
    d = _work_dtype(deltas)
    tq = t.unsqueeze(-1) if isinstance(t, torch.Tensor) else t
    return entropy_continuity_bound(d.mean(-1), t) + entropy_continuity_bound(d, tq).mean(-1)


# --------------------------------------------------------------------------------------------
# the pre-hoc reuse certificate
# --------------------------------------------------------------------------------------------
#: Unit roundoff of float64.
_U64 = 2.0**-53
#: Added to every float64 log-space certificate: covers the rounding of its log-sum-exps (a sum
#: of ``n`` terms errs by at most ``n·2⁻⁵³`` relatively; ``1e-9`` covers ``n`` up to ``10⁷``).
_LOG_SLACK = 1e-9


def _gamma(n: int) -> float:
    """``γ_n = n·u / (1 − n·u)``: a float64 dot product of length ``n`` errs by at most
    ``γ_n · Σ|terms|`` (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1)."""
    return n * _U64 / (1 - n * _U64)


def _check_scaling(scaling: object) -> float:
    if (
        isinstance(scaling, bool)
        or not isinstance(scaling, int | float)
        or not math.isfinite(scaling)
        or scaling <= 0
    ):
        raise ValueError(f"scaling must be a positive finite float, got {scaling!r}")
    return float(scaling)


def round_to_float32(x: torch.Tensor, *, up: bool) -> torch.Tensor:
    """``x`` (float64) as float32, rounded toward ``+inf`` (``up=True``) or ``-inf``.

    An upper bound stored in float32 must not land below its float64 value (round-to-nearest
    does half the time), nor a positive one underflow to 0: rounded up, ``1e-300`` is stored as
    the smallest float32 subnormal. Other dtypes are converted as they are.
    """
    check_float_tensor("x", x)
    y = x.to(torch.float32)
    if x.dtype != torch.float64:
        return y
    toward = torch.full_like(y, math.inf if up else -math.inf)
    wrong = y.double() < x if up else y.double() > x
    return torch.where(wrong, torch.nextafter(y, toward), y)


def _finish(bound64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 upper bound in the caller's working dtype, rounded up where it narrows."""
    return bound64 if dtype == torch.float64 else round_to_float32(bound64, up=True)


def logit_shift_bound(
    query: torch.Tensor,
    anchor: torch.Tensor,
    key_norm_max: float | torch.Tensor,
    scaling: float,
    *,
    check: bool = True,
) -> torch.Tensor:
    """``ε = ‖q − q_a‖ · K_max · scaling``: no logit moves by more than ``ε`` from ``q_a`` to ``q``.

    ``query``, ``anchor``: ``[..., D]``; ``key_norm_max``: broadcastable to ``[...]``
    (the largest key norm of the head); ``scaling``: ``1/sqrt(D)`` usually. Returns ``[...]``,
    float64 for float64 inputs, else float32. It is computed in float64 and widened by that
    arithmetic's worst rounding, and a float32 result is rounded up: it is never below the
    exact value. ``check=False`` skips the value checks (which read device values on the host),
    for the decode path; a NaN then gives a NaN ``ε``, which certifies nothing.
    """
    check_float_tensor("query", query, min_ndim=1)
    check_float_tensor("anchor", anchor, min_ndim=1)
    check_same_shape(("query", "anchor"), (query, anchor))
    scale = _check_scaling(scaling)
    # A float K_max stays float64 (13.7 in float32 is below 13.7).
    kmax = _as_tensor(key_norm_max)
    if not isinstance(key_norm_max, torch.Tensor):
        kmax = kmax.to(query.device)
    check_device(("query", "anchor", "key_norm_max"), (query, anchor, kmax))
    if check:
        check_values_finite("query", query)
        check_values_finite("anchor", anchor)
        check_values_finite("key_norm_max", kmax)
        if kmax.numel() and bool((kmax < 0).any()):
            raise ValueError("key_norm_max must be >= 0")
    eps = (query.double() - anchor.double()).norm(dim=-1) * kmax.double() * scale
    # The difference, D squares, their sum, the root and two products: (D + 5) roundings.
    eps = eps * (1 + _gamma(query.shape[-1] + 5))
    return _finish(eps, _work_dtype(query).dtype)


def _query_change(
    query: torch.Tensor,
    anchor: torch.Tensor,
    names: tuple[str, str],
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
    check: bool,
) -> torch.Tensor:
    """``(q − q_a)·scaling`` in float64, ``[..., 1, D]``, after the shared input checks."""
    check_float_tensor("query", query, min_ndim=1)
    check_float_tensor("anchor", anchor, min_ndim=1)
    check_same_shape(("query", "anchor"), (query, anchor))
    check_float_tensor(names[0], a, min_ndim=2)
    check_float_tensor(names[1], b, min_ndim=1)
    check_device(("query", "anchor", *names), (query, anchor, a, b))
    scale = _check_scaling(scaling)
    if check:
        check_values_finite("query", query)
        check_values_finite("anchor", anchor)
    if a.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"{names[0]} [..., P, D] must have D = {query.shape[-1]} (the query's last "
            f"dimension), got {list(a.shape)}"
        )
    # Exact for float32 queries; float64 ones round once here, counted in the slack.
    return (query.double() - anchor.double()).unsqueeze(-2) * scale


def page_box_shift_bounds(
    query: torch.Tensor,
    anchor: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    scaling: float,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per page, ``l_P ≤ Δq·k·scaling ≤ u_P`` for every key ``k`` of the page, ``Δq = q − q_a``.

    A page whose keys lie in the box ``key_min ≤ k ≤ key_max`` (per channel, Quest's page
    metadata) gets ``u_P = Σ_j max(Δ_j·min_j, Δ_j·max_j)`` and ``l_P = Σ_j min(Δ_j·min_j,
    Δ_j·max_j)``, times ``scaling``: the extremes of a linear function over a box, reached at
    its corners. ``query``, ``anchor``: ``[..., D]``; ``key_min``, ``key_max``:
    ``[..., P, D]``, leading dimensions broadcast with the queries'. Returns ``(lower,
    upper)``, ``[..., P]`` float64, widened by the float64 arithmetic's worst rounding. A page
    with no key (``min = +inf``, ``max = -inf``, as an unwritten side-cache page) gets
    ``(+inf, -inf)``: nothing to bound. ``check=False`` skips the value checks (which read
    device values on the host), for the decode path.
    """
    check_same_shape(("key_min", "key_max"), (key_min, key_max))
    dq = _query_change(query, anchor, ("key_min", "key_max"), key_min, key_max, scaling, check)
    lo, hi = key_min.double(), key_max.double()
    empty = (lo > hi).any(-1)
    lo = torch.where(empty.unsqueeze(-1), 0.0, lo)
    hi = torch.where(empty.unsqueeze(-1), 0.0, hi)
    if check and not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        raise ValueError("key_min and key_max must be finite on every non-empty page")
    pos, neg = dq.clamp_min(0), dq.clamp_max(0)
    upper = (pos * hi + neg * lo).sum(-1)
    lower = (pos * lo + neg * hi).sum(-1)
    # The difference, its scaling, D products and their sum: (D + 2) roundings of terms at most
    # |Δ_j|·max|k_j|.
    slack = _gamma(dq.shape[-1] + 2) * (dq.abs() * torch.maximum(lo.abs(), hi.abs())).sum(-1)
    upper = torch.where(empty, -math.inf, upper + slack)
    lower = torch.where(empty, math.inf, lower - slack)
    return lower, upper


def page_ball_shift_bounds(
    query: torch.Tensor,
    anchor: torch.Tensor,
    centre: torch.Tensor,
    radius: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per page, ``Δq·c_P·s − ‖Δq‖·r_P·s ≤ Δq·k·s ≤ Δq·c_P·s + ‖Δq‖·r_P·s`` (Cauchy–Schwarz),
    for every key ``k`` with ``‖k − c_P‖ ≤ r_P``.

    ``query``, ``anchor``: ``[..., D]``; ``centre``: ``[..., P, D]``; ``radius``: ``[..., P]``
    (``>= 0``; ``-inf`` marks a page with no key, which gets ``(+inf, -inf)``); ``scaling``: ``s``.
    Returns ``(lower, upper)``, ``[..., P]`` float64, widened by the float64 arithmetic's worst
    rounding. The alternative to :func:`page_box_shift_bounds` that reads ``D + 1`` numbers a
    page instead of ``2D``; it is never tighter than the box around the same ball.
    """
    dq = _query_change(query, anchor, ("centre", "radius"), centre, radius, scaling, True)
    if tuple(radius.shape) != tuple(centre.shape[:-1]):
        raise ValueError(
            f"radius must have shape {list(centre.shape[:-1])} (centre's without D), "
            f"got {list(radius.shape)}"
        )
    r = radius.double()
    empty = r == -math.inf
    if bool((r[~empty] < 0).any()) or not bool(torch.isfinite(r[~empty]).all()):
        raise ValueError("radius must be finite and >= 0 (or -inf for a page with no key)")
    c = torch.where(empty.unsqueeze(-1), 0.0, centre.double())
    if not bool(torch.isfinite(c).all()):
        raise ValueError("centre must be finite on every non-empty page")
    mid = (dq * c).sum(-1)
    spread = dq.norm(dim=-1) * r.clamp_min(0)
    d = dq.shape[-1]
    slack = _gamma(d + 2) * (dq.abs() * c.abs()).sum(-1) + _gamma(d + 5) * spread
    upper = torch.where(empty, -math.inf, mid + spread + slack)
    lower = torch.where(empty, math.inf, mid - spread - slack)
    return lower, upper


def page_log_masses(
    logits: torch.Tensor,
    selected: torch.Tensor,
    page_size: int,
    valid: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per aligned page of ``page_size`` positions, ``log`` of the attention mass outside and
    inside ``S``: ``(log m^drop, log m^sel)``, each ``[..., ⌈T / page_size⌉]`` float64,
    ``-inf`` for none. What :func:`log_page_reuse_certificate` keeps of the anchor query.

    ``check=False`` skips the input checks (which read device values on the host), for the
    decode path: ``logits`` must then be ``-inf`` wherever a position does not exist (``valid``
    is ignored), and ``selected`` may be any shape that broadcasts to them."""
    check_int("page_size", page_size, minimum=1)
    if check:
        work, sel, _ = _prep(logits, selected, valid)
        assert sel is not None
    else:
        work, sel = logits, selected
    work = work.double()
    lse_all = torch.logsumexp(work, dim=-1, keepdim=True)
    pad = -work.shape[-1] % page_size

    def pages(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, pad), value=_NEG_INF).unflatten(-1, (-1, page_size))
        return torch.logsumexp(x, dim=-1) - lse_all

    return pages(work.masked_fill(sel, _NEG_INF)), pages(work.masked_fill(~sel, _NEG_INF))


def log_page_reuse_certificate(
    log_mass_dropped: torch.Tensor,
    log_mass_selected: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    *,
    check: bool = True,
) -> torch.Tensor:
    """``log δ̂`` of the per-page certificate ``δ̂ = A / (A + C)``, with
    ``A = Σ_P m_P^drop·e^{u_P}`` and ``C = Σ_P m_P^sel·e^{l_P}``.

    ``m_P^drop`` and ``m_P^sel`` are the anchor query's attention mass in page ``P`` outside and
    inside the set ``S`` it chose (``log_mass_*``: their logs, ``-inf`` for none), ``[l_P, u_P]``
    bounds the change of every logit of the page from the anchor query to the new one
    (:func:`page_box_shift_bounds`, :func:`page_ball_shift_bounds`). Then ``δ(S; q) ≤ δ̂``,
    provided every position added since the anchor is read (see the Theory page for the
    proof). All four ``[..., P]``; returns ``[...]`` float64, raised by a margin that covers its
    rounding. With ``l_P = −ε`` and ``u_P = ε`` on every page it is
    :func:`log_reuse_certificate`. The bound is unchanged when every ``l_P`` and ``u_P`` move
    by one constant, so a common component of the logit change costs nothing. ``check=False``
    skips the value checks, for the decode path (a NaN then gives a NaN, which certifies
    nothing).
    """
    names = ("log_mass_dropped", "log_mass_selected", "lower", "upper")
    tensors = (log_mass_dropped, log_mass_selected, lower, upper)
    for name, t in zip(names, tensors, strict=True):
        check_float_tensor(name, t, min_ndim=1)
    check_same_shape(names, tensors)
    check_device(names, tensors)
    md, ms = log_mass_dropped.double(), log_mass_selected.double()
    lo, hi = lower.double(), upper.double()
    if check:
        if bool((torch.isnan(md) | torch.isnan(ms) | (md > _LOG_SLACK) | (ms > _LOG_SLACK)).any()):
            raise ValueError("log masses must be <= 0 and not NaN (a page's mass lies in [0, 1])")
        if bool((torch.isnan(lo) | torch.isnan(hi)).any()):
            raise ValueError("lower and upper must not be NaN")
    # A page without dropped (selected) mass adds nothing to A (C), whatever its bound.
    a = torch.logsumexp(torch.where(torch.isneginf(md), -math.inf, md + hi), dim=-1)
    c = torch.logsumexp(torch.where(torch.isneginf(ms), -math.inf, ms + lo), dim=-1)
    out = a - torch.logaddexp(a, c) + _LOG_SLACK
    out = torch.where(torch.isposinf(a) | torch.isneginf(c), torch.zeros_like(out), out)
    out = torch.where(torch.isneginf(a), a, out)
    return out.clamp_max(0.0)


def log_reuse_certificate(
    log_delta_anchor: torch.Tensor, eps: float | torch.Tensor, *, check: bool = True
) -> torch.Tensor:
    """``log δ̂`` with ``δ̂ = δ_a e^{2ε} / (δ_a e^{2ε} + 1 − δ_a)``, from ``log δ_a``.

    Working in log space keeps a tiny anchor mass (``log δ_a = −800``) from rounding to zero.
    Computed in float64 and raised by a margin that covers its rounding; a float32 input gets
    the result rounded up to float32. ``check=False`` skips the value checks (which read device
    values on the host), for the decode path; a NaN ``ε`` then gives a NaN bound, which
    certifies nothing.
    """
    check_float_tensor("log_delta_anchor", log_delta_anchor)
    e = _as_tensor(eps, log_delta_anchor)
    check_device(("log_delta_anchor", "eps"), (log_delta_anchor, e))
    if check:
        bad = torch.isnan(log_delta_anchor) | (log_delta_anchor > 0)
        if log_delta_anchor.numel() and bool(bad.any()):
            raise ValueError("log_delta_anchor must be <= 0 and not NaN (δ_a lies in [0, 1])")
        if e.numel() and bool((torch.isnan(e) | (e < 0)).any()):
            raise ValueError("eps must be >= 0")
    la = log_delta_anchor.double()
    a = la + 2 * e.double()
    b = torch.log1p(-torch.exp(la))  # log(1 − δ_a), -inf when δ_a = 1
    out = (a - torch.logaddexp(a, b) + _LOG_SLACK).clamp_max(0.0)
    # δ_a = 0 keeps δ̂ = 0 whatever ε; an infinite shift with δ_a > 0 certifies nothing (δ̂ = 1).
    out = torch.where(torch.isposinf(a), torch.zeros_like(out), out)
    out = torch.where(torch.isneginf(la), la, out)
    return _finish(out, _work_dtype(log_delta_anchor).dtype)


def reuse_certificate(
    delta_anchor: float | torch.Tensor, eps: float | torch.Tensor
) -> torch.Tensor:
    """``δ̂ = δ_a e^{2ε} / (δ_a e^{2ε} + 1 − δ_a)``.

    If ``S`` was chosen for an anchor query with dropped mass ``δ_a`` and every logit moves by at
    most ``ε`` (:func:`logit_shift_bound`), then ``δ(S; q) ≤ δ̂``, provided every position added
    since the anchor is inside ``S``. Under GQA this holds per query head, with that head's
    ``δ_a`` and ``ε``.
    """
    d = _as_tensor(delta_anchor)
    check_probability("delta_anchor", d)
    log_hat = log_reuse_certificate(torch.log(d.double()), eps)
    return _finish(torch.exp(log_hat), _work_dtype(d).dtype)


# --------------------------------------------------------------------------------------------
# oracle comparisons and budgets
# --------------------------------------------------------------------------------------------
def ranks_from_order(order: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` rank of every position, given the ``order`` of a descending sort.

    ``rank[order[j]] = j``: the inverse permutation, so a caller that has sorted already gets
    ranks without sorting again.
    """
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank


def _rank(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every position by descending score (ties by index); invalid ones are -inf."""
    return ranks_from_order(torch.sort(scores, dim=-1, descending=True, stable=True).indices)


def _k_tensor(
    k: int | torch.Tensor, batch_shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    if isinstance(k, torch.Tensor):
        if k.is_floating_point() or k.dtype == torch.bool:
            raise TypeError(f"k must be an int or an integer tensor, got dtype {k.dtype}")
        if k.numel() and bool((k < 1).any()):
            raise ValueError("k must be >= 1")
        return k.to(device=device, dtype=torch.long).expand(batch_shape)
    check_int("k", k, minimum=1)
    return torch.full(batch_shape, k, dtype=torch.long, device=device)


def oracle_topk_mask(
    scores: torch.Tensor, k: int | torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``S*_k``: the ``min(k, t)`` valid positions of largest score; ``[..., T]``.

    Ties go to the lower index.

    ``k``: int or ``[...]`` per row, ``>= 1``.
    """
    work, _, valid_ = _prep(scores, None, valid)
    kk = _k_tensor(k, tuple(work.shape[:-1]), work.device)
    return (_rank(work) < kk.unsqueeze(-1)) & valid_


def retained_mass_gap(
    logits: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``β(S) = τ(S*_{|S|}) − τ(S) ≥ 0``; ``[...]`` (0 for an empty ``S``).

    Computed as ``δ(S) − δ(S*_{|S|})``, both in log space; rounding below zero is clamped.
    """
    work, sel, valid_ = _prep(logits, selected, valid)
    assert sel is not None
    size = sel.sum(-1)
    star = (_rank(work) < size.unsqueeze(-1)) & valid_
    gap = dropped_mass(logits, sel, valid_) - dropped_mass(logits, star, valid_)
    return gap.clamp_min(0.0)


def oracle_overlap(
    scores: torch.Tensor,
    selected: torch.Tensor,
    k: int | torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``|S ∩ S*_k| / min(k, t)``; ``[...]`` in ``[0, 1]``."""
    work, sel, valid_ = _prep(scores, selected, valid)
    assert sel is not None
    star = oracle_topk_mask(work, k, valid_)
    return (star & sel).sum(-1).to(work.dtype) / star.sum(-1).to(work.dtype)


def top_mass_recall(
    logits: torch.Tensor,
    selected: torch.Tensor,
    k: int | torch.Tensor,
    valid: torch.Tensor | None = None,
    mass_fraction: float = 0.5,
) -> torch.Tensor:
    """Recall of the smallest top part of ``S*_k`` holding ``mass_fraction`` of its mass.

    The "recall of the top-50%-mass set of ``S*_k``"; ``[...]`` in ``[0, 1]``.
    """
    check_probability("mass_fraction", mass_fraction)
    work, sel, valid_ = _prep(logits, selected, valid)
    assert sel is not None
    kk = _k_tensor(k, tuple(work.shape[:-1]), work.device).unsqueeze(-1)
    rank = _rank(work)
    p = torch.softmax(work, dim=-1)
    star = (rank < kk) & valid_
    in_star = torch.where(star, p, torch.zeros_like(p))
    # Mass of every star position ranked at or above each position, and the star's total.
    sorted_p = torch.sort(in_star, dim=-1, descending=True, stable=True).values
    cum_sorted = torch.cumsum(sorted_p, dim=-1)
    total = cum_sorted[..., -1:]
    # m = 1 + #{prefixes whose mass is still below the target}: the smallest covering prefix.
    m = 1 + (cum_sorted[..., :-1] < mass_fraction * total).sum(-1, keepdim=True)
    m = torch.minimum(m, star.sum(-1, keepdim=True))
    top = (rank < m) & valid_
    return (top & sel).sum(-1).to(work.dtype) / top.sum(-1).to(work.dtype)


@dataclass(frozen=True)
class TopPSelection:
    """The smallest top set whose dropped mass meets a target.

    Attributes
    ----------
    mask:
        ``[..., T]`` bool, the chosen set.
    size:
        ``[...]`` int64, its size.
    dropped:
        ``[...]`` its dropped mass ``δ`` (``≤ δ_target`` unless ``min_size`` forced more).
    """

    mask: torch.Tensor
    size: torch.Tensor
    dropped: torch.Tensor


def top_p_budget(
    logits: torch.Tensor,
    delta_target: float,
    valid: torch.Tensor | None = None,
    *,
    min_size: int = 1,
    max_size: int | None = None,
) -> TopPSelection:
    """Smallest top set ``S`` with ``δ(S) ≤ δ_target`` (top-p, ``p = 1 − δ_target``).

    ``min_size`` (default 1) keeps the set non-empty when ``δ_target = 1``; ``max_size`` caps it
    (the caller then gets ``δ > δ_target`` where the cap binds, as CIS's ``k_max`` does).
    """
    check_probability("delta_target", delta_target)
    check_int("min_size", min_size, minimum=0)
    if max_size is not None:
        check_int("max_size", max_size, minimum=max(min_size, 1))
    work, _, valid_ = _prep(logits, None, valid)
    t = work.shape[-1]
    sorted_l, order = torch.sort(work, dim=-1, descending=True, stable=True)
    # tail[j] = logsumexp(sorted_l[j:]) for j = 0..T-1: the log mass dropped by the top-j set.
    tail = torch.flip(torch.logcumsumexp(torch.flip(sorted_l, [-1]), dim=-1), [-1])
    lse = tail[..., :1]
    log_target = math.log(delta_target) if delta_target > 0 else _NEG_INF
    # δ(top-j) is non-increasing in j, so the smallest j meeting the target is the number of j
    # that miss it.
    size = ((tail - lse) > log_target).sum(-1)
    size = size.clamp_min(min_size)
    if max_size is not None:
        size = size.clamp_max(max_size)
    size = torch.minimum(size, valid_.sum(-1)).clamp_max(t)
    mask = (ranks_from_order(order) < size.unsqueeze(-1)) & valid_
    return TopPSelection(mask, size, dropped_mass(work, mask, valid_))


# --------------------------------------------------------------------------------------------
# grouped-query attention
# --------------------------------------------------------------------------------------------
def group_query_heads(
    x: torch.Tensor, num_kv_heads: int, reduce: Literal["mean", "max"] = "mean"
) -> torch.Tensor:
    """Reduce ``[B, Hq, ...]`` over each KV head's ``g = Hq/Hkv`` query heads -> ``[B, Hkv, ...]``.

    Query head ``h`` belongs to KV head ``h // g`` (transformers' ``repeat_kv`` order). prhs
    scores a position for a KV head by the *mean* of its group's probabilities, so the
    group's dropped mass is the mean of its heads' dropped masses. Certificates are per query
    head, and a group's certified reuse needs the *max* of its heads' bounds within the target.
    """
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        raise ValueError("x must be a tensor of shape [B, Hq, ...]")
    check_int("num_kv_heads", num_kv_heads, minimum=1)
    hq = x.shape[1]
    if hq % num_kv_heads:
        raise ValueError(f"Hq ({hq}) must be a multiple of num_kv_heads ({num_kv_heads})")
    g = x.reshape(x.shape[0], num_kv_heads, hq // num_kv_heads, *x.shape[2:])
    if reduce == "mean":
        return g.mean(2)
    if reduce == "max":
        return g.amax(2)
    raise ValueError(f"reduce must be 'mean' or 'max', got {reduce!r}")
