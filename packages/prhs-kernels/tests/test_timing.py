"""prhs_kernels.timing: the GPU timer benchmarks share."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.timing import graph_ms, median_ms, window_ms


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_window_ms_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        window_ms(lambda: None, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_window_ms_counts_the_rare_expensive_call():
    x = torch.empty(1 << 24, device="cuda")
    y = torch.empty_like(x)
    calls = []

    def fn():  # every 8th call copies 16 times
        calls.append(1)
        for _ in range(16 if len(calls) % 8 == 0 else 1):
            y.copy_(x)

    w = window_ms(fn, 32, warmup=8)
    assert len(w.per_call_ms) == 32 and len(calls) == 40
    assert w.mean_ms > 1.5 * w.median_ms  # the median leaves the four long calls out
    assert abs(sum(w.per_call_ms) / 32 - w.mean_ms) < 0.05 * w.mean_ms
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="calls"):
            window_ms(fn, bad)
    with pytest.raises(ValueError, match="warmup"):
        window_ms(fn, 4, warmup=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_graph_ms_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        graph_ms([lambda: None])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_ms_times_a_burst_of_copies():
    x = torch.empty(1 << 22, device="cuda")
    ys = [torch.empty_like(x) for _ in range(4)]
    one = graph_ms([lambda: ys[0].copy_(x)], warmup_ms=5, rep_ms=20)
    four = graph_ms([lambda y=y: y.copy_(x) for y in ys], warmup_ms=5, rep_ms=20)
    assert 0 < one < four
    with pytest.raises(ValueError, match="at least one function"):
        graph_ms([])
