"""The decode-size linear layer's Triton kernel against its float32 reference, under Triton's
interpreter (run by ``../test_triton.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prhs_kernels import paths
from prhs_kernels.gemm import (
    MAX_ROWS,
    _residual_norm_reference,
    _rms_reference,
    _rope_reference,
    _swiglu_reference,
    decode_linear,
    decode_linear_path,
    decode_linear_reference,
    decode_linear_residual_norm,
    decode_linear_rms,
    decode_linear_rope,
    decode_linear_swiglu,
    fold_norm_weight,
)
from prhs_kernels.gemm import triton as gemm_triton


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("lead", "n", "k", "bias"),
    [
        ((8,), 96, 256, False),  # whole tiles
        ((3,), 70, 200, True),  # a partial stripe of rows, a partial tile of columns
        ((2, 1), 48, 128, True),  # [B, 1, K] as a decoder layer passes it
        ((MAX_ROWS,), 33, 9000, False),  # long rows: the down projections' plan
        ((1,), 16, 64, True),
    ],
)
def test_decode_linear_is_f_linear(dtype, lead, n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    rows = x.numel() // k
    assert decode_linear_path(rows, w) == "triton-interpreter"
    got = decode_linear(x, w, b)
    assert got.shape == (*lead, n) and got.dtype == dtype
    # Float32 accumulation either way: at most the output dtype's rounding apart.
    torch.testing.assert_close(got, decode_linear_reference(x, w, b))
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, w, b).float(),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_a_strided_input_row_is_read_in_place_or_made_contiguous():
    x = torch.randn(4, 2 * 64).to(torch.bfloat16)[:, ::2]  # last dim not contiguous
    w = torch.randn(40, 64).to(torch.bfloat16)
    torch.testing.assert_close(decode_linear(x, w), decode_linear_reference(x, w))


def test_the_custom_op_compiles_as_one_opaque_call():
    x = torch.randn(4, 128).to(torch.bfloat16)
    w = torch.randn(80, 128).to(torch.bfloat16)
    fn = torch.compile(lambda t: decode_linear(t, w) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(x), decode_linear_reference(x, w) * 2)


def test_plans_are_static_functions_of_the_weight_shape():
    assert gemm_triton.plan(4096, 11008) == (32, 256, 4, 6)
    assert gemm_triton.plan(4096, 4096) == (64, 128, 4, 6)
    assert gemm_triton.plan(12288, 4096) == (64, 128, 4, 4)
    assert gemm_triton.plan(22016, 4096) == (64, 128, 4, 3)
    assert gemm_triton.plan(128256, 4096) == (64, 128, 4, 4)


# The epilogues. The interpreter truncates float32 to bf16 where a GPU rounds, so a result is up
# to one bf16 step (2⁻⁷ relative) off the reference's rounding, and sums of the truncated h²
# up to ~1 % under the reference's.
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}

EPILOGUE_SHAPES = [
    ((1,), 64, 128, True),  # one row, whole tiles
    ((3,), 70, 200, True),  # a partial stripe of rows, a partial tile of columns
    ((2, 1), 48, 128, False),  # [B, 1, K] as a decoder layer passes it
    ((MAX_ROWS,), 130, 64, True),  # every row the kernel takes; three stripes, the last of 2
]


def _draw(lead, n, k, bias, *, dtype=torch.bfloat16, weight_rows=None, seed=0):
    gen = torch.Generator().manual_seed(seed + n * k)
    rows = weight_rows or n
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    w = (torch.randn(rows, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype) if bias else None
    return gen, x, w, b


@pytest.mark.parametrize(("lead", "n", "k", "bias"), EPILOGUE_SHAPES)
def test_residual_is_added_before_the_one_rounding(lead, n, k, bias):
    gen, x, w, b = _draw(lead, n, k, bias)
    r = (4 * torch.randn(*lead, n, generator=gen)).to(x.dtype)
    got = decode_linear(x, w, b, residual=r)
    assert got.shape == (*lead, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, decode_linear_reference(x, w, b, r), **BF16_TOL)
    # A residual whose rows are strided (a slice of a wider stream) is read as its values.
    wide = (4 * torch.randn(*lead, 2 * n, generator=gen)).to(x.dtype)[..., ::2]
    got = decode_linear(x, w, b, residual=wide)
    torch.testing.assert_close(got, decode_linear_reference(x, w, b, wide), **BF16_TOL)


@pytest.mark.parametrize(("lead", "n", "k", "bias"), EPILOGUE_SHAPES)
def test_residual_norm_writes_h_hg_and_partial_sums_of_squares(lead, n, k, bias):
    gen, x, w, b = _draw(lead, n, k, bias)
    r = (4 * torch.randn(*lead, n, generator=gen)).to(x.dtype)
    g = (1 + 0.5 * torch.randn(n, generator=gen)).to(x.dtype)
    rows = x.numel() // k
    h, hg, sumsq = decode_linear_residual_norm(x, w, b, residual=r, norm_weight=g)
    ref_h, ref_hg, ref_sumsq = _residual_norm_reference(x, w, b, r, g)
    stripes = -(-n // gemm_triton.plan(n, k)[0])
    assert h.shape == hg.shape == (*lead, n) and h.dtype == hg.dtype == x.dtype
    assert sumsq.shape == (stripes, rows) and sumsq.dtype == torch.float32
    torch.testing.assert_close(h, ref_h, **BF16_TOL)
    torch.testing.assert_close(hg, ref_hg, **BF16_TOL)
    torch.testing.assert_close(sumsq.sum(0), ref_sumsq.sum(0), rtol=1e-2, atol=1e-3)
    # Against the kernel's own h: hg is h ⊙ g rounded once, and the sums are of the h written.
    hf = h.float().reshape(rows, n)
    torch.testing.assert_close(hg, (h.float() * g.float()).to(x.dtype), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(sumsq.sum(0), hf.pow(2).sum(-1), rtol=1e-5, atol=1e-5)
    # Each stripe's sum is of its own columns.
    width = gemm_triton.plan(n, k)[0]
    for p in range(stripes):
        part = hf[:, p * width : (p + 1) * width].pow(2).sum(-1)
        torch.testing.assert_close(sumsq[p], part, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize(("lead", "n", "k", "bias"), EPILOGUE_SHAPES)
def test_swiglu_is_silu_gate_times_up(lead, n, k, bias, scaled):
    gen, x, w, b = _draw(lead, n, k, bias, weight_rows=2 * n)
    rows = x.numel() // k
    # Three partial sums per row (a block of 4 in the kernel, one masked), of a row's scale.
    sumsq = k * torch.rand(3, rows, generator=gen) + 1.0 if scaled else None
    got = decode_linear_swiglu(x, w, b, sumsq=sumsq, eps=1e-5)
    assert got.shape == (*lead, n) and got.dtype == x.dtype
    ref = _swiglu_reference(x, w, b, sumsq, 1e-5)
    torch.testing.assert_close(got, ref, **BF16_TOL)
    # The reference is the definition: silu(s·x W_gᵀ + b_g) · (s·x W_uᵀ + b_u), in float32.
    s = 1.0 if sumsq is None else torch.rsqrt(sumsq.sum(0) / k + 1e-5).reshape(*lead, 1)
    y = torch.nn.functional.linear(x.float(), w.float()) * s
    y = y + (0 if b is None else b.float())
    gate, up = y[..., :n], y[..., n:]
    torch.testing.assert_close(got.float(), F.silu(gate) * up, **BF16_TOL)


@pytest.mark.parametrize(("lead", "n", "k", "bias"), EPILOGUE_SHAPES)
def test_rms_scales_each_row_by_its_own_rms_norm(lead, n, k, bias):
    gen, x, w, b = _draw(lead, n, k, bias)
    x = (x.float() * torch.rand(*lead, 1, generator=gen) * 4).to(x.dtype)  # rows of other norms
    got = decode_linear_rms(x, w, b, eps=1e-3)
    assert got.shape == (*lead, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, _rms_reference(x, w, b, 1e-3), **BF16_TOL)
    # The reference is the definition: x Wᵀ / sqrt(mean(x²) + eps) + b, in float32 -- the sum
    # of squares over all of K (a partial tile of K included), the eps inside the root.
    xf = x.float()
    want = F.linear(xf, w.float()) / (xf.pow(2).mean(-1, keepdim=True) + 1e-3).sqrt()
    want = want + (0 if b is None else b.float())
    torch.testing.assert_close(got.float(), want, **BF16_TOL)
    assert not torch.allclose(got, decode_linear(x, w, b), **BF16_TOL)  # it did scale


@pytest.mark.parametrize(("lead", "n", "k"), [((3,), 200, 70), ((2, 1), 96, 128), ((5,), 64, 300)])
def test_rms_of_a_folded_weight_is_the_layers_input_norm_and_projection(lead, n, k):
    """``q|k|v(rms_norm(x) ⊙ g)`` as one GEMM of ``x`` over ``W ⊙ g``, against float32."""
    gen = torch.Generator().manual_seed(n + k)
    eps = 1e-5
    x = (3 * torch.randn(*lead, k, generator=gen)).to(torch.bfloat16)
    g = (1 + 0.3 * torch.randn(k, generator=gen)).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    got = decode_linear_rms(x, fold_norm_weight(w, g), eps=eps)
    want = F.linear(F.rms_norm(x.float(), (k,), g.float(), eps), w.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_strided_bias_and_partial_sums_are_read_as_their_values():
    gen, x, w, _ = _draw((3,), 70, 200, False, weight_rows=140)
    b = torch.randn(280, generator=gen).to(x.dtype)[::2]  # a bias of stride 2
    sumsq = (200 * torch.rand(3, 5, generator=gen) + 1.0).t()  # [P, rows] = [5, 3], column-major
    assert not b.is_contiguous() and not sumsq.is_contiguous()
    got = decode_linear_swiglu(x, w, b, sumsq=sumsq)
    ref = _swiglu_reference(x, w, b, sumsq, 1e-6)
    torch.testing.assert_close(got, ref, **BF16_TOL)
    torch.testing.assert_close(decode_linear(x, w, b), decode_linear_reference(x, w, b))


@pytest.mark.parametrize(
    ("lead", "n", "k", "dtype"),
    [
        ((3,), 200, 70, torch.bfloat16),
        ((2, 1), 64, 128, torch.bfloat16),
        ((5,), 96, 64, torch.half),
    ],
)
def test_residual_norm_then_swiglu_is_the_layers_rms_norm_and_mlp(lead, n, k, dtype):
    """``h = o Wₒᵀ + residual``, ``rms_norm(h) · g``, then the MLP's gate/up, as two GEMMs."""
    gen = torch.Generator().manual_seed(n + k)
    f, eps = 96, 1e-5  # the MLP's width
    o = torch.randn(*lead, k, generator=gen).to(dtype)
    w_o = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    res = (3 * torch.randn(*lead, n, generator=gen)).to(dtype)
    g = (1 + 0.3 * torch.randn(n, generator=gen)).to(dtype)
    w_gu = (torch.randn(2 * f, n, generator=gen) / n**0.5).to(dtype)
    h, hg, sumsq = decode_linear_residual_norm(o, w_o, residual=res, norm_weight=g)
    got = decode_linear_swiglu(hg, w_gu, sumsq=sumsq, eps=eps)
    assert sumsq.shape[0] == -(-n // gemm_triton.plan(n, k)[0])
    # The unfused layer in float32, from the same inputs.
    hf = F.linear(o.float(), w_o.float()) + res.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()
    want = F.silu(F.linear(normed, w_gu[:f].float())) * F.linear(normed, w_gu[f:].float())
    torch.testing.assert_close(h.float(), hf, **BF16_TOL)
    # hg's rounding feeds every output: a few bf16 steps (its truncation here is biased), far
    # less in fp16.
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_the_epilogue_ops_compile_as_one_opaque_call_each():
    """A decoder layer's tail: o-proj + residual + norm, gate|up + SwiGLU, down-proj +
    residual: one call to each custom op in the traced graph, shapes from the fake kernels."""
    gen = torch.Generator().manual_seed(7)
    n, k, f = 96, 64, 80
    bf = torch.bfloat16
    w_o = (torch.randn(n, k, generator=gen) / k**0.5).to(bf)
    g = (1 + 0.3 * torch.randn(n, generator=gen)).to(bf)
    w_gu = (torch.randn(2 * f, n, generator=gen) / n**0.5).to(bf)
    w_d = (torch.randn(n, f, generator=gen) / f**0.5).to(bf)
    b_d = torch.randn(n, generator=gen).to(bf)

    w_i = (torch.randn(k, n, generator=gen) / n**0.5).to(bf)  # the next layer's input GEMM

    def tail(o, res):
        h, hg, sumsq = decode_linear_residual_norm(o, w_o, residual=res, norm_weight=g)
        m = decode_linear_swiglu(hg, w_gu, sumsq=sumsq, eps=1e-5)
        out = decode_linear(m, w_d, b_d, residual=h)
        return decode_linear_rms(out, w_i, eps=1e-5), sumsq

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    o = torch.randn(4, 1, k, generator=gen).to(bf)
    res = torch.randn(4, 1, n, generator=gen).to(bf)
    torch._dynamo.reset()
    got, sumsq = torch.compile(tail, backend=backend, fullgraph=True)(o, res)
    (gm,) = graphs
    called = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    prhs = sorted(t for t in called if "prhs." in t)
    assert prhs == [
        "prhs.decode_linear.default",
        "prhs.decode_linear_residual_norm.default",
        "prhs.decode_linear_rms.default",
        "prhs.decode_linear_swiglu.default",
    ], called
    want, want_sumsq = tail(o, res)
    assert sumsq.shape == want_sumsq.shape == (2, 4)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(sumsq, want_sumsq)


def test_the_swiglu_plan_is_static():
    """64 gate rows and their 64 up rows a program, 128-column tiles, 3 stages, at any shape
    (the H200 sweep's best at both Llama shapes' gate|up)."""
    for n, k in [(11008, 4096), (14336, 4096), (70, 200), (1, 1)]:
        assert gemm_triton.plan_swiglu(n, k) == (64, 128, 4, 3)


def _grids(monkeypatch) -> list:
    """The grids the decode GEMM is launched on, from now on (the launches go ahead)."""
    grids = []
    kernel = gemm_triton._kernel(True)

    class Seen:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gemm_triton, "_kernel", lambda interpret: Seen())
    return grids


def test_split_k_sums_its_slices_before_every_epilogue(monkeypatch):
    # One stripe of 1024 columns on the interpreter's 4 "multiprocessors": K in 4 slices of
    # 2 tiles, the last slice of the stripe summing them; the same numbers as one slice (the
    # epilogues -- bias, residual, norm output and partial sums, the row scale -- run once, on
    # the sum), and every counter back at 0.
    from prhs_kernels.sparse_decode import triton as sd

    monkeypatch.setitem(gemm_triton.TUNING, "min_tiles", 2)
    monkeypatch.setattr(sd, "_ARRIVALS", {})
    grids = _grids(monkeypatch)
    gen, x, w, b = _draw((5,), 60, 1024, True)
    r = (4 * torch.randn(5, 60, generator=gen)).to(x.dtype)
    g = (1 + 0.5 * torch.randn(60, generator=gen)).to(x.dtype)
    sumsq = torch.rand(3, 5, generator=gen) * 1024
    runs = {}
    for split in (True, False):
        monkeypatch.setitem(gemm_triton.TUNING, "split_k", split)
        runs[split] = (
            decode_linear(x, w, b),
            *decode_linear_residual_norm(x, w, b, residual=r, norm_weight=g),
            gemm_triton.decode_linear_triton(x, w, b, sumsq=sumsq, eps=1e-6)[0],
        )
    assert [gr[1] for gr in grids] == [4, 4, 4, 1, 1, 1]
    for got, want in zip(runs[True], runs[False], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[True][0], decode_linear_reference(x, w, b))
    (counters,) = sd._ARRIVALS.values()
    assert not counters.any()
    # The input norm's scale needs the whole row of x: that GEMM is never split.
    monkeypatch.setitem(gemm_triton.TUNING, "split_k", True)
    got = decode_linear_rms(x, w, b, eps=1e-6)
    assert grids[-1][1] == 1
    torch.testing.assert_close(got, _rms_reference(x, w, b, 1e-6), **BF16_TOL)


def test_split_k_is_a_static_function_of_the_shapes(monkeypatch):
    cuda132 = torch.device("cpu")
    monkeypatch.setitem(gemm_triton.TUNING, "split_k", True)
    monkeypatch.setattr(gemm_triton, "_multiprocessors", lambda device: 132)
    assert gemm_triton.split_k(64, 4096, 128, cuda132) == 2  # the Llama shapes' o projection
    assert gemm_triton.split_k(192, 4096, 128, cuda132) == 1  # Llama-2-7B's q|k|v
    assert gemm_triton.split_k(128, 11008, 256, cuda132) == 1  # down: a stripe per SM already
    assert gemm_triton.split_k(1, 512, 128, cuda132) == 1  # too few tiles to split
    monkeypatch.setitem(gemm_triton.TUNING, "split_k", False)
    assert gemm_triton.split_k(64, 4096, 128, cuda132) == 1


def _rope_case(b, h_q, h_kv, d, k, *, t=12, bias=False, shared_row=False, seed=0):
    """A q|k|v weight ``[(Hq + 2·Hkv)·D, K]``, inputs ``[B, 1, K]`` of rows of other norms, each
    sequence's rotation (``[B, 1, D]`` as Llama's rotary module gives it, or one row for all),
    and random caches ``[B, Hkv, T, D]``."""
    gen = torch.Generator().manual_seed(seed + 1000 * b + d + k)
    bf = torch.bfloat16
    n = (h_q + 2 * h_kv) * d
    x = (torch.randn(b, 1, k, generator=gen) * torch.rand(b, 1, 1, generator=gen) * 4).to(bf)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(bf)
    bias_t = torch.randn(n, generator=gen).to(bf) if bias else None
    angles = torch.rand(1 if shared_row else b, 1, d // 2, generator=gen) * 40
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(bf), emb.sin().to(bf)
    caches = [torch.randn(b, h_kv, t, d, generator=gen).to(bf) for _ in range(2)]
    return x, w, bias_t, cos, sin, caches


def _rope_definition(x, w, bias, cos, sin, h_kv, d, eps):
    """What a Llama layer computes, in float32: the input RMS norm (its weight folded into
    ``w``), the q|k|v projection, and ``x·cos + rotate_half(x)·sin`` on the q and k heads."""
    b = x.shape[0]
    xf = x.float().reshape(b, -1)
    y = F.linear(xf, w.float())
    if eps is not None:
        y = y / (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    if bias is not None:
        y = y + bias.float()
    heads = y.view(b, -1, d)
    h_q = heads.shape[1] - 2 * h_kv
    c = cos.float().reshape(-1, 1, d)
    s = sin.float().reshape(-1, 1, d)

    def rotate(t):
        return t * c + torch.cat((-t[..., d // 2 :], t[..., : d // 2]), dim=-1) * s

    return rotate(heads[:, :h_q]), rotate(heads[:, h_q : h_q + h_kv]), heads[:, h_q + h_kv :]


@pytest.mark.parametrize(
    ("b", "h_q", "h_kv", "d", "k", "bias", "eps", "shared_row"),
    [
        (3, 4, 2, 32, 96, False, 1e-5, False),  # GQA, a partial tile of K, the input norm
        (2, 2, 2, 64, 128, True, 1e-3, True),  # MHA, biases, one cos/sin row for all sequences
        (1, 4, 1, 32, 64, False, None, False),  # one sequence, no norm
        (MAX_ROWS, 2, 1, 32, 64, True, 1e-6, False),  # every row the kernel takes
    ],
)
def test_rope_gemm_rotates_q_and_k_and_writes_k_and_v_at_the_position(
    b, h_q, h_kv, d, k, bias, eps, shared_row
):
    x, w, bias_t, cos, sin, (kc, vc) = _rope_case(b, h_q, h_kv, d, k, bias=bias,
                                                  shared_row=shared_row)  # fmt: skip
    k_before, v_before = kc.clone(), vc.clone()
    pos = torch.tensor(5)
    assert decode_linear_path(b, w) == "triton-interpreter"
    got = decode_linear_rope(x, w, bias_t, cos=cos, sin=sin, k_cache=kc, v_cache=vc,
                             position=pos, eps=eps)  # fmt: skip
    assert got.shape == (b, 1, h_q * d) and got.dtype == x.dtype
    assert int(pos) == 6  # advanced once, by the last program
    assert int(gemm_triton._arrivals(x.device, 1)[0]) == 0  # the counter back at 0
    q, key, value = _rope_definition(x, w, bias_t, cos, sin, h_kv, d, eps)
    torch.testing.assert_close(got.float().view(b, h_q, d), q, **BF16_TOL)
    torch.testing.assert_close(kc[:, :, 5].float(), key, **BF16_TOL)
    torch.testing.assert_close(vc[:, :, 5].float(), value, **BF16_TOL)
    # Every other row of the caches is as it was.
    others = torch.arange(kc.shape[2]) != 5
    assert torch.equal(kc[:, :, others], k_before[:, :, others])
    assert torch.equal(vc[:, :, others], v_before[:, :, others])
    # The float32 reference computes the same, to one rounding.
    kc2, vc2, pos2 = k_before.clone(), v_before.clone(), torch.tensor(5)
    cos2 = cos.reshape(-1, d).expand(b, d)
    sin2 = sin.reshape(-1, d).expand(b, d)
    want = _rope_reference(x.view(b, k), w, bias_t, cos2, sin2, kc2, vc2, pos2, eps, True)
    torch.testing.assert_close(got.view(b, -1), want, **BF16_TOL)
    torch.testing.assert_close(kc, kc2, **BF16_TOL)
    torch.testing.assert_close(vc, vc2, **BF16_TOL)
    assert int(pos2) == 6


def test_rope_gemm_of_a_folded_weight_is_the_layers_norm_projection_and_rotation():
    """Through transformers' own ``apply_rotary_pos_emb`` and ``StaticLayer.update``, in float32
    (the unfused layer's path), against the one bf16 launch."""
    from transformers.cache_utils import StaticLayer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, h_q, h_kv, d, k, eps = 2, 4, 2, 32, 64, 1e-5
    x, w, _, cos, sin, (kc, vc) = _rope_case(b, h_q, h_kv, d, k)
    g = (1 + 0.3 * torch.randn(k, generator=torch.Generator().manual_seed(3))).to(x.dtype)
    layer = StaticLayer(max_cache_len=kc.shape[2])
    layer.lazy_initialization(kc.float(), vc.float())
    layer.keys.copy_(kc.float())
    layer.values.copy_(vc.float())
    layer.cumulative_length.fill_(7)
    y = F.linear(F.rms_norm(x.float(), (k,), g.float(), eps), w.float())
    q, key, value = y.view(b, 1, -1, d).transpose(1, 2).split([h_q, h_kv, h_kv], dim=1)
    q, key = apply_rotary_pos_emb(q, key, cos.float(), sin.float())
    layer.update(key, value)
    pos = torch.tensor(7)
    got = decode_linear_rope(x, fold_norm_weight(w, g), cos=cos, sin=sin, k_cache=kc,
                             v_cache=vc, position=pos, eps=eps)  # fmt: skip
    torch.testing.assert_close(got.float().view(b, h_q, d), q[:, :, 0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kc.float(), layer.keys, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(vc.float(), layer.values, rtol=2e-2, atol=2e-2)
    assert int(pos) == int(layer.cumulative_length) == 8


def test_rope_gemm_writes_nothing_at_or_past_the_capacity_and_may_leave_the_position():
    x, w, _, cos, sin, (kc, vc) = _rope_case(2, 2, 1, 32, 64, t=6)
    k_before, v_before = kc.clone(), vc.clone()
    pos = torch.tensor(6)
    q = decode_linear_rope(x, w, cos=cos, sin=sin, k_cache=kc, v_cache=vc, position=pos)
    assert torch.equal(kc, k_before) and torch.equal(vc, v_before) and int(pos) == 7
    want, _, _ = _rope_definition(x, w, None, cos, sin, 1, 32, None)
    torch.testing.assert_close(q.float().view(2, 2, 32), want, **BF16_TOL)  # q all the same
    pos = torch.tensor(2)
    decode_linear_rope(x, w, cos=cos, sin=sin, k_cache=kc, v_cache=vc, position=pos,
                       advance=False)  # fmt: skip
    assert int(pos) == 2 and not torch.equal(kc[:, :, 2], k_before[:, :, 2])


def test_rope_gemm_launches_the_plain_plans_stripes_each_half_in_a_heads_first_half(monkeypatch):
    """Each program streams BLOCK_N weight rows, BLOCK_N/2 columns of a head's first half and
    their partners: the plain kernel's grid (its stripes of 64 rows), BLOCK_N cut down until
    its half divides D/2."""
    grids = _grids(monkeypatch)
    for d, h_q, h_kv in ((32, 4, 2), (64, 2, 2)):
        x, w, _, cos, sin, (kc, vc) = _rope_case(2, h_q, h_kv, d, 64)
        decode_linear_rope(x, w, cos=cos, sin=sin, k_cache=kc, v_cache=vc,
                           position=torch.tensor(0))  # fmt: skip
    assert grids == [(8 * 32 // 32, 1), (6 * 64 // 64, 1)]
    assert gemm_triton.plan_rope(12288, 4096, 128) == gemm_triton.plan(12288, 4096)
    assert gemm_triton.plan_rope(6144, 4096, 32)[0] == 32
    assert gemm_triton.plan_rope(6144, 4096, 2)[0] == 2


def test_rope_under_torch_compile_is_one_call_that_writes_the_caches():
    """The op is ``prhs::decode_linear_rope``, declared to mutate the caches and the position:
    traced, it stays one call, and the compiled function writes what the eager one does."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def step(x, w, cos, sin, kc, vc, pos):
        return decode_linear_rope(x, w, cos=cos, sin=sin, k_cache=kc, v_cache=vc, position=pos,
                                  eps=1e-5)  # fmt: skip

    def inputs():
        x, w, _, cos, sin, (kc, vc) = _rope_case(2, 2, 1, 32, 64)
        return dict(x=x, weight=w, cos=cos, sin=sin, k_cache=kc, v_cache=vc,
                    position=torch.tensor(3))  # fmt: skip

    names = ("x", "weight", "cos", "sin", "k_cache", "v_cache", "position")
    a, b = inputs(), inputs()
    want = step(*(b[k] for k in names))  # eager first: the path is announced (logged) once
    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(*(a[k] for k in names))
    (gm,) = graphs
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert called.count("prhs.decode_linear_rope.default") == 1, called
    torch.testing.assert_close(got, want)
    for name in ("k_cache", "v_cache", "position"):
        torch.testing.assert_close(a[name], b[name])
    assert int(a["position"]) == 4
