"""Where a Table V decode step's time goes: kernels per step and CUDA time by kernel, for each
method, from graph replays under torch.profiler (the same model, cache and step as
``prhs-eval table5``).

    python benchmarks/scripts/table5_profile.py --shape llama2-7b --batch 1 --context 4096 \
        --methods "sdpa,quest,prhs[tau=-1.0]" --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from prhs_eval.integration import enable
from prhs_eval.throughput import (
    SDPA,
    _fill,
    _rewind,
    _static_cache,
    _step_fn,
    compiled_parts,
    decode_gemms,
    fused_projections,
    model_config,
    parse_methods,
    random_model,
)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--methods", default="sdpa,dense,quest,prhs,prhs[tau=-1.0]")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--compile", action="store_true", help="table5 --compile's model parts")
    ap.add_argument("--compile-scope", choices=("parts", "layers"), default="parts")
    ap.add_argument("--fuse", action="store_true", help="table5 --fuse's fused projections")
    ap.add_argument("--gemm", choices=("cublas", "triton"), default="cublas")
    ap.add_argument("--fuse-layers", action="store_true", help="table5 --fuse-layers (triton)")
    ap.add_argument("--sequence", type=int, default=0, help="print the first N kernels in order")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.fuse_layers and a.gemm != "triton":
        ap.error("--fuse-layers needs --gemm triton (the norm and adds run inside prhs's GEMMs)")
    dev = torch.device("cuda")
    methods = parse_methods(a.methods, {"budget": a.budget})
    headroom = 8 + a.replays + 8
    cfg = model_config(a.shape, max_positions=a.context + headroom + 8)
    model = random_model(cfg, dev, torch.bfloat16)
    parts = contextlib.ExitStack()  # held until main returns: a dropped one would restore
    if a.gemm == "triton":
        parts.enter_context(decode_gemms(model, a.fuse, a.fuse_layers))
    elif a.fuse:
        parts.enter_context(fused_projections(model))
    if a.compile:
        parts.enter_context(compiled_parts(model, scope=a.compile_scope))
    cache = _static_cache(model, a.batch, a.context + headroom, dev)
    _fill(cache, a.context, 0)
    tokens = torch.zeros(a.batch, 1, dtype=torch.long, device=dev)
    a.out.mkdir(parents=True, exist_ok=True)
    report = {}
    for m in methods:
        _rewind(cache, a.context)
        rt = None
        if m.name != SDPA:
            rt = enable(model, m.name, max_seq_len=a.context + headroom, checked=False,
                        stats=False, **dict(m.options))  # fmt: skip
            rt.attach(cache, a.batch)
        step = _step_fn(model, cache, tokens)
        with torch.no_grad():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
                step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            g.replay()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(a.replays):
                    g.replay()
                torch.cuda.synchronize()
        if rt is not None:
            rt.disable()
        by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        each: dict[str, list[float]] = defaultdict(list)  # every launch's µs, for the median
        order = []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                by[e.name][0] += e.device_time_total / 1e3 / a.replays
                by[e.name][1] += 1 / a.replays
                each[e.name].append(e.device_time_total)
                order.append((e.time_range.start, e.name, e.device_time_total))
        order.sort()
        n_step = round(sum(v[1] for v in by.values()))
        sequence = [{"kernel": k[:120], "us": t} for _, k, t in order[:n_step]][: a.sequence]
        total = sum(v[0] for v in by.values())
        kernels = sum(v[1] for v in by.values())
        top = sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]
        report[m.label] = {
            "kernel_ms_per_step": total, "kernels_per_step": kernels,
            "top": [{"kernel": k[:120], "ms": v[0], "count": v[1],
                     "median_us": statistics.median(each[k])} for k, v in top],
            "sequence": sequence,
        }  # fmt: skip
        print(f"== {m.label}: {kernels:.0f} kernels/step, {total:.3f} ms of kernel time/step")
        for k, v in top:
            med = statistics.median(each[k])
            print(f"   {v[0]:8.3f} ms  {v[1]:6.0f}x  median {med:8.2f} us  {k[:90]}")
        for i, item in enumerate(sequence):
            print(f"   #{i:3d} {item['us']:7.2f} us  {item['kernel'][:100]}")
        del g
    meta = {"shape": a.shape, "batch": a.batch, "context": a.context, "budget": a.budget,
            "compile": a.compile, "compile_scope": a.compile_scope, "fuse": a.fuse,
            "fuse_layers": a.fuse_layers, "gemm": a.gemm,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    tag = (f"-compiled-{a.compile_scope}" if a.compile else "") + ("-fused" if a.fuse else "")
    tag += "-layers" if a.fuse_layers else ""
    tag += "-triton-gemm" if a.gemm == "triton" else ""
    (a.out / f"profile-{a.shape}-B{a.batch}-T{a.context}{tag}.json").write_text(
        json.dumps({"meta": meta, "methods": report}, indent=2) + "\n"
    )
    parts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
