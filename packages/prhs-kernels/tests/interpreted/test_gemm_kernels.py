"""The decode-size linear layer's Triton kernel against its float32 reference, under Triton's
interpreter (run by ``../test_triton.py``)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.gemm import MAX_ROWS, decode_linear, decode_linear_path, decode_linear_reference
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
