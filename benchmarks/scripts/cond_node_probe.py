"""Probe: does this torch build capture a CUDA-graph conditional (if) node, and what does one
cost against the kernels it would skip? Prints timings; writes nothing."""

import torch
import triton
import triton.language as tl


@triton.jit
def _touch(X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)


def main():
    x = torch.zeros(4096, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    pred = flag.view(torch.bool)[0]

    def body():
        for _ in range(3):
            _touch[(4,)](x, x.numel(), BLOCK=1024)

    body()
    torch.cuda.synchronize()
    g_cond, g_plain, g_none = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_cond):
        for _ in range(32):
            cur = torch.cuda.CUDAGraph.get_currently_capturing_graph()
            cur.begin_capture_to_if_node(pred)
            try:
                body()
            finally:
                cur.end_capture_to_conditional_node()
    with torch.cuda.graph(g_plain):
        for _ in range(32):
            body()
    with torch.cuda.graph(g_none):
        for _ in range(32):
            _touch[(1,)](x, 0, BLOCK=1024)
    x.zero_()
    g_cond.replay()
    torch.cuda.synchronize()
    print("flag 0: x sum", float(x.sum()), "(expect 0)")
    flag.fill_(1)
    g_cond.replay()
    torch.cuda.synchronize()
    print("flag 1: x sum", float(x.sum()), "(expect", 32 * 3 * 4096, ")")
    for name, g in (("plain 96 kernels", g_plain), ("32 empty kernels", g_none)):
        print(name, triton.testing.do_bench(g.replay, warmup=50, rep=300), "ms")
    for v in (0, 1):
        flag.fill_(v)
        print(f"32 if-nodes, flag {v}", triton.testing.do_bench(g_cond.replay, warmup=50, rep=300), "ms")


if __name__ == "__main__":
    main()
