"""Selection metrics (the docs' *Theory* page), measured against dense scores on the same steps.

A :class:`SelectionMeter` is an observer of a :class:`~prhs_eval.integration.PrhsRuntime`: after
each selection it scores every cached key exactly (what dense attention would have used) and
records, per (step, layer, KV head) decision:

- ``δ``: the group-mean dropped mass of the positions read (in log space);
- ``β``: the retained-mass gap to the oracle of the same size, ``τ(S*_{|S|}) − τ(S)``, also
  split between the decisions that scored every key (retrievals) and the others (reuses);
- oracle overlap ``|S ∩ S*_{|S|}| / |S|`` and the recall of the top-50%-mass part of it;
- ``ρ̂`` (share of decisions that scored every key, in %), ``Avg KV`` (mean ``|S|``), and the
  bytes read per step (selected K/V rows + proxy bytes, per sequence, all layers);
- violations of a certified ``δ̂`` (some query head of the group drops more than ``δ̂``), when
  the selector certifies;
- routing mutual information per (layer, query head) over the steps of a sequence: the
  empirical ``ΔI_emp = |I_full − I_S|`` beside the bound ``B_MI``, with the
  support of every step padded to the sequence's final length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from prhs_core import theory
from prhs_core.protocols import DecodeStep
from prhs_core.selection import Selection
from prhs_kernels.score import score_keys

__all__ = ["MeterSums", "SelectionMeter", "SelectionMetrics"]


@dataclass(frozen=True)
class SelectionMetrics:
    """Aggregated selection metrics of a run (means over decisions unless said otherwise).

    Attributes
    ----------
    decisions:
        Number of (step, layer, sequence, KV head) decisions measured.
    delta_mean, delta_max:
        Dropped mass ``δ`` of the positions read.
    beta_emp:
        Mean retained-mass gap ``β`` to the same-size oracle.
    oracle_overlap, top_mass_recall:
        Overlap with the same-size oracle set, and recall of its top-50%-mass part.
    retrieval_ratio:
        ``ρ̂`` in %.
    avg_kv:
        Mean positions read per KV head per step (``Avg KV``).
    bytes_per_step, dense_bytes_per_step:
        Bytes read per sequence per decode step over all selectable layers, and what dense
        attention reads.
    b_mi, delta_i_emp:
        Mean MI bound ``B_MI`` and empirical ``ΔI_emp`` over (sequence, layer, query head).
    certificate_violations:
        Decisions where some query head's measured dropped mass is above the certified ``δ̂``
        (``None``: no certificate).
    target_misses:
        Certified retrievals where some query head's dropped mass is above the target
        ``δ_target``, their
        top-p set cut by the cap ``k_max`` (``None``: no certificate). Not violations (their
        ``δ̂`` is their exact ``δ``), and not within the target either.
    beta_retrieval, beta_reuse:
        ``β_emp`` split by decision: over the decisions that scored every key (a retrieval),
        and over the others (for CIS its reuses of an anchor's set; for a selector that never
        scores every key, such as Quest, every decision). ``nan`` where there is no such
        decision or the selector reports no statistics.
    """

    decisions: int
    delta_mean: float
    delta_max: float
    beta_emp: float
    oracle_overlap: float
    top_mass_recall: float
    retrieval_ratio: float
    avg_kv: float
    bytes_per_step: float
    dense_bytes_per_step: float
    b_mi: float
    delta_i_emp: float
    certificate_violations: int | None
    beta_retrieval: float = math.nan
    beta_reuse: float = math.nan
    target_misses: int | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        """Plain dict for result files."""
        return asdict(self)


@dataclass(frozen=True)
class MeterSums:
    """The running sums behind :class:`SelectionMetrics`, for any set of sequences.

    Sums of disjoint sets of sequences add up (:meth:`combine`), so the metrics of a run can be
    recomputed exactly from the sums of its samples (the per-sample rows of a results log):
    :meth:`metrics` is the one place where means are taken, for a live meter and for sums read
    back from a file alike.

    Attributes
    ----------
    decisions:
        Number of (step, layer, sequence, KV head) decisions measured.
    sums:
        Sum over decisions of ``delta``, ``beta``, ``overlap``, ``recall``, ``avg_kv``, and,
        when the selector reports statistics, ``retrieved`` and ``beta_retrieved`` (``β`` of
        the decisions that retrieved), and when it certifies, ``missed`` (retrievals above
        their target).
    delta_max:
        Largest ``δ`` (0 when nothing was measured).
    violations:
        Certificate violations (``None``: no certificate).
    bytes_total, dense_bytes_total:
        Bytes read (selector and dense attention) over every decode step and sequence.
    steps:
        Decode steps measured (per sequence).
    mi_count, delta_i_sum, b_mi_sum:
        Number of (sequence, layer, query head) routing-MI entries and the sums of their
        ``ΔI_emp`` and ``B_MI``.
    """

    decisions: int = 0
    sums: Mapping[str, float] = field(default_factory=dict)
    delta_max: float = 0.0
    violations: int | None = None
    bytes_total: float = 0.0
    dense_bytes_total: float = 0.0
    steps: int = 0
    mi_count: int = 0
    delta_i_sum: float = 0.0
    b_mi_sum: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sums", {str(k): float(v) for k, v in self.sums.items()})

    def __add__(self, other: MeterSums) -> MeterSums:
        if not isinstance(other, MeterSums):
            return NotImplemented
        sums = dict(self.sums)
        for k, v in other.sums.items():
            sums[k] = sums.get(k, 0.0) + v
        if self.violations is None and other.violations is None:
            violations = None
        else:
            violations = (self.violations or 0) + (other.violations or 0)
        return MeterSums(
            decisions=self.decisions + other.decisions,
            sums=sums,
            delta_max=max(self.delta_max, other.delta_max),
            violations=violations,
            bytes_total=self.bytes_total + other.bytes_total,
            dense_bytes_total=self.dense_bytes_total + other.dense_bytes_total,
            steps=self.steps + other.steps,
            mi_count=self.mi_count + other.mi_count,
            delta_i_sum=self.delta_i_sum + other.delta_i_sum,
            b_mi_sum=self.b_mi_sum + other.b_mi_sum,
        )

    @classmethod
    def combine(cls, parts: Iterable[MeterSums]) -> MeterSums:
        """The sums of all ``parts``, added in order."""
        total = cls()
        for p in parts:
            total = total + p
        return total

    def metrics(self) -> SelectionMetrics:
        """The metrics (``nan`` where nothing was measured)."""
        n = self.decisions
        nan = math.nan

        def mean(name: str) -> float:
            return self.sums.get(name, 0.0) / n if n else nan

        steps = self.steps
        mi = self.mi_count
        n_ret = self.sums.get("retrieved", nan)
        beta_ret = self.sums.get("beta_retrieved", nan)
        beta_all = self.sums.get("beta", 0.0)
        return SelectionMetrics(
            decisions=n,
            delta_mean=mean("delta"),
            delta_max=self.delta_max if n else nan,
            beta_emp=mean("beta"),
            oracle_overlap=mean("overlap"),
            top_mass_recall=mean("recall"),
            retrieval_ratio=100.0 * mean("retrieved") if "retrieved" in self.sums else nan,
            avg_kv=mean("avg_kv"),
            bytes_per_step=self.bytes_total / steps if steps else nan,
            dense_bytes_per_step=self.dense_bytes_total / steps if steps else nan,
            b_mi=self.b_mi_sum / mi if mi else nan,
            delta_i_emp=self.delta_i_sum / mi if mi else nan,
            certificate_violations=self.violations,
            beta_retrieval=beta_ret / n_ret if n_ret > 0 else nan,
            beta_reuse=(beta_all - beta_ret) / (n - n_ret) if n - n_ret > 0 else nan,
            target_misses=round(self.sums["missed"]) if "missed" in self.sums else None,
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready: every value finite or ``None``) for result logs."""
        out = asdict(self)
        out["sums"] = dict(self.sums)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeterSums:
        """Inverse of :meth:`as_dict`."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown meter fields {sorted(unknown)}")
        return cls(**dict(data))


class _MIAccumulator:
    """Running sums for one sequence's routing MI, per (layer, query head)."""

    def __init__(self) -> None:
        self.sum_p: dict[int, torch.Tensor] = {}
        self.sum_ps: dict[int, torch.Tensor] = {}
        self.sum_h: dict[int, torch.Tensor] = {}
        self.sum_hs: dict[int, torch.Tensor] = {}
        self.deltas: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def _grow(acc: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
        if acc is None:
            return p.clone()
        t_old, t_new = acc.shape[-1], p.shape[-1]
        if t_new > t_old:
            acc = torch.nn.functional.pad(acc, (0, t_new - t_old))
        elif t_old > t_new:
            p = torch.nn.functional.pad(p, (0, t_old - t_new))
        return acc + p

    def add(self, layer: int, p: torch.Tensor, ps: torch.Tensor, delta: torch.Tensor) -> None:
        """``p``, ``ps``: ``[B, Hq, T]`` dense and sparse routing; ``delta``: ``[B, Hq]``."""
        self.sum_p[layer] = self._grow(self.sum_p.get(layer), p)
        self.sum_ps[layer] = self._grow(self.sum_ps.get(layer), ps)
        self.sum_h[layer] = self.sum_h.get(layer, 0) + theory.entropy(p)
        self.sum_hs[layer] = self.sum_hs.get(layer, 0) + theory.entropy(ps)
        self.deltas.setdefault(layer, []).append(delta)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ΔI_emp, B_MI)`` flattened over (layer, sequence, query head)."""
        d_i, b_mi = [], []
        for layer, deltas in self.deltas.items():
            n = len(deltas)
            t = self.sum_p[layer].shape[-1]
            i_full = theory.entropy(self.sum_p[layer] / n) - self.sum_h[layer] / n
            i_sparse = theory.entropy(self.sum_ps[layer] / n) - self.sum_hs[layer] / n
            d_i.append((i_full - i_sparse).abs().flatten())
            stacked = torch.stack(deltas, dim=-1).clamp(0, 1)  # [B, Hq, steps]
            b_mi.append(theory.mi_loss_bound(stacked, t).flatten())
        if not d_i:
            empty = torch.zeros(0, dtype=torch.float64)
            return empty, empty
        return torch.cat(d_i), torch.cat(b_mi)


class SelectionMeter:
    """Observer measuring every selection against dense attention; see the module docstring.

    Call :meth:`end_sequence` when a batch of sequences finishes (it closes their MI sums) and
    :meth:`result` at the end.
    """

    def __init__(self, *, mi: bool = True, certificate_tolerance: float = 1e-6) -> None:
        self.mi = mi
        self.tolerance = certificate_tolerance
        self._sums: dict[str, float] = {}
        self._delta_max = 0.0
        self._decisions = 0
        self._violations: int | None = None
        self._mi = _MIAccumulator()
        self._mi_results: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bytes_total = 0.0
        self._dense_total = 0.0
        self._step_count = 0
        self._last_layer: int | None = None

    def _add(self, name: str, value: torch.Tensor) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + float(value.double().sum())

    def __call__(self, step: DecodeStep, selection: Selection | None) -> None:
        """Measure one layer's selection at one decode step (``None``: dense)."""
        kv = step.kv
        b, hq, d = step.query.shape
        h = kv.num_kv_heads
        t = kv.max_len
        logits = score_keys(step.query, kv, step.scaling, dtype=torch.float64)  # [B, H, g, T]
        if selection is None:
            pos = torch.arange(t, device=logits.device).view(1, 1, -1)
            chosen = (pos < kv.seq_lens.view(-1, 1, 1)).expand(b, h, t)
        else:
            chosen = selection.to_mask(kv.seq_lens, t)  # [B, H, T]
        chosen_q = chosen.unsqueeze(2)

        # Everything in float64 from one set of logits, in log space where it matters (§2.7).
        lse_all = _logsumexp(logits)
        lse_drop = _logsumexp(logits.masked_fill(chosen_q, float("-inf")))
        lse_keep = _logsumexp(logits.masked_fill(~chosen_q, float("-inf")))
        delta_q = torch.exp(lse_drop - lse_all)  # [B, H, g]
        tau_q = torch.exp(lse_keep - lse_all)
        delta = delta_q.mean(-1)  # group mean (GQA)
        probs = torch.exp(logits - lse_all.unsqueeze(-1))  # 0 past the end
        group_p = probs.mean(2)  # [B, H, T]

        size = chosen.sum(-1, keepdim=True)  # [B, H, 1]
        sorted_p, order = torch.sort(group_p, dim=-1, descending=True, stable=True)
        rank = theory.ranks_from_order(order)
        star = rank < size  # the same-size oracle set
        tau_star = torch.where(star, group_p, 0.0).sum(-1)
        beta = (tau_star - (1 - delta)).clamp_min(0)
        overlap = (star & chosen).sum(-1).double() / size.squeeze(-1).clamp_min(1).double()
        # Top-50%-mass part of the oracle set: its smallest prefix holding half its mass.
        in_star = torch.arange(t, device=order.device).view(1, 1, -1) < size
        cum = torch.cumsum(torch.where(in_star, sorted_p, 0.0), dim=-1)
        half = 0.5 * tau_star.unsqueeze(-1)
        m = (1 + (cum[..., :-1] < half).sum(-1, keepdim=True)).clamp(max=size.clamp_min(1))
        top = rank < m
        recall = (top & chosen).sum(-1).double() / top.sum(-1).clamp_min(1).double()

        n = b * h
        self._decisions += n
        self._add("delta", delta)
        self._delta_max = max(self._delta_max, float(delta.max()))
        self._add("beta", beta)
        self._add("overlap", overlap)
        self._add("recall", recall)
        stats = step.plan.stats
        if stats is not None:
            retrieved = stats.retrieved.double()
            self._add("retrieved", retrieved)
            self._add("beta_retrieved", beta * retrieved)
            self._add("avg_kv", stats.num_selected.double())
            elem = step.query.element_size()
            self._bytes_total += float(stats.bytes_read(head_dim=d, element_size=elem).sum())
            if stats.delta_hat is not None:
                # δ̂ bounds the dropped mass of every query head of the group, not their mean.
                worst = delta_q.amax(-1)
                bad = worst > stats.delta_hat.double() * (1 + self.tolerance) + 1e-12
                self._violations = (self._violations or 0) + int(bad.sum())
            if stats.missed is not None:
                self._add("missed", stats.missed.double())
        else:
            self._add("avg_kv", size.double())
        self._dense_total += (
            float(kv.seq_lens.double().sum()) * h * 2 * d * step.query.element_size()
        )

        if self._last_layer is None or step.layer <= self._last_layer:
            self._step_count += b
        self._last_layer = step.layer

        if self.mi:
            ps = torch.where(chosen_q, probs, 0.0) / tau_q.unsqueeze(-1)
            self._mi.add(
                step.layer, probs.reshape(b, hq, t), ps.reshape(b, hq, t), delta_q.reshape(b, hq)
            )

    def end_sequence(self) -> None:
        """Close the routing-MI sums of the sequences decoded since the last call."""
        if self.mi:
            self._mi_results.append(self._mi.result())
            self._mi = _MIAccumulator()

    def sums(self) -> MeterSums:
        """The running sums so far (closes the open sequence's MI sums first)."""
        self.end_sequence()
        d_i = [x for x, _ in self._mi_results if x.numel()]
        b_mi = [y for _, y in self._mi_results if y.numel()]
        return MeterSums(
            decisions=self._decisions,
            sums=dict(self._sums),
            delta_max=self._delta_max,
            violations=self._violations,
            bytes_total=self._bytes_total,
            dense_bytes_total=self._dense_total,
            steps=self._step_count,
            mi_count=sum(int(x.numel()) for x in d_i),
            delta_i_sum=sum(float(x.double().sum()) for x in d_i),
            b_mi_sum=sum(float(y.double().sum()) for y in b_mi),
        )

    def result(self) -> SelectionMetrics:
        """The metrics so far (``nan`` where nothing was measured)."""
        return self.sums().metrics()


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Float64 log-sum-exp over the last dim, ``-inf`` for an all ``-inf`` row (written out:
    torch's float64 reductions of this kind are far slower on CPU)."""
    m = x.amax(-1, keepdim=True)
    safe = torch.where(torch.isfinite(m), m, 0.0)
    return torch.log(torch.exp(x - safe).sum(-1)) + safe.squeeze(-1)
