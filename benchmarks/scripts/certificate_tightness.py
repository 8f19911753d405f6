"""How tight are the reuse certificates on real queries? δ̂ / δ and the reuse they allow.

Replays recorded dense decode traces (``cis_replay.py capture``). At an anchor step the group of
query heads of a KV head chooses ``S``: the sink, the smallest top set (by group-mean mass)
whose dropped mass is at most ``delta_target`` for *every* query head, capped at ``k_max``, and
the anchor's local window. A later query reads ``S`` and every position added since. For each
certificate (the global one, ``ε = ‖Δq‖·K_max·scaling``; the per-page box of channel minima and
maxima; the per-page ball of centre and radius) the script reports

- ``fixed``: for anchors at every 16th step and ages 1, 2, 4, 8, 16, the ratio ``δ̂ / δ`` of
  every query head (median, 90th percentile), and how often ``δ̂ ≤ δ_max``;
- ``policy``: certified reuse as CIS runs it (reuse while ``max_h δ̂_h ≤ δ_max`` and the anchor
  is at most ``n_local`` steps old, else retrieve), its retrieval ratio ρ̂, the worst realised
  ``δ / δ̂`` (must be ``≤ 1``), and the metadata each check reads.

Usage (repository root)::

    python benchmarks/scripts/certificate_tightness.py /tmp/trace-smollm2 \\
        --delta-max 0.02 0.05 0.1 --out benchmarks/results/DIR/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from prhs_core import theory as th

BOUNDS = ("global", "box", "ball")


def anchor_set(
    logits: torch.Tensor, t: int, target: float, k_max: int, n_sink: int, n_local: int
) -> torch.Tensor:
    """``[H, t]`` bool: sink ∪ top set (every head's drop ≤ target, capped) ∪ local window."""
    h, g, _ = logits.shape
    lg = logits[..., :t]
    p = torch.softmax(lg, -1)  # [H, g, t]
    win = torch.zeros(t, dtype=torch.bool)
    win[: min(n_sink, t)] = True
    win[max(t - n_local, 0) :] = True
    kept = (p * win).sum(-1)  # [H, g]
    group = p.mean(1).masked_fill(win, -1.0)  # rank the rest by group mean
    order = torch.argsort(group, -1, descending=True)
    per_head = torch.gather(p, -1, order.unsqueeze(1).expand(h, g, t))
    dropped_after = 1 - kept.unsqueeze(-1) - per_head.cumsum(-1)  # [H, g, t]
    need = 1 + (dropped_after > target).sum(-1)  # [H, g]
    size = need.amax(-1).clamp(max=k_max)
    rank = th.ranks_from_order(order)
    return (rank < size.unsqueeze(-1)) & (group >= 0) | win


def page_meta(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, ...]:
    """Box and ball of every aligned page of ``keys [H, T, D]``."""
    h, t, d = keys.shape
    pad = -t % page
    k = keys.double()
    lo = torch.nn.functional.pad(k, (0, 0, 0, pad), value=math.inf).view(h, -1, page, d).amin(2)
    hi = torch.nn.functional.pad(k, (0, 0, 0, pad), value=-math.inf).view(h, -1, page, d).amax(2)
    z = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(h, -1, page, d)
    n = torch.nn.functional.pad(torch.ones(t, dtype=torch.float64), (0, pad)).view(-1, page)
    centre = z.sum(2) / n.sum(1).clamp_min(1).view(1, -1, 1)
    dist = (z - centre.unsqueeze(2)).norm(dim=-1).masked_fill(n == 0, -math.inf)
    return lo, hi, centre, dist.amax(-1)


def certificates(
    q: torch.Tensor,
    qa: torch.Tensor,
    keys: torch.Tensor,
    t_a: int,
    sel: torch.Tensor,
    anchor_logits: torch.Tensor,
    scaling: float,
    page: int,
    meta: tuple[torch.Tensor, ...],
) -> dict[str, torch.Tensor]:
    """``log δ̂ [H, g]`` of each certificate for queries ``q [H, g, D]`` against the anchor's."""
    a_logits = anchor_logits[..., :t_a]
    keep = sel[:, :t_a].unsqueeze(1).expand_as(a_logits)
    out = {}
    log_da = th.log_dropped_mass(a_logits, keep)
    kmax = keys[:, :t_a].double().norm(dim=-1).amax(-1).view(-1, 1)
    eps = th.logit_shift_bound(q.double(), qa.double(), kmax, scaling)
    out["global"] = th.log_reuse_certificate(log_da, eps)
    m_drop, m_sel = th.page_log_masses(a_logits, keep, page)
    n_p = m_drop.shape[-1]
    lo, hi, centre, radius = (x[:, :n_p].unsqueeze(1) for x in meta)
    box = th.page_box_shift_bounds(q.double(), qa.double(), lo, hi, scaling, check=False)
    out["box"] = th.log_page_reuse_certificate(m_drop, m_sel, *box, check=False)
    ball = th.page_ball_shift_bounds(q.double(), qa.double(), centre, radius, scaling)
    out["ball"] = th.log_page_reuse_certificate(m_drop, m_sel, *ball, check=False)
    return out


def run_layer(trace: dict, li: int, args: argparse.Namespace, acc: dict) -> None:
    q_all, keys = trace["q"][li].double(), trace["k"][li].double()  # [S, Hq, D], [H, T, D]
    scaling, p_len = trace["scaling"], trace["prompt_len"]
    h, total, d = keys.shape
    steps, hq = q_all.shape[:2]
    g = hq // h
    q_all = q_all.view(steps, h, g, d)
    logits = torch.einsum("shgd,htd->shgt", q_all, keys) * scaling  # [S, H, g, T]
    for dm in args.delta_max:
        target = dm / 2
        metas = {p: page_meta(keys, p) for p in args.page}
        # Fixed anchors and ages.
        for s0 in range(0, steps, 16):
            t_a = p_len + s0 + 1
            sel = anchor_set(logits[s0], t_a, target, args.k_max, args.n_sink, args.n_local)
            sel = torch.nn.functional.pad(sel, (0, total - t_a), value=True)  # new ones are read
            for age in (1, 2, 4, 8, 16):
                s = s0 + age
                if s >= steps:
                    break
                t = p_len + s + 1
                lg = logits[s][..., :t]
                true = th.log_dropped_mass(lg, sel[:, :t].unsqueeze(1).expand_as(lg))
                for p in args.page:
                    cert = certificates(
                        q_all[s], q_all[s0], keys, t_a, sel, logits[s0], scaling, p, metas[p]
                    )
                    for name, lc in cert.items():
                        if name != "global" or p == args.page[0]:
                            key = f"{dm}/{name}" + ("" if name == "global" else f"-{p}")
                            a = acc.setdefault(key, {}).setdefault(str(age), [])
                            a.append(torch.stack([true.flatten(), lc.flatten()], -1))
        # The policy.
        for p in args.page:
            for name in BOUNDS:
                if name == "global" and p != args.page[0]:
                    continue
                key = f"{dm}/{name}" + ("" if name == "global" else f"-{p}")
                pol = acc.setdefault("policy", {}).setdefault(
                    key, {"decisions": 0, "retrievals": 0, "worst": -math.inf, "meta": 0.0}
                )
                for kh in range(h):
                    anchor = None
                    for s in range(steps):
                        t = p_len + s + 1
                        reuse = False
                        if anchor is not None and t - anchor[0] <= args.n_local:
                            t_a, s0, sel = anchor
                            cert = certificates(
                                q_all[s, kh : kh + 1], q_all[s0, kh : kh + 1], keys[kh : kh + 1],
                                t_a, sel, logits[s0, kh : kh + 1], scaling, p,
                                tuple(x[kh : kh + 1] for x in metas[p]),
                            )[name]  # fmt: skip
                            reuse = bool(cert.amax() <= math.log(dm))
                            n_pages = -(-t_a // p)
                            pol["meta"] += (
                                8.0 if name == "global" else n_pages * (2 * d * 2 + 2 * g * 4)
                            )
                        pol["decisions"] += 1
                        if reuse:
                            lg = logits[s, kh : kh + 1, :, :t]
                            true = th.log_dropped_mass(lg, sel[:, :t].unsqueeze(1).expand_as(lg))
                            pol["worst"] = max(pol["worst"], float((true - cert).amax()))
                        else:
                            pol["retrievals"] += 1
                            sel = anchor_set(
                                logits[s, kh : kh + 1], t, target, args.k_max, args.n_sink,
                                args.n_local,
                            )  # fmt: skip
                            sel = torch.nn.functional.pad(sel, (0, total - t), value=True)
                            anchor = (t, s, sel)


def summarise(acc: dict) -> dict:
    out: dict = {"fixed": {}, "policy": {}}
    for key, ages in acc.items():
        if key == "policy":
            continue
        out["fixed"][key] = {}
        for age, rows in ages.items():
            x = torch.cat(rows)
            true, cert = x[:, 0], x[:, 1]
            ok = torch.isfinite(true)
            ratio = (cert - true)[ok].exp()
            dm = float(key.split("/")[0])
            out["fixed"][key][age] = {
                "heads": int(x.shape[0]),
                "violations": int((true > cert + 1e-9).sum()),
                "ratio_median": float(ratio.median()),
                "ratio_p90": float(ratio.quantile(0.9)),
                "log_ratio_mean": float((cert - true)[ok].mean()),
                "certified": float((cert <= math.log(dm)).double().mean()),
                "true_below": float((true <= math.log(dm)).double().mean()),
            }
    for key, pol in acc.get("policy", {}).items():
        n = pol["decisions"]
        out["policy"][key] = {
            "decisions": n,
            "rho": pol["retrievals"] / n,
            "worst_log_true_over_bound": pol["worst"],
            "meta_bytes_per_check": pol["meta"] / max(n - pol["retrievals"], 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--layers", type=int, nargs="*", help="layer positions (default: all)")
    ap.add_argument("--delta-max", type=float, nargs="+", default=[0.05])
    ap.add_argument("--page", type=int, nargs="+", default=[16])
    ap.add_argument("--k-max", type=int, default=1024)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--n-local", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    files = sorted(Path(args.trace).glob("w*.pt"), key=lambda p: int(p.stem[1:]))[: args.windows]
    acc: dict = {}
    t0 = time.perf_counter()
    for f in files:
        trace = torch.load(f)
        layers = args.layers if args.layers is not None else range(len(trace["layers"]))
        for li in layers:
            run_layer(trace, li, args, acc)
            print(f"{f.name} layer {li}: {time.perf_counter() - t0:.0f} s", flush=True)
    res = summarise(acc)
    res["config"] = {k: v for k, v in vars(args).items()}
    for key, ages in res["fixed"].items():
        row = " ".join(
            f"age{a}: {v['ratio_median']:.3g}/{v['ratio_p90']:.3g} cert {v['certified']:.2f}"
            for a, v in ages.items()
        )
        print(f"{key:>18} {row}")
    for key, v in res["policy"].items():
        print(
            f"{key:>18} policy rho {v['rho']:.3f} worst log(δ/δ̂) "
            f"{v['worst_log_true_over_bound']:.3g} meta/check {v['meta_bytes_per_check']:.0f} B"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
