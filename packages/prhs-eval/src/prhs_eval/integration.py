"""Run a transformers model's attention through a prhs selector.

One call::

    runtime = prhs_eval.enable(model, "cis", budget=128)   # or a selector instance
    model.generate(**batch, max_new_tokens=32)              # batched, left-padded: works
    runtime.disable()                                       # back to the model's own attention

or, disabled on leaving the block (also on an exception)::

    with prhs_eval.enable(model, "cis", budget=128) as runtime:
        model.generate(**batch, max_new_tokens=32)

What it installs (transformers 5.x):

- an ``AttentionInterface`` entry ``"prhs"`` (and the matching ``AttentionMaskInterface`` entry,
  which always materialises the boolean mask so padding and Gemma3's sliding windows arrive in
  every layer). Whenever a full-attention layer's K/V are written (the prompt, then each new
  token), they go to the selector's side caches (``write_kv``). At decode, one
  :class:`~prhs_core.plan.DecodePlan` per step carries the rows' lengths; every full-attention
  layer wraps its cache in a :class:`~prhs_core.layout.ContiguousKV`, asks the selector for a
  :class:`~prhs_core.selection.Selection` and runs :func:`prhs_kernels.sparse_decode_attention`
  over it. Sliding-window layers (Gemma3's local layers) run the model's own SDPA attention. At
  prefill, a selector with a prefill plan (PSAW) restricts each row's window, and one that
  observes prompts (CIS with ``tau="auto"``) sees each layer's last prompt queries;
- a forward hook on every decoder layer for ETF: the frozen prefix's hidden states leave the
  layer as they entered it (their keys/values at that layer are still computed from them);
- forward pre-hooks that find the live ``Cache`` object. The selector's state (a
  :class:`~prhs_core.state.SelectorState`, slot ``b`` = batch row ``b``) and the plan are stored
  *on* that cache, so they go wherever the cache goes, and a fresh prefill into a cache starts
  fresh state. A cache prefilled without prhs gets its state at the first decode step, each
  layer's cached K/V written to the side caches then.

``torch.compile`` does not trace the ``"prhs"`` attention call: a compiled decoder layer breaks
its graph there and runs the selector and the decode kernel as they are, so what comes before
and after it in the layer still compiles (``prhs-eval table5 --compile-scope layers``).

On the CPU the plan is *checked* (values validated on the host, a non-finite query raises); on
CUDA it is not, and a non-finite query is skipped and counted (``runtime.nonfinite_count()``).

Dynamic and static caches both work (``generate(..., cache_implementation="static")``). An
unchecked decode step reads no device value on the host, so a whole step of the model can be
captured in a CUDA graph; :meth:`PrhsRuntime.attach` gives a cache filled by other means its
state without a device read, and ``enable(..., stats=True)`` keeps the totals on the device
without an observer. A right-padded prompt (a scorer's batch) is prefilled as dense would, and
refused at decode.

Supported families: Llama (SmolLM2), Qwen2 and Gemma3. Anything else raises
:class:`UnsupportedModelError` before any change is made. Beam search (which reorders cache rows)
is not supported.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from prhs_core.config import AttentionSpec, LayerType
from prhs_core.layout import ContiguousKV
from prhs_core.plan import DecodePlan
from prhs_core.protocols import DecodeSelector, DecodeStep, PrefillPlanner, PromptObserver
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_kernels import sparse_decode_attention, token_locations
from prhs_kernels.kv import row_bounds
from prhs_kernels.paths import warm_up
from prhs_kernels.prefill import psaw_prefill_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_FAMILIES",
    "PrhsRuntime",
    "UnsupportedModelError",
    "attention_spec",
    "enable",
    "register_attention",
]

ATTN_IMPLEMENTATION = "prhs"
SUPPORTED_FAMILIES = ("llama", "qwen2", "gemma3_text", "gemma3")
_STATE_ATTR = "_prhs_state"

StepObserver = Callable[[DecodeStep, Selection | None], None]


@dataclass
class _CacheState:
    """What prhs keeps on one transformers ``Cache``: the selector state, the decode plan, and
    which layers' cached K/V the side caches already hold."""

    state: SelectorState
    plan: DecodePlan | None = None
    written: set[int] = field(default_factory=set)
    right_padded: bool = False
    """The prompt was right-padded: it can be scored, not decoded."""
    slots: torch.Tensor | None = None
    """``[B]`` the rows' state slots, on the device when steps are unchecked (a CUDA graph
    cannot copy them from the host)."""


class UnsupportedModelError(ValueError):
    """The model's family is not one prhs can wrap."""


def attention_spec(config: Any) -> AttentionSpec:
    """The :class:`~prhs_core.config.AttentionSpec` of a transformers config (its text part)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    n = int(config.num_hidden_layers)
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // hq)
    kinds: tuple[LayerType, ...] | None = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        kinds = tuple("sliding" if "sliding" in str(t) else "full" for t in layer_types)
    return AttentionSpec(n, hq, hkv, d, kinds)


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _decoder_layers(model: Any) -> Any:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return decoder, decoder.layers


def _prhs_mask(*args: Any, **kwargs: Any) -> Any:
    """SDPA's boolean mask, never skipped: padding and sliding windows reach every layer."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    if "allow_is_bidirectional_skip" in kwargs:
        kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


@torch.compiler.disable(
    reason="prhs's decode step runs its own kernels and is captured in CUDA graphs as it is"
)
def _prhs_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    runtime = getattr(module, "_prhs_runtime", None)
    if runtime is None:
        raise RuntimeError(
            "attn_implementation='prhs' needs a selector: call prhs_eval.enable(model, name) first"
        )
    return runtime.attend(module, query, key, value, attention_mask, scaling, kwargs)


def register_attention() -> None:
    """Register ``"prhs"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` (idempotent). :func:`enable` calls it; call it yourself to load a
    model with ``attn_implementation="prhs"`` before enabling a selector on it.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _prhs_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _prhs_mask)


def _row_bounds(
    mask: torch.Tensor | None, batch: int, length: int, device: torch.device, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start [B], lens [B])`` of each row's cached run from a ``[B, T]`` validity mask.

    A row's tokens must be one contiguous run: at the end of the columns (a dynamic cache,
    left-padded) or followed by unfilled capacity (a static cache). ``check`` reads the mask on
    the host to verify that (a sync); without it nothing is read, so a decode step stays
    capturable in a CUDA graph.
    """
    if mask is None:
        lens = torch.full((batch,), length, dtype=torch.long, device=device)
        return torch.zeros_like(lens), lens
    valid = mask.to(torch.bool)
    lens = valid.sum(-1)
    # The first valid column (argmax of a bool row finds its first True); an empty row: 0.
    # Read as uint8 in place (argmax has no bool kernel): no copy of the [B, T] mask a step.
    start = valid.view(torch.uint8).argmax(-1)
    if check:
        pos = torch.arange(length, device=valid.device).view(1, -1)
        expected = (pos >= start.view(-1, 1)) & (pos < (start + lens).view(-1, 1))
        if not bool((expected == valid).all()):
            raise ValueError(
                "prhs needs each row's cached tokens contiguous (a left-padded batch, or a "
                "static cache's filled prefix); got an attention mask with holes"
            )
    return start, lens


def _forget_on_reset(cache: Any) -> None:
    """Make ``cache.reset()`` (what ``generate`` calls before reusing a static cache) drop the
    prhs state stored on it, so the next prompt starts fresh without a device read."""
    func = getattr(type(cache), "reset", None)  # the class's: holds no reference to the cache
    if func is None or getattr(cache.__dict__.get("reset"), "_prhs_forgets", False):
        return
    # Weak: the cache holds this function, which must not keep the cache (and its K/V) alive.
    ref = weakref.ref(cache)

    def forgetting_reset(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        if target is None:  # pragma: no cover - the cache is gone
            return None
        if hasattr(target, _STATE_ATTR):
            delattr(target, _STATE_ATTR)
        return func(target, *args, **kwargs)

    forgetting_reset._prhs_forgets = True  # type: ignore[attr-defined]
    cache.reset = forgetting_reset


def _query_length(args: tuple, kwargs: dict) -> int | None:
    """Tokens in this forward (``input_ids`` or ``inputs_embeds``), ``None`` when unknown."""
    for name in ("input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor) and x.ndim >= 2:
            return int(x.shape[1])
    if args and isinstance(args[0], torch.Tensor) and args[0].ndim >= 2:
        return int(args[0].shape[1])
    return None


class PrhsRuntime:
    """The selector installed on one model; made by :func:`enable`.

    Attributes
    ----------
    selector:
        The decode selector (and prefill planner, if it is one).
    spec:
        The model's attention geometry.
    observers:
        Callables ``(step, selection)`` run after each selection (metrics); see
        :meth:`add_observer`.
    """

    def __init__(
        self,
        model: Any,
        selector: DecodeSelector,
        max_seq_len: int,
        checked: bool | None = None,
        stats: bool = False,
    ) -> None:
        self.model = model
        self.checked = checked
        self.stats = stats
        self.selector = selector
        self.spec = attention_spec(model.config)
        self.max_seq_len = max_seq_len
        self.observers: list[StepObserver] = []
        self._selectable = frozenset(self.spec.selectable_layers)
        self._first_layer = min(self.spec.selectable_layers)
        self._planner = selector if isinstance(selector, PrefillPlanner) else None
        # A selector that calibrates on the prompt (CIS tau="auto") sees its last queries.
        self._prompt_queries = (
            selector.prompt_queries() if isinstance(selector, PromptObserver) else 0
        )
        self._handles: list[Any] = []
        self._previous_impl: str | None = None
        self._cache: Any = None
        self._fresh_prefill = False
        self._row_mask: torch.Tensor | None = None
        # (start, lens) of each row's cached run, int64, and the same as int32 (what the
        # kernels take): found at a forward's first full layer, shared by the others.
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows32: tuple[torch.Tensor, torch.Tensor] | None = None
        self._new_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prompt_rows: list[tuple[int, int]] | None = None
        self.enabled = False

    # -- install / remove -------------------------------------------------------------------
    def _install(self) -> None:
        decoder, layers = _decoder_layers(self.model)
        self._handles.append(
            decoder.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True)
        )
        for layer in layers:
            self._handles.append(
                layer.register_forward_pre_hook(self._layer_pre_hook, with_kwargs=True)
            )
            if self._planner is not None:
                self._handles.append(layer.register_forward_hook(self._etf_hook, with_kwargs=True))
            layer.self_attn._prhs_runtime = self
        self._previous_impl = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.enabled = True

    def disable(self) -> None:
        """Remove every hook and restore the model's previous attention implementation."""
        if not self.enabled:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _, layers = _decoder_layers(self.model)
        for layer in layers:
            if getattr(layer.self_attn, "_prhs_runtime", None) is self:
                del layer.self_attn._prhs_runtime
        self.model.set_attn_implementation(self._previous_impl or "sdpa")
        self._cache = None  # the runtime must not keep a cache (and its K/V) alive
        self.enabled = False

    def __enter__(self) -> PrhsRuntime:
        """``with prhs_eval.enable(model, ...) as runtime:`` -- the runtime itself."""
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Disable on leaving the ``with`` block, also when it raised (the exception
        propagates)."""
        self.disable()

    def add_observer(self, fn: StepObserver) -> None:
        """Call ``fn(step, selection)`` after every decode selection."""
        self.observers.append(fn)

    # -- state ------------------------------------------------------------------------------
    def state_for(self, cache: Any) -> SelectorState | None:
        """The selector state stored on ``cache`` (``None`` before its first prefill)."""
        held = getattr(cache, _STATE_ATTR, None) if cache is not None else None
        return held.state if held is not None else None

    def plan_for(self, cache: Any) -> DecodePlan | None:
        """The decode plan stored on ``cache`` (``None`` before its first decode step)."""
        held = getattr(cache, _STATE_ATTR, None) if cache is not None else None
        return held.plan if held is not None else None

    def nonfinite_count(self, cache: Any = None) -> int:
        """Non-finite queries and keys skipped so far on ``cache`` (the live one by default)."""
        state = self.state_for(cache if cache is not None else self._cache)
        return state.nonfinite_count() if state is not None else 0

    def attach(self, cache: Any, batch_size: int) -> SelectorState:
        """Give ``cache``, filled without prhs (a static cache written by other means, or a
        prompt run under another attention), its selector state now; returns it.

        Decoding such a cache also creates the state, at its first step, but must then ask the
        cache whether it is empty (a static cache keeps its length on the device: a sync).
        After ``attach`` no decode step reads a device value, the first one included (it
        copies the cached K/V into the selector's side caches).
        """
        if getattr(cache, _STATE_ATTR, None) is not None:
            raise ValueError("this cache already has prhs state (cache.reset() drops it)")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        param = next(iter(self.model.parameters()))
        layer = self._first_layer
        layers = getattr(cache, "layers", None)
        keys = getattr(layers[layer], "keys", None) if layers is not None else None
        if isinstance(keys, torch.Tensor):
            if keys.shape[0] != batch_size:
                raise ValueError(
                    f"batch_size {batch_size} does not match the cache's {keys.shape[0]} rows"
                )
            dtype, device = keys.dtype, keys.device
        else:
            dtype, device = param.dtype, param.device
        return self._new_state(cache, batch_size, dtype, device).state

    def _new_state(
        self, cache: Any, batch: int, dtype: torch.dtype, device: torch.device
    ) -> _CacheState:
        state = self.selector.init_state(
            self.spec,
            capacity=batch,
            max_seq_len=self.max_seq_len,
            kv_dtype=dtype,
            device=device,
        )
        state.pool.create(list(range(batch)))
        held = _CacheState(state)
        held.slots = torch.arange(batch, device=None if self._checked(device) else device)
        if cache is not None:
            setattr(cache, _STATE_ATTR, held)
            _forget_on_reset(cache)
        return held

    def _plan(
        self, held: _CacheState, batch: int, scaling: float, device: torch.device
    ) -> DecodePlan:
        plan = held.plan
        if plan is None or plan.batch_size != batch or plan.scaling != scaling:
            checked = self._checked(device)
            plan = self.selector.make_plan(
                held.state,
                batch_size=batch,
                scaling=scaling,
                stats=self.stats or bool(self.observers),
                checked=checked,
            )
            held.plan = plan
        return plan

    def _checked(self, device: torch.device) -> bool:
        return self.checked if self.checked is not None else device.type != "cuda"

    def _keeps_kv(self, held: _CacheState, device: torch.device) -> bool:
        """Whether written K/V go anywhere: side caches keep them, a checked run checks them."""
        return held.state.side is not None or self._checked(device)

    def _write_kv(
        self,
        held: _CacheState,
        layer: int,
        kv: ContiguousKV,
        positions: torch.Tensor,
    ) -> None:
        """Write the K/V at logical ``positions [B, W]`` (``-1``: none) to the side caches."""
        held.written.add(layer)
        if not self._keeps_kv(held, kv.k.device):
            return
        b, _, t, _ = kv.k.shape
        loc = token_locations(kv, positions, held.state.row_stride)  # -1 where none
        start = kv.start.long() if kv.start is not None else torch.zeros_like(positions[:, 0])
        col = (positions + start.view(-1, 1)).clamp(0, t - 1)
        rows = torch.arange(b, device=kv.k.device).view(-1, 1).expand_as(col)
        key = kv.k[rows, :, col]  # [B, W, Hkv, D]
        value = kv.v[rows, :, col]
        self.selector.write_kv(
            held.state,
            layer,
            loc.flatten(),
            key.flatten(0, 1),
            value.flatten(0, 1),
            checked=self._checked(kv.k.device),
        )

    def _write_new_tokens(self, held: _CacheState, layer: int, kv: ContiguousKV) -> None:
        """A decode step's write: each row's new token (its last position) to the side caches,
        read in place from the cache (no gather). Its locations and cache columns are the same
        at every layer: found once per forward."""
        if self._new_tokens is None:
            last = (kv.seq_lens - 1).view(-1, 1)
            loc = token_locations(kv, last, held.state.row_stride).view(-1)  # -1: an empty row
            col = last.view(-1) if kv.start is None else last.view(-1) + kv.start
            self._new_tokens = (loc, col)
        loc, col = self._new_tokens
        self.selector.write_kv(
            held.state, layer, loc, kv.k, kv.v, checked=self._checked(kv.k.device), columns=col
        )

    @staticmethod
    def _all_positions(kv: ContiguousKV) -> torch.Tensor:
        """``[B, T]`` every logical position of each row (``-1`` past its length)."""
        t = kv.k.shape[2]
        pos = torch.arange(t, device=kv.k.device).view(1, -1).expand(kv.batch_size, -1)
        return torch.where(pos < kv.seq_lens.view(-1, 1), pos, -1)

    # -- hooks ------------------------------------------------------------------------------
    def _model_pre_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        past = kwargs.get("past_key_values")
        if past is None:
            self._fresh_prefill = True
        elif _query_length(args, kwargs) == 1 and getattr(past, _STATE_ATTR, None) is not None:
            # Decoding a cache prhs already holds: no need to ask its length, which a static
            # cache keeps on the device (reading it would sync and break graph capture).
            # ``reset()`` drops the state (_forget_on_reset), so a new prompt is never missed.
            self._fresh_prefill = False
        else:
            self._fresh_prefill = int(past.get_seq_length()) == 0
        self._rows = self._rows32 = None
        self._new_tokens = None
        self._prompt_rows = None
        mask = kwargs.get("attention_mask")
        self._row_mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None

    def _layer_pre_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._cache = kwargs.get("past_key_values")

    def _etf_hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        hidden_in = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        if not self._fresh_prefill or hidden_in.shape[1] <= 1 or self._planner is None:
            return output
        layer = module.self_attn.layer_idx
        b, t = hidden_in.shape[:2]
        if self._prompt_rows is None:  # once per forward: the rows' (start, length) on the host
            start, lens = _row_bounds(self._row_mask, b, t, hidden_in.device)
            self._prompt_rows = list(zip(start.tolist(), lens.tolist(), strict=True))
        # Frozen rows [start + a, start + E_ℓ(length)) of each sequence (a: its sink rows,
        # which stay live), as per-row bounds.
        plan = self._planner.plan_prefill(layer, self.spec.num_layers)
        frozen = [plan.frozen_rows(n) for _, n in self._prompt_rows]
        if not any(a < e for a, e in frozen):
            return output
        first = torch.tensor([s for s, _ in self._prompt_rows], device=hidden_in.device)
        lo = first + torch.tensor([a for a, _ in frozen], device=hidden_in.device)
        hi = first + torch.tensor([e for _, e in frozen], device=hidden_in.device)
        pos = torch.arange(t, device=hidden_in.device).view(1, -1)
        frozen = (pos >= lo.view(-1, 1)) & (pos < hi.view(-1, 1))
        new = torch.where(frozen.unsqueeze(-1), hidden_in, out)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    # -- attention --------------------------------------------------------------------------
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, None]:
        """The attention of one layer call (``query [B, Hq, Tq, D]``, cache ``[B, Hkv, Tk, D]``)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        b, _, tq, _ = query.shape
        tk = key.shape[2]
        if layer not in self._selectable:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scale, **kwargs
            )
        if tq > 1 and self._fresh_prefill and tk > tq:
            # A static cache's prompt: its first tq columns hold it (left padding included),
            # the rest is capacity. Attend over the prompt only, as a dynamic cache would.
            key, value, tk = key[:, :, :tq], value[:, :, :tq], tq
            if attention_mask is not None:
                attention_mask = attention_mask[..., :tq]
        if tq == 1 and layer == self._first_layer:
            prompt = getattr(self._cache, _STATE_ATTR, None)
            if prompt is not None and prompt.right_padded:
                raise ValueError(
                    "prhs cannot decode a right-padded batch (a new token would follow the "
                    "padding); pad on the left (tokenizer.padding_side = 'left')"
                )
        if layer == self._first_layer or self._rows is None:
            # Every full layer of one forward shares the padding: find it once (checked steps
            # verify it on the host; unchecked ones read nothing).
            last_row = attention_mask[:, 0, -1, :] if attention_mask is not None else None
            check = tq > 1 or self._checked(query.device)
            if check or last_row is None or last_row.dtype != torch.bool:
                self._rows = _row_bounds(last_row, b, tk, query.device, check=check)
                self._rows32 = (self._rows[0].to(torch.int32), self._rows[1].to(torch.int32))
            else:  # an unchecked step: int32 bounds in one launch; the int64 ones go unused
                self._rows = self._rows32 = row_bounds(last_row, key.dtype)
            self._new_tokens = None
        start, lens = self._rows
        start32, lens32 = self._rows32
        kv = ContiguousKV(key, value, lens32, start32)
        if tq > 1:
            if layer == self._first_layer and self._fresh_prefill:
                fresh = self._new_state(self._cache, b, key.dtype, query.device)
                # A prompt whose rows do not all end at its last column (right padding) can be
                # scored, but not decoded: new tokens land after the padding. Known here, on
                # the host, so a decode step need not look.
                fresh.right_padded = bool(((start + lens) != tk).any())
            held = getattr(self._cache, _STATE_ATTR, None)
            if held is not None and self._fresh_prefill and tq == tk:
                self._write_kv(held, layer, kv, self._all_positions(kv))
                w = min(self._prompt_queries, tq)
                if w >= 2:
                    if self._prompt_rows is None:  # once per forward (a host read)
                        self._prompt_rows = list(zip(start.tolist(), lens.tolist(), strict=True))
                    self.selector.observe_prompt(  # type: ignore[attr-defined]
                        held.state, layer, list(range(b)), query[:, :, -w:].transpose(1, 2),
                        kv, scale, self._prompt_rows,
                    )  # fmt: skip
            mask = attention_mask
            if self._planner is not None and self._fresh_prefill and tq == tk:
                plan = self._planner.plan_prefill(layer, self.spec.num_layers)
                if plan.window_fraction > 0.0:
                    # Only the sink and window keys are read (Triton on CUDA, chunks of rows
                    # elsewhere), not the causal square a mask would cost.
                    out, _ = psaw_prefill_attention(
                        query.contiguous(), key.contiguous(), value.contiguous(),
                        window_fraction=plan.window_fraction, n_sink=plan.n_sink,
                        scaling=scale, start=start, with_lse=False,
                    )  # fmt: skip
                    return out.transpose(1, 2).contiguous(), None
                mask = self._prefill_mask(layer, attention_mask, start, tk)
            if tq == tk and mask is not None and not bool(start.any()):
                # No padding: the mask is plain causal. Without it SDPA takes its fused causal
                # kernel (transformers passes prhs's attention a materialised mask, which would
                # send SDPA to its math path: ~30 % of a CPU prefill).
                mask = None
            return sdpa_attention_forward(module, query, key, value, mask, scaling=scale, **kwargs)

        held = getattr(self._cache, _STATE_ATTR, None)
        if held is None:  # decoding into a cache prefilled without prhs
            held = self._new_state(self._cache, b, key.dtype, query.device)
        plan = self._plan(held, b, scale, query.device)
        if layer == self._first_layer:
            plan.update(lens32, held.slots)
        # The new token's K/V (or, on a cache prefilled without prhs, all of them), where
        # anything keeps or checks them: a step of a selector without side caches adds no work.
        if layer not in held.written:
            self._write_kv(held, layer, kv, self._all_positions(kv))
        elif self._keeps_kv(held, query.device):
            self._write_new_tokens(held, layer, kv)
        kv = ContiguousKV(key, value, plan.seq_lens, start32)
        q = query[:, :, 0]
        selection = self.selector.select(plan, layer, q, kv, held.state)
        if self.observers:
            step = DecodeStep(layer, q, kv, plan)
            for fn in self.observers:
                fn(step, selection)
        out, _ = sparse_decode_attention(q, kv, selection, plan.scaling)
        return out.unsqueeze(1), None

    def summary(self, cache: Any = None) -> dict[str, float]:
        """Running totals of the live (or given) cache's plan: decisions, retrievals, selected
        positions, proxy bytes, ``retrieval_ratio`` (%) and ``avg_selected`` (needs
        ``enable(..., stats=True)`` or an observer, which switch statistics on; ``{}``
        otherwise)."""
        plan = self.plan_for(cache if cache is not None else self._cache)
        return plan.summary() if plan is not None else {}

    def _prefill_mask(
        self, layer: int, mask: torch.Tensor | None, start: torch.Tensor, t: int
    ) -> torch.Tensor:
        """The model's mask restricted by the planner's per-row window (PSAW), left padding
        handled by indexing the plan with each row's logical position. ``start [B]`` is each
        row's first position; the longest prompt fills all ``t`` columns."""
        assert self._planner is not None
        b, device = start.shape[0], start.device
        plan = self._planner.plan_prefill(layer, self.spec.num_layers)
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        base = mask.to(torch.bool) if mask is not None else causal.expand(b, 1, t, t)
        if plan.window_fraction == 0.0:
            return base
        pos = torch.arange(t, device=device)
        logical = pos.view(1, -1) - start.view(-1, 1)  # [B, T], negative in padding
        lo = plan.window_start(t, device)[logical.clamp(0, t - 1)]  # [B, T]
        rows = lo.view(b, 1, t, 1)
        cols = logical.view(b, 1, 1, t)
        allowed = (cols >= rows) | (cols < plan.n_sink)
        return base & allowed


def enable(
    model: Any,
    selector: str | DecodeSelector = "prhs",
    *,
    max_seq_len: int | None = None,
    checked: bool | None = None,
    stats: bool = False,
    **options: Any,
) -> PrhsRuntime:
    """Make ``model`` decode (and, for PSAW/ETF/CPE, prefill) through a prhs selector.

    Parameters
    ----------
    model:
        A loaded transformers causal LM of a supported family (Llama, Qwen2, Gemma3).
    selector:
        A registered name (``prhs-eval selectors`` lists them) or a selector instance.
    max_seq_len:
        Longest sequence the selector state must hold; the model's
        ``max_position_embeddings`` by default.
    checked:
        Validate lengths and queries on the host at every decode step and raise on a non-finite
        query (``None``: on unless the model is on CUDA). Off, a non-finite query is skipped and
        counted (:meth:`PrhsRuntime.nonfinite_count`).
    stats:
        Keep the running totals of :meth:`PrhsRuntime.summary` (retrieval ratio, positions
        and proxy bytes read) on the device, without an observer; a step that keeps them
        can still be captured in a CUDA graph.
    **options:
        Config values for a named selector (``budget=128``, ``tau=0.9`` ...), validated before
        the model is touched.

    Returns
    -------
    PrhsRuntime
        Call :meth:`PrhsRuntime.disable` to restore the model, or use the runtime as a context
        manager (``with enable(model, "cis") as runtime: ...``), which disables it on exit.
    """
    config = _text_config(model)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"prhs cannot wrap model family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if isinstance(selector, str):
        sel = selectors.create(selector, **options)
    else:
        if options:
            raise TypeError("options are for a selector given by name; configure the instance")
        sel = selector
    if not isinstance(sel, DecodeSelector):
        raise TypeError(f"selector must implement DecodeSelector, got {type(sel).__name__}")
    existing = getattr(model, "_prhs_runtime", None)
    if existing is not None and existing.enabled:
        raise RuntimeError("prhs is already enabled on this model; call runtime.disable() first")
    if max_seq_len is None:
        max_seq_len = int(getattr(config, "max_position_embeddings", 0) or 32768)
    register_attention()
    device = next(iter(model.parameters()), torch.empty(0)).device
    warm_up(device)  # Numba's one-time compile, here rather than inside the first decode step
    runtime = PrhsRuntime(model, sel, max_seq_len, checked, stats)
    runtime._install()
    model._prhs_runtime = runtime
    return runtime
