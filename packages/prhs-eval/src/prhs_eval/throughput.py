"""End-to-end decode throughput through the transformers integration (the paper's Table V).

A model of a published shape with random weights (throughput does not depend on the weights'
values), a transformers ``StaticCache`` holding ``B`` rows of ``T`` cached tokens (random K/V: a
decode step reads the same bytes whatever they hold), and one decode step -- embedding, every
layer, the LM head and the greedy token fed back as the next input -- captured in a CUDA graph
and replayed. Each method runs on the same model and cache in the same process:

- ``sdpa``: transformers' own attention over the static cache (it reads the whole capacity,
  masked), the dense baseline users get from transformers;
- ``dense``: prhs's dense selector (its decode kernel over each row's cached prefix only);
- any registered selector (``prhs``, ``quest`` ...), options in brackets:
  ``prhs[budget=1024;tau=0.5]``.

Beside each point its **byte floor**: the weights plus the K/V (and the proxies: page bounds,
the keys a retrieval scores) that method reads per step, as its own statistics count them,
over the copy bandwidth measured in the same run. ``vs floor`` is the measured step time over
that floor (1.0 is a step that only streams what it must). The timed run keeps no statistics
(as a user's decode does not); they come from a second, untimed run of as many steps from the
same cache.

On CUDA a step is a graph replay, and a point's figure is the mean step of a window of 132
consecutive replays (four whole 33-step periods of CIS's anchor) timed by CUDA events: a
selector that retrieves once in a while is charged for its retrieval steps as often as they
run (the median step, kept beside it, would be a reuse step only). Elsewhere the step runs
eagerly and is timed by the wall clock (for tests and small checks; CPU figures are not
throughput claims).

With ``compile`` the model's per-layer elementwise work -- the RMS norms, the MLP and the rotary
embedding -- goes through ``torch.compile`` (one graph each, shared by every layer) before the
capture, for every method alike: transformers runs these as ~30 small kernels a layer, which a
decode step at small batch spends more time launching than streaming. Attention (prhs's or
transformers') is not compiled.

With ``fuse`` each layer's query/key/value projections run as one GEMM and its MLP's gate and
up projections as another (:func:`fused_projections`), for every method alike, as serving
engines do: at a batch of a few rows a projection is a weight stream, and cuBLAS streams one
wide matrix faster than three narrow ones.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "SHAPES",
    "Method",
    "ThroughputPoint",
    "compiled_parts",
    "copy_bandwidth",
    "decode_gemms",
    "decode_throughput",
    "fused_layers",
    "fused_projections",
    "kv_bytes_per_token",
    "model_config",
    "parse_methods",
    "random_model",
    "weight_bytes",
]

#: Published model shapes (Llama-2-7B: multi-head attention; Llama-3-8B: grouped-query).
SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0,
    ),
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    ),
    # A small shape of the same family, for tests and CPU checks.
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, rope_theta=10000.0,
    ),
}  # fmt: skip

#: Baselines that are not registered selectors.
SDPA = "sdpa"
_METHOD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[(.*)\])?$")


@dataclass(frozen=True)
class Method:
    """One row of the table: ``name`` (``sdpa`` or a registered selector) and its options."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        inner = ";".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}[{inner}]"


def parse_methods(text: str, common: Mapping[str, Any] | None = None) -> list[Method]:
    """``"sdpa,dense,prhs[tau=0.5;budget=512],quest"`` -> methods. ``common`` options (e.g.
    ``budget``) go to every selector that has them, under its own bracketed ones."""
    import prhs_selectors  # noqa: F401  (registers the selectors where no entry points exist)
    from prhs_core.registry import selectors
    from prhs_eval.runner import parse_option_value

    methods: list[Method] = []
    # Split on commas outside brackets.
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for part in (p.strip() for p in parts):
        if not part:
            continue
        m = _METHOD.match(part)
        if m is None:
            raise ValueError(
                f"method {part!r}: expected NAME or NAME[KEY=VALUE;...], e.g. prhs[budget=512]"
            )
        name, inner = m.group(1), m.group(2)
        opts: dict[str, Any] = {}
        fields: set[str] = set()
        if name != SDPA:
            entry = selectors.get(name)  # UnknownSelectorError lists the known names
            fields = set(entry.defaults())
            for k, v in (common or {}).items():
                if k in fields:
                    opts[k] = v
        for item in (inner or "").split(";"):
            if not item.strip():
                continue
            if "=" not in item:
                raise ValueError(f"method {part!r}: option {item!r} is not KEY=VALUE")
            k, v = (s.strip() for s in item.split("=", 1))
            if name == SDPA or k not in fields:
                known = ", ".join(sorted(fields)) or "none"
                raise ValueError(
                    f"method {part!r}: {name} has no option {k!r} (its options: {known})"
                )
            opts[k] = parse_option_value(v)
        if name != SDPA:
            selectors.create(name, **opts)  # a bad value fails here, before any model exists
        methods.append(Method(name, opts))
    if not methods:
        raise ValueError("no methods given")
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a method is given twice: {labels}")
    return methods


def model_config(shape: str, *, layers: int | None = None, max_positions: int = 131072) -> Any:
    """A ``LlamaConfig`` of one of :data:`SHAPES` (``layers`` overrides its depth)."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    kw = dict(SHAPES[shape])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        kw["num_hidden_layers"] = layers
    theta = kw.pop("rope_theta")
    return LlamaConfig(
        **kw,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False,
    )


def random_model(config: Any, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A ``LlamaForCausalLM`` of ``config`` with N(0, 0.02) weights (norms at 1), in eval mode,
    built directly on ``device`` (no host copy of billions of parameters)."""
    from transformers import LlamaForCausalLM

    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)  # the dtype first: no float32 copy
    gen = torch.Generator(device=device if device.type != "meta" else "cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if device.type == "meta":
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if device.type != "meta":  # to_empty left the rotary frequencies uninitialised
        with torch.device("cpu"):
            rotary = type(model.model.rotary_emb)(config)
        model.model.rotary_emb = rotary.to(device)
    return model.eval()


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """K and V bytes one token takes over every layer."""
    hkv = config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * hkv * d * torch.empty(0, dtype=dtype).element_size()


def weight_bytes(model: Any, batch: int) -> int:
    """Parameter bytes a decode step reads: every weight, but of the input embedding only the
    ``batch`` rows it looks up (the LM head is read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if emb is not model.get_output_embeddings().weight:
        total -= emb.numel() * emb.element_size()
        total += batch * emb.shape[1] * emb.element_size()
    return total


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), measured now."""
    n = nbytes // 2  # bfloat16 elements
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from prhs_kernels.timing import median_ms

        ms = median_ms(lambda: dst.copy_(src), warmup_ms=25, rep_ms=200)
    else:
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src)
        ms = (time.perf_counter() - t0) / 3 * 1e3
    return 2 * nbytes / (ms / 1e3)


@dataclass
class ThroughputPoint:
    """One measured (shape, B, T, method) point."""

    shape: str
    batch: int
    context: int
    method: str
    ms_per_step: float | None = None  # CUDA: the mean over a window of consecutive steps
    ms_median: float | None = None  # that window's median step (None: eager, or an old row)
    tokens_per_s: float | None = None
    floor_ms: float | None = None
    vs_floor: float | None = None
    speedup_vs_dense: float | None = None
    weight_bytes: int | None = None
    kv_bytes_per_step: float | None = None
    retrieval_ratio: float | None = None
    avg_selected: float | None = None
    state_bytes: int | None = None
    graph: bool = False
    compiled: str | None = None  # the torch.compile backend of the model's parts, if any
    compile_scope: str | None = None  # what it compiled (COMPILE_SCOPES); None: "parts"
    fused: bool = False  # QKV and gate/up projections as one GEMM each (fused_projections)
    fused_layers: bool = False  # post-attention work in GEMM epilogues (fused_layers)
    rope_epilogue: bool = False  # and the rotary embedding + cache write (ROPE_EPILOGUE)
    gemm: str | None = None  # "triton": the linear layers through decode_gemms; None: cuBLAS
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> ThroughputPoint:
        """The point a ``rows.jsonl`` line holds (unknown keys are an error)."""
        names = {f for f in cls.__dataclass_fields__}
        extra = sorted(set(row) - names)
        if extra:
            raise ValueError(f"not a table5 row: unknown fields {extra}")
        return cls(**dict(row))


def _join_key(p: ThroughputPoint) -> tuple:
    """What makes two rows the same point: (shape, B, T, method, compile backend and scope,
    fused, fused layers, rotary epilogue, GEMM); rows written before a field existed read as
    its default."""
    scope = (p.compile_scope or "parts") if p.compiled else None
    return (p.shape, p.batch, p.context, p.method, p.compiled, scope, p.fused, p.fused_layers,
            p.rope_epilogue, p.gemm or "cublas")  # fmt: skip


def load_points(folders: Sequence[Any]) -> tuple[list[ThroughputPoint], list[dict], dict]:
    """The points, run contexts and machine of earlier ``table5`` folders, joined: a point
    measured in a later folder replaces the same point (:func:`_join_key`: shape, B, T, method
    and how the model ran) of an earlier one (a re-run of what ran out of memory). All must
    come from one GPU model."""
    import json
    from pathlib import Path

    merged: dict[tuple, ThroughputPoint] = {}
    runs: list[dict] = []
    machine: dict = {}
    for folder in map(Path, folders):
        rows = folder / "rows.jsonl"
        if not rows.is_file():
            raise ValueError(f"{folder}: no rows.jsonl (not a table5 folder)")
        mach = json.loads((folder / "machine.json").read_text(encoding="utf-8"))
        if machine and mach.get("gpu") != machine.get("gpu"):
            raise ValueError(
                f"{folder} ran on {mach.get('gpu')!r}, an earlier folder on "
                f"{machine.get('gpu')!r}: one table, one GPU"
            )
        if machine and mach.get("prhs_commit") not in str(machine.get("prhs_commit")).split(", "):
            machine["prhs_commit"] = f"{machine['prhs_commit']}, {mach.get('prhs_commit')}"
        machine = machine or dict(mach)
        runs += json.loads((folder / "config.json").read_text(encoding="utf-8")).get("runs", [])
        for line in rows.read_text(encoding="utf-8").splitlines():
            if line.strip():
                pt = ThroughputPoint.from_dict(json.loads(line))
                key = _join_key(pt)
                if pt.skipped is None or key not in merged or merged[key].skipped:
                    merged[key] = pt
    order = {s: i for i, s in enumerate(SHAPES)}
    points = sorted(merged.values(), key=lambda p: (order.get(p.shape, 99), p.context, p.batch))
    # Keep each (B, T)'s methods in the order they ran.
    return points, runs, machine


#: The modules ``compiled_parts`` compiles, by class-name suffix (transformers' Llama family):
#: ``scope="parts"`` the norms and MLPs, ``scope="layers"`` each decoder layer whole.
COMPILED_MODULES = ("RMSNorm", "MLP")
COMPILED_LAYERS = ("DecoderLayer",)
#: What ``scope="layers"`` also compiles outside the decoder layers: the rotary embedding (its
#: cos/sin, once a step) and the final norm.
COMPILED_OUTSIDE_LAYERS = ("RotaryEmbedding", "RMSNorm")
COMPILE_SCOPES = ("parts", "layers")


@contextlib.contextmanager
def compiled_parts(model: Any, backend: str = "inductor", scope: str = "parts") -> Iterator[int]:
    """Within the block, parts of the model run through ``torch.compile(backend=backend,
    dynamic=False)``; yields how many modules were compiled. Everything is restored on exit.

    ``scope="parts"``: the RMS norms and MLPs (modules whose class name ends in
    :data:`COMPILED_MODULES`) and the modeling module's ``apply_rotary_pos_emb``; the attention
    call is left alone (prhs's decode path has its own kernels and transformers' sdpa is one
    call). ``scope="layers"``: each decoder layer whole (class names ending in
    :data:`COMPILED_LAYERS`), so that Inductor also fuses what lies between the parts -- the
    residual adds into the norms, the rotary embedding into the cache write -- and what runs
    outside the layers (:data:`COMPILED_OUTSIDE_LAYERS`: the rotary embedding's cos/sin, the
    final norm). transformers' sdpa is traced with the layer; prhs's attention is not (it is
    excluded from tracing, see :mod:`prhs_eval.integration`): each layer compiles to the graphs
    before and after it.
    Dynamo specialises on each layer's index, so ``layers`` compiles a graph per layer and per
    batch size the first time each runs."""
    import torch._dynamo

    if scope not in COMPILE_SCOPES:
        raise ValueError(f"scope must be one of {COMPILE_SCOPES}, got {scope!r}")
    suffixes = COMPILED_LAYERS if scope == "layers" else COMPILED_MODULES
    mods = [m for m in model.modules() if type(m).__name__.endswith(suffixes)]
    if not mods:
        raise ValueError(
            f"{type(model).__name__} has no module whose class name ends in {suffixes}"
        )
    if scope == "layers":  # and what runs outside them (inside, a layer's graph holds it)
        inside = {id(sub) for layer in mods for sub in layer.modules()}
        outside = COMPILED_OUTSIDE_LAYERS
        mods += [
            m for m in model.modules() if type(m).__name__.endswith(outside) and id(m) not in inside
        ]
    cfg = torch._dynamo.config
    # The recompile limits raised for the block (per code object, and over all its graphs;
    # older torch names them cache_size_limit), and their old values.
    names = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
             "accumulated_cache_size_limit")  # fmt: skip
    limits = {name: getattr(cfg, name) for name in names if hasattr(cfg, name)}
    rotary = []  # (module, original) of each modeling module that defines it
    if scope == "parts":
        for name in dict.fromkeys(type(m).__module__ for m in model.modules()):
            module = sys.modules.get(name)
            fn = getattr(module, "apply_rotary_pos_emb", None)
            if callable(fn):
                rotary.append((module, fn))
    # A graph per batch size and module type (parts); per layer, batch size and cache (layers).
    want = 64 if scope == "parts" else max(64, 16 * len(mods))
    try:
        for name, old in limits.items():
            setattr(cfg, name, max(old, want if "accumulated" not in name else 8 * want))
        for m in mods:
            m.compile(backend=backend, dynamic=False)
        for module, fn in rotary:
            module.apply_rotary_pos_emb = torch.compile(fn, backend=backend, dynamic=False)
        yield len(mods)
    finally:
        for m in mods:
            m._compiled_call_impl = None
        for module, fn in rotary:
            module.apply_rotary_pos_emb = fn
        for name, old in limits.items():
            setattr(cfg, name, old)


class _SharedProjection:
    """What one fused GEMM of a layer's q/k/v left for the k and v projections: their slices
    of the output, keyed by the input tensor they were computed from."""

    def __init__(self) -> None:
        self.source: torch.Tensor | None = None
        self.parts: dict[str, torch.Tensor] = {}


def _fused_qkv_forward(holder: _SharedProjection, name: str, weight: torch.Tensor,
                       bias: torch.Tensor | None, splits: list[int], own: Any,
                       linear: Callable[..., torch.Tensor]
                       ) -> Callable[[torch.Tensor], torch.Tensor]:  # fmt: skip
    """The forward of one of q/k/v: ``q`` computes all three with one GEMM (``linear``) and
    keeps k's and v's slices; ``k``/``v`` hand theirs out when called on the same input
    (anything else -- another input, another order -- runs their ``own`` forward: correct,
    unfused)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if name == "q":
            q, k, v = linear(x, weight, bias).split(splits, dim=-1)
            holder.source, holder.parts = x, {"k": k, "v": v}
            return q
        part = holder.parts.pop(name, None)
        if part is not None and holder.source is x:
            if not holder.parts:
                holder.source = None
            return part
        return own(x)

    return forward


def _fused_mlp_forward(mlp: Any, weight: torch.Tensor, bias: torch.Tensor | None, inner: int,
                       linear: Callable[..., torch.Tensor]
                       ) -> Callable[[torch.Tensor], torch.Tensor]:  # fmt: skip
    """``down(act(gate(x)) * up(x))`` with gate and up as one GEMM (``linear``)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, weight, bias).split([inner, inner], dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    return forward


def _is_linear(m: Any) -> bool:
    return isinstance(m, torch.nn.Linear)


def _concat_into(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' stacked along the output dimension; each
    Linear's parameter becomes a view into it, so the fused model holds no second copy."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([
            lin.bias.detach() if lin.bias is not None
            else lin.weight.new_zeros(lin.out_features) for lin in linears
        ])  # fmt: skip
    start = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = torch.nn.Parameter(weight[start : start + n], requires_grad=False)
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


@contextlib.contextmanager
def fused_projections(
    model: Any,
    linear: Callable[..., torch.Tensor] | None = None,
    exclude: Sequence[Any] = (),
) -> Iterator[tuple[int, int]]:
    """Within the block, every attention module with ``q_proj``/``k_proj``/``v_proj`` computes
    the three with one GEMM, and every MLP with ``gate_proj``/``up_proj``/``down_proj``/
    ``act_fn`` its gate and up with one; yields (attention modules, MLPs) fused. ``linear``
    (``F.linear`` by default; :func:`decode_gemms` passes prhs's) runs each fused GEMM.

    The weights are concatenated once and each projection's parameter becomes a view of the
    concatenation (no second copy; the values are unchanged, so the model computes what it
    did, up to the GEMM's summation order). The forwards are restored on exit (the parameters
    stay views: same values). A model whose modules have other names is left alone; one with
    neither is an error. Modules inside ``exclude`` (:func:`fused_layers`' layers) are left
    alone."""
    import torch.nn.functional as F

    linear = linear or F.linear
    patched: list[tuple[Any, Any]] = []  # (module, the forward its instance had, if any)
    attn = mlps = 0
    skip = {id(sub) for mod in exclude for sub in mod.modules()}
    try:
        for m in model.modules():
            if id(m) in skip:
                continue
            lins = [getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj")]
            if all(_is_linear(x) for x in lins):
                weight, bias = _concat_into(lins)
                holder = _SharedProjection()
                splits = [x.out_features for x in lins]
                for name, lin in zip("qkv", lins, strict=True):
                    patched.append((lin, lin.__dict__.get("forward")))
                    own = lin.forward
                    lin.forward = _fused_qkv_forward(
                        holder, name, weight, bias, splits, own, linear
                    )
                attn += 1
                continue
            lins = [getattr(m, n, None) for n in ("gate_proj", "up_proj")]
            if (all(_is_linear(x) for x in lins) and _is_linear(getattr(m, "down_proj", None))
                    and callable(getattr(m, "act_fn", None))
                    and lins[0].out_features == lins[1].out_features):  # fmt: skip
                weight, bias = _concat_into(lins)
                patched.append((m, m.__dict__.get("forward")))
                m.forward = _fused_mlp_forward(m, weight, bias, lins[0].out_features, linear)
                mlps += 1
        if not attn and not mlps and not exclude:
            raise ValueError(f"{type(model).__name__} has no q/k/v or gate/up projections to fuse")
        yield attn, mlps
    finally:
        for mod, old in patched:
            if old is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = old


#: The decoder layers :func:`fused_layers` runs, by class name: transformers' Llama
#: family, whose forward is ``h = x + attn(norm1(x)); return h + mlp(norm2(h))`` with RMS norms
#: (:data:`FUSED_NORMS`) and a SwiGLU MLP.
FUSED_LAYERS = (
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
)  # fmt: skip
#: The RMS norms whose forward is ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)``.
FUSED_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
_SILU = ("SiLU", "SiLUActivation")


def _fusable_layer(layer: Any) -> bool:
    """``layer`` is one :func:`fused_layers` can run: a :data:`FUSED_LAYERS` class with
    :data:`FUSED_NORMS` norms, linear q/k/v/o projections and a SiLU-gated MLP."""
    if type(layer).__name__ not in FUSED_LAYERS:
        return False
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    if not all(type(n).__name__ in FUSED_NORMS for n in norms):
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(_is_linear(getattr(mod, n, None)) for mod, n in names):
        return False
    return (type(getattr(mlp, "act_fn", None)).__name__ in _SILU
            and mlp.gate_proj.out_features == mlp.up_proj.out_features)  # fmt: skip


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _fused_layer_forward(layer: Any, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None
                         ) -> Callable[..., torch.Tensor]:  # fmt: skip
    """A Llama-family decoder layer's forward with its norms and the work after its attention
    in four GEMM epilogues: the attention is called on the layer's input itself (its q|k|v
    GEMM runs the input norm, :func:`~prhs_kernels.gemm.decode_linear_rms`, see
    :func:`fused_layers`), then ``h = x + o(attn)`` with the post-attention norm's weight and
    sums of squares (:func:`~prhs_kernels.gemm.decode_linear_residual_norm`), ``silu(gate) *
    up`` of the normed ``h`` (:func:`~prhs_kernels.gemm.decode_linear_swiglu`), and ``h +
    down(...)`` (:func:`~prhs_kernels.gemm.decode_linear`'s ``residual``). The attention module
    (its o projection the identity) returns the heads' output unprojected."""
    import inspect

    from prhs_kernels.gemm import decode_linear, decode_linear_residual_norm, decode_linear_swiglu

    # The original forward's keyword names after hidden_states, for arguments given by position.
    params = list(inspect.signature(type(layer).forward).parameters.values())[2:]
    names = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    attn = layer.self_attn
    o, down, norm = attn.o_proj, layer.mlp.down_proj, layer.post_attention_layernorm
    eps = float(norm.variance_epsilon)

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > len(names):
            raise TypeError(f"{type(layer).__name__}.forward takes at most {len(names) + 1} "
                            f"positional arguments, got {len(args) + 1}")  # fmt: skip
        kwargs.update(zip(names, args, strict=False))
        heads, _ = attn(hidden_states=hidden_states, **kwargs)  # q|k|v norm the input
        h, hg, sumsq = decode_linear_residual_norm(
            heads, o.weight, o.bias, residual=hidden_states, norm_weight=norm.weight
        )
        act = decode_linear_swiglu(hg, gate_up, gate_up_bias, sumsq=sumsq, eps=eps)
        return decode_linear(act, down.weight, down.bias, residual=h)

    return forward


#: The attention modules whose decode step :func:`fused_layers` runs as one q|k|v GEMM with the
#: rotary embedding and the cache write in its epilogue, by class name, and what each passes
#: the attention function besides the Llama arguments: their forwards are transformers'
#: ``q|k|v -> apply_rotary_pos_emb -> cache.update -> attention -> o_proj``.
ROPE_ATTENTION: dict[str, Callable[[Any], dict[str, Any]]] = {
    "LlamaAttention": lambda attn: {},
    "Qwen2Attention": lambda attn: {"sliding_window": attn.sliding_window},
    "MistralAttention": lambda attn: {
        "sliding_window": getattr(attn.config, "sliding_window", None)
    },
}
#: Whether :func:`fused_layers` runs the rotary epilogue (:func:`_rope_attention_forward`) where
#: it can; module-level so that a benchmark can A/B it.
ROPE_EPILOGUE = True


def _static_layer(cache: Any, index: int, rows: int, dim: int, dtype: torch.dtype) -> Any:
    """The cache's layer ``index`` where the rotary epilogue can write it: a plain
    ``StaticLayer`` (no sliding window), already allocated for ``rows`` sequences of heads of
    ``dim`` in ``dtype``, with its length a device tensor, in a cache that does not offload;
    else None. Reads nothing on the device."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False) or index >= len(layers):
        return None
    layer = layers[index]
    if type(layer) is not StaticLayer or not getattr(layer, "is_initialized", False):
        return None
    keys, length = layer.keys, layer.cumulative_length
    if (keys.shape[0] != rows or keys.shape[-1] != dim or keys.dtype != dtype
            or layer.values.shape != keys.shape or not isinstance(length, torch.Tensor)
            or length.dtype != torch.int64 or length.device != keys.device):  # fmt: skip
        return None
    return layer


def _rope_attention_forward(
    attn: Any,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    fallback: Callable[..., Any],
) -> Callable[..., Any]:
    """``attn``'s forward (a :data:`ROPE_ATTENTION` class) where a decode step's q|k|v
    projection, input norm, rotary embedding and cache write are one
    :func:`~prhs_kernels.gemm.decode_linear_rope` launch on ``weight`` (the input norm's
    weight folded in): one new token per sequence into a plain static cache
    (:func:`_static_layer`), whose length the kernel also advances as ``StaticLayer.update``
    does. Anything else -- a prompt, another cache, cos/sin of another width -- runs
    ``fallback`` (the module's forward with the folded q/k/v GEMM). Outside ``torch.compile``'s
    tracing: the op writes the cache in place, and the attention after it breaks the graph
    anyway."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from prhs_kernels.gemm import decode_linear_rope

    dim = attn.head_dim
    extra = ROPE_ATTENTION[type(attn).__name__]
    eager = sys.modules[type(attn).__module__].eager_attention_forward

    @torch.compiler.disable(reason="writes the KV cache in place, before prhs's attention")
    def forward(hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        rows, length = hidden_states.shape[:2]
        layer = None
        if length == 1 and position_embeddings is not None:
            cos, sin = position_embeddings
            if cos.shape[-1] == dim and cos.numel() == sin.numel() in (dim, rows * dim):
                layer = _static_layer(past_key_values, attn.layer_idx, rows, dim,
                                      hidden_states.dtype)  # fmt: skip
        if layer is None:
            return fallback(hidden_states=hidden_states, position_embeddings=position_embeddings,
                            attention_mask=attention_mask, past_key_values=past_key_values,
                            **kwargs)  # fmt: skip
        q = decode_linear_rope(
            hidden_states, weight, bias, cos=cos, sin=sin, k_cache=layer.keys,
            v_cache=layer.values, position=layer.cumulative_length, eps=eps,
        )  # fmt: skip
        query = q.view(rows, 1, -1, dim).transpose(1, 2)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
        out, weights = interface(
            attn, query, layer.keys, layer.values, attention_mask,
            dropout=0.0 if not attn.training else attn.attention_dropout,
            scaling=attn.scaling, **extra(attn), **kwargs,
        )  # fmt: skip
        out = out.reshape(rows, length, -1).contiguous()
        return attn.o_proj(out), weights

    return forward


def _normed_qkv(attn: Any, norm: Any, stack: contextlib.ExitStack, rope: bool = False) -> None:
    """``attn``'s q/k/v projections as one :func:`~prhs_kernels.gemm.decode_linear_rms` GEMM of
    the un-normed input, ``norm``'s weight folded into the concatenated weight's columns (in
    place: the three parameters are views of it; an exact copy on the host puts the values
    back when ``stack`` closes). k and v hand out their slices of q's output
    (:func:`_fused_qkv_forward`); called on anything else, each runs its own slice of the
    folded weight, the norm included. ``rope`` (an attention class of :data:`ROPE_ATTENTION`):
    its decode steps also run the rotary embedding and the cache write in that GEMM
    (:func:`_rope_attention_forward`)."""
    from prhs_kernels.gemm import decode_linear_rms, fold_norm_weight

    lins = [attn.q_proj, attn.k_proj, attn.v_proj]
    eps = float(norm.variance_epsilon)
    weight, bias = _concat_into(lins)
    original = weight.to("cpu", copy=True)
    weight.copy_(fold_norm_weight(weight, norm.weight.detach()))
    stack.callback(weight.copy_, original)

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return decode_linear_rms(x, w, b, eps=eps)

    holder = _SharedProjection()
    splits = [x.out_features for x in lins]
    for name, lin in zip("qkv", lins, strict=True):
        old = lin.__dict__.get("forward")
        stack.callback(_restore_forward, lin, old)

        def own(x: torch.Tensor, lin: Any = lin) -> torch.Tensor:
            return linear(x, lin.weight, lin.bias)

        lin.forward = _fused_qkv_forward(holder, name, weight, bias, splits, own, linear)
    if rope and type(attn).__name__ in ROPE_ATTENTION:
        stack.callback(_restore_forward, attn, attn.__dict__.get("forward"))
        attn.forward = _rope_attention_forward(attn, weight, bias, eps, attn.forward)


def _restore_forward(mod: Any, old: Any) -> None:
    if old is None:
        mod.__dict__.pop("forward", None)
    else:
        mod.forward = old


@contextlib.contextmanager
def fused_layers(model: Any, rope: bool | None = None) -> Iterator[int]:
    """Within the block, each Llama-family decoder layer (:func:`_fusable_layer`:
    :data:`FUSED_LAYERS`) runs as four of prhs's decode GEMMs (:mod:`prhs_kernels.gemm`) with
    its norms, activation and residual adds in their prologue-free epilogues: the q|k|v GEMM
    (one weight, the input norm's weight folded into its columns) scales each row by the
    input norm's ``1 / rms``, summed from the tiles of the input it loads; the o projection
    adds the residual and applies the post-attention RMS norm's weight, writing the sums of
    squares the norm needs; the gate|up GEMM (gate and up as one weight, no second copy)
    scales by the norm's ``1 / rms`` and writes ``silu(gate) * up``; the down projection adds
    the residual. With ``rope`` (:data:`ROPE_EPILOGUE` by default), a decode step into a
    static cache also runs the rotary embedding of q and k and the write of k and v into the
    cache in the q|k|v GEMM's epilogue (:func:`~prhs_kernels.gemm.decode_linear_rope`; for the
    attention classes of :data:`ROPE_ATTENTION`); without, they are the layer's own. The
    attention (prhs's or transformers') is the layer's own. At a decode step's few rows that
    removes four launches a layer (the two norms, the SiLU·mul and the last residual add),
    those of the rotation, the cache write and the length's add with the rotary epilogue,
    and the writes of the normed input and the ``[rows, 2·intermediate]`` gate|up output.
    The model computes what it did up to where the norms and the rotation round
    (:func:`~prhs_kernels.gemm.decode_linear_rms`,
    :func:`~prhs_kernels.gemm.decode_linear_residual_norm`,
    :func:`~prhs_kernels.gemm.decode_linear_rope`). Yields the layers fused; other
    layers are left alone, and a model with none is an error. Within the block the q/k/v
    weights hold the input norm's weight folded in; on exit their values are copied back
    (from a host copy) and the forwards restored (the q/k/v and gate/up weights stay views of
    their concatenations: same values)."""
    layers = [m for m in model.modules() if _fusable_layer(m)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no decoder layer to fuse (one of {FUSED_LAYERS} with "
            f"{FUSED_NORMS} norms and a SiLU-gated MLP)"
        )
    rope = ROPE_EPILOGUE if rope is None else rope
    with contextlib.ExitStack() as stack:
        for layer in layers:
            mlp, o = layer.mlp, layer.self_attn.o_proj
            _normed_qkv(layer.self_attn, layer.input_layernorm, stack, rope)
            gate_up, gate_up_bias = _concat_into([mlp.gate_proj, mlp.up_proj])
            stack.callback(_restore_forward, o, o.__dict__.get("forward"))
            o.forward = _identity  # the layer's forward projects the heads, in an epilogue GEMM
            stack.callback(_restore_forward, layer, layer.__dict__.get("forward"))
            layer.forward = _fused_layer_forward(layer, gate_up, gate_up_bias)
        yield len(layers)


#: What ``--gemm`` may name: cuBLAS (``F.linear``) or prhs's decode GEMM.
GEMMS = ("cublas", "triton")


@contextlib.contextmanager
def decode_gemms(model: Any, fuse: bool = False, fuse_layers: bool = False) -> Iterator[int]:
    """Within the block, every ``nn.Linear`` of the model (the projections, the MLP, the LM
    head) runs :func:`prhs_kernels.gemm.decode_linear` -- a Triton weight stream at decode
    sizes (at most 16 rows on CUDA, fp16/bf16), ``F.linear`` otherwise -- and with ``fuse`` the
    fused q/k/v and gate/up GEMMs of :func:`fused_projections` too (entered here); with
    ``fuse_layers`` (which implies ``fuse``) the decoder layers :func:`fused_layers` takes run
    their post-attention norm, SiLU·mul and residual adds in GEMM epilogues, the rest as
    ``fuse`` says. Yields the linear layers rerouted; every forward is restored on exit."""
    from prhs_kernels.gemm import decode_linear

    with contextlib.ExitStack() as stack:
        whole: list[Any] = []
        if fuse_layers:
            stack.enter_context(fused_layers(model))
            whole = [m for m in model.modules() if "forward" in m.__dict__ and _fusable_layer(m)]
        if fuse or fuse_layers:
            stack.enter_context(fused_projections(model, linear=decode_linear, exclude=whole))
        patched = []  # the Linears whose forward this block set (fused ones keep theirs)
        try:
            for mod in model.modules():
                if isinstance(mod, torch.nn.Linear) and "forward" not in mod.__dict__:
                    mod.forward = _decode_linear_forward(mod, decode_linear)
                    patched.append(mod)
            if not patched:
                raise ValueError(f"{type(model).__name__} has no nn.Linear to run")
            yield len(patched)
        finally:
            for mod in patched:
                mod.__dict__.pop("forward", None)


def _decode_linear_forward(
    lin: torch.nn.Linear, linear: Callable[..., torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, lin.weight, lin.bias)

    return forward


def _static_cache(model: Any, batch: int, capacity: int, device: torch.device) -> Any:
    from transformers import StaticCache

    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=capacity)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache.early_initialization(batch, cfg.num_key_value_heads, d, dtype, device)
    return cache


def _fill(cache: Any, context: int, seed: int) -> None:
    """Random K/V in every layer; the cache then holds ``context`` tokens per row."""
    for i, layer in enumerate(cache.layers):
        if layer.keys.device.type != "meta":
            gen = torch.Generator(device=layer.keys.device).manual_seed(seed + i)
            layer.keys.normal_(generator=gen)
            layer.values.normal_(generator=gen)
    _rewind(cache, context)


def _rewind(cache: Any, context: int) -> None:
    """Back to ``context`` cached tokens per row, prhs's state dropped (the next method starts
    from the same cache)."""
    for layer in cache.layers:
        length = layer.cumulative_length
        if isinstance(length, torch.Tensor):
            length.fill_(context)
        else:
            layer.cumulative_length = context
    if hasattr(cache, "_prhs_state"):
        delattr(cache, "_prhs_state")


def _step_fn(model: Any, cache: Any, tokens: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        out = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tokens.copy_(out.logits[:, -1].argmax(-1, keepdim=True))

    return step


def _capture(step: Callable[[], None], device: torch.device) -> Any:
    """Two eager warm-up steps on a side stream, then the step captured in a CUDA graph."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()  # the first step after attach copies the cache into the side caches
        step()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _count_steps(step: Callable[[], None], device: torch.device, steps: int) -> None:
    """Run ``steps`` steps as the timed run does (two eager, the rest graph replays on CUDA),
    untimed: the pass that keeps a method's statistics."""
    if device.type != "cuda":
        for _ in range(steps):
            step()
        return
    graph = _capture(step, device)
    for _ in range(max(steps - 3, 1)):
        graph.replay()
    torch.cuda.synchronize(device)
    del graph


WINDOW_PERIOD = 33
"""The timed window is a multiple of this many steps (when the headroom allows one): a CIS
anchor is reused while it is at most ``n_local`` positions old (32 at the defaults), so with
every query alike (``tau=-1``) a row retrieves once every 33 steps, and a window of whole
periods counts each retrieval as often as it runs."""


def _time_step(
    step: Callable[[], None], device: torch.device, steps: int
) -> tuple[float, float | None, bool]:
    """(ms per step, the median step's ms or None, whether a CUDA graph ran it). ``steps``: the
    replays allowed (the cache's headroom).

    On CUDA: two eager warm-up steps, the capture, 8 replays of warm-up, then the longest
    window of consecutive replays that is a multiple of :data:`WINDOW_PERIOD` steps and fits
    the headroom, timed back to back by CUDA events (:func:`prhs_kernels.timing.window_ms`):
    its mean is the figure, so a selector's periodic retrieval steps count as often as they
    run (the median step would be a reuse step and leave them out)."""
    if device.type != "cuda":
        step()
        t0 = time.perf_counter()
        n = max(1, steps - 1)
        for _ in range(n):
            step()
        return (time.perf_counter() - t0) / n * 1e3, None, False
    from prhs_kernels.timing import window_ms

    graph = _capture(step, device)
    warm = 8
    room = max(steps - 2 - warm, 1)
    calls = room - room % WINDOW_PERIOD if room >= WINDOW_PERIOD else room
    w = window_ms(graph.replay, calls, warmup=warm)
    del graph
    return w.mean_ms, w.median_ms, True


def _free(device: torch.device) -> None:
    gc.collect()  # what a finished method left in reference cycles, before the next allocates
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(
    model: Any,
    config: Any,
    cache: Any,
    tokens: torch.Tensor,
    shape: str,
    b: int,
    t: int,
    m: Method,
    capacity: int,
    headroom: int,
    bw: float,
    device: torch.device,
    compiled: str | None = None,
    fused: bool = False,
    compile_scope: str | None = None,
    gemm: str = "cublas",
    fused_layers: bool = False,
) -> ThroughputPoint:
    """One method's point on a filled cache (a method that runs out of memory is skipped).

    A selector runs twice from the same cache: timed without statistics (what a user runs),
    then as many steps again with them kept on the device, untimed, for the bytes it read and
    its retrieval ratio (the two runs make the same decisions: nothing in a step depends on
    whether statistics are kept)."""
    from prhs_eval.integration import enable

    p = ThroughputPoint(
        shape,
        b,
        t,
        m.label,
        compiled=compiled,
        fused=fused,
        fused_layers=fused_layers,
        rope_epilogue=fused_layers and ROPE_EPILOGUE,
        compile_scope=compile_scope if compiled else None,
        gemm=None if gemm == "cublas" else gemm,
    )
    summary: dict[str, Any] = {}
    try:
        with torch.no_grad():
            for counting in (False, True) if m.name != SDPA else (False,):
                _rewind(cache, t)
                runtime = None
                try:
                    if m.name != SDPA:
                        runtime = enable(model, m.name, max_seq_len=capacity, checked=False,
                                         stats=counting, **dict(m.options))  # fmt: skip
                        state = runtime.attach(cache, b)
                        p.state_bytes = sum(state.nbytes().values())
                    step = _step_fn(model, cache, tokens)
                    if counting:
                        _count_steps(step, device, headroom)
                        summary = runtime.summary(cache)
                    else:
                        ms, median, graphed = _time_step(step, device, headroom)
                finally:
                    if runtime is not None:
                        runtime.disable()
                    _rewind(cache, t)
                    _free(device)
    except torch.OutOfMemoryError:
        p.skipped = "out of memory (its state and scratch on top of the K/V)"
        return p
    p.ms_per_step, p.ms_median, p.graph = ms, median, graphed
    p.tokens_per_s = b / (ms / 1e3)
    p.weight_bytes = weight_bytes(model, b)
    per_token = kv_bytes_per_token(config, next(model.parameters()).dtype)
    if summary and summary.get("decisions"):
        heads = config.num_key_value_heads * config.num_hidden_layers
        steps_run = summary["decisions"] / (b * heads)
        row_bytes = per_token // heads  # K and V of one position of one KV head
        p.kv_bytes_per_step = (summary["selected"] * row_bytes + summary["proxy_bytes"]) / steps_run
        p.retrieval_ratio = summary["retrieval_ratio"]
        p.avg_selected = summary["avg_selected"]
    else:  # sdpa: what dense must read, each row's cached tokens
        p.kv_bytes_per_step = float(b * (t + headroom / 2) * per_token)
    p.floor_ms = (p.weight_bytes + p.kv_bytes_per_step) / bw * 1e3
    p.vs_floor = ms / p.floor_ms
    return p


def decode_throughput(
    shape: str,
    batches: Sequence[int],
    contexts: Sequence[int],
    methods: Sequence[Method],
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    layers: int | None = None,
    headroom: int = 160,
    memory_fraction: float = 0.9,
    seed: int = 0,
    compile: str | None = None,
    fuse: bool = False,
    compile_scope: str = "parts",
    gemm: str = "cublas",
    progress: Callable[[str], None] | None = None,
    fuse_layers: bool = False,
) -> tuple[list[ThroughputPoint], dict[str, Any]]:
    """Measure every (B, T, method) point of one shape; returns the points and the run's
    context (bandwidth, weight bytes, config).

    A (B, T) whose weights, K/V and ``headroom`` decode positions do not fit in
    ``memory_fraction`` of the device's memory is reported as skipped, not run. ``compile``:
    a ``torch.compile`` backend (``"inductor"``) for the model's norms, MLPs and rotary
    embedding, or with ``compile_scope="layers"`` each decoder layer whole
    (:func:`compiled_parts`), every method alike; ``None``: eager modules.
    ``fuse``: each layer's q/k/v and gate/up projections as one GEMM each
    (:func:`fused_projections`), every method alike. ``gemm="triton"``: every linear layer
    through prhs's decode GEMM (:func:`decode_gemms`), every method alike; with it,
    ``fuse_layers`` runs each Llama-family decoder layer's post-attention norm, SiLU·mul and
    residual adds in its GEMMs' epilogues (:func:`fused_layers`; implies ``fuse``).
    """
    device = torch.device(device)
    if headroom < 16:
        raise ValueError(f"headroom must be >= 16 decode positions, got {headroom}")
    if compile is not None and not (isinstance(compile, str) and compile):
        raise ValueError(f"compile must be a torch.compile backend name or None, got {compile!r}")
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {compile_scope!r}")
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    if fuse_layers and gemm != "triton":
        raise ValueError(
            "fuse_layers needs gemm='triton': the norms and adds run inside prhs's decode GEMMs"
        )
    fuse = fuse or fuse_layers
    say = progress or (lambda _m: None)
    config = model_config(shape, layers=layers, max_positions=max(contexts) + headroom + 8)
    model = random_model(config, device, dtype, seed)
    with contextlib.ExitStack() as stack:
        # Before compiling: the compiled modules trace the fused / rerouted forwards.
        if gemm == "triton":
            stack.enter_context(decode_gemms(model, fuse, fuse_layers))
        elif fuse:
            stack.enter_context(fused_projections(model))
        if compile is not None:
            stack.enter_context(compiled_parts(model, compile, compile_scope))
        points, bw, params = _run_points(
            model, config, shape, batches, contexts, methods, device, dtype, headroom,
            memory_fraction, seed, compile, fuse, compile_scope, gemm, say, fuse_layers,
        )  # fmt: skip
    context = {
        "shape": shape,
        "config": {k: v for k, v in SHAPES[shape].items()}
        | ({"num_hidden_layers": layers} if layers else {}),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "copy_bandwidth_GBps": bw / 1e9,
        "parameter_bytes": params,
        "kv_bytes_per_token": kv_bytes_per_token(config, dtype),
        "headroom": headroom,
        "compile": compile,
        "compile_scope": compile_scope if compile is not None else None,
        "gemm": gemm,
        "fuse": fuse,
        "fuse_layers": fuse_layers,
        "methods": [m.label for m in methods],
    }
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return points, context


def _run_points(
    model: Any,
    config: Any,
    shape: str,
    batches: Sequence[int],
    contexts: Sequence[int],
    methods: Sequence[Method],
    device: torch.device,
    dtype: torch.dtype,
    headroom: int,
    memory_fraction: float,
    seed: int,
    compile: str | None,
    fuse: bool,
    compile_scope: str,
    gemm: str,
    say: Callable[[str], None],
    fuse_layers: bool = False,
) -> tuple[list[ThroughputPoint], float, int]:
    bw = copy_bandwidth(device)
    per_token = kv_bytes_per_token(config, dtype)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    total_mem = (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    )
    points: list[ThroughputPoint] = []
    for t in contexts:
        for b in batches:
            capacity = t + headroom
            need = params + b * capacity * per_token * 1.15  # side caches and scratch
            if total_mem is not None and need > memory_fraction * total_mem:
                why = f"K/V {b * capacity * per_token / 2**30:.0f} GiB + weights do not fit"
                points += [ThroughputPoint(shape, b, t, m.label, skipped=why) for m in methods]
                say(f"{shape} B{b} T{t}: skipped ({why})")
                continue
            try:
                cache = _static_cache(model, b, capacity, device)
                _fill(cache, t, seed)
            except torch.OutOfMemoryError:
                cache = None
                _free(device)
                why = "out of memory allocating the K/V"
                points += [ThroughputPoint(shape, b, t, m.label, skipped=why) for m in methods]
                say(f"{shape} B{b} T{t}: skipped ({why})")
                continue
            tokens = torch.zeros(b, 1, dtype=torch.long, device=device)
            row = [
                _measure(
                    model,
                    config,
                    cache,
                    tokens,
                    shape,
                    b,
                    t,
                    m,
                    capacity,
                    headroom,
                    bw,
                    device,
                    compile,
                    fuse,
                    compile_scope,
                    gemm,
                    fuse_layers,
                )
                for m in methods
            ]
            dense = [p.ms_per_step for p in row if p.ms_per_step and p.method in (SDPA, "dense")]
            for p in row:
                if dense and p.ms_per_step:
                    p.speedup_vs_dense = min(dense) / p.ms_per_step
                say(
                    f"{shape} B{b} T{t} {p.method}: "
                    + (f"skipped ({p.skipped})" if p.skipped else
                       f"{p.ms_per_step:.3f} ms/step, {p.tokens_per_s:.0f} tok/s, "
                       f"x{p.vs_floor:.2f} of floor, x{p.speedup_vs_dense or 0:.2f} dense")
                )  # fmt: skip
            points += row
            del cache, tokens
            _free(device)
    return points, bw, params


TABLE5_HEAD = (
    "shape", "B", "T", "method", "ms/step", "median ms", "tokens/s", "× dense", "floor ms",
    "× floor", "ρ̂ %", "KV+proxy GB/step", "state GB",
)  # fmt: skip


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table5_rows(points: Sequence[ThroughputPoint]) -> list[list[str]]:
    """The cells of :data:`TABLE5_HEAD`, one row per point (skipped points say why)."""
    rows = []
    for p in points:
        if p.skipped:
            rows.append([p.shape, str(p.batch), str(p.context), p.method, "skipped: " + p.skipped,
                         *["—"] * (len(TABLE5_HEAD) - 5)])  # fmt: skip
            continue
        kv = None if p.kv_bytes_per_step is None else p.kv_bytes_per_step / 1e9
        state = None if p.state_bytes is None else p.state_bytes / 1e9
        method = point_label(p)
        ms = _f(p.ms_per_step, ".3f")
        if p.graph and p.ms_median is None:  # a row timed before the window: do_bench's median
            ms += " (median)"
        rows.append([
            p.shape, str(p.batch), str(p.context), method, ms, _f(p.ms_median, ".3f"),
            _f(p.tokens_per_s, ".0f"), _f(p.speedup_vs_dense, ".2f"), _f(p.floor_ms, ".3f"),
            _f(p.vs_floor, ".2f"), _f(p.retrieval_ratio, ".1f"), _f(kv, ".2f"),
            _f(state, ".2f"),
        ])  # fmt: skip
    return rows


def point_label(p: ThroughputPoint) -> str:
    """A point's method and how the model around it ran: ``prhs[...] · compiled layers ·
    fused · triton GEMMs`` (``fused layers + rope``: with the rotary epilogue)."""
    label = p.method
    if p.compiled:
        label += " · compiled layers" if p.compile_scope == "layers" else " · compiled"
    label += " · fused layers" if p.fused_layers else " · fused" if p.fused else ""
    label += " + rope" if p.rope_epilogue else ""
    return label + (" · triton GEMMs" if p.gemm == "triton" else "")


def table5_figure(points: Sequence[ThroughputPoint], path: Any) -> None:
    """Tokens/s per (B, T) and method, one panel per shape, each bar's floor as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(p.shape for p in points))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(12, 6.0 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes, strict=True):
        pts = [p for p in points if p.shape == shape and not p.skipped]
        cells = list(dict.fromkeys((p.batch, p.context) for p in pts))
        methods = list(dict.fromkeys(point_label(p) for p in pts))
        width = 0.8 / max(len(methods), 1)
        # Distinct colours for up to 20 bars of a cell (tab10 repeats after 10).
        cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
        for j, m in enumerate(methods):
            xs, ys, floors = [], [], []
            for i, c in enumerate(cells):
                hit = [p for p in pts if (p.batch, p.context) == c and point_label(p) == m]
                if hit and hit[0].tokens_per_s:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    ys.append(hit[0].tokens_per_s)
                    floors.append(hit[0].batch / (hit[0].floor_ms / 1e3))
            ax.bar(xs, ys, width=width * 0.95, label=m, color=cmap(j % cmap.N))
            ax.scatter(xs, floors, marker="_", s=120, color="black", zorder=3)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"B{b}·T{t // 1024}k" for b, t in cells])
        ax.set_yscale("log")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{shape}: decode throughput (black ticks: each bar's byte floor)")
        ax.legend(fontsize=7, ncol=min(len(methods), 3), loc="upper center",
                  bbox_to_anchor=(0.5, -0.12), frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # legends below the axes included
    plt.close(fig)
