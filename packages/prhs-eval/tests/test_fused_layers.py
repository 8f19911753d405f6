""":func:`prhs_eval.throughput.fused_layers` (``table5 --fuse-layers``) on tiny random models on
the CPU.

There ``prhs_kernels.gemm``'s epilogue GEMMs take their torch path (the float32 references of
what the Triton kernels compute; the kernels themselves are tested under ``TRITON_INTERPRET=1``
in prhs-kernels), so these tests check the layer around them: that each GEMM gets its layer's
weights, residual, norm weight, sums of squares and eps -- the models here have random norm
weights, random biases and an eps that matters at their activations' scale, so a wrong one
shows in the logits -- that the model computes what it did, and that everything is restored.
The ``table5 --fuse-layers`` command line is tested in test_table5.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from prhs_eval.throughput import (
    decode_gemms,
    decode_throughput,
    fused_layers,
    fused_projections,
    model_config,
    parse_methods,
    random_model,
)

EPS = 1e-3  # the activations' mean square is ~4e-4 here: a dropped or wrong eps shows
HIDDEN, INTER, VOCAB = 64, 96, 128


def _randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Norm weights in [0.5, 1.5] (each norm its own), biases N(0, 0.05), every norm's eps
    :data:`EPS`: a fused layer that applied the wrong norm's weight, dropped a bias or used
    another eps would compute something else."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.05, generator=gen))
    for m in model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = EPS
    return model


def _tiny(family: str = "llama", bias: bool = False, layers: int = 2, **over) -> torch.nn.Module:
    """A 2-layer float32 model of ``family`` (hidden 64, intermediate 96, GQA 4/2 heads),
    randomized by :func:`_randomize`; ``bias``: every projection has one (Llama)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128, rms_norm_eps=EPS) | over  # fmt: skip
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common, attention_bias=bias, mlp_bias=bias), tf.LlamaForCausalLM
    elif family == "qwen2":  # q/k/v biases
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    return _randomize(cls(cfg).eval())


def _ids(rows: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))


def _patched(model: torch.nn.Module) -> list[str]:
    """The modules whose instance has a forward of its own (what the context managers set)."""
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def _spy_epilogues(monkeypatch) -> dict[str, list[dict]]:
    """Record each call of the four epilogue GEMMs (``decode_linear`` only where it is given a
    residual) and run the real ones."""
    import prhs_kernels.gemm as gemm

    calls: dict[str, list[dict]] = {"rms": [], "residual_norm": [], "swiglu": [], "residual": [],
                                    "rope": []}  # fmt: skip
    real_norm, real_swiglu = gemm.decode_linear_residual_norm, gemm.decode_linear_swiglu
    real_linear, real_rms = gemm.decode_linear, gemm.decode_linear_rms
    real_rope = gemm.decode_linear_rope

    def rope(x, weight, bias=None, **kw):
        calls["rope"].append(dict(weight=weight, bias=bias, position=kw["position"].clone(),
                                  k_cache=kw["k_cache"], eps=kw["eps"]))  # fmt: skip
        return real_rope(x, weight, bias, **kw)

    def rms(x, weight, bias=None, *, eps=1e-6):
        # (the values too: the fold is undone when the block closes)
        calls["rms"].append(dict(weight=weight, values=weight.detach().clone(), bias=bias, eps=eps))
        return real_rms(x, weight, bias, eps=eps)

    def residual_norm(x, weight, bias=None, *, residual, norm_weight):
        out = real_norm(x, weight, bias, residual=residual, norm_weight=norm_weight)
        calls["residual_norm"].append(dict(weight=weight, norm_weight=norm_weight, out=out))
        return out

    def swiglu(x, weight, bias=None, *, sumsq=None, eps=1e-6):
        calls["swiglu"].append(dict(x=x, weight=weight, bias=bias, sumsq=sumsq, eps=eps))
        return real_swiglu(x, weight, bias, sumsq=sumsq, eps=eps)

    def linear(x, weight, bias=None, *, residual=None):
        if residual is not None:
            calls["residual"].append(dict(weight=weight, residual=residual))
        return real_linear(x, weight, bias, residual=residual)

    monkeypatch.setattr(gemm, "decode_linear_residual_norm", residual_norm)
    monkeypatch.setattr(gemm, "decode_linear_swiglu", swiglu)
    monkeypatch.setattr(gemm, "decode_linear", linear)
    monkeypatch.setattr(gemm, "decode_linear_rms", rms)
    monkeypatch.setattr(gemm, "decode_linear_rope", rope)
    return calls


@pytest.mark.parametrize(("family", "bias"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_fused_layers_compute_what_the_layers_did_and_restore_them(monkeypatch, family, bias):
    model = _tiny(family, bias)
    layers = list(model.model.layers)
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    weights = {n: p for n, p in model.named_parameters()}
    calls = _spy_epilogues(monkeypatch)
    x = torch.randn(3, HIDDEN)
    with fused_layers(model) as n, torch.no_grad():
        assert n == len(layers) == 2
        assert _patched(model) == [
            f"model.layers.{i}{name}" for i in range(n)
            for name in ("", ".self_attn", *(f".self_attn.{p}_proj" for p in "qkvo"))
        ]  # fmt: skip
        assert layers[0].self_attn.o_proj(x) is x  # the layer's first epilogue GEMM projects
        got = model(input_ids=ids).logits
    # One of each epilogue GEMM per layer, each on its own layer's weights (a prompt, into no
    # static cache: the q|k|v GEMM without the rotary epilogue).
    assert [len(c) for c in calls.values()] == [n, n, n, n, 0]
    per_layer = zip(layers, *list(calls.values())[:4], strict=True)
    for i, (layer, rms, norm, swiglu, res) in enumerate(per_layer):
        mlp, attn = layer.mlp, layer.self_attn
        # q|k|v: one weight (the three parameters views of it) holding the input norm's weight
        # folded into its columns, the norm's eps, called on the layer's input itself.
        qkv = [weights[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
        g = weights[f"model.layers.{i}.input_layernorm.weight"]
        assert rms["weight"].data_ptr() == attn.q_proj.weight.data_ptr()
        assert torch.equal(rms["values"], torch.cat(qkv) * g) and rms["eps"] == EPS
        assert (rms["bias"] is not None) == (bias or family == "qwen2")
        assert norm["weight"] is layer.self_attn.o_proj.weight
        assert norm["norm_weight"] is layer.post_attention_layernorm.weight
        h, hg, sumsq = norm["out"]
        assert swiglu["x"] is hg and swiglu["sumsq"] is sumsq and swiglu["eps"] == EPS
        # gate|up is one weight of which the two projections' parameters are views: no copy.
        assert swiglu["weight"].shape == (2 * INTER, HIDDEN)
        assert swiglu["weight"].data_ptr() == mlp.gate_proj.weight.data_ptr()
        assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr() + (
            mlp.gate_proj.weight.numel() * mlp.gate_proj.weight.element_size()
        )
        assert (swiglu["bias"] is not None) == bias
        assert res["weight"] is mlp.down_proj.weight and res["residual"] is h
    # float32 throughout: the fused layer differs only by the order of float32 operations
    # (where the norm's weight and 1/rms are applied; ~1e-7 of the logits), far inside this.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Restored: no forward left behind, o_proj projects again, the same parameters with the
    # same values, and the unfused model computes bit for bit what it did.
    assert _patched(model) == []
    torch.testing.assert_close(
        layers[0].self_attn.o_proj(x),
        F.linear(x, layers[0].self_attn.o_proj.weight, layers[0].self_attn.o_proj.bias),
    )
    assert {n: p for n, p in model.named_parameters()}.keys() == weights.keys()
    for name, p in model.named_parameters():  # the folded q/k/v weights hold theirs again
        assert torch.equal(p, weights[name]), name
    with torch.no_grad():
        again = model(input_ids=ids).logits
    assert torch.equal(again, want)
    assert len(calls["swiglu"]) == n  # nothing ran through the epilogues after the block


def test_fused_layers_in_bfloat16_stay_as_close_to_float32_as_the_unfused_layers():
    model = _tiny()
    ids = _ids(4, 3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        plain = bf16(input_ids=ids).logits.float()
        with fused_layers(bf16):
            fused = bf16(input_ids=ids).logits.float()
    # Both round the activations to bf16 (2^-8 relative) at a few places a layer; the fused
    # layer rounds h once (not o(attn) and then h), silu(gate)·up once, and h ⊙ g where the
    # unfused layer rounds h / rms(h): the same number of roundings or fewer. So its distance
    # from the float32 model is of the unfused layers' (here ~2.5e-3 of logits of max ~0.4,
    # within 10 % of each other over seeds); a layer that computed something else would be off
    # by the logits' own scale (~0.1).
    err_plain = (plain - ref).abs().max().item()
    err_fused = (fused - ref).abs().max().item()
    assert 0 < err_plain < 0.02
    assert err_fused <= 2 * err_plain
    assert not torch.equal(fused, plain)  # the fused layers ran (they round elsewhere)


def test_fused_layers_decode_like_the_model_through_the_table5_gemms(monkeypatch):
    """What ``table5 --gemm triton --fuse-layers`` runs: :func:`decode_gemms` with both
    fusions, a static cache and prhs's attention, a decode step at a time."""
    import prhs_eval.throughput as throughput
    from prhs_eval.integration import enable
    from prhs_eval.throughput import _fill, _static_cache

    model = _randomize(random_model(model_config("tiny", max_positions=64), "cpu", torch.float32))
    cache = _static_cache(model, 2, 64, torch.device("cpu"))

    def decode(steps: int = 3) -> torch.Tensor:
        _fill(cache, 40, 0)
        for layer in cache.layers:  # a written row shows up: not what _fill drew
            layer.keys[:, :, 40:] = 0.0
            layer.values[:, :, 40:] = 0.0
        rt = enable(model, "prhs", max_seq_len=64, checked=False, budget=16, block_size=8)
        rt.attach(cache, 2)
        tokens, out = torch.tensor([[1], [2]]), []
        with torch.no_grad():
            for _ in range(steps):
                out.append(model(input_ids=tokens, past_key_values=cache).logits[:, -1])
                tokens = (tokens * 7 + 3) % 512
        rt.disable()
        return torch.stack(out)

    want = decode()
    want_kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    calls = _spy_epilogues(monkeypatch)
    for rope in (False, True):
        calls["swiglu"].clear()
        monkeypatch.setattr(throughput, "ROPE_EPILOGUE", rope)  # what fused_layers defaults to
        with decode_gemms(model, fuse=True, fuse_layers=True):
            got = decode()
        assert len(calls["swiglu"]) == 3 * 2  # every step, every layer
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        # The rotated keys and the values went to the rows the unfused layers wrote them to,
        # each layer's length raised once a step.
        for layer, (keys, values) in zip(cache.layers, want_kv, strict=True):
            torch.testing.assert_close(layer.keys, keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.values, values, rtol=1e-4, atol=1e-5)
            assert int(layer.cumulative_length) == 43
    # With the rotary epilogue, every decode step's q|k|v GEMM of each layer wrote its cache at
    # the length before the step, through its own layer's folded weight.
    rows = calls["rope"]
    assert [int(c["position"]) for c in rows] == [40, 40, 41, 41, 42, 42]
    layers = list(model.model.layers) * 3
    for c, layer, kv in zip(rows, layers, list(cache.layers) * 3, strict=True):
        assert c["weight"].data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert c["k_cache"] is kv.keys and c["eps"] == layer.input_layernorm.variance_epsilon
    assert _patched(model) == []
    assert torch.equal(decode(), want)


def test_a_fused_layer_takes_its_arguments_by_position_too():
    model = _tiny()
    layer = model.model.layers[0]
    h = torch.randn(2, 3, HIDDEN)
    pos = torch.arange(3).expand(2, 3)
    pe = model.model.rotary_emb(h, pos)
    with torch.no_grad():
        want = layer(h, None, pos, None, False, pe)
        with fused_layers(model):
            got = layer(h, None, pos, None, False, pe)
            assert torch.equal(layer(h, position_ids=pos, position_embeddings=pe), got)
            with pytest.raises(TypeError, match="at most 6 positional arguments, got 7"):
                layer(h, None, pos, None, False, pe, "one too many")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_layers_leave_other_layers_alone():
    model = _tiny(layers=3)
    ids = _ids()
    odd = model.model.layers[1]  # a post-attention norm fused_layers does not know
    norm = torch.nn.RMSNorm(HIDDEN, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(odd.post_attention_layernorm.weight)
    odd.post_attention_layernorm = norm
    with torch.no_grad():
        want = model(input_ids=ids).logits
    gate = odd.mlp.gate_proj.weight
    with fused_layers(model) as n, torch.no_grad():
        assert n == 2
        assert not [name for name in _patched(model) if name.startswith("model.layers.1")]
        got = model(input_ids=ids).logits
    assert odd.mlp.gate_proj.weight is gate  # its gate/up were not concatenated
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _linear():
    return torch.nn.Linear(4, 4)


def _gelu_llama():  # a Llama layout whose MLP is not SiLU-gated
    return _tiny(hidden_act="gelu")


@pytest.mark.parametrize("build", ["gpt2", "gemma3", _gelu_llama, _linear])
def test_fused_layers_refuse_a_model_with_no_llama_layer_and_change_nothing(make_tiny, build):
    model = make_tiny(build) if isinstance(build, str) else build()
    params = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
    values = copy.deepcopy(model.state_dict())
    for enter in (fused_layers, lambda m: decode_gemms(m, fuse=True, fuse_layers=True)):
        with pytest.raises(ValueError, match=r"has no decoder layer to fuse \(one of \("):
            with enter(model):
                pass
        assert _patched(model) == []
        assert {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()} == params
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in values.items())


def test_decode_throughput_refuses_fuse_layers_without_the_triton_gemms(monkeypatch):
    import prhs_eval.throughput as throughput

    def no_model(*args, **kwargs):
        raise AssertionError("built a model before checking its arguments")

    monkeypatch.setattr(throughput, "random_model", no_model)
    with pytest.raises(ValueError, match="fuse_layers needs gemm='triton'"):
        decode_throughput("tiny", [2], [256], parse_methods("sdpa"), device="cpu",
                          dtype=torch.float32, headroom=20, fuse_layers=True)  # fmt: skip


def test_decode_gemms_leave_the_fused_layers_mlps_out_of_fused_projections(monkeypatch):
    model = _tiny()
    layers = list(model.model.layers)
    ids = _ids(2, 1)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    calls = _spy_epilogues(monkeypatch)
    with decode_gemms(model, fuse=True, fuse_layers=True) as rerouted, torch.no_grad():
        for layer in layers:
            # The layer's forward runs its MLP's GEMMs and its q/k/v theirs (the input norm
            # folded in): fused_projections did not take the layer (a second fusion would
            # concatenate gate/up again, a second copy the layer does not stream, and q/k/v
            # without the norm).
            assert "forward" in layer.__dict__ and "forward" not in layer.mlp.__dict__
            assert all("forward" in getattr(layer.self_attn, p).__dict__ for p in ("q_proj",
                       "k_proj", "v_proj"))  # fmt: skip
        # The LM head and each layer's gate, up and down Linears (unused: the layer calls the
        # GEMMs itself); not o_proj (the identity) nor q/k/v (the fused GEMM's).
        assert rerouted == 3 * len(layers) + 1
        got = model(input_ids=ids).logits
    assert len(calls["swiglu"]) == len(calls["rms"]) == len(layers)
    for layer, swiglu in zip(layers, calls["swiglu"], strict=True):
        mlp = layer.mlp
        assert swiglu["weight"].data_ptr() == mlp.gate_proj.weight.data_ptr()
        assert torch.equal(swiglu["weight"], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert _patched(model) == []
    # fused_projections alone, told to leave the MLPs out: q/k/v fused, no MLP.
    with fused_projections(model, exclude=[layer.mlp for layer in layers]) as (attn, mlps):
        assert (attn, mlps) == (len(layers), 0)
        assert not [name for name in _patched(model) if ".mlp" in name]
    assert _patched(model) == []


def test_the_rotary_epilogue_writes_only_a_plain_allocated_static_cache_layer():
    """:func:`_static_layer`: the layer the epilogue may write, or None (the layer's own path)."""
    from transformers import DynamicCache, StaticCache

    from prhs_eval.throughput import _static_cache, _static_layer

    model = _tiny()
    cfg = model.config
    cache = _static_cache(model, 2, 32, torch.device("cpu"))
    assert _static_layer(cache, 1, 2, 16, torch.float32) is cache.layers[1]
    assert _static_layer(cache, 1, 3, 16, torch.float32) is None  # another batch
    assert _static_layer(cache, 1, 2, 8, torch.float32) is None  # another head size
    assert _static_layer(cache, 1, 2, 16, torch.bfloat16) is None  # another dtype
    assert _static_layer(cache, 5, 2, 16, torch.float32) is None  # no such layer
    assert _static_layer(StaticCache(config=cfg, max_cache_len=32), 0, 2, 16,
                         torch.float32) is None  # not allocated yet  # fmt: skip
    assert _static_layer(DynamicCache(config=cfg), 0, 2, 16, torch.float32) is None
    assert _static_layer(None, 0, 2, 16, torch.float32) is None


def test_fused_layers_leave_attention_they_cannot_rotate_to_its_own_forward(monkeypatch):
    """A class outside ROPE_ATTENTION (its forward may rotate otherwise) keeps its forward;
    with ``rope=False`` none is replaced."""
    import prhs_eval.throughput as throughput

    model = _tiny()
    with fused_layers(model, rope=False):
        assert not [n for n in _patched(model) if n.endswith("self_attn")]
    monkeypatch.setattr(throughput, "ROPE_ATTENTION", {"Qwen2Attention": lambda attn: {}})
    with fused_layers(model):  # Llama's attention is not among them now
        assert not [n for n in _patched(model) if n.endswith("self_attn")]
    assert _patched(model) == []
