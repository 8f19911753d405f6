"""GPU timing for benchmarks: Triton's ``do_bench`` median, behind one function, so packages
that must not import Triton themselves (prhs-eval) time GPU code the way the kernels do; and a
window of consecutive calls timed by CUDA events, for work whose calls differ by design; and a
burst of calls replayed from one CUDA graph, for launches whose own cost is what is measured."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Window", "graph_ms", "median_ms", "window_ms"]


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


@dataclass(frozen=True)
class Window:
    """A run of consecutive calls timed by :func:`window_ms`: ``mean_ms`` (the window's elapsed
    time over its calls: what a stream of such calls sustains) and ``median_ms`` (the median
    call), and each call's milliseconds (``per_call_ms``)."""

    mean_ms: float
    median_ms: float
    per_call_ms: tuple[float, ...]


def window_ms(fn: Callable[[], object], calls: int, *, warmup: int = 0) -> Window:
    """Time ``calls`` consecutive calls of ``fn()`` on the current CUDA device, back to back (no
    cache flush, no host wait between them), with a CUDA event after each, after ``warmup``
    untimed calls.

    For work whose calls differ from one another by design -- a decode step that retrieves once
    in a while and reuses in between -- the median of separately timed calls
    (:func:`median_ms`) is the common call's time and leaves the rare expensive ones out; the
    window's mean counts each as often as it ran. Choose ``calls`` a multiple of the period when
    there is one. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("window_ms times CUDA work: no CUDA device here")
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be an int >= 1, got {calls!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    for _ in range(warmup):
        fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for e in events[1:]:
        fn()
        e.record()
    events[-1].synchronize()
    per_call = tuple(a.elapsed_time(b) for a, b in itertools.pairwise(events))
    total = events[0].elapsed_time(events[-1])
    return Window(total / calls, float(statistics.median(per_call)), per_call)


def graph_ms(
    fns: Sequence[Callable[[], object]], *, warmup_ms: float = 20.0, rep_ms: float = 100.0
) -> float:
    """Median milliseconds of one call of each of ``fns``, back to back in one CUDA graph
    (each called once eagerly on a side stream, then captured in order; :func:`median_ms` of
    the replay): what launches cost with no host in between, as a decode step replays them.
    Each function must be capturable (no host read, static shapes). CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("graph_ms times CUDA work: no CUDA device here")
    if not fns:
        raise ValueError("graph_ms needs at least one function to capture")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return median_ms(graph.replay, warmup_ms=warmup_ms, rep_ms=rep_ms)
