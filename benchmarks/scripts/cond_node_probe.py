"""Probe: what a CUDA-graph conditional node (``prhs_kernels.graphs.run_if``) costs against the
kernels it would skip. Needs a torch build with the API (``conditional_nodes_supported()``);
prints timings, writes nothing.

    PRHS_GRAPH_CONDITIONALS=1 python benchmarks/scripts/cond_node_probe.py
"""

import sys

import torch
import triton
import triton.language as tl

from prhs_kernels import graphs


@triton.jit
def _touch(X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)


def main() -> int:
    if not graphs.conditional_nodes_supported():
        print(f"torch {torch.__version__} cannot capture conditional nodes")
        return 1
    graphs.ENABLED = True
    x = torch.zeros(4096, device="cuda")
    flag = torch.zeros(1, dtype=torch.bool, device="cuda")

    def body():
        for _ in range(3):
            _touch[(4,)](x, x.numel(), BLOCK=1024)

    body()
    torch.cuda.synchronize()
    g_cond, g_plain = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_cond):
        for _ in range(32):
            with graphs.run_if(flag):
                body()
    with torch.cuda.graph(g_plain):
        for _ in range(32):
            body()
    for value in (False, True):
        x.zero_()
        flag.fill_(value)
        g_cond.replay()
        torch.cuda.synchronize()
        print(f"flag {value}: x sum {float(x.sum())} (expect {value * 32 * 3 * 4096})")
    print("96 kernels, plain:", triton.testing.do_bench(g_plain.replay, warmup=50, rep=300), "ms")
    for value in (False, True):
        flag.fill_(value)
        ms = triton.testing.do_bench(g_cond.replay, warmup=50, rep=300)
        print(f"32 if-nodes of 3 kernels, flag {value}: {ms} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
