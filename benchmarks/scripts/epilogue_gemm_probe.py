"""A decoder layer's post-attention work in GEMM epilogues, on the GPU: each fused decode GEMM
(:mod:`prhs_kernels.gemm`'s ``decode_linear_residual_norm``, ``decode_linear_swiglu`` and
``decode_linear``'s ``residual``) against the plain GEMM plus the
Inductor kernel it replaces, on the Llama-2-7B / Llama-3-8B projections; with ``--sweep`` the
SwiGLU GEMM's plans (how :func:`prhs_kernels.gemm.triton.plan_swiglu` was chosen); then a
two-layer model's logits with and without :func:`prhs_eval.throughput.fused_layers`.

Each figure is the median of CUDA-graph replays of 16 calls over distinct weight copies (more
bytes than L2 holds), per call; errors are against the float32 references.

    python benchmarks/scripts/epilogue_gemm_probe.py [--sweep] --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from prhs_kernels.gemm import (
    _residual_norm_reference,
    _swiglu_reference,
    decode_linear,
    decode_linear_reference,
    decode_linear_residual_norm,
    decode_linear_swiglu,
)
from prhs_kernels.gemm.triton import decode_linear_triton, plan_swiglu
from prhs_kernels.timing import median_ms

# name: (N, K, fusion): "residual+norm" (o, then the residual add and the post-attention norm),
# "swiglu" (gate|up, then SiLU·mul), "residual" (down, then the residual add).
SHAPES = {
    "llama2 o": (4096, 4096, "residual+norm"),
    "llama2 gate|up": (22016, 4096, "swiglu"),
    "llama2 down": (4096, 11008, "residual"),
    "llama3 o": (4096, 4096, "residual+norm"),
    "llama3 gate|up": (28672, 4096, "swiglu"),
    "llama3 down": (4096, 14336, "residual"),
}
SWEEP = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4, 6)))
CALLS = 16
EPS = 1e-5


def graph_us(fn) -> float:
    """Median µs of one call, from a CUDA graph of ``CALLS`` of them (``fn(i)``: call i)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(CALLS):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i)
    return median_ms(g.replay, warmup_ms=10, rep_ms=60) / CALLS * 1e3


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMS norm."""
    xf = x.float()
    return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def probe_shape(name: str, n: int, k: int, how: str, m: int, sweep: bool) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=dt)
    row: dict = {"shape": name, "N": n, "K": k, "M": m, "fusion": how}
    rows = [row]
    if how == "residual+norm":
        r = torch.randn(m, n, device=dev, dtype=dt)
        g = torch.randn(n, device=dev, dtype=dt)
        got = decode_linear_residual_norm(x, ws[0], residual=r, norm_weight=g)
        want = _residual_norm_reference(x, ws[0], None, r, g)
        row["rel_err"] = max(rel(got[0], want[0]), rel(got[1], want[1]))
        row["sumsq_rel_err"] = rel(got[2].sum(0), want[2].sum(0))
        row["plain_us"] = graph_us(lambda i: decode_linear(x, ws[i % copies]))
        row["fused_us"] = graph_us(
            lambda i: decode_linear_residual_norm(x, ws[i % copies], residual=r, norm_weight=g)
        )
        add_norm = torch.compile(lambda y, res: rms_norm(y + res, g, EPS), dynamic=False)
        y0 = decode_linear(x, ws[0])
        row["replaced_us"] = graph_us(lambda i: add_norm(y0, r))
    elif how == "swiglu":
        ss = (x.float().pow(2).sum(-1)).reshape(1, m)
        got = decode_linear_swiglu(x, ws[0], sumsq=ss, eps=EPS)
        row["rel_err"] = rel(got, _swiglu_reference(x, ws[0], None, ss, EPS))
        row["plan"] = list(plan_swiglu(n // 2, k))
        row["plain_us"] = graph_us(lambda i: decode_linear(x, ws[i % copies]))
        row["fused_us"] = graph_us(
            lambda i: decode_linear_swiglu(x, ws[i % copies], sumsq=ss, eps=EPS)
        )
        half = n // 2
        silu = torch.compile(lambda t: F.silu(t[:, :half]) * t[:, half:], dynamic=False)
        gu = decode_linear(x, ws[0])
        row["replaced_us"] = graph_us(lambda i: silu(gu))
        if sweep:
            y = torch.empty(m, half, device=dev, dtype=dt)
            for launch in SWEEP:
                try:
                    us = graph_us(lambda i, launch=launch: decode_linear_triton(
                        x, ws[i % copies], None, launch, out=y, swiglu=True, sumsq=ss, eps=EPS
                    ))  # fmt: skip
                except Exception as e:  # a plan past shared memory
                    rows.append({**row, "sweep": list(launch), "error": type(e).__name__})
                    continue
                rows.append({"shape": name, "M": m, "sweep": list(launch), "us": us})
    else:
        r = torch.randn(m, n, device=dev, dtype=dt)
        got = decode_linear(x, ws[0], residual=r)
        row["rel_err"] = rel(got, decode_linear_reference(x, ws[0], None, r))
        row["plain_us"] = graph_us(lambda i: decode_linear(x, ws[i % copies]))
        row["fused_us"] = graph_us(lambda i: decode_linear(x, ws[i % copies], residual=r))
        add = torch.compile(lambda p, q: p + q, dynamic=False)
        row["replaced_us"] = graph_us(lambda i: add(r, r))
    row["TBps_fused"] = n * k * 2 / (row["fused_us"] * 1e-6) / 1e12
    row["saved_us"] = row["plain_us"] + row["replaced_us"] - row["fused_us"]
    return rows


def model_check() -> dict:
    """A two-layer Llama-2-7B-shaped model, one decode row batch: fused layers' logits against
    the unfused decode GEMMs' (both bf16) and a float32 copy's."""
    from prhs_eval.throughput import decode_gemms, model_config, random_model

    cfg = model_config("llama2-7b", layers=2, max_positions=64)
    model = random_model(cfg, "cuda", torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (8, 1), device="cuda")
    with torch.no_grad():
        ref = model.float()(input_ids=ids).logits
        model.to(torch.bfloat16)
        with decode_gemms(model, fuse=True):
            plain = model(input_ids=ids).logits
        with decode_gemms(model, fuse=True, fuse_layers=True):
            fused = model(input_ids=ids).logits
    return {
        "fused_vs_unfused_rel": rel(fused, plain),
        "fused_vs_fp32_rel": rel(fused, ref),
        "unfused_vs_fp32_rel": rel(plain, ref),
        "argmax_agree_fused_unfused": (fused.argmax(-1) == plain.argmax(-1)).float().mean().item(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}  # fmt: skip
    rows = []
    for name, (n, k, how) in SHAPES.items():
        for m in map(int, a.batches.split(",")):
            got = probe_shape(name, n, k, how, m, a.sweep)
            rows += got
            r = got[0]
            print(f"{name:15s} M={m:2d} {how:14s} plain {r['plain_us']:6.1f} + replaced "
                  f"{r['replaced_us']:5.1f} us -> fused {r['fused_us']:6.1f} us "
                  f"({r['TBps_fused']:.2f} TB/s), saved {r['saved_us']:5.1f} us, "
                  f"err {r['rel_err']:.1e}", flush=True)  # fmt: skip
            best = sorted((x for x in got[1:] if "us" in x), key=lambda x: x["us"])[:4]
            for x in best:
                print(f"    sweep {x['sweep']} {x['us']:6.1f} us", flush=True)
        torch.cuda.empty_cache()
    check = model_check()
    print("model:", check)
    (a.out / "epilogue-gemm-probe.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "model": check}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
