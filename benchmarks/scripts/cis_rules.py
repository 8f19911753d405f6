"""Compare CIS reuse rules on recorded dense traces, in an idealised CIS written for the purpose.

``cis_replay.py`` runs the real ``cis`` selector; this script runs a compact re-implementation of
CIS at per-token granularity (retrieval: the top ``budget`` positions by group-mean probability
outside the sink and local windows; reuse: the anchor's set, its dilation and the windows) in
which the reuse *rule* and the reused *set* are easy to swap. It reproduces the selector's
figures (at τ 0.72, budget 512, 2 SmolLM2 windows: β_emp 0.0188 / ρ̂ 27.4 % here, 0.0187 /
27.9 % in the real 8-window run) and measures what a change would give before it is built.

Every decision of every (layer, KV head) row is measured with the meter's definitions: δ, the
group-mean dropped mass of the positions read, and β, the mass the oracle of the same size keeps
minus the mass kept.

Rules (``"rule"`` in a spec):

- ``cos``: reuse iff the cosine of the group's concatenated queries with the anchor's is at
  least ``thr`` (CIS's rule);
- ``cos-min``: the smallest per-head cosine of the group instead;
- ``moment1`` / ``moment2``: reuse iff the predicted group-mean dropped mass of the reused set
  is at most ``thr``, predicted from the anchor by a first- / second-order (diagonal) expansion
  of the log-sum-exp of the kept and dropped keys in ``q − q_a``;
- ``exact-in``: the same, with the kept set's log-sum-exp computed exactly at the new query and
  only the dropped set's expanded (second order);
- ``adapt``: the cosine rule with a threshold per (layer, KV head) that moves after every
  retrieval by ``eta · tanh((e − eps) / eps)``, where ``e`` is what reusing would have lost
  (the reused set's δ minus the retrieval's), starting from ``thr`` each window;
- ``oracle``: reuse iff the reused set's true δ is at most ``thr`` (not implementable: a bound).

Sets: ``hold_local`` (the reuse reads the local window from the anchor's start), ``extra``
(``"dilate"``: ``±1..±r`` around the top ``budget/n_den`` entries, CIS's; ``"next"``: the anchor's
next-best ``2·r·m`` positions instead; ``"none"``), ``shift`` (the reuse also reads the top
``shift`` anchor positions moved by ``t − t_a``), ``retrieval_extra`` (a retrieval reads the
extra entries too).

Usage (traces from ``cis_replay.py capture``)::

    python benchmarks/scripts/cis_rules.py rules /tmp/trace-smollm2 --windows 2 \\
        --spec '{"rule": "cos", "thr": 0.72}' \\
        --spec '{"rule": "cos", "thr": 0.72, "hold_local": true}'
    python benchmarks/scripts/cis_rules.py per-head /tmp/trace-smollm2 --windows 4 --hold-local

``per-head`` sweeps one global τ, then chooses a τ per (layer, KV head) on the first half of the
windows (minimising ``β + λ·ρ̂`` row by row for a range of λ) and reports it on the other half:
the β–ρ̂ curve a calibrated per-head threshold would reach, out of sample.

``calibrate`` writes such a table for the ``cis`` selector's ``tau`` option, with λ bisected to
meet a target mean ρ̂ (``--target-rho``, %) on the given windows::

    python benchmarks/scripts/cis_rules.py calibrate /tmp/trace-qwen --windows 2 \\
        --target-rho 30 --out tau.json
    python benchmarks/scripts/cis_replay.py replay /tmp/trace-qwen --first 2 --windows 2 \\
        --set budget=512 --set tau=@tau.json          # measured on other windows

``self`` calibrates a table per window from the first half of its decode steps and measures it
on the second half, beside one τ and a ``calibrate`` table (what a calibration from the
prompt's own queries would give)::

    python benchmarks/scripts/cis_rules.py self /tmp/trace-qwen --first 2 --windows 2 \\
        --table tau.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

RULES = ("cos", "cos-min", "moment1", "moment2", "exact-in", "adapt", "oracle")


def load(path: Path, windows: int | None) -> list[dict]:
    files = sorted(path.glob("w*.pt"), key=lambda p: int(p.stem[1:]))[:windows]
    return [torch.load(f) for f in files]


def _kv_heads(path: Path) -> int:
    return json.loads((path / "meta.json").read_text())["spec"]["num_kv_heads"]


def run(trace: dict, h: int, spec: dict, tau_state: torch.Tensor | None = None) -> dict:
    """One window: per-step, per-row ``beta``, ``delta``, ``retrieved`` and ``size``."""
    rule, thr = spec.get("rule", "cos"), spec.get("thr", 0.72)
    if rule not in RULES:
        raise SystemExit(f"unknown rule {rule!r}; known: {', '.join(RULES)}")
    budget, n_sink, n_local = (
        spec.get("budget", 512),
        spec.get("n_sink", 4),
        spec.get("n_local", 32),
    )
    r, n_den = spec.get("r", 1), spec.get("n_den", 3)
    extra, shift = spec.get("extra", "dilate"), spec.get("shift", 0)
    hold, ret_extra = spec.get("hold_local", False), spec.get("retrieval_extra", False)
    rescore = spec.get("rescore", 0)
    eps, eta = spec.get("eps", 0.03), spec.get("eta", 0.05)

    q, k = trace["q"].float(), trace["k"].float()  # [L, S, Hq, D], [L, Hkv, T, D]
    n_layers, steps, hq, d = q.shape
    g, t_max = hq // h, k.shape[2]
    rows = n_layers * h
    qg = q.view(n_layers, steps, h, g, d).permute(0, 2, 1, 3, 4).reshape(rows, steps, g, d)
    keys = k.reshape(rows, t_max, d)
    sc = trace["scaling"]
    z = torch.einsum("rsgd,rtd->rsgt", qg, keys) * sc
    lens = trace["prompt_len"] + torch.arange(steps) + 1
    pos = torch.arange(t_max)
    z = z.masked_fill(~(pos.view(1, -1) < lens.view(-1, 1)).view(1, steps, 1, t_max), -math.inf)
    p = torch.softmax(z, -1)
    m = budget // n_den

    a_q = torch.zeros(rows, g, d)
    a_len = torch.zeros(rows, dtype=torch.long)
    a_keep = torch.zeros(rows, t_max, dtype=torch.bool)
    a_top = torch.zeros(rows, budget, dtype=torch.long)
    a_cand = torch.zeros(rows, budget + rescore, dtype=torch.long)  # top set + shortlist
    a_cand_ok = torch.zeros(rows, budget + rescore, dtype=torch.bool)
    a_mu, a_var = torch.zeros(rows, g, d), torch.zeros(rows, g, d)
    a_lout, a_ell = torch.zeros(rows, g), torch.zeros(rows, g)
    if rule == "adapt":
        tau_state = torch.full((rows,), float(thr)) if tau_state is None else tau_state
    out = {key: [] for key in ("beta", "delta", "retrieved", "size", "k_read", "cached")}

    def mask_of(idx: torch.Tensor) -> torch.Tensor:
        mk = torch.zeros(rows, t_max, dtype=torch.bool)
        return mk.scatter_(1, idx.clamp(0, t_max - 1), True)

    for s in range(steps):
        n = int(lens[s])
        ps = p[:, s]  # [R, g, T]
        gm = ps.mean(1)
        local = (pos >= n - n_local) & (pos < n)
        sink = pos < n_sink
        eligible = (pos < n) & ~local & ~sink
        score = gm.masked_fill(~eligible, -1.0)
        ranked_ids = score.topk(budget + rescore, -1)
        top = ranked_ids.indices[:, :budget]
        new = mask_of(top) & eligible
        if extra == "dilate" and r > 0 and m > 0:
            offs = torch.cat([torch.arange(1, r + 1), -torch.arange(1, r + 1)])
            more = mask_of((top[:, :m, None] + offs).flatten(1)) & (pos < n)
        elif extra == "next":
            more = mask_of(score.topk(budget + 2 * r * m, -1).indices) & eligible
        else:
            more = torch.zeros_like(new)
        anchor_set = new | more | sink
        retrieval_read = (anchor_set if ret_extra else new | sink) | local

        if rescore:
            # The anchor's top set and its next ``rescore`` positions scored at the new query:
            # the best ``budget`` of them replace the anchor's top set (their keys are read).
            # Ranked as a selector can without scoring every key: each head's probabilities
            # normalised over the keys it reads (candidates, sink, held local window), averaged
            # over the group ("rescore_rank": "exact" ranks by the true group mean instead).
            if spec.get("rescore_rank", "read") == "exact":
                cand_score = gm.gather(1, a_cand)
            else:
                window = sink | local
                if hold:
                    start = (a_len - n_local).view(-1, 1)
                    window = window | ((pos.view(1, -1) >= start) & (pos.view(1, -1) < n))
                zc = z[:, s].gather(2, a_cand.unsqueeze(1).expand(-1, g, -1))  # [R, g, C]
                zc = zc.masked_fill(~a_cand_ok.unsqueeze(1), -math.inf)
                zw = z[:, s].masked_fill(~window.unsqueeze(1), -math.inf)
                lse = torch.logsumexp(torch.cat([zc, zw], -1), -1, keepdim=True)
                cand_score = torch.exp(zc - lse).mean(1)
            cand_score = cand_score.masked_fill(~a_cand_ok, -1.0)
            best = a_cand.gather(1, cand_score.topk(budget, -1).indices)
            reuse_sel = (mask_of(best) & eligible) | (a_keep & ~mask_of(a_top))
            reuse_read = reuse_sel | sink | local
        else:
            reuse_read = a_keep | sink | local
        if hold:
            start = (a_len - n_local).view(-1, 1)
            reuse_read |= (pos.view(1, -1) >= start) & (pos.view(1, -1) < n)
        if shift:
            moved = a_top[:, :shift] + (n - a_len).view(-1, 1)
            reuse_read |= mask_of(moved) & (pos < n)

        ranked = gm.sort(-1, descending=True).values.cumsum(-1)

        def measure(read: torch.Tensor, ps=ps, ranked=ranked) -> tuple[torch.Tensor, torch.Tensor]:
            delta = (ps * ~read.unsqueeze(1)).sum(-1).mean(-1)
            size = read.sum(-1)
            star = ranked.gather(1, (size - 1).clamp(min=0).view(-1, 1)).squeeze(1)
            return (star - (1 - delta)).clamp_min(0), delta

        beta_reuse, delta_reuse = measure(reuse_read)
        beta_ret, delta_ret = measure(retrieval_read)

        qs = qg[:, s]
        dq = qs - a_q
        if rule in ("cos", "adapt"):
            cos = torch.nn.functional.cosine_similarity(qs.flatten(1), a_q.flatten(1), dim=-1)
            ok = cos >= (tau_state if rule == "adapt" else thr)
        elif rule == "cos-min":
            ok = torch.nn.functional.cosine_similarity(qs, a_q, dim=-1).amin(-1) >= thr
        elif rule == "oracle":
            ok = delta_reuse <= thr
        else:
            if rule == "exact-in":
                kept = torch.logsumexp(z[:, s].masked_fill(~reuse_read.unsqueeze(1), -math.inf), -1)
                log_odds = a_lout + sc * (dq * a_mu).sum(-1) - kept
                log_odds = log_odds + 0.5 * sc * sc * (dq * dq * a_var).sum(-1)
            else:
                log_odds = a_ell + sc * (dq * a_mu).sum(-1)
                if rule == "moment2":
                    log_odds = log_odds + 0.5 * sc * sc * (dq * dq * a_var).sum(-1)
            ok = torch.sigmoid(log_odds).mean(-1) <= thr
        reuse = (a_len > 0) & (n - a_len <= n_local) & ok
        retrieve = ~reuse
        if rule == "adapt":
            seen = retrieve & (a_len > 0)
            move = eta * torch.tanh((delta_reuse - delta_ret - eps) / eps)
            tau_state += torch.where(seen, move, 0.0)
            tau_state.clamp_(-1.0, 1.0)

        out["beta"].append(torch.where(reuse, beta_reuse, beta_ret))
        out["delta"].append(torch.where(reuse, delta_reuse, delta_ret))
        out["retrieved"].append(retrieve.float())
        out["size"].append(torch.where(reuse, reuse_read.sum(-1), retrieval_read.sum(-1)).float())
        # Key rows read beside the attended ones: every key at a retrieval, the shortlist at a
        # reuse that rescores.
        out["k_read"].append(torch.where(reuse, float(rescore), (pos < n).sum().float()))
        out["cached"].append(torch.full((rows,), float(n)))

        rr = retrieve
        a_q[rr], a_len[rr], a_keep[rr], a_top[rr] = qs[rr], n, anchor_set[rr], top[rr]
        if rescore:
            a_cand[rr] = ranked_ids.indices[rr]
            a_cand_ok[rr] = ranked_ids.values[rr] >= 0
        if rule in ("moment1", "moment2", "exact-in"):
            inside = (anchor_set | local).unsqueeze(1)
            outside = ~inside & (pos < n).view(1, 1, -1)
            zs = z[:, s]
            lse_in = torch.logsumexp(zs.masked_fill(~inside, -math.inf), -1)
            lse_out = torch.logsumexp(zs.masked_fill(~outside, -math.inf), -1)
            p_in = torch.softmax(zs.masked_fill(~inside, -math.inf), -1)
            p_out = torch.softmax(zs.masked_fill(~outside, -math.inf), -1).nan_to_num(0.0)
            mu_in = torch.einsum("rgt,rtd->rgd", p_in, keys)
            mu_out = torch.einsum("rgt,rtd->rgd", p_out, keys)
            var_in = torch.einsum("rgt,rtd->rgd", p_in, keys * keys) - mu_in**2
            var_out = torch.einsum("rgt,rtd->rgd", p_out, keys * keys) - mu_out**2
            if rule == "exact-in":
                mu, var = mu_out, var_out
            else:
                mu, var = mu_out - mu_in, var_out - var_in
            a_mu[rr], a_var[rr], a_lout[rr], a_ell[rr] = (
                mu[rr],
                var[rr],
                lse_out[rr],
                (lse_out - lse_in)[rr],
            )
    return {key: torch.stack(v) for key, v in out.items()}  # [S, R] each


def summary(parts: list[dict]) -> dict:
    cat = {key: torch.cat([x[key] for x in parts]) for key in parts[0]}
    return {
        "beta": round(float(cat["beta"].mean()), 4),
        "delta": round(float(cat["delta"].mean()), 4),
        "rho": round(100 * float(cat["retrieved"].mean()), 1),
        "avg_kv": round(float(cat["size"].mean()), 1),
        # K and V of the attended positions plus the keys scored beside them, over dense's K+V.
        "bytes_vs_dense": round(
            float(((2 * cat["size"] + cat["k_read"]) / (2 * cat["cached"])).mean()), 4
        ),
    }


def rules(args: argparse.Namespace) -> None:
    path = Path(args.trace)
    h = _kv_heads(path)
    traces = load(path, args.windows)
    for text in args.spec:
        spec = json.loads(text)
        row = {**spec, **summary([run(tr, h, spec) for tr in traces])}
        print(json.dumps(row), flush=True)
        if args.log:
            with open(args.log, "a") as fh:
                fh.write(json.dumps(row) + "\n")


def per_head(args: argparse.Namespace) -> None:
    path = Path(args.trace)
    h = _kv_heads(path)
    traces = load(path, args.windows)
    half = max(1, len(traces) // 2)
    taus = [float(x) for x in args.taus.split(",")]
    beta, rho = [], []  # [K, W, R]
    for tau in taus:
        spec = {"rule": "cos", "thr": tau, "hold_local": args.hold_local, "budget": args.budget,
                "rescore": args.rescore}  # fmt: skip
        res = [run(tr, h, spec) for tr in traces]
        beta.append(torch.stack([x["beta"].mean(0) for x in res]))
        rho.append(torch.stack([x["retrieved"].mean(0) for x in res]))
        b, p = beta[-1][half:].mean(), rho[-1][half:].mean()
        print(f"global tau {tau}: rho {100 * p:.1f} %  beta {b:.4f}  (windows {half}+)", flush=True)
    b_all, r_all = torch.stack(beta), torch.stack(rho)
    b_cal, r_cal = b_all[:, :half].mean(1), r_all[:, :half].mean(1)  # [K, R]
    b_ev, r_ev = b_all[:, half:].mean(1), r_all[:, half:].mean(1)
    rows = torch.arange(b_all.shape[-1])
    for lam in (0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12):
        pick = (b_cal + lam * r_cal).argmin(0)
        cal = f"rho {100 * r_cal[pick, rows].mean():.1f} % beta {b_cal[pick, rows].mean():.4f}"
        held = f"rho {100 * r_ev[pick, rows].mean():.1f} % beta {b_ev[pick, rows].mean():.4f}"
        print(f"per-head tau, lambda {lam}: calibration {cal} | held out {held}", flush=True)


def _row_curves(traces: list[dict], h: int, taus: list[float], spec: dict) -> tuple:
    """Per (τ, window, row): β and ρ̂ of the cosine rule at each τ of ``taus``."""
    beta, rho = [], []
    for tau in taus:
        res = [run(tr, h, {**spec, "rule": "cos", "thr": tau}) for tr in traces]
        beta.append(torch.stack([x["beta"].mean(0) for x in res]))
        rho.append(torch.stack([x["retrieved"].mean(0) for x in res]))
        print(f"  tau {tau}: rho {100 * rho[-1].mean():.1f} % beta {beta[-1].mean():.4f}",
              flush=True)  # fmt: skip
    return torch.stack(beta), torch.stack(rho)  # [K, W, R]


def calibrate(args: argparse.Namespace) -> None:
    """A τ per (layer, KV head) for ``cis``'s ``tau`` option: per row, the τ of the grid that
    minimises ``β + λ·ρ̂`` over the windows, with λ bisected until the mean ρ̂ meets the
    target. Writes ``{"tau": [[...] per layer], ...provenance}``."""
    path = Path(args.trace)
    meta = json.loads((path / "meta.json").read_text())
    h = meta["spec"]["num_kv_heads"]
    traces = load(path, args.windows)
    taus = [float(x) for x in args.taus.split(",")]
    spec = {"budget": args.budget, "hold_local": not args.sliding}
    beta, rho = _row_curves(traces, h, taus, spec)
    b, r = beta.mean(1), rho.mean(1)  # [K, R]
    rows = torch.arange(b.shape[-1])
    lo, hi = 0.0, 10.0
    for _ in range(60):  # larger λ: fewer retrievals
        lam = (lo + hi) / 2
        pick = (b + lam * r).argmin(0)
        if r[pick, rows].mean() > args.target_rho / 100:
            lo = lam
        else:
            hi = lam
    pick = (b + hi * r).argmin(0)
    table = torch.tensor(taus)[pick].view(-1, h)
    out = {
        "tau": [[round(float(x), 4) for x in row] for row in table],
        "model": meta["model"],
        "text": meta.get("text"),
        "windows": len(traces),
        "budget": args.budget,
        "hold_local": not args.sliding,
        "target_rho": args.target_rho,
        "calibration_rho": round(100 * float(r[pick, rows].mean()), 2),
        "calibration_beta": round(float(b[pick, rows].mean()), 5),
        "grid": taus,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}: rho {out['calibration_rho']} % beta {out['calibration_beta']} "
          f"on the calibration windows")  # fmt: skip


def self_calibration(args: argparse.Namespace) -> None:
    """Calibrate from the text just read: per window, a τ per row chosen on the first half of
    its decode steps (λ bisected to the target ρ̂ there), measured on the second half; beside
    one τ for every row and, with ``--table``, a table calibrated on other windows, measured on
    the same second halves. What a calibration from the prompt's own queries (at prefill) would
    give, before it is built."""
    path = Path(args.trace)
    h = _kv_heads(path)
    traces = load(path, args.first + args.windows)[args.first :]
    taus = sorted({float(x) for x in args.taus.split(",")} | {args.tau})
    spec = {"budget": args.budget, "hold_local": True}
    beta, ret = [], []  # [K][W] of [S, R]
    for tau in taus:
        res = [run(tr, h, {**spec, "rule": "cos", "thr": tau}) for tr in traces]
        beta.append([x["beta"] for x in res])
        ret.append([x["retrieved"] for x in res])
        print(f"  tau {tau}: done", flush=True)
    steps = beta[0][0].shape[0]
    half = steps // 2
    n_rows = beta[0][0].shape[1]
    rows = torch.arange(n_rows)

    def second(pick_w: list[torch.Tensor]) -> tuple[float, float]:
        """Mean β and ρ̂ over the windows' second halves, row r at grid index pick_w[w][r]."""
        b = torch.stack([torch.stack([beta[k][w][half:, r] for r, k in enumerate(p.tolist())])
                         for w, p in enumerate(pick_w)])  # fmt: skip
        q = torch.stack([torch.stack([ret[k][w][half:, r] for r, k in enumerate(p.tolist())])
                         for w, p in enumerate(pick_w)])  # fmt: skip
        return float(b.mean()), 100 * float(q.mean())

    results = {}
    one = torch.full((n_rows,), taus.index(args.tau))
    results[f"tau {args.tau}"] = second([one] * len(traces))
    if args.table:
        table = json.loads(Path(args.table).read_text())["tau"]
        flat = [x for row in table for x in (row if len(row) == h else row * h)]
        pick = torch.tensor([taus.index(min(taus, key=lambda g, x=x: abs(g - x))) for x in flat])
        results[f"table {Path(args.table).name}"] = second([pick] * len(traces))
    picks = []
    for w in range(len(traces)):
        b = torch.stack([beta[k][w][:half].mean(0) for k in range(len(taus))])  # [K, R]
        r = torch.stack([ret[k][w][:half].mean(0) for k in range(len(taus))])
        lo, hi = 0.0, 10.0
        for _ in range(60):
            lam = (lo + hi) / 2
            if r[(b + lam * r).argmin(0), rows].mean() > args.target_rho / 100:
                lo = lam
            else:
                hi = lam
        picks.append((b + hi * r).argmin(0))
    results[f"self, target {args.target_rho} %"] = second(picks)
    for name, (b, q) in results.items():
        row = {"set": name, "beta": round(b, 4), "rho": round(q, 1), "windows": len(traces),
               "first": args.first, "steps": f"{half}..{steps - 1}"}  # fmt: skip
        print(json.dumps(row), flush=True)
        if args.log:
            with open(args.log, "a") as fh:
                fh.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("rules", help="measure each --spec (a JSON object) over the windows")
    a.add_argument("trace")
    a.add_argument("--windows", type=int)
    a.add_argument("--spec", action="append", required=True)
    a.add_argument("--log")
    b = sub.add_parser("per-head", help="a calibrated per-(layer, KV head) tau, out of sample")
    b.add_argument("trace")
    b.add_argument("--windows", type=int, default=4)
    b.add_argument("--taus", default="0.5,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,1.01")
    b.add_argument("--budget", type=int, default=512)
    b.add_argument("--hold-local", action="store_true")
    b.add_argument("--rescore", type=int, default=0, help="reuses rescore this many more")
    c = sub.add_parser("calibrate", help="write a per-(layer, KV head) tau table for cis")
    c.add_argument("trace")
    c.add_argument("--windows", type=int, default=2)
    c.add_argument("--target-rho", type=float, default=28.0, help="mean rho-hat, %%")
    c.add_argument("--taus", default="0.5,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,1.01")
    c.add_argument("--budget", type=int, default=512)
    c.add_argument("--sliding", action="store_true", help="calibrate for hold_local=False")
    c.add_argument("--out", required=True)
    d = sub.add_parser("self", help="a table calibrated on each window's first half, measured "
                       "on its second half")  # fmt: skip
    d.add_argument("trace")
    d.add_argument("--first", type=int, default=0, help="skip the first windows")
    d.add_argument("--windows", type=int, default=2)
    d.add_argument("--target-rho", type=float, default=30.0, help="mean rho-hat, %%")
    d.add_argument("--taus", default="0.5,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,1.01")
    d.add_argument("--tau", type=float, default=0.72, help="the one threshold to compare")
    d.add_argument("--table", help="a calibrate table to compare")
    d.add_argument("--budget", type=int, default=512)
    d.add_argument("--log")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    cmds = {"rules": rules, "per-head": per_head, "calibrate": calibrate, "self": self_calibration}
    cmds[args.cmd](args)


if __name__ == "__main__":
    main()
