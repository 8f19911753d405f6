"""CIS ``tau="auto"`` on a GPU: what the prompt calibration costs at prefill, and that it computes
what the CPU computes.

Per prompt length ``T`` (Llama-3-8B-shaped layer: Hq 32, Hkv 8, D 128, bf16 keys), one layer's
``CIS.observe_prompt`` (32 queries replayed over a grid of 12 thresholds) is timed alone against
the layer's dense causal prefill attention (SDPA, flash); then inside a prefill of 8 such layers
(projections, attention, MLP), with and without it. Then the GPU replay is compared with the CPU
one, and the per-slot decide of the Triton path with torch's.
A benchmark, not a test: it asserts nothing about speed.

Usage (packages' ``src`` on ``PYTHONPATH``)::

    python benchmarks/scripts/tau_auto_probe.py --out tau-auto.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from prhs_core.config import AttentionSpec
from prhs_core.layout import ContiguousKV
from prhs_core.registry import selectors
from prhs_kernels.cis import cis_decide
from prhs_selectors.cis_calibration import TAU_GRID, replay_curves

HQ, HKV, D = 32, 8, 128


def _bench(fn, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event timed runs (after one warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _emit(out, row: dict) -> None:
    print(json.dumps(row), flush=True)
    if out is not None:
        out.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    out = open(args.out, "w") if args.out else None
    _emit(out, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "python": platform.python_version(), "date": time.strftime("%F %T")})  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    for n in [int(x) for x in args.lengths.split(",")]:
        sel = selectors.create("cis", budget=args.budget)
        spec = AttentionSpec(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
        state = sel.init_state(spec, capacity=1, max_seq_len=n, device=dev)
        state.pool.create([0])
        k = torch.randn(1, HKV, n, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        base = torch.randn(HQ, D, device=dev, generator=g)
        q_all = (base + 0.3 * torch.randn(n, HQ, D, device=dev, generator=g)).bfloat16()
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        kv = ContiguousKV(k, v, lens)
        queries = q_all[-32:].unsqueeze(0)
        calib = _bench(
            lambda sel=sel, state=state, queries=queries, kv=kv, n=n: sel.observe_prompt(
                state, 0, [0], queries, kv, D**-0.5, [(0, n)]
            )
        )
        q_sdpa = q_all.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        dense = _bench(
            lambda q_sdpa=q_sdpa, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                q_sdpa, k, v, is_causal=True, enable_gqa=True
            )
        )
        mem = torch.cuda.max_memory_allocated() / 2**20
        _emit(out, {"part": "cost", "prompt_len": n, "observe_prompt_ms": round(calib, 3),
                    "dense_prefill_attention_ms": round(dense, 3),
                    "ratio": round(calib / dense, 4), "peak_mib": round(mem),
                    "tau_row": [round(float(x), 3) for x in state.pool["tau"][0, 0]]})  # fmt: skip
        if n <= 16384:
            cfg = sel.replay_config()
            taus = torch.tensor(TAU_GRID)
            b_gpu, r_gpu, *_ = replay_curves(queries[0], k[0], D**-0.5, cfg, taus.to(dev))
            b_cpu, r_cpu, *_ = replay_curves(queries[0].cpu(), k[0].cpu(), D**-0.5, cfg, taus)
            _emit(out, {"part": "gpu-vs-cpu", "prompt_len": n,
                        "beta_max_abs_diff": float((b_gpu.cpu() - b_cpu).abs().max()),
                        "rho_max_abs_diff": float((r_gpu.cpu() - r_cpu).abs().max())})  # fmt: skip

    # A prefill of Llama-3-8B-shaped layers (attention projections, causal attention, MLP;
    # bf16), with and without the calibration after each layer's attention: what it adds to
    # the time to first token once the host runs ahead of the GPU.
    hidden, inter, n_layers = 4096, 14336, 8
    w_qkv = torch.randn(hidden, (HQ + 2 * HKV) * D, device=dev, dtype=torch.bfloat16) * 0.01
    w_o = torch.randn(HQ * D, hidden, device=dev, dtype=torch.bfloat16) * 0.01
    w_up = torch.randn(hidden, 2 * inter, device=dev, dtype=torch.bfloat16) * 0.01
    w_down = torch.randn(inter, hidden, device=dev, dtype=torch.bfloat16) * 0.01
    for n in [int(x) for x in args.lengths.split(",")][:3]:
        sel = selectors.create("cis", budget=args.budget)
        spec = AttentionSpec(num_layers=n_layers, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
        state = sel.init_state(spec, capacity=1, max_seq_len=n, device=dev)
        state.pool.create([0])
        x0 = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)

        def prefill(calibrate: bool, x0=x0, n=n, sel=sel, state=state, lens=lens) -> None:
            x = x0
            for layer in range(n_layers):
                qkv = x @ w_qkv
                q = qkv[:, : HQ * D].view(n, HQ, D)
                k = qkv[:, HQ * D : (HQ + HKV) * D].view(n, HKV, D).transpose(0, 1)[None]
                v = qkv[:, (HQ + HKV) * D :].view(n, HKV, D).transpose(0, 1)[None]
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k, v, is_causal=True, enable_gqa=True
                )
                if calibrate:
                    kv = ContiguousKV(k.contiguous(), v.contiguous(), lens)
                    sel.observe_prompt(state, layer, [0], q[-32:][None], kv, D**-0.5, [(0, n)])
                x = x + o[0].transpose(0, 1).reshape(n, HQ * D) @ w_o
                up, gate = (x @ w_up).chunk(2, -1)
                x = x + (torch.nn.functional.silu(gate) * up) @ w_down

        plain = _bench(lambda: prefill(False), reps=5)
        with_cal = _bench(lambda: prefill(True), reps=5)
        _emit(out, {"part": "prefill", "prompt_len": n, "layers": n_layers,
                    "prefill_ms": round(plain, 2), "with_calibration_ms": round(with_cal, 2),
                    "added": round(with_cal / plain - 1, 4)})  # fmt: skip

    # The per-slot decide: Triton against torch, 64 rows of 8 KV heads.
    b, n_slots = 64, 80
    aq = torch.randn(n_slots, HKV, HQ // HKV, D, device=dev, generator=g)
    alen = torch.full((n_slots, HKV), 900, dtype=torch.int32, device=dev)
    slots = torch.randperm(n_slots, device=dev, generator=g)[:b]
    lens = torch.full((b,), 910, dtype=torch.int32, device=dev)
    q = aq[slots] + 0.7 * torch.randn(b, HKV, HQ // HKV, D, device=dev, generator=g)
    query = q.reshape(b, HQ, D).bfloat16()
    table = torch.rand(n_slots, 3, HKV, device=dev, generator=g) * 0.6 + 0.5
    args_ = (query, aq, alen, slots, lens)
    got, _ = cis_decide(*args_, tau=table[:, 1], n_local=32, path="triton")
    want, _ = cis_decide(*args_, tau=table[:, 1], n_local=32, path="torch")
    _emit(out, {"part": "per-slot-decide", "rows": b * HKV, "equal": bool(torch.equal(got, want)),
                "retrieve_share": round(float(got.float().mean()), 3)})  # fmt: skip
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
