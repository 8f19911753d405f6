"""The prhs decode step on a GPU: CUDA-graph correctness, then timings against dense attention.

Two parts, one command (a benchmark, not a test: nothing here asserts a speed):

``check``
    For every registered selector, a decode step over a stack of Llama-3-8B-shaped attention
    layers (Hq 32, Hkv 8, D 128, bf16), B in {1, 16} with mixed lengths and padded rows: the
    step (K/V write, side-cache write, select, attend, for every layer) is captured with
    ``torch.cuda.graph`` and replayed for 64 steps; every step's output must equal eager
    execution of the same steps, and one eager step must run under
    ``torch.cuda.set_sync_debug_mode("error")``.

``bench``
    Per-layer step time (median over repeats of a 32-step drifting query trace, ``do_bench``
    style events) at B1·T16k, B16·T16k and B16·T64k, budget 1024: SDPA flash with GQA (the best
    dense baseline in the image), and the prhs step of ``oracle``, ``cis``, ``quest`` and
    ``streaming`` replayed from a CUDA graph. ``--impl old`` times the previous contracts
    (eager; they cannot be captured) from another source tree, for the before/after table.

Usage (from the repository root, packages' ``src`` on ``PYTHONPATH``)::

    python benchmarks/scripts/decode_step.py check --out results.jsonl
    python benchmarks/scripts/decode_step.py bench --out results.jsonl
    PYTHONPATH=<old tree> python benchmarks/scripts/decode_step.py bench --impl old --out ...
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from typing import Any

import torch

HQ, HKV, D = 32, 8, 128
DEV = "cuda"
DTYPE = torch.bfloat16
SCALING = D**-0.5


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def emit(out: Any, row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)
    if out is not None:
        out.write(json.dumps(row) + "\n")
        out.flush()


# ---------------------------------------------------------------------------------------------
# workload: caches, a drifting query trace
# ---------------------------------------------------------------------------------------------
class Workload:
    """``layers`` contiguous caches ``[B, Hkv, T_cap, D]`` and a trace of ``steps`` decode steps
    (queries drifting slowly, so that CIS can reuse, and new keys/values)."""

    def __init__(
        self, batch: int, lens: list[int], layers: int, steps: int, drift: float, seed: int = 0
    ) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.batch, self.layers, self.steps = batch, layers, steps
        self.lens0 = torch.tensor(lens, dtype=torch.int32)
        self.t_cap = max(lens) + steps + 8
        shape = (batch, HKV, self.t_cap, D)
        self.k = [torch.randn(shape, generator=g, device=DEV, dtype=DTYPE) for _ in range(layers)]
        self.v = [torch.randn(shape, generator=g, device=DEV, dtype=DTYPE) for _ in range(layers)]
        q0 = torch.randn(layers, batch, HQ, D, generator=g, device=DEV)
        noise = torch.randn(steps, layers, batch, HQ, D, generator=g, device=DEV)
        self.q = (q0 + drift * torch.cumsum(noise, 0)).to(DTYPE)  # [steps, L, B, Hq, D]
        self.new_k = torch.randn(steps, layers, batch, HKV, D, generator=g, device=DEV).to(DTYPE)
        self.new_v = torch.randn(steps, layers, batch, HKV, D, generator=g, device=DEV).to(DTYPE)

    def lens_at(self, step: int) -> torch.Tensor:
        """``[B]`` int32 cached positions at ``step`` (the step's token included)."""
        return self.lens0 + step


# ---------------------------------------------------------------------------------------------
# the new contracts: plan once per step, select + attend per layer, graph-capturable
# ---------------------------------------------------------------------------------------------
class NewStep:
    """One selector on a :class:`Workload`, with static inputs a CUDA graph can replay."""

    def __init__(
        self, name: str, options: dict[str, Any], w: Workload, live: int, stats: bool = False
    ):
        import prhs_selectors  # noqa: F401
        from prhs_core import AttentionSpec, ContiguousKV, selectors
        from prhs_kernels import token_locations

        self.w = w
        self.sel = selectors.create(name, **options)
        self.spec = AttentionSpec(w.layers, HQ, HKV, D)
        self.state = self.sel.init_state(
            self.spec, capacity=w.batch, max_seq_len=w.t_cap, kv_dtype=DTYPE, device=DEV
        )
        self.state.pool.create(list(range(live)))
        self.slots = torch.tensor([i if i < live else -1 for i in range(w.batch)])
        self.plan = self.sel.make_plan(
            self.state, batch_size=w.batch, scaling=SCALING, stats=stats, checked=False
        )
        self.q = torch.zeros(w.layers, w.batch, HQ, D, device=DEV, dtype=DTYPE)
        self.nk = torch.zeros(w.layers, w.batch, HKV, D, device=DEV, dtype=DTYPE)
        self.nv = torch.zeros_like(self.nk)
        self.out = torch.zeros(w.layers, w.batch, HQ, D, device=DEV, dtype=DTYPE)
        self.rows = torch.arange(w.batch, device=DEV)
        # The prompt (positions before each first decode token) goes to the side caches once.
        prompt = w.lens0.to(DEV) - 1
        pos = torch.arange(w.t_cap, device=DEV).view(1, -1).expand(w.batch, -1)
        pos = torch.where(pos < prompt.view(-1, 1), pos, -1)
        for layer in range(w.layers):
            kv = ContiguousKV(w.k[layer], w.v[layer], prompt.to(torch.int32).clamp(min=1))
            loc = token_locations(kv, pos, self.state.row_stride)
            key = w.k[layer].transpose(1, 2).reshape(-1, HKV, D)
            val = w.v[layer].transpose(1, 2).reshape(-1, HKV, D)
            self.sel.write_kv(self.state, layer, loc.flatten(), key, val)
        if base_name(name) == "louver":
            # A host shows Louver its prompt at prefill, where the prompt's keys are indexed;
            # without it every step would fold one more buffer of the prompt. (The other
            # selectors' prompt observations need real queries, which this workload lacks.)
            n_q = self.sel.prompt_queries()
            for layer in range(w.layers):
                kv = ContiguousKV(
                    w.k[layer][:live], w.v[layer][:live], prompt[:live].to(torch.int32)
                )
                queries = torch.zeros(live, n_q, HQ, D, device=DEV, dtype=DTYPE)
                self.sel.observe_prompt(self.state, layer, list(range(live)), queries, kv, SCALING)
        self._contiguous = ContiguousKV

    def load(self, step: int) -> None:
        """Copy step ``step``'s inputs into the static buffers and update the plan (host)."""
        self.q.copy_(self.w.q[step])
        self.nk.copy_(self.w.new_k[step])
        self.nv.copy_(self.w.new_v[step])
        self.plan.update(self.w.lens_at(step), self.slots)

    def run(self) -> None:
        """The step, every layer: the host's K/V write, the side-cache write, select, attend."""
        from prhs_kernels import sparse_decode_attention, token_locations

        w, plan = self.w, self.plan
        pos = plan.seq_lens.long() - 1
        # Once per step, as a host does (SGLang's out_cache_loc): where the new token goes, as a
        # row of the flat [B * Hkv * T_cap, D] cache view, and its side-cache location. Each
        # layer then writes K and V with one copy each.
        heads = torch.arange(HKV, device=pos.device).view(1, -1)
        flat = ((self.rows.view(-1, 1) * HKV + heads) * w.t_cap + pos.view(-1, 1)).view(-1)
        kv0 = self._contiguous(w.k[0], w.v[0], plan.seq_lens)
        loc = token_locations(kv0, pos.view(-1, 1), self.state.row_stride).view(-1)
        for layer in range(w.layers):
            w.k[layer].view(-1, D).index_copy_(0, flat, self.nk[layer].view(-1, D))
            w.v[layer].view(-1, D).index_copy_(0, flat, self.nv[layer].view(-1, D))
            kv = self._contiguous(w.k[layer], w.v[layer], plan.seq_lens)
            self.sel.write_kv(self.state, layer, loc, self.nk[layer], self.nv[layer])
            s = self.sel.select(plan, layer, self.q[layer], kv, self.state)
            sparse_decode_attention(self.q[layer], kv, s, plan.scaling, out=self.out[layer])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the step mutates (state, caches), for snapshots."""
        st = self.state
        ts = [st.pool[n] for n in st.pool.field_names] + [st.nonfinite]
        if st.side is not None:
            ts += [st.side[n] for n in st.side.field_names]
        return ts + self.w.k + self.w.v


def snapshot(st: NewStep) -> tuple[list[torch.Tensor], set[int]]:
    """Every tensor the step mutates, and the pool's host record of new sequences."""
    return [t.clone() for t in st.tensors()], set(st.state.pool._pending)


def restore(st: NewStep, snap: tuple[list[torch.Tensor], set[int]]) -> None:
    for t, s in zip(st.tensors(), snap[0], strict=True):
        t.copy_(s)
    st.state.pool._pending = set(snap[1])


CIS_OPTIONS: dict[str, Any] = {}
"""Options ``--cis KEY=VALUE`` adds to CIS's (its defaults otherwise)."""


LAYERS = 4  # attention layers of every workload


def label_table(layers: int = LAYERS) -> list[list[list[int]]]:
    """A seeded Double Sparsity channels table: ``D // 8`` label channels per (layer, KV head)."""
    g = torch.Generator().manual_seed(0)
    r = D // 8
    return [
        [sorted(torch.randperm(D, generator=g)[:r].tolist()) for _ in range(HKV)]
        for _ in range(layers)
    ]


def base_name(name: str) -> str:
    """The registry name of a run name: ``cis-certified`` is ``cis``; ``NAME-table`` is a
    Double Sparsity / HShare run with a channels table (a label cache)."""
    return "cis" if name == "cis-certified" else name.removesuffix("-table")


def selector_options(name: str, budget: int) -> dict[str, Any]:
    if name.endswith("-table"):
        return {"budget": budget, "channels": label_table()}
    if name in ("dense", "psaw", "etf"):
        return {}
    if name == "h2o":
        return {"budget": budget}
    if name == "cis-certified":
        return {"budget": budget, "delta_max": 0.1}
    if name == "cis":
        return {"budget": budget, **CIS_OPTIONS}
    return {"budget": budget}


def parse_cis_options(items: list[str]) -> None:
    """``KEY=VALUE`` items into :data:`CIS_OPTIONS` (booleans, ints, floats, else strings;
    ``KEY=@FILE`` reads JSON, an object's entry ``KEY``, e.g. a ``tau`` table)."""
    for item in items:
        key, _, value = item.partition("=")
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as fh:
                data = json.load(fh)
            CIS_OPTIONS[key] = data[key] if isinstance(data, dict) else data
            continue
        if value.lower() in ("true", "false"):
            CIS_OPTIONS[key] = value.lower() == "true"
            continue
        try:
            CIS_OPTIONS[key] = int(value)
        except ValueError:
            try:
                CIS_OPTIONS[key] = float(value)
            except ValueError:
                CIS_OPTIONS[key] = value


def registry_names() -> list[str]:
    import prhs_selectors  # noqa: F401  (registers the built-ins without entry points)
    from prhs_core import selectors

    return sorted(selectors.names())


def check_score(out: Any) -> None:
    """The CUDA ``bmm`` scoring path against the torch reference (float64 truth)."""
    from prhs_core import ContiguousKV
    from prhs_kernels.score import score_keys
    from prhs_kernels.score.reference import score_keys_reference

    w = Workload(4, [5000, 4093, 17, 1], layers=1, steps=1, drift=0.0, seed=3)
    kv = ContiguousKV(w.k[0], w.v[0], w.lens0.to(DEV))
    q = w.q[0, 0]
    fast = score_keys(q, kv, SCALING)
    ref = score_keys_reference(q, kv, SCALING, dtype=torch.float64)
    ok = torch.isfinite(ref)
    err = ((fast.double() - ref).abs()[ok].max() / ref[ok].abs().max()).item()
    try:
        a = torch.ones(2, 3, 4, device=DEV, dtype=DTYPE)
        bmm_ok = torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError) as e:
        bmm_ok = f"{type(e).__name__}: {e}"[:200]
    emit(
        out,
        {
            "part": "check",
            "op": "score_keys (bmm path) vs float64 reference",
            "bmm_out_dtype_supported": bmm_ok,
            "max_rel_err": err,
            "inf_pattern_equal": bool(torch.equal(torch.isinf(fast), ~ok)),
        },
    )
    # Attention: the launcher's CUDA path against the float32 reference, dense and sparse.
    from prhs_core import Selection
    from prhs_kernels import sparse_decode_attention
    from prhs_kernels.sparse_decode.reference import sparse_decode_attention_reference

    g = torch.Generator(device=DEV).manual_seed(5)
    idx = torch.randint(0, 5000, (4, HKV, 300), generator=g, device=DEV, dtype=torch.int32)
    idx = torch.sort(idx, dim=-1).values
    counts = torch.randint(0, 301, (4, HKV), generator=g, device=DEV, dtype=torch.int32)
    for label, sel in (("dense", None), ("sparse", Selection(idx, counts, 1))):
        o, lse = sparse_decode_attention(q, kv, sel, SCALING)
        ro, rlse = sparse_decode_attention_reference(q, kv, sel, SCALING)
        fin = torch.isfinite(rlse)
        emit(
            out,
            {
                "part": "check",
                "op": f"sparse_decode_attention ({label}, CUDA path) vs float32 reference",
                "out_rel_err": ((o.float() - ro.float()).norm() / ro.float().norm()).item(),
                "lse_max_abs_err": (lse - rlse)[fin].abs().max().item(),
                "lse_inf_pattern_equal": bool(torch.equal(fin, torch.isfinite(lse))),
            },
        )


def check(out: Any, steps: int, batches: list[int], only: list[str] | None = None) -> None:
    names = [n for n in registry_names() if only is None or n in only]
    cuda = DEV == "cuda"
    check_score(out)
    for batch in batches:
        lens = [3000] if batch == 1 else [500 + 211 * i for i in range(batch)]
        live = batch if batch == 1 else max(1, batch - 3)  # the last rows are padding (slot -1)
        pseudo = ["cis-certified", "double_sparsity-table", "hshare-table"]
        extra = [n for n in pseudo if only is None or n in only]
        for name in [*names, *extra]:
            base = base_name(name)
            w = Workload(batch, lens, layers=LAYERS, steps=steps, drift=0.02, seed=batch)
            st = NewStep(base, selector_options(name, 64), w, live)
            snap = snapshot(st)
            eager = []
            for t in range(steps):
                st.load(t)
                st.run()
                eager.append(st.out.clone())
            restore(st, snap)
            st.load(0)  # the first step (seeding, for H2O) runs eagerly in both
            st.run()
            graph_out = [st.out.clone()]
            st.load(1)
            mid = snapshot(st)
            error = None
            replay = st.run  # on the CPU (a dry run of this script): eager again
            if cuda:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up outside the graph
                    st.run()
                torch.cuda.current_stream().wait_stream(side)
                restore(st, mid)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        st.run()
                    replay = graph.replay
                except Exception as e:  # reported, not raised: every selector gets its row
                    error = f"{type(e).__name__}: {e}"[:500]
            equal, max_diff = False, math.nan
            if error is None:
                restore(st, mid)
                replay()
                graph_out.append(st.out.clone())
                for t in range(2, steps):
                    st.load(t)
                    replay()
                    graph_out.append(st.out.clone())
                # Live rows only: padded rows share the scratch slot, so what they read is noise.
                pairs = [(a[:, :live], b[:, :live]) for a, b in zip(eager, graph_out, strict=True)]
                diffs = [
                    (a.float() - b.float()).abs().nan_to_num(1e9).max().item() for a, b in pairs
                ]
                max_diff = max(diffs)
                equal = all(torch.equal(a, b) for a, b in pairs)
            # One eager step with syncs forbidden.
            sync_error = None
            restore(st, snap)
            st.load(0)
            st.run()
            st.load(1)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    st.run()
                except Exception as e:
                    sync_error = f"{type(e).__name__}: {e}"[:300]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            emit(
                out,
                {
                    "part": "check",
                    "selector": name,
                    "batch": batch,
                    "padded_rows": batch - live,
                    "layers": 4,
                    "steps": steps,
                    "graph_equals_eager": equal,
                    "max_abs_diff": max_diff,
                    "capture_error": error,
                    "sync_error": sync_error,
                },
            )
            del st, w
            if cuda:
                torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# timings
# ---------------------------------------------------------------------------------------------
def time_trace(fn_load: Any, fn_run: Any, steps: int, repeats: int) -> float:
    """Median milliseconds of one step over ``repeats`` runs of the ``steps``-step trace."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for t in range(steps):
            fn_load(t)
            fn_run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    times.sort()
    return times[len(times) // 2]


def trace_gpu_ms(st: NewStep, snap: Any, graph: Any, steps: int) -> float:
    """Milliseconds per step the GPU spends in kernels, copies and memsets over one replay of
    the trace (the profiler's device times, summed): with the trace's wall time per step, the
    share of the step the GPU is busy."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    restore(st, snap)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(steps):
            st.load(t)
            graph.replay()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    return total_us / 1000 / steps


def bench_dense(w: Workload, repeats: int) -> float:
    import torch.nn.functional as F

    out = torch.empty(w.layers, w.batch, HQ, 1, D, device=DEV, dtype=DTYPE)
    q = w.q[0].unsqueeze(3)  # [L, B, Hq, 1, D]
    n = int(w.lens0.max())

    def run() -> None:
        for layer in range(w.layers):
            out[layer] = F.scaled_dot_product_attention(
                q[layer], w.k[layer][:, :, :n], w.v[layer][:, :, :n], enable_gqa=True
            )

    for _ in range(3):
        run()
    return time_trace(lambda t: None, run, 8, repeats) / w.layers


def bench_new(
    name: str,
    w: Workload,
    steps: int,
    repeats: int,
    budget: int,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    opts = selector_options(name, budget) if options is None else options
    # ρ̂ of the trace, measured eagerly with statistics on.
    st = NewStep(base_name(name), opts, w, w.batch)
    snap = snapshot(st)
    meas = NewStep(base_name(name), opts, w, w.batch, stats=True)
    for t in range(steps):
        meas.load(t)
        meas.run()
    summary = meas.plan.summary()
    del meas
    restore(st, snap)  # the caches the measuring run wrote into
    st.load(0)
    st.run()  # first step eagerly (H2O seeding); then capture the steady state
    st.load(1)
    mid = snapshot(st)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        st.run()
    torch.cuda.current_stream().wait_stream(side)
    restore(st, mid)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st.run()
    eager_ms = time_trace(st.load, st.run, steps, 1) / w.layers
    ms = []
    for _ in range(repeats):
        restore(st, snap)
        ms.append(time_trace(st.load, graph.replay, steps, 1) / w.layers)
    ms.sort()
    gpu_ms = trace_gpu_ms(st, snap, graph, steps) / w.layers
    # The graph replayed back to back on one step's inputs: the GPU's time for a step, without
    # the trace's host work between steps (plan.update, input copies).
    restore(st, snap)
    st.load(1)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / 50 / w.layers
    del st, graph
    return {
        "ms": ms[len(ms) // 2],
        "gpu_ms": gpu_ms,
        "gpu_busy": gpu_ms / ms[len(ms) // 2],
        "replay_ms": replay_ms,
        "eager_ms": eager_ms,
        "retrieval_ratio": summary.get("retrieval_ratio"),
        "avg_selected": summary.get("avg_selected"),
    }


def bench_old(name: str, w: Workload, steps: int, repeats: int, budget: int) -> dict[str, Any]:
    """The previous contracts (commit ccd30e5): eager only."""
    import prhs_selectors  # noqa: F401
    from prhs_core import AttentionSpec, ContiguousKVCache, DecodeStep, selectors
    from prhs_kernels import sparse_decode_attention

    sel = selectors.create(name, **selector_options(name, budget))
    spec = AttentionSpec(w.layers, HQ, HKV, D)
    rows = torch.arange(w.batch, device=DEV)
    slots = torch.arange(w.batch, device=DEV)

    def fresh() -> Any:
        pool = sel.init_state(spec, w.batch, w.t_cap, DEV)
        pool.create(list(range(w.batch)), (w.lens0 - 1).tolist())
        return pool

    pool = [fresh()]

    def load(t: int) -> None:
        pass

    step_box = [0]

    def run() -> None:
        t = step_box[0]
        lens = w.lens_at(t).long().to(DEV)
        for layer in range(w.layers):
            w.k[layer][rows, :, lens - 1] = w.new_k[t, layer]
            w.v[layer][rows, :, lens - 1] = w.new_v[t, layer]
            view = ContiguousKVCache(w.k[layer], w.v[layer], lens, check_values=False)
            step = DecodeStep(layer, w.q[t, layer], view, slots, SCALING)
            s = sel.select(step, pool[0])
            sparse_decode_attention(w.q[t, layer], view, s, SCALING)
        pool[0].append(list(range(w.batch)), 1)
        step_box[0] = t + 1

    ms = []
    for _ in range(repeats):
        pool[0] = fresh()
        step_box[0] = 0
        ms.append(time_trace(load, run, steps, 1) / w.layers)
    ms.sort()
    return {"ms": ms[len(ms) // 2], "eager_ms": ms[len(ms) // 2]}


JUMP_COS = 0.0
"""Cosine of a forced jump's new query with the one it leaves (:func:`force_jumps`): 0, a fresh
query (nothing the last retrieval found helps the next), or a move of that size (a retrieval
triggered by a cosine threshold just above it)."""


def force_jumps(w: Workload, rho: float, seed: int = 12, jump_cos: float | None = None) -> None:
    """Make a share ``rho`` of the (layer, sequence, KV head) query groups jump at each step
    after the first (the others keep theirs): a trace whose retrieval ratio CIS measures as
    about ``rho``. A jump moves each query to cosine ``jump_cos`` (default :data:`JUMP_COS`)
    with its last value, keeping its norm; 0 draws a fresh query."""
    c = JUMP_COS if jump_cos is None else jump_cos
    g = torch.Generator(device=DEV).manual_seed(seed)
    steps, layers, b = w.q.shape[:3]
    q = w.q.clone().view(steps, layers, b, HKV, -1, D)
    for s in range(1, steps):
        jump = torch.rand(layers, b, HKV, generator=g, device=DEV) < rho
        fresh = torch.randn(q[s].shape, generator=g, device=DEV)
        if c:
            old = q[s - 1].float()
            norm = old.norm(dim=-1, keepdim=True)
            ortho = fresh - (fresh * old).sum(-1, keepdim=True) / norm.square() * old
            ortho = ortho / ortho.norm(dim=-1, keepdim=True) * norm
            fresh = c * old + (1 - c * c) ** 0.5 * ortho
        q[s] = torch.where(jump[..., None, None], fresh.to(DTYPE), q[s - 1])
    w.q = q.view_as(w.q)


def profile(out: Any, names: list[str], shape: str, budget: int, rho: float | None = None) -> None:
    """The CUDA kernels of one eager step (all layers), by total time: where a step spends its
    time. ``rho``: queries jump as in :func:`force_jumps` (``None``: they drift slowly); the
    step profiled is the third, so both reuse and retrieval occur."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    b, t = shape.split("x")
    batch, t_len = int(b), int(t) * 1024
    lens = [t_len - (i * t_len) // (8 * batch) for i in range(batch)]
    for name in names:
        w = Workload(batch, lens, layers=LAYERS, steps=4, drift=0.02, seed=7)
        if rho is not None:
            force_jumps(w, rho)
        st = NewStep(base_name(name), selector_options(name, budget), w, w.batch)
        for step in range(2):
            st.load(step)
            st.run()
        st.load(2)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            st.run()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.device_time_total for e in events)
        emit(
            out,
            {
                "part": "profile",
                "selector": name,
                "options": selector_options(name, budget),
                "shape": shape,
                "rho": rho,
                "kernels": sum(e.count for e in events) / w.layers,
                "gpu_ms_per_layer": total / 1000 / w.layers,
                "top": [
                    [
                        e.key[:60],
                        e.count // w.layers,
                        round(e.device_time_total / 1000 / w.layers, 4),
                    ]
                    for e in events[:40]
                ],
            },
        )
        del st, w
        torch.cuda.empty_cache()


def bench(
    out: Any,
    impl: str,
    steps: int,
    repeats: int,
    budget: int,
    shapes: list[str],
    names: list[str] | None = None,
) -> None:
    if names is None:
        names = ["oracle", "cis", "quest", "streaming"] if impl == "new" else ["cis", "quest"]
    for shape in shapes:
        b, t = shape.split("x")
        batch, t_len = int(b), int(t) * 1024
        # Mixed lengths: up to 1/8 shorter than T.
        lens = [t_len - (i * t_len) // (8 * max(batch, 1)) for i in range(batch)]
        w = Workload(batch, lens, layers=LAYERS, steps=steps, drift=0.02, seed=7)
        dense = bench_dense(w, repeats)
        kv_bytes = sum(lens) * HKV * D * 2 * 2  # one layer's K and V
        emit(
            out,
            {
                "part": "bench",
                "impl": "sdpa",
                "selector": "dense (SDPA flash, GQA)",
                "shape": shape,
                "ms": dense,
                "TB/s": kv_bytes / dense / 1e9,
            },
        )
        for name in names:
            w = Workload(batch, lens, layers=LAYERS, steps=steps, drift=0.02, seed=7)
            fn = bench_new if impl == "new" else bench_old
            try:
                r = fn(name, w, steps, repeats, budget)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            emit(
                out,
                {
                    "part": "bench",
                    "impl": impl,
                    "selector": name,
                    "shape": shape,
                    "budget": budget,
                    "steps": steps,
                    **r,
                    "vs_dense": (r["ms"] / dense) if "ms" in r else None,
                },
            )
            del w
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["check", "bench", "profile"])
    p.add_argument("--impl", choices=["new", "old"], default="new")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--shapes", default="1x16,16x16,16x64", help="BxTk, comma separated")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the logic, no graphs")
    p.add_argument("--batches", default="1,16", help="check: batch sizes")
    p.add_argument(
        "--selectors",
        default=None,
        help="profile: selectors (default streaming,cis,quest); check and bench: only these "
        "(default: every registered one and cis-certified; bench: oracle,cis,quest,streaming)",
    )
    p.add_argument("--rho", type=float, default=None, help="profile: forced query jumps")
    p.add_argument("--jump-cos", type=float, default=0.0,
                   help="profile: a jump's cosine with the query it leaves (0: fresh)")  # fmt: skip
    p.add_argument("--cis", action="append", default=[], metavar="KEY=VALUE",
                   help="a CIS option, e.g. block_size=1 (repeatable)")  # fmt: skip
    a = p.parse_args(argv)
    parse_cis_options(a.cis)
    global DEV, JUMP_COS
    DEV = a.device
    JUMP_COS = a.jump_cos
    out = open(a.out, "a") if a.out else None
    emit(out, {"part": "machine", "impl": a.impl, **machine()})
    if a.part == "profile":
        for shape in a.shapes.split(","):
            profile(out, (a.selectors or "streaming,cis,quest").split(","), shape, a.budget, a.rho)
    elif a.part == "check":
        only = a.selectors.split(",") if a.selectors else None
        check(out, a.steps or 64, [int(b) for b in a.batches.split(",")], only)
    else:
        names = a.selectors.split(",") if a.selectors else None
        bench(out, a.impl, a.steps or 32, a.repeats, a.budget, a.shapes.split(","), names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
