"""GPU timing for benchmarks: Triton's ``do_bench`` median, behind one function, so packages
that must not import Triton themselves (prhs-eval) time GPU code the way the kernels do."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["median_ms"]


def median_ms(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device, by
    ``triton.testing.do_bench`` (``warmup_ms`` of warm-up calls, then ``rep_ms`` of timed ones,
    the L2 cache flushed between them). CUDA only: a CPU has no events to time with."""
    if not torch.cuda.is_available():
        raise RuntimeError("median_ms times CUDA work: no CUDA device here")
    if warmup_ms < 0 or rep_ms <= 0:
        raise ValueError(f"warmup_ms must be >= 0 and rep_ms > 0, got {warmup_ms}, {rep_ms}")
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
