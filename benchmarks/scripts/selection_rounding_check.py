"""Why prhs decodes differ with and without the rotary epilogue (the GPU decode check found the
second layer's K/V apart under prhs, not under dense): the epilogue rotates the query in float32
and rounds once; transformers rounds, rotates in bf16 and rounds again. This measures how many
of a CIS retrieval's top-128 blocks (blocks of 8, Llama-3-8B heads, B8·T4k, random keys) change
under that difference alone. CPU, a few seconds:

    python benchmarks/scripts/selection_rounding_check.py
"""

import torch
from transformers.models.llama.modeling_llama import rotate_half

from prhs_core.layout import ContiguousKV
from prhs_kernels.cis import retrieval_block_scores, top_blocks

torch.manual_seed(0)
B, Hq, Hkv, D, K, T = 8, 32, 8, 128, 4096, 4096
for name, wscale in (("random weights (std 0.02)", 0.02),):
    x = torch.randn(B, K).bfloat16()
    w = (torch.randn(Hq * D, K) * wscale).bfloat16()
    ang = torch.rand(B, D // 2) * 6.28
    cos = torch.cat([ang.cos()] * 2, -1)
    sin = torch.cat([ang.sin()] * 2, -1)
    acc = x.float() @ w.float().T  # float32 accumulator
    qa = acc.view(B, Hq, D)
    fused = (qa * cos[:, None] + rotate_half(qa) * sin[:, None]).bfloat16()  # rotate, round once
    qb = acc.bfloat16().view(B, Hq, D)  # round, rotate in bf16 (transformers)
    unfused = qb * cos[:, None].bfloat16() + rotate_half(qb) * sin[:, None].bfloat16()
    rel = ((fused.float() - unfused.float()).norm() / unfused.float().norm()).item()
    keys = torch.randn(B, Hkv, T, D).bfloat16()
    kv = ContiguousKV(keys, keys, torch.full((B,), T, dtype=torch.int32))
    act = torch.ones(B, Hkv, dtype=torch.bool)
    out = []
    for q in (fused, unfused):
        s = retrieval_block_scores(q, kv, D**-0.5, act, block_size=8, n_sink=4, n_local=32)
        out.append(top_blocks(s, 128, act)[0])
    a, b = out
    same = [
        len(set(a[i, j].tolist()) & set(b[i, j].tolist())) / 128
        for i in range(B)
        for j in range(Hkv)
    ]
    print(
        f"{name}: query relative difference {rel:.2e}; top-128 blocks shared "
        f"{sum(same) / len(same):.1%} on average, min {min(same):.1%}"
    )
