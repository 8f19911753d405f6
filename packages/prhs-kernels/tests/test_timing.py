"""prhs_kernels.timing: the GPU timer benchmarks share."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.timing import median_ms


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_median_ms_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        median_ms(lambda: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_median_ms_times_a_copy():
    x = torch.empty(1 << 24, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), warmup_ms=5, rep_ms=20)
    assert 0 < ms < 100
    with pytest.raises(ValueError, match="rep_ms"):
        median_ms(lambda: None, rep_ms=0)
