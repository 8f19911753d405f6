"""The decode-size linear layer's launcher: which path it takes, and its input checks (the
Triton kernel itself is tested in ``interpreted/test_gemm_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.gemm import MAX_ROWS, decode_linear, decode_linear_path, decode_linear_reference


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
