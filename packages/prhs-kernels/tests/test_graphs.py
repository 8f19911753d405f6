"""``prhs_kernels.graphs.run_if``: outside a capture the body runs; inside one (CUDA only) a
replay runs it only when the flag is true."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import graphs
from prhs_kernels.graphs import conditional_nodes_supported, run_if


def test_outside_a_capture_the_body_runs_whatever_the_flag():
    x = torch.zeros(3)
    for value in (False, True):
        with run_if(torch.tensor([value])) as conditional:
            x += 1
        assert conditional is False
    assert x.tolist() == [2.0, 2.0, 2.0]
    meta = torch.zeros(1, dtype=torch.bool, device="meta")
    with run_if(meta) as conditional:  # a shape-only run: nothing is read
        assert conditional is False


@pytest.mark.parametrize(
    "flag", [torch.tensor([1]), torch.zeros(2, dtype=torch.bool), torch.tensor(0.0), None]
)
def test_a_flag_that_is_not_one_bool_is_refused(flag):
    ran = []
    with pytest.raises(ValueError, match="one-element bool tensor"):
        with run_if(flag):
            ran.append(1)
    assert ran == []


def test_conditional_nodes_are_opt_in(monkeypatch):
    import importlib

    for value, want in (("", False), ("0", False), ("1", True), ("on", True)):
        monkeypatch.setenv("PRHS_GRAPH_CONDITIONALS", value)
        assert importlib.reload(graphs).ENABLED is want
    monkeypatch.delenv("PRHS_GRAPH_CONDITIONALS")
    assert importlib.reload(graphs).ENABLED is False


def test_support_is_a_property_of_the_build():
    assert isinstance(conditional_nodes_supported(), bool)
    if torch.version.cuda is None:
        assert not conditional_nodes_supported()


@pytest.mark.skipif(
    not torch.cuda.is_available() or not conditional_nodes_supported(),
    reason="needs CUDA with conditional graph nodes",
)
@pytest.mark.parametrize("enabled", [True, False])
def test_a_captured_body_runs_only_when_the_flag_is_true(monkeypatch, enabled):
    monkeypatch.setattr(graphs, "ENABLED", enabled)
    dev = torch.device("cuda")
    flag = torch.zeros(1, dtype=torch.bool, device=dev)
    x = torch.zeros(4, device=dev)
    after = torch.zeros(4, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with run_if(flag) as conditional:
            x.add_(1)
        after.add_(1)  # after the node: always
    assert conditional is enabled
    x.zero_()
    after.zero_()
    for value in (False, True, False, True, True):
        flag.fill_(value)
        g.replay()
    torch.cuda.synchronize()
    assert after.tolist() == [5.0] * 4
    assert x.tolist() == ([3.0] * 4 if enabled else [5.0] * 4)


def test_off_cuda_or_switched_off_a_forked_body_runs_in_order(monkeypatch):
    """``forked`` yields no stream off CUDA, or on CUDA with ``SIDE_STREAMS`` switched off
    (``PRHS_SIDE_STREAMS=0``): the body runs on the current stream and ``join(None)`` waits for
    nothing."""
    from prhs_kernels.graphs import forked, join, side_stream

    monkeypatch.setattr(graphs, "SIDE_STREAMS", True)
    assert side_stream("cpu") is None
    x = torch.zeros(2)
    with forked("cpu") as stream:
        x += 1
    join(stream)
    assert stream is None and x.tolist() == [1.0, 1.0]
    monkeypatch.setattr(graphs, "SIDE_STREAMS", False)
    assert side_stream("cuda:0") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), ("1", True), ("on", True), ("0", False), ("false", False), ("OFF", False)],
)
def test_side_streams_are_on_unless_the_environment_switches_them_off(value, expected):
    """``PRHS_SIDE_STREAMS`` is read at import: unset or anything but ``0`` / ``false`` /
    ``off`` leaves the side streams on (the default since they were checked on a GPU)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PRHS_SIDE_STREAMS"}
    if value is not None:
        env["PRHS_SIDE_STREAMS"] = value
    code = "import prhs_kernels.graphs as g; print(g.SIDE_STREAMS)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == str(expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_forked_body_overlaps_and_joins_in_a_captured_graph(monkeypatch):
    """On a side stream the body runs beside what the current stream queues next, eager and
    captured; after ``join`` the current stream sees what it wrote."""
    from prhs_kernels.graphs import forked, join

    monkeypatch.setattr(graphs, "SIDE_STREAMS", True)
    a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    b = torch.zeros_like(a)
    c = torch.zeros_like(a)
    out = torch.zeros(2, device="cuda")

    def step():
        with forked(a.device) as stream:
            b.copy_(a * 2)
        c.copy_(a + 1)
        join(stream)
        out.copy_(torch.stack([b.sum(), c.sum()]))

    step()
    want = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    b.zero_()
    c.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
