"""The decode-size linear layer's launcher and its epilogue variants: which path they take, what
the torch path computes, and their input checks (the Triton kernel itself is tested in
``interpreted/test_gemm_kernels.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prhs_kernels.gemm import (
    MAX_ROWS,
    decode_linear,
    decode_linear_path,
    decode_linear_reference,
    decode_linear_residual_norm,
    decode_linear_rms,
    decode_linear_rope,
    decode_linear_swiglu,
    fold_norm_weight,
)


def test_paths_by_device_dtype_rows_and_layout(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    assert decode_linear_path(4, w) == "torch"  # the CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decode_linear_path(MAX_ROWS, w) == "triton-interpreter"
    assert decode_linear_path(MAX_ROWS + 1, w) == "torch"  # prefill-sized: cuBLAS's GEMM
    assert decode_linear_path(4, w.float()) == "torch"
    assert decode_linear_path(4, w.t().contiguous().t()) == "torch"  # rows not contiguous
    monkeypatch.setenv("PRHS_KERNELS", "torch")
    assert decode_linear_path(4, w) == "torch"


def test_torch_path_is_f_linear(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, b = torch.randn(3, 1, 16), torch.randn(10, 16), torch.randn(10)
    torch.testing.assert_close(decode_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(decode_linear_reference(x, w, b), decode_linear(x, w, b))
    assert decode_linear(torch.randn(0, 16), w).shape == (0, 10)


@pytest.mark.parametrize(
    ("x", "w", "b", "message"),
    [
        (torch.randn(2, 8), torch.randn(4, 6), None, "must equal weight's columns"),
        (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), r"bias must be \[N\] = \[4\]"),
        (torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64), None, "match x's dtype"),
        (torch.randn(2, 8), torch.randn(2, 4, 8), None, "weight"),
        (torch.ones(2, 8, dtype=torch.long), torch.randn(4, 8), None, "x"),
    ],
)
def test_bad_input_is_a_clear_error(x, w, b, message):
    with pytest.raises((ValueError, TypeError), match=message):
        decode_linear(x, w, b)


@pytest.fixture
def _torch_path(monkeypatch):
    """CPU tensors without the interpreter: every op takes its torch path."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.usefixtures("_torch_path")
def test_torch_path_residual_is_added_to_f_linear():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 1, 16, generator=gen), torch.randn(10, 16, generator=gen), None
    r = torch.randn(3, 1, 10, generator=gen)
    torch.testing.assert_close(decode_linear(x, w, b, residual=r), r + F.linear(x, w))
    torch.testing.assert_close(decode_linear(x, w, residual=r), decode_linear_reference(x, w, b, r))
    # In bf16, as the unfused layer computes it: F.linear rounded, then the residual added.
    xb, wb, rb = x.bfloat16(), w.bfloat16(), r.bfloat16()
    assert torch.equal(decode_linear(xb, wb, residual=rb), rb + F.linear(xb, wb))


@pytest.mark.usefixtures("_torch_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_residual_norm_is_h_h_times_g_and_sums_of_squares(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 24, generator=gen).to(dtype)
    w, b = torch.randn(40, 24, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    r, g = torch.randn(2, 1, 40, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    h, hg, sumsq = decode_linear_residual_norm(x, w, b, residual=r, norm_weight=g)
    want = (F.linear(x.float(), w.float(), b.float()) + r.float()).to(dtype)  # rounded once
    assert torch.equal(h, want) and h.dtype == hg.dtype == dtype
    assert torch.equal(hg, (h.float() * g.float()).to(dtype))
    assert sumsq.shape == (1, 2) and sumsq.dtype == torch.float32  # one stripe, two rows
    torch.testing.assert_close(sumsq[0], h.float().pow(2).sum(-1).flatten())


@pytest.mark.usefixtures("_torch_path")
@pytest.mark.parametrize("bias", [False, True])
def test_torch_path_swiglu_is_silu_gate_times_up(bias):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 1, 16, generator=gen), torch.randn(2 * 12, 16, generator=gen)
    b = torch.randn(24, generator=gen) if bias else None
    y = F.linear(x, w, b)
    want = F.silu(y[..., :12]) * y[..., 12:]
    got = decode_linear_swiglu(x, w, b)
    assert got.shape == (3, 1, 12)
    torch.testing.assert_close(got, want)
    # With partial sums of squares: each row scaled by rsqrt(Σ sumsq / K + eps) before the bias.
    sumsq = torch.rand(4, 3, generator=gen) * 16 + 1
    s = torch.rsqrt(sumsq.sum(0) / 16 + 1e-3).reshape(3, 1, 1)
    y = F.linear(x, w) * s + (0 if b is None else b)
    want = F.silu(y[..., :12]) * y[..., 12:]
    torch.testing.assert_close(decode_linear_swiglu(x, w, b, sumsq=sumsq, eps=1e-3), want)


@pytest.mark.usefixtures("_torch_path")
def test_torch_path_residual_norm_then_swiglu_is_rms_norm_and_the_mlp():
    gen = torch.Generator().manual_seed(3)
    n, k, f, eps = 32, 24, 20, 1e-5
    o, w_o = torch.randn(4, 1, k, generator=gen), torch.randn(n, k, generator=gen)
    res, g = torch.randn(4, 1, n, generator=gen), torch.randn(n, generator=gen)
    w_gu = torch.randn(2 * f, n, generator=gen)
    h, hg, sumsq = decode_linear_residual_norm(o, w_o, residual=res, norm_weight=g)
    got = decode_linear_swiglu(hg, w_gu, sumsq=sumsq, eps=eps)
    hf = F.linear(o, w_o) + res
    normed = F.rms_norm(hf, (n,), g, eps)
    want = F.silu(F.linear(normed, w_gu[:f])) * F.linear(normed, w_gu[f:])
    torch.testing.assert_close(h, hf)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("_torch_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_rms_of_a_folded_weight_is_rms_norm_then_the_projection(dtype):
    gen = torch.Generator().manual_seed(4)
    n, k, eps = 20, 24, 1e-3
    x = (0.05 * torch.randn(4, 1, k, generator=gen)).to(dtype)  # mean square ~ eps: it counts
    w, b = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    g = torch.randn(k, generator=gen).to(dtype)
    folded = fold_norm_weight(w, g)
    assert folded.dtype == dtype and torch.equal(w, w.clone())  # a new tensor
    torch.testing.assert_close(folded, (w.float() * g.float()).to(dtype))
    got = decode_linear_rms(x, folded, b, eps=eps)
    assert got.shape == (4, 1, n) and got.dtype == dtype
    want = F.linear(F.rms_norm(x.float(), (k,), g.float(), eps), w.float(), b.float())
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    wrong_eps = decode_linear_rms(x, folded, b, eps=0.0)
    assert not torch.allclose(got.float(), wrong_eps.float(), **tol)


def test_fold_norm_weight_checks_its_shapes():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"norm_weight must be \[K\] = \[8\] on cpu"):
        fold_norm_weight(w, torch.randn(4))
    with pytest.raises(ValueError, match="norm_weight must have 1 dimension"):
        fold_norm_weight(w, torch.randn(1, 8))
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        fold_norm_weight(torch.randn(8), torch.randn(8))


def _bad_cases():
    x, w, w2 = torch.randn(3, 8), torch.randn(4, 8), torch.randn(6, 8)
    nw = torch.randn(4)
    ss = torch.rand(2, 3)
    linear = [
        ({"residual": torch.randn(3, 5)}, r"residual must be \[3, 4\], got \[3, 5\]"),
        ({"residual": torch.randn(4)}, r"residual must be \[3, 4\]"),
        ({"residual": torch.randn(3, 4).double()}, "residual must match x's dtype"),
        ({"residual": torch.ones(3, 4, dtype=torch.long)}, "residual must be a floating-point"),
    ]
    norm = [
        ({"residual": torch.randn(1, 3, 4), "norm_weight": nw}, r"residual must be \[3, 4\]"),
        (
            {"residual": torch.randn(3, 4), "norm_weight": torch.randn(5)},
            r"norm_weight must be \[4\]",
        ),
        (
            {"residual": torch.randn(3, 4), "norm_weight": torch.randn(1, 4)},
            r"norm_weight must be \[4\]",
        ),
        (
            {"residual": torch.randn(3, 4), "norm_weight": nw.half()},
            "norm_weight must match x's dtype",
        ),
    ]
    swiglu = [
        (w[:3], {}, r"weight must be \[gate; up\], \[2N, K\], got 3 rows \(odd\)"),
        (w2, {"sumsq": torch.rand(3)}, "sumsq must have 2 dimensions"),
        (w2, {"sumsq": torch.rand(2, 4)}, r"sumsq must be float32 \[P, rows\] = \[P, 3\]"),
        (w2, {"sumsq": torch.rand(0, 3)}, r"\(P >= 1\).*got torch.float32 \[0, 3\]"),
        (w2, {"sumsq": ss.bfloat16()}, r"sumsq must be float32 .* got torch.bfloat16"),
        (w2, {"sumsq": ss.double()}, r"sumsq must be float32 .* got torch.float64"),
        (w2, {"sumsq": torch.ones(2, 3, dtype=torch.int32)}, "sumsq must be a floating-point"),
        (w2, {"sumsq": ss, "eps": -1e-6}, "eps must be a finite float >= 0, got -1e-06"),
        (w2, {"sumsq": ss, "eps": float("nan")}, "eps must be a finite float >= 0, got nan"),
        (w2, {"sumsq": ss, "eps": float("inf")}, "eps must be a finite float >= 0, got inf"),
        (w2, {"eps": True}, "eps must be a finite float"),
        (w2, {"eps": torch.tensor(1e-6)}, "eps must be a finite float"),
    ]
    rms = [
        ({"eps": -1.0}, "eps must be a finite float >= 0, got -1.0"),
        ({"eps": float("nan")}, "eps must be a finite float >= 0, got nan"),
        ({"eps": None}, "eps must be a finite float"),
    ]
    cases = [(decode_linear, w, kw, m, "linear") for kw, m in linear]
    cases += [(decode_linear_rms, w, kw, m, "rms") for kw, m in rms]
    cases += [(decode_linear_rms, torch.randn(4, 7), {}, r"weight's columns \[N, K\]", "rms")]
    cases += [(decode_linear_residual_norm, w, kw, m, "norm") for kw, m in norm]
    cases += [(decode_linear_swiglu, ww, kw, m, "swiglu") for ww, kw, m in swiglu]
    return [
        pytest.param(op, x, ww, kw, m, id=f"{name}-{i}")
        for i, (op, ww, kw, m, name) in enumerate(cases)
    ]


@pytest.mark.parametrize(("op", "x", "w", "kwargs", "message"), _bad_cases())
def test_bad_epilogue_input_is_a_clear_error(op, x, w, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        op(x, w, **kwargs)


def test_swiglu_bias_is_both_halves():
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[6\], got \[3\]"):
        decode_linear_swiglu(x, w, torch.randn(3))


def _rope_inputs(b=2, h_q=4, h_kv=2, d=8, k=16, t=6):
    gen = torch.Generator().manual_seed(b + d + k)
    x = torch.randn(b, 1, k, generator=gen)
    w = torch.randn((h_q + 2 * h_kv) * d, k, generator=gen)
    angles = torch.rand(b, 1, d // 2, generator=gen) * 6
    emb = torch.cat([angles, angles], dim=-1)
    kc, vc = torch.randn(b, h_kv, t, d, generator=gen), torch.randn(b, h_kv, t, d, generator=gen)
    return dict(x=x, weight=w, cos=emb.cos(), sin=emb.sin(), k_cache=kc, v_cache=vc,
                position=torch.tensor(3))  # fmt: skip


def test_torch_path_rope_is_the_projection_rotated_and_written_to_the_caches(monkeypatch):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = _rope_inputs()
    kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
    q = decode_linear_rope(a.pop("x"), **a)
    x = _rope_inputs()["x"]
    y = F.linear(x, a["weight"]).view(2, 1, -1, 8).transpose(1, 2)
    q_want, k_want = apply_rotary_pos_emb(y[:, :4], y[:, 4:6], a["cos"], a["sin"])
    torch.testing.assert_close(q, q_want.transpose(1, 2).reshape(2, 1, 32))
    kc[:, :, 3:4], vc[:, :, 3:4] = k_want, y[:, 6:]
    torch.testing.assert_close(a["k_cache"], kc)
    torch.testing.assert_close(a["v_cache"], vc)
    assert int(a["position"]) == 4


_ROPE_BAD = [
    (dict(x=torch.randn(2, 3, 16)), "one new token per sequence"),
    (dict(k_cache=torch.randn(2, 2, 6, 8, dtype=torch.float64)), "k_cache must be torch.float32"),
    (dict(v_cache=torch.randn(2, 2, 7, 8)), "one shape"),
    (dict(k_cache=torch.randn(3, 2, 6, 8), v_cache=torch.randn(3, 2, 6, 8)), "3 sequences"),
    (dict(weight=torch.randn(4 * 8, 16)), r"\(Hq \+ 2·Hkv\)·D"),
    (dict(cos=torch.randn(2, 1, 6)), r"cos must be \[B, D\] = \[2, 8\]"),
    (dict(sin=torch.randn(3, 8)), r"sin must be \[B, D\]"),
    (dict(position=torch.tensor(3, dtype=torch.int32)), "one-element int64"),
    (dict(position=torch.tensor([3, 3])), "one-element int64"),
    (dict(position=3), "got int"),
    (dict(eps=-1.0), "eps must be"),
]


@pytest.mark.parametrize(("change", "message"), _ROPE_BAD)
def test_bad_rope_input_is_a_clear_error_and_writes_nothing(change, message):
    a = _rope_inputs() | change
    before = [t.clone() for t in (a["k_cache"], a["v_cache"])]
    pos = a["position"].clone() if isinstance(a["position"], torch.Tensor) else a["position"]
    with pytest.raises((ValueError, TypeError), match=message):
        decode_linear_rope(a.pop("x"), **a)
    assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])
    if isinstance(pos, torch.Tensor):
        assert torch.equal(a["position"], pos)


def test_rope_reads_nothing_on_the_host_meta_tensors_run_through():
    """On ``meta`` tensors (no values at all) the op runs from shapes alone, as a captured
    decode step needs; the query comes back as ``[B, 1, Hq·D]``."""
    a = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _rope_inputs().items()}
    q = decode_linear_rope(a.pop("x"), **a, eps=1e-6)
    assert q.device.type == "meta" and q.shape == (2, 1, 32)
