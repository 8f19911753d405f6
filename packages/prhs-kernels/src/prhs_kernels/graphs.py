"""Kernels that a captured decode step skips when a device flag says they have nothing to do.

A CUDA graph replays every kernel it captured, each one at least a launch (1-3 µs on an H200)
even when it finds no work. A CIS layer step where no row retrieves (with ``tau=-1`` a row
retrieves once every ``n_local`` steps; at a real model's 20-25 % per row, a batch rarely has
no retrieving row) would still launch its retrieval's three kernels (scores, block scores,
top-k). :func:`run_if` captures such kernels into a CUDA-graph *conditional node*: at each
replay the graph reads a one-element bool on the device and runs the body only when it is true,
with no host read.

The body must be correct whether it runs or not when the flag is false -- the flag only says
when running it would change nothing -- because outside a capture (eager, on the CPU, on ``meta``
tensors, on a torch build without conditional nodes, or with :data:`ENABLED` off -- the
default) it always runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from prhs_core.checks import check_flag

__all__ = [
    "ENABLED",
    "SIDE_STREAMS",
    "conditional_nodes_supported",
    "forked",
    "join",
    "run_if",
    "side_stream",
]

ENABLED = os.environ.get("PRHS_GRAPH_CONDITIONALS", "0").strip().lower() in ("1", "true", "on")
"""Capture :func:`run_if` bodies into conditional nodes where the build supports them. Off by
default (``PRHS_GRAPH_CONDITIONALS=1`` in the environment turns it on) until it has been
measured on a GPU: the H200 prhs is benchmarked on runs torch 2.11, which lacks the API
(``CUDAGraph.begin_capture_to_if_node``, in later releases). Module-level so that a benchmark
can compare a step with and without: set it before capturing."""


@functools.cache
def conditional_nodes_supported() -> bool:
    """Whether this torch build captures conditional nodes: a CUDA (not ROCm) build of CUDA 12.4
    or later whose ``CUDAGraph`` has ``begin_capture_to_if_node`` and
    ``get_currently_capturing_graph``."""
    cuda = torch.version.cuda
    if cuda is None or torch.version.hip is not None:
        return False
    major, minor = (int(x) for x in cuda.split(".")[:2])
    graph = torch.cuda.CUDAGraph
    api = ("begin_capture_to_if_node", "end_capture_to_conditional_node",
           "get_currently_capturing_graph")  # fmt: skip
    return (major, minor) >= (12, 4) and all(hasattr(graph, name) for name in api)


@contextlib.contextmanager
def run_if(flag: torch.Tensor) -> Iterator[bool]:
    """Run the body's kernels only when ``flag`` (a one-element bool tensor) is true at replay.

    Inside a CUDA-graph capture on the flag's device (and :func:`conditional_nodes_supported`,
    :data:`ENABLED`), the body is captured into an ``if`` node whose predicate is read from
    ``flag`` each replay; yields ``True``. Anywhere else the body simply runs; yields ``False``.
    The body's outputs are written in place or allocated inside it: a skipped body leaves them as
    they were, so nothing downstream may read them when the flag is false.
    """
    check_flag("run_if's flag", flag)
    capturing = (
        ENABLED
        and flag.device.type == "cuda"
        and conditional_nodes_supported()
        and torch.cuda.is_current_stream_capturing()
    )
    if not capturing:
        yield False
        return
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(flag.view(()))
    try:
        yield True
    finally:
        graph.end_capture_to_conditional_node()


SIDE_STREAMS = os.environ.get("PRHS_SIDE_STREAMS", "1").strip().lower() not in ("0", "false", "off")
"""Let :func:`forked` run its body on a side stream. On by default (``PRHS_SIDE_STREAMS=0`` in the
environment turns it off): on an H100 (2026-12-08) a captured CIS step with the re-ranking on
the side stream equals eager bit for bit, and a layer step at the defaults took 0.143 ms
against 0.177 at B1·T16k, 0.270 against 0.300 at B16·T16k, 0.424 against 0.447 at B16·T64k.
Module-level so that a benchmark can compare a step with and without: set it before
capturing."""


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def side_stream(device: torch.device | str) -> torch.cuda.Stream | None:
    """The side stream of a CUDA ``device`` (one per device, created at its first use), or
    ``None`` off CUDA or with :data:`SIDE_STREAMS` off."""
    device = torch.device(device)
    if device.type != "cuda" or not SIDE_STREAMS:
        return None
    return _side_stream(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def forked(device: torch.device | str) -> Iterator[torch.cuda.Stream | None]:
    """Run the body's kernels on ``device``'s side stream, after everything queued so far on the
    current stream, so that they overlap what the current stream queues next; yields that
    stream (``None``: no side stream, :func:`side_stream`, and the body runs in order on the
    current stream). In a CUDA-graph capture the body becomes a parallel branch of the graph.
    The caller must :func:`join` the stream before anything reads what the body wrote, keep
    every tensor the body reads that the current stream allocated alive until then, and give
    the body no tensor the current stream writes meanwhile. No host synchronisation."""
    stream = side_stream(device)
    if stream is None:
        yield None
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield stream


def join(stream: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for everything queued on ``stream`` (from :func:`forked`;
    ``None``: nothing to wait for)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)
