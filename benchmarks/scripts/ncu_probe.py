"""A small driver for Nsight Compute: the sparse attention kernel (1024 positions as 128 blocks of
8) and the retrieval (10 % and 100 % of rows) at B16·T16k, Hq 32, Hkv 8, D 128, bf16, each run a
few times. Run it under ``ncu --clock-control none --kernel-name regex:... python ...``."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as kb

from prhs_kernels.score import retrieval_probs
from prhs_kernels.sparse_decode import sparse_decode_attention

b, t, hq, hkv = 16, 16384, 32, 8
gen = torch.Generator(device="cuda").manual_seed(0)
lens = [t] * b
kv = kb.contiguous(b, hkv, t, lens, padded=False, gen=gen)
q = torch.randn(b, hq, kb.D, generator=gen, device="cuda").to(kb.DTYPE)
sel = kb.block_selection(b, hkv, lens, 128, 8, gen)
out = torch.empty_like(q)
lse = torch.empty(b, hq, device="cuda")
probs = torch.empty(b, hkv, t, device="cuda")
act10 = torch.zeros(b * hkv, dtype=torch.bool, device="cuda")
act10[:13] = True
act10 = act10[torch.randperm(b * hkv, device="cuda")].view(b, hkv)
act100 = torch.ones(b, hkv, dtype=torch.bool, device="cuda")
for _ in range(4):
    sparse_decode_attention(q, kv, sel, kb.SCALING, out=out, lse=lse)
    retrieval_probs(q, kv, kb.SCALING, act10, out=probs)
    retrieval_probs(q, kv, kb.SCALING, act100, out=probs)
torch.cuda.synchronize()
print("done")
