"""The ``prhs`` attention backend: SGLang's paged KV pool, a prhs selector at every decode step.

One backend lives in each scheduler (TP rank) process. It keeps SGLang's KV pool as the only
copy of K/V and adds:

- a :class:`~prhs_core.state.SelectorState` sized by SGLang's pools: one per-request slot per
  ``req_to_token`` row, one side-cache row per KV-pool slot;
- per decode step, a :class:`~prhs_core.plan.DecodePlan` (one per power-of-two batch bucket,
  padded rows marked ``slot = -1``) and, per layer, ``select`` then sparse attention over a
  :class:`~prhs_core.layout.PagedKV` view of the pool;
- prefill / extend through a dense SGLang backend (``torch_native`` on the CPU, ``triton`` on
  CUDA), or through PSAW's windowed attention where the selector plans a window for the layer;
  a selector that observes prompts (CIS with ``tau="auto"``) then sees each request's last
  extended queries and its cached K/V, per layer, to calibrate on.

Request lifecycle. The request id SGLang attaches to each batch row (or, without ids, the
``req_to_token`` row's *generation*, which SGLang bumps whenever it hands the row to a new
request) tells a new request from a continuing one: a row now held by another request gets
fresh selector state before its first forward, whether that request arrives with a prefix from
the radix cache or not; the chunks of a chunked prefill (same row, same request) continue one
state. A row freed by SGLang (finish, abort, retraction) releases its state at once through the
``ReqToTokenPool.free_rows`` hook the plugin registers.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.runtime_context import get_parallel
from torch.nn.functional import scaled_dot_product_attention

from prhs_core.config import AttentionSpec
from prhs_core.layout import ContiguousKV, PagedKV
from prhs_core.plan import DecodePlan
from prhs_kernels.paths import kernel_path, warm_up
from prhs_kernels.prefill import psaw_prefill_attention
from prhs_kernels.sparse_decode import sparse_decode_attention
from prhs_sglang.config import SparseAttnConfig, SparseConfigError

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

__all__ = ["PrhsAttnBackend", "live_backends"]

logger = logging.getLogger("prhs_sglang")

_LIVE: weakref.WeakSet[PrhsAttnBackend] = weakref.WeakSet()


def live_backends() -> list[PrhsAttnBackend]:
    """The prhs backends of this process (one per model runner)."""
    return list(_LIVE)


def _bucket(n: int) -> int:
    """The power of two ``>= n``: decode batches of ``n`` rows run padded to it."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Bucket:
    """One batch bucket's plan and padded per-step buffers (reused every step)."""

    plan: DecodePlan
    req_pool_indices: torch.Tensor  # [P] int64, padded rows -> row 0 (SGLang's padding row)
    seq_lens: torch.Tensor  # [P] int32, padded rows -> 1
    slots: torch.Tensor  # [P] int64 on the CPU, padded rows -> -1
    query: torch.Tensor  # [P, Hq, D], padded rows stay 0


@dataclass
class _DecodeStep:
    bucket: _Bucket
    batch_size: int
    max_len: int


def _bucket_bytes(b: _Bucket) -> int:
    sel = b.plan.selection
    tensors = [b.req_pool_indices, b.seq_lens, b.slots, b.query, sel.indices, sel.counts]
    return sum(t.numel() * t.element_size() for t in tensors)


class PrhsAttnBackend(AttentionBackend):
    """SGLang attention backend running a prhs selector at decode (see the module docstring)."""

    def __init__(self, model_runner: ModelRunner, sparse: SparseAttnConfig | None = None) -> None:
        super().__init__()
        self.sparse = sparse if sparse is not None else SparseAttnConfig.from_env()
        _check_runner(model_runner)
        self.device = torch.device(model_runner.device)
        dense_name = self.sparse.dense_backend or (
            "triton" if self.device.type == "cuda" else "torch_native"
        )
        if dense_name not in ATTENTION_BACKENDS:
            raise SparseConfigError(
                f"--sparse-config dense_backend {dense_name!r} is not an SGLang attention "
                f"backend; known: {sorted(ATTENTION_BACKENDS)}"
            )
        self.dense_backend_name = dense_name
        self.dense: AttentionBackend = ATTENTION_BACKENDS[dense_name](model_runner)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        self.forward_metadata = None

        mc = model_runner.model_config
        par = get_parallel()
        tp = par.attn_tp_size
        self.tp_rank = getattr(par, "attn_tp_rank", 0)
        self.spec = AttentionSpec(
            num_layers=mc.num_hidden_layers,
            num_q_heads=mc.get_num_attention_heads(tp),
            num_kv_heads=mc.get_num_kv_heads(tp),
            head_dim=mc.head_dim,
        )
        self.scaling = mc.head_dim**-0.5
        self.selector = self.sparse.build()
        req_to_token = self.req_to_token_pool.req_to_token
        self.max_context_len = int(req_to_token.shape[1])
        k0 = self.token_to_kv_pool.get_key_buffer(self.token_to_kv_pool.start_layer)
        self.state = self.selector.init_state(
            self.spec,
            capacity=int(req_to_token.shape[0]),
            max_seq_len=self.max_context_len,
            num_kv_locations=int(k0.shape[0]),
            kv_page_size=self.page_size,
            kv_dtype=k0.dtype,
            device=self.device,
        )
        self._selectable = frozenset(self.spec.selectable_layers)
        # The request holding each row (its id, or the row's generation; None: free).
        self._owner: list[object] = [None] * int(req_to_token.shape[0])
        self._lock = threading.Lock()  # the scheduler thread frees rows; the forward reads them
        self._buckets: dict[int, _Bucket] = {}
        self._step: _DecodeStep | None = None
        self._checked_layers: set[int] = set()
        self._prefill_plans = self._plan_prefill()
        observe = getattr(self.selector, "prompt_queries", None)
        self._prompt_queries = int(observe()) if observe is not None else 0
        self._last_selectable = max(self.spec.selectable_layers)
        # Statistics: host counters plus the plans' device totals, read when logged/reported.
        self.decode_steps = 0
        self.prompts_observed = 0  # extends shown to a selector that calibrates on prompts
        self._cached_sum = 0.0  # sum over decode steps of the mean cached length
        self._last_logged: dict[str, float] = {}
        self._last_logged_steps = 0
        self._last_logged_cached = 0.0
        _LIVE.add(self)
        named = getattr(self.selector, "kernel_path", None)  # selectors not built on BaseSelector
        self.kernel_path = named(k0.device, k0.dtype) if named else kernel_path(k0.device, k0.dtype)
        warm_up(k0.device)  # Numba's one-time compile on the CPU, before the first request
        logger.info(
            "prhs-sglang: selector %s (%s), kernels %s, dense backend %s, KV pool %s slots, "
            "%d request rows, state %.1f MiB, TP rank %d",
            self.sparse.selector,
            self.selector.config,
            self.kernel_path,
            dense_name,
            k0.shape[0],
            req_to_token.shape[0],
            sum(self.state.nbytes().values()) / 2**20,
            self.tp_rank,
        )

    # -- prefill planning ---------------------------------------------------------------------
    def _plan_prefill(self) -> dict[int, Any]:
        planner = getattr(self.selector, "plan_prefill", None)
        if planner is None:
            return {}
        plans: dict[int, Any] = {}
        frozen = False
        for layer in range(self.spec.num_layers):
            plan = planner(layer, self.spec.num_layers)
            frozen = frozen or plan.frozen_fraction > 0.0
            if plan.window_fraction > 0.0:
                plans[layer] = plan
        if frozen:
            logger.warning(
                "prhs-sglang: %s plans ETF's frozen prefix, which leaves hidden states unchanged "
                "inside decoder layers; an attention backend cannot do that, so prefill under "
                "SGLang computes every row (ETF's savings are not applied)",
                self.sparse.selector,
            )
        if plans:
            logger.info("prhs-sglang: PSAW windowed prefill in layers %s", sorted(plans))
        return plans

    # -- request lifecycle ----------------------------------------------------------------------
    def _sync_rows(self, rows: list[int], rids: list[str] | None) -> None:
        """Fresh state for rows now held by another request than when this backend last saw
        them. The request is named by its id when SGLang gives the batch's ids (captured when
        the batch was scheduled, so an overlapped scheduler reallocating a freed row cannot
        race it), else by the row's generation."""
        gen = self.req_to_token_pool.req_generation
        pool = self.state.pool
        with self._lock:
            for i, row in enumerate(rows):
                if row <= 0:  # row 0 is SGLang's padding row
                    continue
                owner = rids[i] if rids is not None else int(gen[row])
                if self._owner[row] != owner:
                    if pool.is_active(row):
                        pool.release([row])
                    pool.create([row])
                    self._owner[row] = owner

    def release_rows(self, rows: list[int]) -> None:
        """SGLang freed ``rows`` (finish, abort, retraction): release their state."""
        pool = self.state.pool
        with self._lock:
            live = [r for r in rows if 0 < r < pool.capacity and pool.is_active(r)]
            if live:
                pool.release(live)
            for r in rows:
                if 0 <= r < len(self._owner):
                    self._owner[r] = None

    def release_all(self) -> None:
        """SGLang cleared its request pool."""
        with self._lock:
            self.state.pool.release_all()
            self._owner = [None] * len(self._owner)

    @property
    def live_states(self) -> int:
        """Requests holding selector state now."""
        return self.state.pool.num_active

    # -- per-forward metadata -------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.dense.init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        self._step = None
        if mode.is_idle():
            return
        rows_cpu = forward_batch.req_pool_indices_cpu
        if rows_cpu is None:
            rows_cpu = forward_batch.req_pool_indices.cpu()
        rows = [int(r) for r in rows_cpu.tolist()]
        rids = forward_batch.rids
        self._sync_rows(rows, list(rids) if rids is not None and len(rids) == len(rows) else None)
        if mode.is_decode():
            self._step = self._prepare_decode(forward_batch, rows_cpu)

    def _bucket_for(self, n: int) -> _Bucket:
        p = _bucket(n)
        b = self._buckets.get(p)
        if b is None:
            plan = self.selector.make_plan(
                self.state,
                batch_size=p,
                scaling=self.scaling,
                stats=self.sparse.stats,
                checked=self.sparse.checked,
            )
            dev = self.device
            b = _Bucket(
                plan=plan,
                req_pool_indices=torch.zeros(p, dtype=torch.int64, device=dev),
                seq_lens=torch.ones(p, dtype=torch.int32, device=dev),
                slots=torch.full((p,), -1, dtype=torch.int64),
                query=torch.zeros(
                    p, self.spec.num_q_heads, self.spec.head_dim, dtype=self._dtype(), device=dev
                ),
            )
            self._buckets[p] = b
        return b

    def _dtype(self) -> torch.dtype:
        return self.token_to_kv_pool.get_key_buffer(self.token_to_kv_pool.start_layer).dtype

    def _prepare_decode(self, fb: ForwardBatch, rows_cpu: torch.Tensor) -> _DecodeStep:
        n = int(fb.batch_size)
        b = self._bucket_for(n)
        b.req_pool_indices[:n].copy_(fb.req_pool_indices, non_blocking=True)
        b.seq_lens[:n].copy_(fb.seq_lens, non_blocking=True)
        slots = rows_cpu.to(torch.int64)
        b.slots[:n].copy_(torch.where(slots > 0, slots, -1))
        if n < b.slots.shape[0]:  # padded rows: SGLang's padding row, one cached position
            b.req_pool_indices[n:].zero_()
            b.seq_lens[n:].fill_(1)
            b.slots[n:].fill_(-1)
            b.query[n:].zero_()
        b.plan.update(b.seq_lens, b.slots)
        if fb.seq_lens_cpu is not None:
            lens = fb.seq_lens_cpu[:n]
            max_len = int(lens.max())
            self._cached_sum += float(lens.double().mean())
        else:
            max_len = self.max_context_len
        self.decode_steps += 1
        return _DecodeStep(b, n, max(1, min(max_len, self.max_context_len)))

    # -- forward --------------------------------------------------------------------------------
    def _check_layer(self, layer: RadixAttention) -> None:
        lid = layer.layer_id
        if lid in self._checked_layers:
            return
        s = self.spec
        got = (layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim)
        if got != (s.num_q_heads, s.num_kv_heads, s.head_dim) or layer.v_head_dim != s.head_dim:
            raise RuntimeError(
                f"prhs-sglang: layer {lid} has (Hq, Hkv, D, Dv) = {(*got, layer.v_head_dim)}, the "
                f"model config gave ({s.num_q_heads}, {s.num_kv_heads}, {s.head_dim}, "
                f"{s.head_dim}); this model family is not supported"
            )
        if getattr(layer, "sliding_window_size", -1) not in (None, -1):
            raise RuntimeError(
                f"prhs-sglang: layer {lid} uses a sliding window; sliding-window models are not "
                "supported yet"
            )
        if getattr(layer, "is_cross_attention", False):
            raise RuntimeError("prhs-sglang: cross-attention layers are not supported")
        if not math.isclose(layer.scaling, self.scaling, rel_tol=1e-6):
            raise RuntimeError(
                f"prhs-sglang: layer {lid} scales logits by {layer.scaling}, not 1/sqrt(D) = "
                f"{self.scaling}; this model family is not supported"
            )
        if getattr(layer, "logit_cap", 0.0) not in (None, 0.0, 0):
            raise RuntimeError("prhs-sglang: attention logit soft-capping is not supported")
        self._checked_layers.add(lid)

    def _write_side(self, layer: RadixAttention, fb: ForwardBatch, k: Any, v: Any) -> None:
        if k is None or v is None or layer.layer_id not in self._selectable:
            return
        s = self.spec
        self.selector.write_kv(
            self.state,
            layer.layer_id,
            fb.out_cache_loc,
            k.reshape(-1, s.num_kv_heads, s.head_dim),
            v.reshape(-1, s.num_kv_heads, layer.v_head_dim),
            checked=self.sparse.checked,
        )

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        self._check_layer(layer)
        plan = self._prefill_plans.get(layer.layer_id)
        if plan is None:
            out = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        else:
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v
                )
            out = self._windowed_extend(q, layer, forward_batch, plan)
        if save_kv_cache:
            self._write_side(layer, forward_batch, k, v)
        if self._prompt_queries and layer.layer_id in self._selectable:
            self._observe_prompt(q, layer, forward_batch)
        return out

    def _extend_rows(self, fb: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
        """``(prefix, extend, rows)`` of an extend batch's requests, from host metadata."""
        prefix, extend, rows = (
            fb.extend_prefix_lens_cpu,
            fb.extend_seq_lens_cpu,
            fb.req_pool_indices_cpu,
        )
        if prefix is None or extend is None or rows is None:  # host metadata SGLang always sets
            prefix = fb.extend_prefix_lens.tolist()
            extend = fb.extend_seq_lens.tolist()
            rows = fb.req_pool_indices.cpu()
        return [int(x) for x in prefix], [int(x) for x in extend], [int(x) for x in rows]

    def _observe_prompt(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> None:
        """CIS with ``tau="auto"``: show the selector each request's last extended queries and
        its cached K/V (prefix included), to calibrate its reuse thresholds on."""
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        qv = q.reshape(-1, hq, d)
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        r2t = self.req_to_token_pool.req_to_token
        last = layer.layer_id == self._last_selectable
        start = 0
        for p, n, row in zip(*self._extend_rows(fb), strict=True):
            w = min(self._prompt_queries, n)
            if row > 0 and w >= 2:
                self.prompts_observed += int(last)
                total = p + n
                locs = r2t[row, :total].long()
                kv = ContiguousKV(
                    k_buf[locs].to(qv.dtype).transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
                    v_buf[locs].to(qv.dtype).transpose(0, 1).unsqueeze(0),
                    torch.full((1,), total, dtype=torch.int32, device=qv.device),
                )
                queries = qv[start + n - w : start + n].unsqueeze(0)  # [1, W, Hq, D]
                self.selector.observe_prompt(
                    self.state, layer.layer_id, [row], queries, kv, layer.scaling, [(0, total)],
                    locations=locs.unsqueeze(0),
                )  # fmt: skip
            start += n

    def _windowed_extend(
        self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch, plan: Any
    ) -> torch.Tensor:
        """PSAW prefill: row ``t`` (absolute position) attends to ``[⌊f·t⌋, t]`` and the sinks.
        Positions are absolute, so chunks and radix-cache prefixes see the same windows."""
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        qv = q.reshape(-1, hq, d)
        out = qv.new_empty(qv.shape[0], hq, layer.v_head_dim)
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        r2t = self.req_to_token_pool.req_to_token
        start = 0
        for p, n, row in zip(*self._extend_rows(fb), strict=True):
            total = p + n
            locs = r2t[row, :total].long()
            kk = k_buf[locs].to(qv.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vv = v_buf[locs].to(qv.dtype).transpose(0, 1).unsqueeze(0)
            qq = qv[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if self.kernel_path == "triton":  # skips the keys between sinks and windows
                o, _ = psaw_prefill_attention(
                    qq.contiguous(), kk.contiguous(), vv.contiguous(),
                    window_fraction=plan.window_fraction, n_sink=plan.n_sink,
                    scaling=layer.scaling,
                )  # fmt: skip
            else:
                mask = plan.attention_mask(total, qv.device, first_row=p)  # [n, total]
                o = scaled_dot_product_attention(
                    qq, kk, vv, attn_mask=mask, scale=layer.scaling, enable_gqa=hq != kk.shape[1]
                )
            out[start : start + n] = o.squeeze(0).transpose(0, 1)
            start += n
        return out.reshape(qv.shape[0], hq * layer.v_head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        self._check_layer(layer)
        lid = layer.layer_id
        step = self._step
        if step is None:
            raise RuntimeError("prhs-sglang: forward_decode before init_forward_metadata")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v
            )
            self._write_side(layer, forward_batch, k, v)
        n = step.batch_size
        b = step.bucket
        hq, d = self.spec.num_q_heads, self.spec.head_dim
        qv = q.reshape(n, hq, d)
        if n == b.query.shape[0]:  # a full bucket: no padded row to carry
            query = qv
        else:
            if b.query.dtype != qv.dtype:
                b.query = b.query.to(qv.dtype)
            query = b.query
            query[:n].copy_(qv)
        kv = PagedKV(
            k_pool=self.token_to_kv_pool.get_key_buffer(lid),
            v_pool=self.token_to_kv_pool.get_value_buffer(lid),
            req_to_token=self.req_to_token_pool.req_to_token,
            req_pool_indices=b.req_pool_indices,
            seq_lens=b.seq_lens,
            page_size=self.page_size,
            max_len_hint=step.max_len,
        )
        if lid in self._selectable:
            selection = self.selector.select(b.plan, lid, query, kv, self.state)
        else:
            selection = None
        out, _ = sparse_decode_attention(query, kv, selection, layer.scaling)
        self._maybe_log(lid)
        return out[:n].reshape(n, hq * layer.v_head_dim).to(q.dtype)

    # -- statistics -----------------------------------------------------------------------------
    def _maybe_log(self, layer: int) -> None:
        every = self.sparse.log_interval
        if (
            every
            and layer == self.spec.num_layers - 1
            and self.decode_steps - self._last_logged_steps >= every
        ):
            logger.info("prhs-sglang: %s", self._format(self.report(window=True)))

    def _totals(self) -> dict[str, float]:
        out = {"decisions": 0.0, "retrievals": 0.0, "selected": 0.0}
        for b in self._buckets.values():
            s = b.plan.summary()
            for key in out:
                out[key] += s.get(key, 0.0)
        return out

    def _delta_hat(self) -> float:
        """Mean ``δ̂`` over the live rows of the last decode step's last selected layer."""
        step = self._step
        if step is None or not getattr(self.selector, "certifies", False):
            return float("nan")
        stats = step.bucket.plan.stats
        if stats is None or stats.delta_hat is None:
            return float("nan")
        d = stats.delta_hat[: step.batch_size].double()
        d = d[torch.isfinite(d)]
        return float(d.mean()) if d.numel() else float("nan")

    def report(self, window: bool = False) -> dict[str, Any]:
        """Statistics as host numbers (a device read): since start-up, or since the last log
        line when ``window`` (which then starts a new window)."""
        tot = self._totals()
        steps, cached = self.decode_steps, self._cached_sum
        if window:
            last = self._last_logged
            cur = dict(tot)
            tot = {k: v - last.get(k, 0.0) for k, v in tot.items()}
            steps -= self._last_logged_steps
            cached -= self._last_logged_cached
            self._last_logged = cur
            self._last_logged_steps = self.decode_steps
            self._last_logged_cached = self._cached_sum
        n = tot["decisions"]
        report = {
            "selector": self.sparse.selector,
            "kernel_path": self.kernel_path,
            "tp_rank": self.tp_rank,
            "decode_steps": steps,
            "prompts_observed": self.prompts_observed,
            "live_states": self.live_states,
            "retrieval_ratio": 100.0 * tot["retrievals"] / n if n else float("nan"),
            "avg_selected": tot["selected"] / n if n else float("nan"),
            "avg_cached": cached / steps if steps else float("nan"),
            "delta_hat": self._delta_hat(),
            "nonfinite": self.state.nonfinite_count(),
            "state_bytes": sum(self.state.nbytes().values()),
            "plan_buckets": sorted(self._buckets),
            "workspace_bytes": sum(_bucket_bytes(b) for b in self._buckets.values()),
        }
        # JSON has no NaN: a figure that does not exist yet (no decode step) is None.
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in report.items()}

    @staticmethod
    def _format(r: dict[str, Any]) -> str:
        def num(key: str, fmt: str) -> str:
            return "n/a" if r[key] is None else format(r[key], fmt)

        return (
            f"{r['selector']} rank {r['tp_rank']}: {r['decode_steps']} decode steps, "
            f"{r['live_states']} live requests, ρ̂ = {num('retrieval_ratio', '.1f')} %, "
            f"Avg KV = {num('avg_selected', '.1f')} of {num('avg_cached', '.1f')} cached, "
            f"δ̂ = {num('delta_hat', '.4g')}, non-finite rows {r['nonfinite']}"
        )

    # -- CUDA graphs ----------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise RuntimeError(
            "prhs-sglang runs decode eagerly: start SGLang with --disable-decode-cuda-graph "
            "--disable-prefill-cuda-graph (the plugin's --sparse-attn and engine_args() do this "
            "for you)"
        )

    def support_triton(self) -> bool:
        return self.dense.support_triton()


def _check_runner(runner: ModelRunner) -> None:
    """Refuse what the backend cannot serve, with the reason."""
    if getattr(runner, "use_mla_backend", False):
        raise SparseConfigError(
            "prhs-sglang does not support MLA models (DeepSeek-style latent attention)"
        )
    par = get_parallel()
    if getattr(par, "pp_size", 1) > 1:
        raise SparseConfigError("prhs-sglang does not support pipeline parallelism yet")
    if getattr(par, "attn_dcp_size", 1) > 1:
        raise SparseConfigError("prhs-sglang does not support decode context parallelism")
    if getattr(runner, "is_draft_worker", False):
        raise SparseConfigError("prhs-sglang does not support speculative decoding")
