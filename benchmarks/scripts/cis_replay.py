"""Replay decode selectors on recorded dense traces: β_emp and ρ̂ in seconds, not minutes.

A perplexity run spends its time in the model (prefill and 63 decode forwards per window).
What a decode selector's options change, though, is only what it selects from the queries and
keys it is given. This script records them once, on the dense trajectory, and then runs any
selector over the recording, measuring every selection with the same meter as ``prhs-eval``.

The queries of a real sparse run differ slightly from the dense run's (earlier layers attended
sparsely), so the figures here approximate a real run's β_emp and ρ̂; perplexity needs the
real run (``prhs-eval compare``). Use this to rank options, then confirm with the real run.

Usage (repository root)::

    python benchmarks/scripts/cis_replay.py capture --windows 8 --out /tmp/trace-smollm2
    python benchmarks/scripts/cis_replay.py replay /tmp/trace-smollm2 --selector cis \\
        --set budget=512 --set block_size=1 --set tau=0.8 [--per-layer]
    python benchmarks/scripts/cis_replay.py cosines /tmp/trace-smollm2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from prhs_core.layout import ContiguousKV
from prhs_core.protocols import DecodeStep
from prhs_core.registry import selectors
from prhs_eval.integration import attention_spec, enable
from prhs_eval.metrics import SelectionMeter
from prhs_eval.runner import parse_option_value
from prhs_kernels import token_locations


def capture(args: argparse.Namespace) -> None:
    from prhs_eval.models import load_model
    from prhs_eval.tasks.perplexity import perplexity_text

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    samples = perplexity_text(
        tok, context_len=args.context_len, num_samples=args.windows, seed=args.seed,
        source=args.text,
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = attention_spec(model.config)
    meta = {
        "model": args.model, "context_len": args.context_len, "score_tokens": args.score_tokens,
        "text": args.text, "seed": args.seed, "windows": len(samples),
        "spec": {"num_layers": spec.num_layers, "num_q_heads": spec.num_q_heads,
                 "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
    }  # fmt: skip
    for sample in samples:
        ids = tok(sample.prompt, return_tensors="pt", add_special_tokens=True).input_ids
        n = args.score_tokens
        prompt, targets = ids[:, :-n], ids[0, -n:]
        queries: dict[int, list[torch.Tensor]] = {}
        last: dict[int, ContiguousKV] = {}
        nll = 0.0

        def record(step: DecodeStep, selection: object, queries=queries, last=last) -> None:
            queries.setdefault(step.layer, []).append(step.query[0].clone())
            last[step.layer] = step.kv

        prompt_q: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        with torch.no_grad(), enable(model, "dense") as runtime, _prompt_queries(prompt_q):
            runtime.add_observer(record)
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            logits = model(input_ids=prompt, past_key_values=cache, logits_to_keep=1).logits
            for i in range(n):
                nll -= float(torch.log_softmax(logits[0, -1].float(), -1)[targets[i]])
                if i + 1 < n:
                    logits = model(input_ids=targets[i : i + 1].view(1, 1), past_key_values=cache
                                   ).logits  # fmt: skip
        layers = sorted(queries)
        length = int(last[layers[0]].seq_lens[0])
        trace = {
            "layers": layers,
            "prompt_len": prompt.shape[1],
            "q": torch.stack([torch.stack(queries[lay]) for lay in layers]),  # [L, S, Hq, D]
            "k": torch.stack([last[lay].k[0, :, :length].clone() for lay in layers]),
            "v": torch.stack([last[lay].v[0, :, :length].clone() for lay in layers]),
            "scaling": model.config.head_dim**-0.5
            if getattr(model.config, "head_dim", None)
            else (model.config.hidden_size // model.config.num_attention_heads) ** -0.5,
            "dense_nll": nll / n,
            # The prompt's last PROMPT_QUERIES queries per layer [L, W, Hq, D]: what a host
            # shows a selector at prefill (CIS's tau="auto" calibration).
            "prompt_q": torch.stack([prompt_q[lay] for lay in layers]),
        }
        torch.save(trace, out / f"w{sample.index}.pt")
        print(f"window {sample.index}: {length} positions, dense ppl "
              f"{torch.tensor(nll / n).exp():.3f}, {time.perf_counter() - t0:.1f} s")  # fmt: skip
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


PROMPT_QUERIES = 32


@contextlib.contextmanager
def _prompt_queries(store: dict[int, torch.Tensor]):
    """Record each layer's last :data:`PROMPT_QUERIES` prefill queries (after RoPE) into
    ``store`` while the dense runtime prefills: the prefill path's SDPA call is wrapped."""
    from transformers.integrations import sdpa_attention as integration

    inner = integration.sdpa_attention_forward

    def wrapped(module, query, *args, **kwargs):  # type: ignore[no-untyped-def]
        if query.shape[2] > 1:
            store[module.layer_idx] = query[0, :, -PROMPT_QUERIES:].transpose(0, 1).clone()
        return inner(module, query, *args, **kwargs)

    integration.sdpa_attention_forward = wrapped
    try:
        yield
    finally:
        integration.sdpa_attention_forward = inner


def _traces(path: Path, limit: int | None, first: int = 0):
    files = sorted(path.glob("w*.pt"), key=lambda p: int(p.stem[1:]))[first:]
    for f in files[:limit]:
        yield torch.load(f)


def _option(key: str, value: str) -> object:
    """A ``--set`` value; ``@FILE`` reads JSON (an object's entry ``key``, as
    ``prhs-eval --set`` does)."""
    if not value.startswith("@"):
        return parse_option_value(value)
    data = json.loads(Path(value[1:]).read_text())
    return data[key] if isinstance(data, dict) else data


def replay_one(trace: dict, name: str, options: dict, spec, per_layer: dict | None) -> object:
    """Run ``name`` over one recorded window; return the meter's sums."""
    selector = selectors.create(name, **options)
    q, k, v = trace["q"], trace["k"], trace["v"]
    layers, p_len = trace["layers"], trace["prompt_len"]
    total = k.shape[2]
    state = selector.init_state(spec, capacity=1, max_seq_len=total, kv_dtype=k.dtype,
                                device=k.device)  # fmt: skip
    state.pool.create([0])
    plan = selector.make_plan(state, batch_size=1, scaling=trace["scaling"], stats=True,
                              checked=False)  # fmt: skip
    meter = SelectionMeter(mi=False)
    layer_meters = {lay: SelectionMeter(mi=False) for lay in layers} if per_layer is not None \
        else {}  # fmt: skip
    zero = torch.zeros(1, dtype=torch.int32)
    n_q = selector.prompt_queries() if hasattr(selector, "prompt_queries") else 0
    if n_q and "prompt_q" in trace:  # the prompt, as a host shows it at prefill
        kv_len = torch.tensor([p_len], dtype=torch.int32)
        for li, lay in enumerate(layers):
            kv = ContiguousKV(k[li, :, :p_len].unsqueeze(0), v[li, :, :p_len].unsqueeze(0),
                              kv_len, zero)  # fmt: skip
            if state.side is not None:
                loc = token_locations(kv, torch.arange(p_len).view(1, -1), state.row_stride)
                selector.write_kv(state, lay, loc.flatten(), kv.k[0].transpose(0, 1),
                                  kv.v[0].transpose(0, 1), checked=False)  # fmt: skip
            w = trace["prompt_q"][li, -n_q:].unsqueeze(0)
            selector.observe_prompt(state, lay, [0], w, kv, trace["scaling"], [(0, p_len)])
    for s in range(q.shape[1]):
        n = p_len + s + 1
        lens = torch.tensor([n], dtype=torch.int32)
        plan.update(lens, torch.arange(1))
        for li, lay in enumerate(layers):
            kv = ContiguousKV(k[li, :, :n].unsqueeze(0), v[li, :, :n].unsqueeze(0), lens, zero)
            pos = torch.arange(n).view(1, -1) if s == 0 else torch.tensor([[n - 1]])
            if state.side is not None:
                loc = token_locations(kv, pos, state.row_stride)
                selector.write_kv(state, lay, loc.flatten(), kv.k[0, :, pos[0]].transpose(0, 1),
                                  kv.v[0, :, pos[0]].transpose(0, 1), checked=False)  # fmt: skip
            kv = ContiguousKV(kv.k, kv.v, plan.seq_lens, zero)
            query = q[li, s].unsqueeze(0)
            sel = selector.select(plan, lay, query, kv, state)
            step = DecodeStep(lay, query, kv, plan)
            meter(step, sel)
            if per_layer is not None:
                layer_meters[lay](step, sel)
    if per_layer is not None:
        for lay, m in layer_meters.items():
            per_layer.setdefault(lay, []).append(m.sums())
    return meter.sums()


def replay(args: argparse.Namespace) -> None:
    path = Path(args.trace)
    meta = json.loads((path / "meta.json").read_text())
    from prhs_core.config import AttentionSpec

    spec = AttentionSpec(**meta["spec"])
    meta["spec"]["group_size"] = spec.num_q_heads // spec.num_kv_heads
    options = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        options[key] = _option(key, value)
    per_layer: dict | None = {} if args.per_layer else None
    from prhs_eval.metrics import MeterSums

    parts = []
    t0 = time.perf_counter()
    for trace in _traces(path, args.windows, args.first):
        parts.append(replay_one(trace, args.selector, options, spec, per_layer))
    m = MeterSums.combine(parts).metrics()
    shown = {k: ("table" if isinstance(v, list) else v) for k, v in options.items()}
    row = {
        "selector": args.selector, **shown, "first": args.first, "beta": m.beta_emp,
        "beta_retrieval": m.beta_retrieval, "beta_reuse": m.beta_reuse, "rho": m.retrieval_ratio,
        "avg_kv": m.avg_kv, "bytes": m.bytes_per_step / m.dense_bytes_per_step,
        "overlap": m.oracle_overlap,
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    print(json.dumps(row))
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    if per_layer is not None:
        for lay, sums in sorted(per_layer.items()):
            lm = MeterSums.combine(sums).metrics()
            print(f"  layer {lay:2d}: β {lm.beta_emp:.4f} (retr {lm.beta_retrieval:.4f}, reuse "
                  f"{lm.beta_reuse:.4f}) ρ̂ {lm.retrieval_ratio:5.1f} %")  # fmt: skip


def cosines(args: argparse.Namespace) -> None:
    """Per layer: the cosine of each step's group queries with the previous step's."""
    path = Path(args.trace)
    meta = json.loads((path / "meta.json").read_text())
    h = meta["spec"]["num_kv_heads"]
    g = meta["spec"]["num_q_heads"] // h
    per: dict[int, list[torch.Tensor]] = {}
    for trace in _traces(path, args.windows):
        q = trace["q"]  # [L, S, Hq, D]
        lq, s, _, d = q.shape
        gq = q.view(lq, s, h, g * d)
        c = torch.nn.functional.cosine_similarity(gq[:, 1:], gq[:, :-1], dim=-1)  # [L, S-1, H]
        for li, lay in enumerate(trace["layers"]):
            per.setdefault(lay, []).append(c[li].flatten())
    for lay, cs in sorted(per.items()):
        c = torch.cat(cs)
        qs = torch.quantile(c, torch.tensor([0.1, 0.5, 0.9]))
        print(f"layer {lay:2d}: cos p10 {qs[0]:.3f} p50 {qs[1]:.3f} p90 {qs[2]:.3f}  "
              f"≥0.8 {100 * (c >= 0.8).float().mean():5.1f} %  ≥0.9 "
              f"{100 * (c >= 0.9).float().mean():5.1f} %")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--context-len", type=int, default=4096)
    c.add_argument("--score-tokens", type=int, default=64)
    c.add_argument("--windows", type=int, default=8)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--text", default="kjv")
    c.add_argument("--out", required=True)
    r = sub.add_parser("replay")
    r.add_argument("trace")
    r.add_argument("--selector", default="cis")
    r.add_argument("--set", action="append")
    r.add_argument("--windows", type=int)
    r.add_argument("--first", type=int, default=0, help="skip the first windows")
    r.add_argument("--per-layer", action="store_true")
    r.add_argument("--log")
    s = sub.add_parser("cosines")
    s.add_argument("trace")
    s.add_argument("--windows", type=int)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    {"capture": capture, "replay": replay, "cosines": cosines}[args.cmd](args)


if __name__ == "__main__":
    main()
