"""How tight are the reuse certificates on real queries? δ̂ / δ, and the reuse they allow.

Replays recorded dense decode traces (``cis_replay.py capture``). At an anchor step the group of
query heads of a KV head chooses ``S``: the sink, the smallest top set (ranked by group-mean
mass) after which *every* query head drops at most ``delta_target = delta_max / 2``, capped at
``k_max``, and the anchor's local window (CIS certified mode with ``hold_local``). A later query
reads ``S`` and every position added since. Certificates compared (all per query head):

- ``global``: ``ε = ‖q − q_a‖·K_max·scaling`` for every key (certified CIS's
  ``certificate="global"``);
- ``box-P``: per page of ``P`` positions, the logit change bounded over the page's key box
  (channel minima and maxima; ``certificate="page"``);
- ``ball-P``: per page, over the ball of the page's mean key and radius;
- ``box-P+read``: ``box-P`` for the dropped pages, with the selected mass ``C`` computed exactly
  over the read set (its keys are scored by the attention anyway; not pre-hoc);
- ``exact-P`` / ``exact-P+read``: per page, the realised extremes of the logit change (no
  metadata can give more): the limit of every per-page bound at that page size.

It reports, for anchors at every 8th step and ages 1, 4 and 16 (``fixed``), the ratio ``δ̂ / δ``
of every query head and how often ``δ̂ ≤ δ_max`` (beside how often the true ``δ ≤ δ_max``);
the per-page width ``u − l`` each bound allows beside the realised spread of the logit change
(``widths``); and the retrieval ratio ρ̂ of certified reuse run as CIS runs it (``policy``:
reuse while every head's ``δ̂ ≤ δ_max`` and the anchor is at most ``n_local`` steps old), with
the metadata each check reads. ``--plot`` draws the distribution of ``δ̂ / δ``.

Usage (repository root)::

    python benchmarks/scripts/certificate_tightness.py /tmp/trace-smollm2 \\
        --delta-max 0.02 0.05 0.1 --out DIR/smollm2.json --plot DIR/smollm2.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from prhs_core import theory as th

AGES = (1, 4, 16)


def anchor_set(
    logits: torch.Tensor, t: int, target: float, k_max: int, n_sink: int, n_local: int
) -> torch.Tensor:
    """``[H, t]`` bool: sink ∪ top set (every head's drop ≤ target, capped) ∪ local window."""
    h, g, _ = logits.shape
    p = torch.softmax(logits[..., :t], -1)  # [H, g, t]
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
    """Box (min, max) and ball (mean, radius) of every aligned page of ``keys [H, T, D]``."""
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


def _pagewise(x: torch.Tensor, page: int, fill: float) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % page), value=fill).unflatten(
        -1, (-1, page)
    )


def certificates(
    q: torch.Tensor,
    qa: torch.Tensor,
    keys: torch.Tensor,
    t: int,
    t_a: int,
    sel: torch.Tensor,
    anchor_logits: torch.Tensor,
    scaling: float,
    pages: list[int],
    metas: dict[int, tuple[torch.Tensor, ...]],
    new_logits: torch.Tensor,
    widths: dict | None = None,
    only: str | None = None,
) -> dict[str, torch.Tensor]:
    """``log δ̂ [H, g]`` of every certificate (or ``only`` one) for queries ``q [H, g, D]``
    (logits ``new_logits [H, g, ≥t]``; the cache holds ``t`` positions) against the anchor
    ``qa`` (``t_a`` positions) and its read set ``sel [H, t]``."""
    a_lg = anchor_logits[..., :t_a]
    keep = sel[:, :t_a].unsqueeze(1).expand_as(a_lg)
    lse_a = torch.logsumexp(a_lg, -1)
    new_lg = new_logits[..., :t]
    lse_read = torch.logsumexp(new_lg.masked_fill(~sel[:, :t].unsqueeze(1), -math.inf), -1)
    change = new_lg[..., :t_a] - a_lg  # the realised change of every anchor logit
    out = {}
    if only in (None, "global"):
        kmax = keys[:, :t_a].double().norm(dim=-1).amax(-1).view(-1, 1)
        eps = th.logit_shift_bound(q.double(), qa.double(), kmax, scaling)
        out["global"] = th.log_reuse_certificate(th.log_dropped_mass(a_lg, keep), eps)
        if widths is not None:
            widths.setdefault("global", []).append((2 * eps).flatten())
    for p in pages if only != "global" else []:
        m_drop, m_sel = th.page_log_masses(a_lg, keep, p)
        n_p = m_drop.shape[-1]
        lo, hi, centre, radius = (x[:, :n_p].unsqueeze(1) for x in metas[p])
        kind = None if only is None else only.split("-")[0]
        bounds = {}
        if kind in (None, "box"):
            bounds[f"box-{p}"] = th.page_box_shift_bounds(q, qa, lo, hi, scaling, check=False)
        if kind in (None, "ball"):
            bounds[f"ball-{p}"] = th.page_ball_shift_bounds(q, qa, centre, radius, scaling)
        if kind in (None, "exact"):
            bounds[f"exact-{p}"] = (
                _pagewise(change, p, math.inf).amin(-1),
                _pagewise(change, p, -math.inf).amax(-1),
            )
        for name, (lower, upper) in bounds.items():
            out[name] = th.log_page_reuse_certificate(m_drop, m_sel, lower, upper, check=False)
            if widths is not None:
                w = (upper - lower).flatten()
                widths.setdefault(name, []).append(w[torch.isfinite(w)])
            if not name.startswith("ball"):
                # The selected mass exactly, over the read set (new positions included).
                log_a = torch.logsumexp(m_drop + lse_a.unsqueeze(-1) + upper, -1)
                out[f"{name}+read"] = log_a - torch.logaddexp(log_a, lse_read)
    return out


def run_layer(trace: dict, li: int, args: argparse.Namespace, acc: dict) -> None:
    q_all, keys = trace["q"][li].double(), trace["k"][li].double()  # [S, Hq, D], [H, T, D]
    scaling, p_len = trace["scaling"], trace["prompt_len"]
    h, total, d = keys.shape
    steps, hq = q_all.shape[:2]
    g = hq // h
    q_all = q_all.view(steps, h, g, d)
    logits = torch.einsum("shgd,htd->shgt", q_all, keys) * scaling  # [S, H, g, T]
    metas = {p: page_meta(keys, p) for p in args.page}
    fixed = acc.setdefault("fixed", {})
    for dm in args.delta_max:
        target = dm / 2
        for s0 in range(0, steps - 1, 8):
            t_a = p_len + s0 + 1
            sel = anchor_set(logits[s0], t_a, target, args.k_max, args.n_sink, args.n_local)
            sel = torch.nn.functional.pad(sel, (0, total - t_a), value=True)  # new ones are read
            for age in AGES:
                s = s0 + age
                if s >= steps:
                    break
                t = p_len + s + 1
                lg = logits[s][..., :t]
                true = th.log_dropped_mass(lg, sel[:, :t].unsqueeze(1).expand_as(lg))
                widths = acc.setdefault("widths", {}) if dm == args.delta_max[0] else None
                cert = certificates(
                    q_all[s], q_all[s0], keys, t, t_a, sel, logits[s0], scaling, args.page,
                    metas, logits[s], widths,
                )  # fmt: skip
                for name, lc in cert.items():
                    rows = fixed.setdefault(f"{dm}/{name}", {}).setdefault(str(age), [])
                    rows.append(torch.stack([true.flatten(), lc.flatten()], -1))
                if widths is not None:
                    change = lg[..., :t_a] - logits[s0][..., :t_a]
                    for p in args.page:
                        spread = _pagewise(change, p, -math.inf).amax(-1) - _pagewise(
                            change, p, math.inf
                        ).amin(-1)
                        widths.setdefault(f"realised-{p}", []).append(spread.flatten())
        # The policy: one anchor chain per certificate and KV head.
        # "oracle": reuse iff every head's true δ is within δ_max (no certificate can allow more
        # reuse of this anchor set).
        names = [*cert, "oracle"]
        policy = acc.setdefault("policy", {})
        for name in names:
            pol = policy.setdefault(
                f"{dm}/{name}",
                {"decisions": 0, "retrievals": 0, "worst": -math.inf, "meta": 0.0, "checks": 0},
            )
            page = int(name.split("-")[1].split("+")[0]) if "-" in name else 0
            for kh in range(h):
                one = {p: tuple(x[kh : kh + 1] for x in m) for p, m in metas.items()}
                anchor = None
                for s in range(steps):
                    t = p_len + s + 1
                    reuse = False
                    if anchor is not None and t - anchor[0] <= args.n_local:
                        t_a, s0, sel = anchor
                        if name == "oracle":
                            lg = logits[s, kh : kh + 1, :, :t]
                            lc = th.log_dropped_mass(lg, sel[:, :t].unsqueeze(1).expand_as(lg))
                        else:
                            lc = certificates(
                                q_all[s, kh : kh + 1], q_all[s0, kh : kh + 1], keys[kh : kh + 1],
                                t, t_a, sel, logits[s0, kh : kh + 1], scaling,
                                [page] if page else [], one, logits[s, kh : kh + 1], only=name,
                            )[name]  # fmt: skip
                            # What a check reads beyond the anchor's queries (bf16 keys): the
                            # global one the norms of the keys added since; a page one each
                            # anchor page's box and two float32 masses per query head.
                            pol["meta"] += (
                                (t - t_a) * d * 2 if not page else -(-t_a // page) * (4 * d + 8 * g)
                            )
                            pol["checks"] += 1
                        reuse = bool(lc.amax() <= math.log(dm))
                    pol["decisions"] += 1
                    if reuse:
                        lg = logits[s, kh : kh + 1, :, :t]
                        true = th.log_dropped_mass(lg, sel[:, :t].unsqueeze(1).expand_as(lg))
                        pol["worst"] = max(pol["worst"], float((true - lc).amax()))
                    else:
                        pol["retrievals"] += 1
                        sel = anchor_set(
                            logits[s, kh : kh + 1], t, target, args.k_max, args.n_sink,
                            args.n_local,
                        )  # fmt: skip
                        sel = torch.nn.functional.pad(sel, (0, total - t), value=True)
                        anchor = (t, s, sel)


def summarise(acc: dict) -> dict:
    out: dict = {"fixed": {}, "widths": {}, "policy": {}}
    for key, ages in acc.get("fixed", {}).items():
        dm = float(key.split("/")[0])
        out["fixed"][key] = {}
        for age, rows in ages.items():
            x = torch.cat(rows)
            true, cert = x[:, 0], x[:, 1]
            ok = torch.isfinite(true)
            ratio = (cert - true)[ok].exp()
            out["fixed"][key][age] = {
                "heads": int(x.shape[0]),
                "violations": int((true > cert + 1e-9).sum()),
                "ratio_median": float(ratio.median()),
                "ratio_p90": float(ratio.quantile(0.9)),
                "certified": float((cert <= math.log(dm)).double().mean()),
                "true_below": float((true <= math.log(dm)).double().mean()),
            }
    for key, rows in acc.get("widths", {}).items():
        x = torch.cat(rows)
        x = x[torch.isfinite(x)]
        out["widths"][key] = {
            "median": float(x.median()),
            "p10": float(x.quantile(0.1)),
            "p90": float(x.quantile(0.9)),
        }
    for key, pol in acc.get("policy", {}).items():
        n = pol["decisions"]
        out["policy"][key] = {
            "decisions": n,
            "rho": pol["retrievals"] / n,
            "worst_log_true_over_bound": pol["worst"],
            "meta_bytes_per_check": pol["meta"] / max(pol["checks"], 1),
        }
    return out


def plot(acc: dict, res: dict, path: str, title: str, delta_max: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for key, ages in acc["fixed"].items():
        dm, name = key.split("/", 1)
        if float(dm) != delta_max or name.startswith("ball"):
            continue
        x = torch.cat([torch.cat(rows) for rows in ages.values()])
        ok = torch.isfinite(x[:, 0])
        r = ((x[ok, 1] - x[ok, 0]) / math.log(10)).sort().values.numpy()
        style = "--" if name.endswith("+read") else "-"
        ax[0].plot(r, (torch.arange(len(r)) + 1).numpy() / len(r), style, label=name)
    ax[0].axvline(0, color="k", lw=0.5)
    ax[0].set_xlabel("log10(δ̂ / δ), every query head, anchor ages 1–16")
    ax[0].set_ylabel("fraction of decisions")
    ax[0].set_title(f"{title}: tightness (δ_max {delta_max})")
    ax[0].legend(fontsize=7)
    names = [k.split("/", 1)[1] for k in res["policy"] if float(k.split("/")[0]) == delta_max]
    rho = [res["policy"][f"{delta_max}/{n}"]["rho"] for n in names]
    ax[1].barh(names, rho)
    ax[1].set_xlim(0, 1)
    ax[1].set_xlabel("retrieval ratio ρ̂ (certified reuse, lower is better)")
    ax[1].set_title(f"δ_max {delta_max}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--layers", type=int, nargs="*", help="layer positions (default: all)")
    ap.add_argument("--delta-max", type=float, nargs="+", default=[0.05])
    ap.add_argument("--page", type=int, nargs="+", default=[16, 4])
    ap.add_argument("--k-max", type=int, default=1024)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--n-local", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args()
    files = sorted(Path(args.trace).glob("w*.pt"), key=lambda p: int(p.stem[1:]))[: args.windows]
    if not files:
        ap.error(f"no trace windows (w0.pt, ...) in {args.trace}: record them first with "
                 "`cis_replay.py capture --out DIR`")  # fmt: skip
    acc: dict = {}
    t0 = time.perf_counter()
    meta = {}
    for f in files:
        trace = torch.load(f)
        meta = {"prompt_len": trace["prompt_len"], "layers": trace["layers"]}
        layers = args.layers if args.layers is not None else range(len(trace["layers"]))
        for li in layers:
            run_layer(trace, li, args, acc)
            print(f"{f.name} layer {li}: {time.perf_counter() - t0:.0f} s", flush=True)
    res = summarise(acc)
    res["config"] = {**vars(args), **meta}
    for key, ages in res["fixed"].items():
        row = " ".join(
            f"age{a}: {v['ratio_median']:.3g}/{v['ratio_p90']:.3g} "
            f"cert {v['certified']:.2f} (true {v['true_below']:.2f}, viol {v['violations']})"
            for a, v in ages.items()
        )
        print(f"{key:>22} {row}")
    for key, v in res["widths"].items():
        spread = f"median {v['median']:.3g} (p10 {v['p10']:.3g}, p90 {v['p90']:.3g})"
        print(f"{'width ' + key:>22} {spread}")
    for key, v in res["policy"].items():
        worst, meta = v["worst_log_true_over_bound"], v["meta_bytes_per_check"]
        print(f"{key:>22} policy ρ̂ {v['rho']:.3f}, worst log(δ/δ̂) {worst:.3g}, {meta:.0f} B/check")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.plot:
        dm = 0.05 if 0.05 in args.delta_max else args.delta_max[0]
        plot(acc, res, args.plot, Path(args.trace).name, dm)


if __name__ == "__main__":
    main()
