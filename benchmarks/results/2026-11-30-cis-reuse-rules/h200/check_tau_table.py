"""H200 check of CIS's per-head tau (run from the repository root with the packages' src on
PYTHONPATH): the Triton decide against torch, and a tau-table CIS step on both paths."""

import sys

import torch

from prhs_kernels.cis import cis_decide

sys.path.insert(0, "benchmarks/scripts")
import kernels  # a benchmark script, found through the path above

torch.manual_seed(0)
b, h, g, d, n = 64, 8, 4, 128, 80
aq = torch.randn(n, h, g, d, device="cuda")
alen = torch.full((n, h), 4000, dtype=torch.int32, device="cuda")
slots = torch.randperm(n, device="cuda")[:b]
lens = torch.full((b,), 4010, dtype=torch.int32, device="cuda")
q = (aq[slots] + 0.6 * torch.randn(b, h, g, d, device="cuda")).reshape(b, h * g, d).bfloat16()
tau = torch.linspace(0.5, 1.01, h, device="cuda")
got, _ = cis_decide(q, aq, alen, slots, lens, tau=tau, n_local=32, path="triton")
want, _ = cis_decide(q, aq, alen, slots, lens, tau=tau, n_local=32, path="torch")
share = got.float().mean().item()
print("per-head decide triton==torch:", bool(torch.equal(got, want)), "retrieve share", share)
for j in range(h):
    col, _ = cis_decide(q, aq, alen, slots, lens, tau=float(tau[j]), n_local=32, path="triton")
    assert torch.equal(col[:, j], got[:, j]), j
print("columns equal scalar rule: True")
table = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01, 0.72], [0.72]]
kernels.check_selector_paths(None, "cis", {"budget": 256, "block_size": 1, "tau": table})
kernels.check_selector_paths(None, "cis", {"budget": 256, "block_size": 1})
