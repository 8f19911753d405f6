"""prhs decode under tensor parallelism, sharded by heads as the SGLang backend shards it.

The device image has no SGLang, so this runs a Llama-3-8B-shaped decoder (random weights, bf16;
hidden 4096, 32 layers, Hq 32, Hkv 8, D 128, MLP 14336, vocab 128256) over ``--tp`` GPUs with
``torch.distributed`` (NCCL): rank ``r`` holds query heads ``r·Hq/tp …``, KV heads
``r·Hkv/tp …``, its column slice of the QKV and gate/up projections and its row slice of the
output and down projections, whose partial results are all-reduced, as SGLang's tensor parallel
layers do. Each rank keeps its own KV cache and its own prhs selector state over its heads (what
``prhs_sglang.backend`` does per TP rank: selection needs no communication).

One run, per ``--tp``:

1. prefill ``--batch`` random prompts of ``--context`` tokens (dense causal attention); the
   ``prhs`` selector observes each layer's last prompt queries (``tau="auto"``);
2. decode ``--steps`` greedy tokens once per run of ``--runs`` from the same prompt cache, each
   step one CUDA graph (every layer, the all-reduces included; ``--eager`` runs without graphs):

   - ``dense``: dense attention (prhs-kernels' dense decode kernel, 0.99× cuDNN on the H200);
   - ``none``: no attention at all (the query passed on): the time of the rest of the step;
   - ``prhs-full``: prhs with a budget covering every position (its tokens must equal dense's);
   - ``prhs``: prhs at ``--budget`` with its defaults (``tau="auto"``);
   - ``prhs-reuse``, ``prhs-2layers``, ``prhs-retrieve``: prhs at ``--budget`` with the
     retrieval ratio forced, since consecutive queries of a random model are not alike the way a
     real model's are: ``tau=-1`` (reuse whenever the anchor is young: one retrieval per
     decision's run, ρ̂ ≈ 1/steps), two layers of 32 that retrieve at every step and the rest
     reusing (ρ̂ ≈ 9 %), every decision retrieving (ρ̂ = 100 %);

   tokens/s of each, its measured ρ̂ (over both ranks), and whether the full-budget tokens equal
   dense's;
3. teacher-forced on dense's tokens, how often the full-budget prhs step picks the same token and
   how far its logits are (bf16 kernels that add in another order can flip a near tie; in
   ``--dtype float32`` they should not).

Usage (packages' ``src`` on ``PYTHONPATH``)::

    python benchmarks/scripts/tp_decode.py --tp 2 --out tp2.jsonl
    python benchmarks/scripts/tp_decode.py --tp 1 --out tp1.jsonl
    python benchmarks/scripts/tp_decode.py --tp 2 --dtype float32 --eager --runs dense,prhs-full
    python benchmarks/scripts/tp_decode.py --tp 2 --device cpu --tiny   # a check on the CPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    layers: int = 32
    hq: int = 32
    hkv: int = 8
    d: int = 128
    inter: int = 14336
    vocab: int = 128256
    theta: float = 500000.0


TINY = Shape(hidden=64, layers=3, hq=4, hkv=2, d=16, inter=96, vocab=256)


def _randn(shape: tuple[int, ...], seed: int, dev: torch.device, dtype, std: float):
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * std).to(dtype)


class Rank:
    """One rank's shard of the model, its KV cache and decode buffers."""

    def __init__(self, s: Shape, tp: int, rank: int, batch: int, t_cap: int, dev, dtype) -> None:
        self.s, self.tp, self.rank, self.dev, self.dtype = s, tp, rank, dev, dtype
        self.hq, self.hkv = s.hq // tp, s.hkv // tp
        hq0, hkv0, i0 = rank * self.hq, rank * self.hkv, rank * (s.inter // tp)
        std = 0.02
        self.embed = _randn((s.vocab, s.hidden), 1, dev, dtype, 1.0)
        self.head = _randn((s.hidden, s.vocab), 2, dev, dtype, std)
        self.w = []
        for layer in range(s.layers):
            base = 100 + 10 * layer
            # Full matrices from fixed seeds, then this rank's slice: every tp sees one model.
            wq = _randn((s.hidden, s.hq * s.d), base, dev, dtype, std)
            wk = _randn((s.hidden, s.hkv * s.d), base + 1, dev, dtype, std)
            wv = _randn((s.hidden, s.hkv * s.d), base + 2, dev, dtype, std)
            wo = _randn((s.hq * s.d, s.hidden), base + 3, dev, dtype, std)
            wg = _randn((s.hidden, s.inter), base + 4, dev, dtype, std)
            wu = _randn((s.hidden, s.inter), base + 5, dev, dtype, std)
            wd = _randn((s.inter, s.hidden), base + 6, dev, dtype, std)
            cols = slice(hq0 * s.d, (hq0 + self.hq) * s.d)
            kcols = slice(hkv0 * s.d, (hkv0 + self.hkv) * s.d)
            icols = slice(i0, i0 + s.inter // tp)
            qkv = torch.cat([wq[:, cols], wk[:, kcols], wv[:, kcols]], 1).contiguous()
            gu = torch.cat([wg[:, icols], wu[:, icols]], 1).contiguous()
            self.w.append((qkv, wo[cols].contiguous(), gu, wd[icols].contiguous()))
            del wq, wk, wv, wo, wg, wu, wd
        shape = (batch, self.hkv, t_cap, s.d)
        self.k = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(s.layers)]
        self.v = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(s.layers)]
        inv = 1.0 / (s.theta ** (torch.arange(0, s.d, 2, device=dev).float() / s.d))
        self.inv_freq = inv

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x [..., H, D]`` rotated at positions ``pos [...]`` (the same for every head)."""
        ang = pos.float().unsqueeze(-1) * self.inv_freq  # [..., D/2]
        cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)
        x1, x2 = x.float()[..., ::2], x.float()[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
        return out.to(x.dtype)

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x)
        return x

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, hq, hkv = self.s, self.hq, self.hkv
        q = qkv[..., : hq * s.d].unflatten(-1, (hq, s.d))
        k = qkv[..., hq * s.d : (hq + hkv) * s.d].unflatten(-1, (hkv, s.d))
        v = qkv[..., (hq + hkv) * s.d :].unflatten(-1, (hkv, s.d))
        return q, k, v

    def mlp(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        _, _, gu, wd = self.w[layer]
        g, u = (self.norm(x) @ gu).chunk(2, -1)
        return x + self.reduce((torch.nn.functional.silu(g) * u) @ wd)

    def prefill(self, ids: torch.Tensor, observe: Any = None) -> None:
        """Dense causal prefill of ``ids [B, L]``, one sequence at a time; ``observe(layer, b,
        q_last, k, v)`` sees each layer's queries and K/V of sequence ``b``."""
        s = self.s
        n = ids.shape[1]
        pos = torch.arange(n, device=self.dev)
        for b in range(ids.shape[0]):
            x = self.embed[ids[b]]
            for layer in range(s.layers):
                qkv_w, wo, _, _ = self.w[layer]
                q, k, v = self.split(self.norm(x) @ qkv_w)
                q, k = self.rope(q, pos), self.rope(k, pos)
                self.k[layer][b, :, :n] = k.transpose(0, 1)
                self.v[layer][b, :, :n] = v.transpose(0, 1)
                g = self.hq // self.hkv  # K/V expanded: float32 SDPA has no GQA flash path
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(g, 0)[None],
                    v.transpose(0, 1).repeat_interleave(g, 0)[None], is_causal=True,
                )[0]  # fmt: skip
                if observe is not None:
                    observe(layer, b, q)
                x = x + self.reduce(o.transpose(0, 1).reshape(n, -1) @ wo)
                x = self.mlp(x, layer)

    def step(self, tok: torch.Tensor, lens: torch.Tensor, attend: Any) -> torch.Tensor:
        """One decode step for tokens ``tok [B]`` at positions ``lens − 1``: logits ``[B, V]``.
        ``attend(layer, q, lens)`` returns ``[B, Hq_r, D]``; K/V are written first."""
        s = self.s
        b = tok.shape[0]
        pos = (lens - 1).long()
        rows = torch.arange(b, device=self.dev)
        x = self.embed[tok]
        for layer in range(s.layers):
            qkv_w, wo, _, _ = self.w[layer]
            q, k, v = self.split(self.norm(x) @ qkv_w)
            q, k = self.rope(q, pos), self.rope(k, pos)
            self.k[layer][rows, :, pos] = k
            self.v[layer][rows, :, pos] = v
            o = attend(layer, q, lens)
            x = x + self.reduce(o.reshape(b, -1) @ wo)
            x = self.mlp(x, layer)
        return self.norm(x) @ self.head


def worker(rank: int, args: argparse.Namespace) -> None:
    import prhs_selectors  # noqa: F401
    from prhs_core import AttentionSpec, ContiguousKV, selectors
    from prhs_kernels import sparse_decode_attention

    tp = args.tp
    cuda = args.device == "cuda"
    if tp > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=tp)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.set_grad_enabled(False)
    s = TINY if args.tiny else Shape()
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    b, n, steps = args.batch, args.context, args.steps
    t_cap = n + steps + 1
    model = Rank(s, tp, rank, b, t_cap, dev, dtype)
    scaling = s.d**-0.5
    spec = AttentionSpec(s.layers, s.hq // tp, s.hkv // tp, s.d)
    ids = torch.randint(
        0, s.vocab, (b, n), generator=torch.Generator().manual_seed(7)
    ).to(dev)  # fmt: skip

    every = [[1.01]] * s.layers
    always = (s.layers // 4, 3 * s.layers // 4)  # the two layers that retrieve at every step
    two = [[1.01] if layer in always else [-1.0] for layer in range(s.layers)]
    taus = {"prhs-full": "auto", "prhs": "auto", "prhs-reuse": -1.0, "prhs-2layers": two,
            "prhs-retrieve": every}  # fmt: skip
    names = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(names) - set(taus) - {"dense", "none"})
    if unknown or not names:
        raise SystemExit(
            f"--runs: unknown {unknown}; expected some of dense, none, {', '.join(taus)}"
        )

    def make(budget: int, tau: Any):
        sel = selectors.create("prhs", budget=budget, use_psaw=False, tau=tau)
        state = sel.init_state(spec, capacity=b, max_seq_len=t_cap, kv_dtype=dtype, device=dev)
        state.pool.create(list(range(b)))
        plan = sel.make_plan(state, batch_size=b, scaling=scaling, stats=True, checked=not cuda)
        return sel, state, plan

    runs = {
        name: make(t_cap if name == "prhs-full" else args.budget, taus[name])
        for name in names if name not in ("dense", "none")
    }  # fmt: skip

    def observe(layer: int, row: int, q: torch.Tensor) -> None:
        kv = ContiguousKV(
            model.k[layer][row : row + 1], model.v[layer][row : row + 1],
            torch.full((1,), n, dtype=torch.int32, device=dev),
        )  # fmt: skip
        for sel, state, _ in runs.values():
            w = sel.prompt_queries()
            if w:
                sel.observe_prompt(state, layer, [row], q[-w:][None], kv, scaling, [(0, n)])

    t0 = time.perf_counter()
    model.prefill(ids, observe)
    if cuda:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    first = ids[:, -1].clone()

    def dense_attend(layer, q, lens):
        kv = ContiguousKV(model.k[layer], model.v[layer], lens)
        return sparse_decode_attention(q, kv, None, scaling)[0]

    def prhs_attend(name):
        sel, state, plan = runs[name]

        def attend(layer, q, lens):
            kv = ContiguousKV(model.k[layer], model.v[layer], plan.seq_lens)
            selection = sel.select(plan, layer, q, kv, state)
            return sparse_decode_attention(q, kv, selection, scaling)[0]

        return attend

    def no_attend(layer, q, lens):  # the step without attention: what the rest costs
        return q

    fixed = {"dense": dense_attend, "none": no_attend}
    attends = {name: fixed[name] if name in fixed else prhs_attend(name) for name in names}
    slots = torch.arange(b)
    out: dict[str, Any] = {}
    forced: dict[str, torch.Tensor] = {}
    graphs: list[Any] = []
    for name, attend in attends.items():
        tok = first.clone()
        lens = torch.full((b,), n + 1, dtype=torch.int32, device=dev)
        plan = runs[name][2] if name in runs else None
        if plan is not None:
            plan.update(lens, slots)
        snapshot = None
        if name in runs:  # each decode run starts from the state the prefill left
            st = runs[name][1]
            snapshot = {f: st.pool[f].clone() for f in st.pool.field_names}

        def one(tok=tok, lens=lens, attend=attend, plan=plan):
            return model.step(tok, plan.seq_lens if plan is not None else lens, attend)

        if cuda and not args.eager:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                one()  # warm-up (writes the token after the prompt; overwritten below)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = one()
            run = graph.replay
            graphs.append(graph)
        else:
            logits = None
            run = None
        if snapshot is not None:
            for f, t in snapshot.items():
                runs[name][1].pool[f].copy_(t)
            runs[name][2].totals.zero_()  # the warm-up step is not counted
        tokens = []
        host_lens = n + 1
        if cuda:
            torch.cuda.synchronize()
            if tp > 1:
                dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            lens.fill_(host_lens)
            if plan is not None:
                plan.update(lens, slots)
            if run is not None:
                run()
                nxt = logits.float().argmax(-1)
            else:
                nxt = one().float().argmax(-1)
            tokens.append(nxt)
            tok.copy_(nxt)
            host_lens += 1
        if cuda:
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        out[name] = {
            "tokens_per_s": round(b * steps / sec, 1),
            "ms_per_step": round(1e3 * sec / steps, 3),
        }
        forced[name] = torch.stack(tokens, 1).cpu()
        if name in runs:  # every rank's decisions (each rank decides for its own KV heads)
            rho = torch.tensor([runs[name][2].summary()["retrieval_ratio"]], device=dev)
            if tp > 1:
                dist.all_reduce(rho)
            out[name]["retrieval_ratio"] = round(float(rho) / tp, 4)
    if rank == 0:
        row = {
            "tp": tp, "batch": b, "context": n, "steps": steps, "budget": args.budget,
            "dtype": str(dtype).removeprefix("torch."), "cuda_graphs": cuda and not args.eager,
            "shape": s.__dict__, "prefill_s": round(prefill_s, 2), **out,
            "dense_tokens_sha256": _digest(forced.get("dense")),
            "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%F %T"),
        }  # fmt: skip
        if "dense" in forced and "prhs-full" in forced:
            row.update(_equality(model, runs, forced, first, n, steps, slots, dev, attends))
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    elif "dense" in forced and "prhs-full" in forced:
        _equality(model, runs, forced, first, n, steps, slots, dev, attends)  # the same collectives
    graphs.clear()
    if tp > 1:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        # The first run hung here (NCCL teardown after CUDA graphs that captured all-reduces):
        # give it a minute, then leave without it; the rows are written.
        done = threading.Thread(target=dist.destroy_process_group, daemon=True)
        done.start()
        done.join(60)
        if done.is_alive():
            print(f"rank {rank}: destroy_process_group did not return in 60 s", flush=True)
            os._exit(0)


def _digest(tokens: torch.Tensor | None) -> str | None:
    if tokens is None:
        return None
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]


def _equality(model, runs, forced, first, n, steps, slots, dev, attends) -> dict[str, Any]:
    """Full-budget prhs against dense: free-running greedy tokens, then teacher-forced."""
    b = first.shape[0]
    same = forced["prhs-full"].eq(forced["dense"])
    first_diff = [int((~r).nonzero()[0]) if (~r).any() else steps for r in same]

    # Teacher-forced on dense's tokens: does the full-budget step pick the same next token?
    agree, worst = [], 0.0
    dense_attend = attends["dense"]
    runs["prhs-full"][1].pool.release(list(range(b)))
    runs["prhs-full"][1].pool.create(list(range(b)))
    plan_f = runs["prhs-full"][2]
    dense_toks = forced["dense"].to(dev)
    feed = torch.cat([first.view(-1, 1), dense_toks[:, :-1]], 1)
    for i in range(min(steps, 8)):
        lens = torch.full((b,), n + 1 + i, dtype=torch.int32, device=dev)
        plan_f.update(lens, slots)
        lf = model.step(feed[:, i], plan_f.seq_lens, attends["prhs-full"]).float()
        ld = model.step(feed[:, i], lens, dense_attend).float()
        agree.append(float((lf.argmax(-1) == ld.argmax(-1)).float().mean()))
        worst = max(worst, float((lf - ld).abs().max() / ld.abs().max()))
    return {
        "full_budget_tokens_sha256": _digest(forced["prhs-full"]),
        "full_budget_tokens_equal": bool(same.all()),
        "full_budget_first_difference": first_diff,
        "teacher_forced_argmax_agreement": round(sum(agree) / len(agree), 4),
        "teacher_forced_max_rel_logit_diff": round(worst, 8),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="weights, activations and KV cache on CUDA (the CPU runs float32)",
    )
    ap.add_argument(
        "--runs",
        default="dense,prhs-full,prhs,prhs-reuse,prhs-2layers,prhs-retrieve",
        help="comma-separated decode runs (see the module docstring)",
    )
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--tiny", action="store_true", help="a small model (a check, not a figure)")
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.tp == 1:
        worker(0, args)
    else:
        mp.spawn(worker, args=(args,), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
