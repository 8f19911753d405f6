"""Decode-size linear layers: ``y = x Wᵀ (+ b)`` for a few rows of ``x``, as one weight stream.

A decode step's projections multiply a handful of rows (one per sequence) by each weight: the
weight's bytes are the whole cost. :func:`decode_linear` runs them through a Triton kernel that
reads each weight row once, in one launch (no second reduction launch), on CUDA for
fp16/bf16 inputs of at most :data:`MAX_ROWS` rows (:mod:`prhs_kernels.gemm.triton`); any other
input -- more rows, float32, a CPU tensor (``TRITON_INTERPRET=1`` aside), a weight whose rows
are not contiguous, ``PRHS_KERNELS=torch`` -- goes to ``torch.nn.functional.linear``. The choice
is a function of the device, dtype and shapes only, made before anything runs.

Two decode GEMMs take a decoder layer's elementwise work into their epilogues (on the float32
accumulator, after the weight has streamed: the loop that streams it is left as it is), so none
of it costs a launch of its own: :func:`decode_linear_residual_norm` -- a projection, the
residual add after it, and the first half of the RMS norm that follows (the norm's weight
applied, the sums of squares over each program's columns); and :func:`decode_linear_swiglu` --
an MLP's gate and up projections as one weight stream that scales each row by the norm's
``1 / rms`` (the second half) and writes ``silu(gate) * up``. :func:`decode_linear`'s
``residual`` adds the residual stream to a projection's output (the MLP's down projection).
And :func:`decode_linear_rms` runs the RMS norm *before* a projection in the same pass: the
norm's weight folded into the projection's columns (:func:`fold_norm_weight`), each row's
``1 / rms`` summed from the tiles of ``x`` the weight stream loads anyway (a decoder layer's
input norm and its q|k|v projection: no norm launch).

The Triton paths are the custom ops ``torch.ops.prhs.decode_linear``,
``prhs::decode_linear_residual_norm``, ``prhs::decode_linear_swiglu`` and
``prhs::decode_linear_rms`` (``torch.library``), so
a ``torch.compile``'d model calls each as one opaque op, and a CUDA graph captures each as one
launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prhs_core.checks import check_float_tensor, shape_str
from prhs_kernels.paths import announce, kernel_path

__all__ = [
    "MAX_ROWS",
    "decode_linear",
    "decode_linear_path",
    "decode_linear_reference",
    "decode_linear_residual_norm",
    "decode_linear_rms",
    "decode_linear_rope",
    "decode_linear_swiglu",
    "fold_norm_weight",
]

MAX_ROWS = 16
"""The most rows (``x.numel() // K``) the Triton path takes."""


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x Wᵀ + b (+ residual)`` accumulated in float32, in ``x``'s dtype: what the kernel
    computes."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def _residual_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = decode_linear_reference(x, weight, bias, residual)
    hf = h.float()
    hg = (hf * norm_weight.float()).to(h.dtype)
    return h, hg, hf.pow(2).sum(-1).reshape(1, -1)


def _swiglu_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    y = F.linear(x.float(), weight.float())
    if sumsq is not None:  # one scale per row of x, in order
        scale = torch.rsqrt(sumsq.sum(0) / x.shape[-1] + eps)
        y = y * scale.reshape(*x.shape[:-1], 1)
    if bias is not None:
        y = y + bias.float()
    gate, up = y.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _rms_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    xf = x.float()
    y = F.linear(xf, weight.float()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@torch.library.custom_op("prhs::decode_linear", mutates_args=())
def _decode_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    from prhs_kernels.gemm.triton import decode_linear_triton

    return decode_linear_triton(x, weight, bias, residual=residual)[0]


@_decode_linear_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("prhs::decode_linear_residual_norm", mutates_args=())
def _residual_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from prhs_kernels.gemm.triton import decode_linear_triton

    return decode_linear_triton(x, weight, bias, residual=residual, norm_weight=norm_weight)


@_residual_norm_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from prhs_kernels.gemm.triton import plan

    m, n = x.shape[0], weight.shape[0]
    parts = -(-n // plan(n, weight.shape[1])[0])
    h = x.new_empty(m, n)
    return h, torch.empty_like(h), x.new_empty(parts, m, dtype=torch.float32)


@torch.library.custom_op("prhs::decode_linear_swiglu", mutates_args=())
def _swiglu_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    from prhs_kernels.gemm.triton import decode_linear_triton

    return decode_linear_triton(x, weight, bias, swiglu=True, sumsq=sumsq, eps=eps)[0]


@_swiglu_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("prhs::decode_linear_rms", mutates_args=())
def _rms_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    from prhs_kernels.gemm.triton import decode_linear_triton

    return decode_linear_triton(x, weight, bias, rms_in=True, eps=eps)[0]


@_rms_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _rope_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    position: torch.Tensor,
    eps: float | None,
    advance: bool,
) -> torch.Tensor:
    """:func:`decode_linear_rope` in float32 (rounded once): ``x [M, K]``, ``cos``/``sin``
    ``[M, D]``; writes the caches and ``position`` in place, returns the query ``[M, Hq·D]``."""
    m = x.shape[0]
    _, h_kv, t, d = k_cache.shape
    xf = x.float()
    y = F.linear(xf, weight.float())
    if eps is not None:
        y = y * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if bias is not None:
        y = y + bias.float()
    y = y.view(m, -1, d)
    h_q = y.shape[1] - 2 * h_kv
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    rotated = y[:, : h_q + h_kv]
    half = torch.cat((-rotated[..., d // 2 :], rotated[..., : d // 2]), dim=-1)
    rotated = rotated * c + half * s
    q, k, v = rotated[:, :h_q], rotated[:, h_q:], y[:, h_q + h_kv :]
    # Row ``position`` of every (sequence, head); nothing at or past the capacity.
    at = position.view(1).clamp(max=t - 1)
    fits = (position.view(1) < t).view(1, 1, 1, 1)
    for cache, new in ((k_cache, k), (v_cache, v)):
        old = cache.index_select(2, at)
        cache.index_copy_(2, at, torch.where(fits, new.unsqueeze(2).to(cache.dtype), old))
    if advance:
        position.add_(1)
    return q.reshape(m, h_q * d).to(x.dtype)


@torch.library.custom_op(
    "prhs::decode_linear_rope", mutates_args=("k_cache", "v_cache", "position")
)
def _rope_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    position: torch.Tensor,
    eps: float | None,
    advance: bool,
) -> torch.Tensor:
    from prhs_kernels.gemm.triton import Rope, decode_linear_triton

    rope = Rope(cos, sin, k_cache, v_cache, position, advance)
    rms = eps is not None
    return decode_linear_triton(x, weight, bias, rms_in=rms, eps=eps or 0.0, rope=rope)[0]


@_rope_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    position: torch.Tensor,
    eps: float | None,
    advance: bool,
) -> torch.Tensor:
    _, h_kv, _, d = k_cache.shape
    return x.new_empty(x.shape[0], weight.shape[0] - 2 * h_kv * d)


def decode_linear_path(rows: int, weight: torch.Tensor) -> str:
    """The path :func:`decode_linear` takes for ``rows`` rows of input to ``weight``:
    ``"triton"``, ``"triton-interpreter"`` or ``"torch"``."""
    path = kernel_path(weight.device, weight.dtype)
    if path != "torch" and (rows > MAX_ROWS or weight.stride(-1) != 1):
        return "torch"
    return path


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float_tensor("x", x, min_ndim=1)
    check_float_tensor("weight", weight, ndim=2)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim ({x.shape[-1]}) must equal weight's columns [N, K] "
            f"(K = {weight.shape[1]})"
        )
    if bias is not None:
        check_float_tensor("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must be [N] = [{weight.shape[0]}], got {list(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{name} must match x's dtype and device ({x.dtype}, {x.device}), got "
                f"{t.dtype}, {t.device}"
            )


def _check_like(name: str, t: torch.Tensor, x: torch.Tensor, shape: Sequence[int]) -> None:
    """``t`` is a float tensor of ``shape`` on ``x``'s device, in its dtype."""
    check_float_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if t.dtype != x.dtype or t.device != x.device:
        raise ValueError(
            f"{name} must match x's dtype and device ({x.dtype}, {x.device}), got "
            f"{t.dtype}, {t.device}"
        )


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous (itself where it already is): the kernel reads a bias, a norm weight
    and the partial sums at unit strides."""
    return None if t is None else t.contiguous()


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` as ``[rows, last]`` with a contiguous last dim (a view where it already is)."""
    t2 = t.reshape(rows, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check_eps(eps: object) -> None:
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float))
        or not math.isfinite(eps)
        or eps < 0
    ):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]ᵀ (+ bias [N])`` -> ``[..., N]``, as ``F.linear`` computes it
    (float32 accumulation, the output in ``x``'s dtype); the Triton weight stream where
    :func:`decode_linear_path` says so. ``residual [..., N]``: added to the output in the same
    pass (a decoder layer's residual stream after its down projection), before the one
    rounding to ``x``'s dtype; on the ``torch`` path, ``residual + F.linear(...)`` as the unfused
    layer computes it."""
    _check(x, weight, bias)
    n, k = weight.shape
    if residual is not None:
        _check_like("residual", residual, x, (*x.shape[:-1], n))
    rows = x.numel() // k if k else 0
    path = decode_linear_path(rows, weight)
    if path == "torch" or rows == 0:
        y = F.linear(x, weight, bias)
        return y if residual is None else residual + y
    announce("decode_linear", path, x.device)
    res = None if residual is None else _rows(residual, rows)
    return _decode_linear_op(_rows(x, rows), weight, _dense(bias), res).view(*x.shape[:-1], n)


def decode_linear_residual_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A projection, the residual add after it, and the first half of the RMS norm that
    follows, in one weight stream: ``h = residual + x Wᵀ (+ b)`` ``[..., N]`` (rounded once to
    ``x``'s dtype), ``hg = h ⊙ norm_weight`` (rounded) and ``sumsq [P, rows]`` float32, the sums
    of ``h²`` over ``P`` disjoint column stripes of each row (``P`` is the kernel's stripe count;
    1 on the ``torch`` path). Returns ``(h, hg, sumsq)``: :func:`decode_linear_swiglu` of
    ``hg`` with ``sumsq`` is the MLP's gate/up projection of ``rms_norm(h)`` (a Llama-family
    decoder layer's ``mlp(post_attention_layernorm(residual + o_proj(attn)))``), the norm's
    ``1 / rms`` applied to its accumulator: the norm costs no launch, and ``hg`` is read once.

    It differs from the unfused layer by where the norm rounds: that layer rounds
    ``h / rms(h)`` to ``x``'s dtype and then multiplies by ``norm_weight``; here ``h ⊙
    norm_weight`` is rounded and ``1 / rms`` scales a float32 sum."""
    _check(x, weight, bias)
    n, k = weight.shape
    _check_like("residual", residual, x, (*x.shape[:-1], n))
    _check_like("norm_weight", norm_weight, x, (n,))
    rows = x.numel() // k if k else 0
    path = decode_linear_path(rows, weight)
    if path == "torch" or rows == 0:
        h, hg, sumsq = _residual_norm_reference(x, weight, bias, residual, norm_weight)
        return h, hg, sumsq
    announce("decode_linear", path, x.device)
    h, hg, sumsq = _residual_norm_op(
        _rows(x, rows), weight, _dense(bias), _rows(residual, rows), _dense(norm_weight)
    )
    shape = (*x.shape[:-1], n)
    return h.view(shape), hg.view(shape), sumsq


def decode_linear_swiglu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    sumsq: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A SwiGLU MLP's gate and up projections as one weight stream: ``weight [2N, K]`` is
    ``[gate; up]`` (``bias [2N]`` likewise), ``[g | u] = s · x Wᵀ + b`` and the result is
    ``silu(g) * u`` ``[..., N]``, computed in float32 and rounded once. ``sumsq [P, rows]``
    (float32, as :func:`decode_linear_residual_norm` returns it): ``s = 1 / sqrt(Σ_p sumsq / K
    + eps)`` per row, the RMS norm's scale of the row ``x`` was made from; without it ``s = 1``.
    Each program streams the gate rows and the up rows of the same output columns into two
    accumulators, so ``silu(g) * u`` is its epilogue (no launch of its own, and the ``[rows,
    2N]`` intermediate is never written)."""
    _check(x, weight, bias)
    two_n, k = weight.shape
    if two_n % 2:
        raise ValueError(f"weight must be [gate; up], [2N, K], got {two_n} rows (odd)")
    rows = x.numel() // k if k else 0
    if sumsq is not None:
        check_float_tensor("sumsq", sumsq, ndim=2)
        if (
            sumsq.dtype != torch.float32
            or sumsq.shape[0] < 1
            or sumsq.shape[1] != rows
            or sumsq.device != x.device
        ):
            raise ValueError(
                f"sumsq must be float32 [P, rows] = [P, {rows}] (P >= 1) on {x.device} (the "
                f"partial sums decode_linear_residual_norm returns), got {sumsq.dtype} "
                f"{list(sumsq.shape)} on {sumsq.device}"
            )
    _check_eps(eps)
    path = decode_linear_path(rows, weight)
    if path == "torch" or rows == 0:
        return _swiglu_reference(x, weight, bias, sumsq, float(eps))
    announce("decode_linear", path, x.device)
    y = _swiglu_op(_rows(x, rows), weight, _dense(bias), _dense(sumsq), float(eps))
    return y.view(*x.shape[:-1], two_n // 2)


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` with column ``k`` multiplied by ``norm_weight[k]`` (in float32, rounded
    once to ``weight``'s dtype): the weight :func:`decode_linear_rms` takes for a projection of
    ``rms_norm(x) ⊙ norm_weight``. A new tensor; ``weight`` is unchanged."""
    check_float_tensor("weight", weight, ndim=2)
    check_float_tensor("norm_weight", norm_weight, ndim=1)
    if norm_weight.shape[0] != weight.shape[1] or norm_weight.device != weight.device:
        raise ValueError(
            f"norm_weight must be [K] = [{weight.shape[1]}] on {weight.device} (weight's "
            f"columns), got {list(norm_weight.shape)} on {norm_weight.device}"
        )
    return (weight.float() * norm_weight.float()).to(weight.dtype)


def decode_linear_rms(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """An RMS norm and the projection after it, in one weight stream: ``y = s · x Wᵀ (+ b)``
    ``[..., N]`` with ``s = 1 / sqrt(mean(x²) + eps)`` over each row of ``x [..., K]``, in
    float32, rounded once. ``weight`` holds the norm's weight folded into its columns
    (:func:`fold_norm_weight`), so ``y`` is the projection of ``rms_norm(x) ⊙ g`` (a
    Llama-family layer's ``q|k|v(input_layernorm(x))``). The kernel sums each row's squares
    from the tiles of ``x`` its weight stream loads, and scales the accumulator once: the norm
    costs no launch, and its output is never written.

    It differs from the unfused layer by where it rounds: that layer rounds ``x / rms(x)`` to
    ``x``'s dtype, multiplies by ``g`` (rounded) and then projects; here ``W ⊙ g`` is rounded
    once, and ``1 / rms`` scales a float32 sum."""
    _check(x, weight, bias)
    _check_eps(eps)
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    path = decode_linear_path(rows, weight)
    if path == "torch" or rows == 0:
        return _rms_reference(x, weight, bias, float(eps))
    announce("decode_linear", path, x.device)
    return _rms_op(_rows(x, rows), weight, _dense(bias), float(eps)).view(*x.shape[:-1], n)


def decode_linear_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    position: torch.Tensor,
    eps: float | None = None,
    advance: bool = True,
) -> torch.Tensor:
    """A decode step's q|k|v projection, rotary embedding and KV-cache write, in one weight
    stream. ``x [B, 1, K]`` (or ``[B, K]``) holds one new token per sequence; ``weight [N, K]``
    is the q, k and v projections stacked (``N = (Hq + 2·Hkv)·D``: ``Hq`` query heads, then
    ``Hkv`` key and ``Hkv`` value heads of ``D`` columns; ``bias [N]`` likewise);
    ``cos``/``sin`` (``[B, D]``, or ``[B, 1, D]`` as a rotary embedding module returns them;
    one row of ``D`` for all) the rotation of each sequence's position;
    ``k_cache``/``v_cache`` ``[B, Hkv, T, D]`` the layer's caches (a static cache's
    ``keys``/``values``), written at row ``position`` (a one-element int64 tensor on the
    device: a static cache layer's ``cumulative_length``), which ``advance`` then raises by
    one -- all on the device, nothing read on the host.

    The query and key heads are rotated as Llama-family models do (``x·cos + rotate_half(x)
    ·sin``, the halves of each head paired), in float32 on the accumulator; returns the
    rotated query ``[B, Hq·D]`` (``[B, 1, Hq·D]`` for a 3-D ``x``), in ``x``'s dtype. With
    ``eps`` (a float), ``weight`` holds an RMS norm's weight folded into its columns
    (:func:`fold_norm_weight`) and each row is scaled by ``1 / sqrt(mean(x²) + eps)`` as
    :func:`decode_linear_rms` does: a decoder layer's input norm, q|k|v projection, rotary
    embedding and cache write in one launch. A ``position`` at or past ``T`` writes nothing
    (it cannot be checked without a host read).

    On the Triton path (:func:`decode_linear_path`, and ``D/2`` a multiple of 16) each program
    streams the plain kernel's stripe of weight rows, half of them columns of one head's first
    half and half their partners ``D/2`` on, rotates the pairs in its epilogue and stores them
    where they go; the last program to
    finish raises ``position``. Elsewhere the float32 reference (:func:`_rope_reference`).
    It differs from the unfused layer by where it rounds: that layer rounds the projection to
    ``x``'s dtype before rotating; here the rotation runs on the float32 accumulator."""
    _check(x, weight, bias)
    if eps is not None:
        _check_eps(eps)
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[1] != 1):
        raise ValueError(
            f"x must be [B, K] or [B, 1, K] (one new token per sequence), got {list(x.shape)}"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float_tensor(name, cache, ndim=4)
        if cache.dtype != x.dtype or cache.device != x.device or cache.stride(-1) != 1:
            raise ValueError(
                f"{name} must be {x.dtype} on {x.device} with a unit stride along D (x's dtype "
                f"and device), got {cache.dtype} on {cache.device}, strides {cache.stride()}"
            )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {list(k_cache.shape)} and "
            f"{list(v_cache.shape)}"
        )
    b, h_kv, _, d = k_cache.shape
    if b != rows:
        raise ValueError(f"the caches hold {b} sequences, x {rows} rows: they must be equal")
    if d % 2 or n % d or n // d <= 2 * h_kv:
        raise ValueError(
            f"weight must be [(Hq + 2·Hkv)·D, K] with Hq >= 1 and D even (Hkv = {h_kv}, D = "
            f"{d} from the caches), got {n} rows"
        )
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_tensor(name, t)
        if t.numel() not in (d, b * d) or t.shape[-1] != d or t.device != x.device:
            raise ValueError(
                f"{name} must be [B, D] = [{b}, {d}] (or [B, 1, D]; one row of D for every "
                f"sequence) on {x.device}, got {list(t.shape)} on {t.device}"
            )
        # [B, D]; one row shared by every sequence is read through a stride of 0.
        tables.append(_rows(t, b) if t.numel() == b * d else _rows(t, 1).expand(b, d))
    if (
        not isinstance(position, torch.Tensor)
        or position.dtype != torch.int64
        or position.numel() != 1
        or position.device != x.device
    ):
        got = type(position).__name__
        if isinstance(position, torch.Tensor):
            got = f"{position.dtype} {shape_str(position)} on {position.device}"
        raise ValueError(
            f"position must be a one-element int64 tensor on {x.device} (a static cache "
            f"layer's cumulative_length), got {got}"
        )
    path = decode_linear_path(rows, weight)
    x2 = _rows(x, rows)
    args = (x2, weight, _dense(bias), *tables, k_cache, v_cache, position)
    extra = (None if eps is None else float(eps), bool(advance))
    if path == "torch" or (d // 2) % 16:
        q = _rope_reference(*args, *extra)
    else:
        announce("decode_linear", path, x.device)
        q = _rope_op(*args, *extra)
    return q.view(*x.shape[:-1], n - 2 * h_kv * d)
