"""The integration on a transformers ``StaticCache``: the same tokens as a dynamic cache, a
decode step that reads no device value (so it can be captured in a CUDA graph), and the state's
life on a cache that is reset and reused."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import prhs_eval
from prhs_core.registry import selectors
from prhs_eval.integration import _row_bounds

SPARSE = [
    ("oracle", {"budget": 12}),
    ("prhs", {"budget": 12, "use_psaw": True, "use_etf": True}),
    ("cis", {"budget": 12, "tau": 0.5}),
    ("quest", {"budget": 16, "page_size": 4, "dense_layers": 0}),
    ("h2o", {"budget": 24}),
]


def _batch(vocab: int, lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = 1
        ids[i, : t - n] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _gen(model, batch, **kw):
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False, **kw)


@pytest.mark.parametrize(("name", "options"), SPARSE)
@pytest.mark.parametrize("checked", [True, False])
def test_static_cache_decodes_the_tokens_a_dynamic_cache_does(make_tiny, name, options, checked):
    model = make_tiny("llama")
    batch = _batch(128, [61, 40, 52])  # left-padded rows
    dense = _gen(model, batch)
    runtime = prhs_eval.enable(model, name, checked=checked, **options)
    try:
        dynamic = _gen(model, batch)
        static = _gen(model, batch, cache_implementation="static")
        again = _gen(model, batch, cache_implementation="static")  # the cache reset and reused
    finally:
        runtime.disable()
    assert torch.equal(static, dynamic)
    assert torch.equal(again, static)
    if name in ("oracle", "prhs", "cis"):  # a budget far below the prompts: not dense
        assert not torch.equal(dynamic, dense)


def test_unchecked_decode_step_reads_no_device_value(make_tiny):
    """Every selector's whole decode step (the model's forward included) on ``meta`` tensors:
    any host read (``.item()``, ``bool(t)``, ``.tolist()``) raises there."""
    from transformers import StaticCache

    tiny = make_tiny("llama")
    config = tiny.config
    with torch.device("meta"):
        model = type(tiny)(config).eval()
    d = config.hidden_size // config.num_attention_heads
    for name in selectors.names():
        cache = StaticCache(config=config, max_cache_len=256)
        cache.early_initialization(2, config.num_key_value_heads, d, torch.float32, "meta")
        runtime = prhs_eval.enable(model, name, checked=False, stats=True, max_seq_len=256)
        try:
            runtime.attach(cache, 2)
            ids = torch.zeros(2, 1, dtype=torch.long, device="meta")
            with torch.no_grad():
                for _ in range(2):  # the first step copies the cache in; the second is steady
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        finally:
            runtime.disable()
        assert out.logits.shape == (2, 1, config.vocab_size), name


def test_row_bounds_of_a_static_prefix_and_a_left_padded_row():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1]])
    start, lens = _row_bounds(mask, 3, 6, torch.device("cpu"))
    assert start.tolist() == [1, 0, 4]
    assert lens.tolist() == [3, 5, 2]
    with pytest.raises(ValueError, match="contiguous"):
        _row_bounds(torch.tensor([[1, 0, 1, 0]]), 1, 4, torch.device("cpu"))
    # Unchecked: nothing is verified (nor read).
    start, lens = _row_bounds(torch.tensor([[1, 0, 1, 0]]), 1, 4, torch.device("cpu"), check=False)
    assert lens.tolist() == [2]


def test_unchecked_steps_take_row_bounds_in_one_op(make_tiny, monkeypatch):
    """An unchecked decode step finds each row's run with prhs_kernels' row_bounds (one launch
    on CUDA) instead of the checked path's reductions and casts; same tokens either way."""
    import prhs_eval.integration as integration

    calls = []
    real = integration.row_bounds
    monkeypatch.setattr(integration, "row_bounds",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))  # fmt: skip
    model = make_tiny("llama")
    batch = _batch(128, [61, 40, 52])  # left-padded rows: starts 0, 21, 9
    got = {}
    for checked in (True, False):
        runtime = prhs_eval.enable(model, "cis", checked=checked, budget=12, tau=0.5)
        try:
            got[checked] = _gen(model, batch, cache_implementation="static")
        finally:
            runtime.disable()
        assert bool(calls) is not checked  # only unchecked steps call it
    assert torch.equal(got[True], got[False])


def test_stats_without_an_observer_and_attach_errors(make_tiny):
    from transformers import StaticCache

    model = make_tiny("llama")
    batch = _batch(128, [50, 50])
    runtime = prhs_eval.enable(model, "oracle", budget=8)
    try:
        _gen(model, batch)
        assert runtime.summary() == {}  # no statistics asked for
    finally:
        runtime.disable()
    runtime = prhs_eval.enable(model, "oracle", budget=8, stats=True)
    try:
        _gen(model, batch)
        summary = runtime.summary()
        assert summary["retrieval_ratio"] == 100.0
        assert summary["avg_selected"] > 8
        cfg = model.config
        cache = StaticCache(config=cfg, max_cache_len=64)
        cache.early_initialization(
            2, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
            torch.float32, "cpu",
        )  # fmt: skip
        with pytest.raises(ValueError, match="does not match"):
            runtime.attach(cache, 3)
        assert not hasattr(cache, "_prhs_state")  # the refused call changed nothing
        runtime.attach(cache, 2)
        with pytest.raises(ValueError, match="already has prhs state"):
            runtime.attach(cache, 2)
        cache.reset()
        assert not hasattr(cache, "_prhs_state")
        runtime.attach(cache, 2)
    finally:
        runtime.disable()


def test_a_cache_is_freed_without_the_cycle_collector(make_tiny):
    from transformers import StaticCache

    model = make_tiny("llama")
    cfg = model.config
    runtime = prhs_eval.enable(model, "oracle", budget=8, max_seq_len=64)
    cache = StaticCache(config=cfg, max_cache_len=64)
    cache.early_initialization(
        1, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
        torch.float32, "cpu",
    )  # fmt: skip
    runtime.attach(cache, 1)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    runtime.disable()
    ref = weakref.ref(cache)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del cache
        assert ref() is None  # no reference cycle keeps a cache's K/V alive
    finally:
        if enabled:
            gc.enable()


def test_right_padded_prompts_are_scored_but_not_decoded(make_tiny):
    """A right-padded batch (what a scorer of continuations sends) prefills as dense does;
    decoding it is refused, as its new tokens would follow the padding."""
    model = make_tiny("llama")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # row 1 right-padded
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=mask).logits
    runtime = prhs_eval.enable(model, "oracle", budget=8)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        valid = mask.bool()
        torch.testing.assert_close(out.logits[valid], dense[valid])
        nxt = out.logits[:, -1:].argmax(-1)
        with pytest.raises(ValueError, match="right-padded"), torch.no_grad():
            model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                  past_key_values=out.past_key_values, use_cache=True)  # fmt: skip
    finally:
        runtime.disable()


def _count_ops():
    """A dispatch mode counting every torch op run inside it by name (``.ops``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    return Count()


def test_an_unchecked_decode_layer_adds_no_op_of_its_own(monkeypatch):
    """Between transformers' ops and the selector's, ``attend`` itself issues nothing per layer
    of an unchecked decode step (the rows' int32 bounds are made once per forward; no K/V is
    written where no side cache keeps it): counted as the ops one more pair of layers adds,
    with the selection and the decode kernel stubbed out."""
    import prhs_eval.integration as integration
    from prhs_eval.throughput import _fill, _static_cache, model_config, random_model

    monkeypatch.setattr(
        integration, "sparse_decode_attention", lambda q, *a, **k: (torch.zeros_like(q), None)
    )

    def step_ops(layers: int, method: str | None) -> dict[str, int]:
        model = random_model(model_config("tiny", layers=layers), "cpu", torch.float32)
        cache = _static_cache(model, 2, 64, torch.device("cpu"))
        _fill(cache, 40, 0)
        runtime = None
        if method is not None:
            runtime = prhs_eval.enable(model, method, max_seq_len=64, checked=False)
            runtime.attach(cache, 2)
            runtime.selector.select = lambda *a, **k: None
        tokens = torch.zeros(2, 1, dtype=torch.long)
        with torch.no_grad():
            for _ in range(2):
                model(input_ids=tokens, past_key_values=cache)
            with _count_ops() as count:
                model(input_ids=tokens, past_key_values=cache)
        if runtime is not None:
            runtime.disable()
        return count.ops

    def per_layer(method: str | None) -> dict[str, float]:
        a, b = step_ops(2, method), step_ops(4, method)
        return {k: (b.get(k, 0) - a.get(k, 0)) / 2 for k in set(a) | set(b)}

    got = per_layer("dense")
    for op in ("aten._to_copy.default", "aten.sub.Tensor", "aten.copy_.default"):
        assert got.get(op, 0) == 0, (op, got.get(op))
    # Beside the views it takes, the layer's ops are the model's own (its sdpa's aside).
    own = per_layer(None)
    extra = {k for k, v in got.items() if v > own.get(k, 0) and "view" not in k}
    assert extra <= {"aten.zeros_like.default", "aten.select.int", "aten.unsqueeze.default"}, extra


def test_an_unchecked_decode_step_writes_the_new_tokens_in_place(monkeypatch):
    """A selector with side caches (Quest) is handed each layer's whole cache and the rows'
    columns -- found once per forward -- instead of a gather of the new keys and values per
    layer: a layer's write adds no op to the step."""
    import prhs_eval.integration as integration
    from prhs_eval.throughput import _fill, _static_cache, model_config, random_model

    monkeypatch.setattr(
        integration, "sparse_decode_attention", lambda q, *a, **k: (torch.zeros_like(q), None)
    )

    def step(layers: int) -> tuple[dict[str, int], list]:
        model = random_model(model_config("tiny", layers=layers), "cpu", torch.float32)
        cache = _static_cache(model, 2, 64, torch.device("cpu"))
        _fill(cache, 40, 0)
        runtime = prhs_eval.enable(
            model, "quest", max_seq_len=64, checked=False, budget=16, page_size=4, dense_layers=0
        )
        runtime.attach(cache, 2)
        runtime.selector.select = lambda *a, **k: None
        writes: list = []
        runtime.selector.write_kv = lambda state, layer, loc, k, v, **kw: writes.append(
            (layer, loc, k, kw, state.row_stride)
        )
        tokens = torch.zeros(2, 1, dtype=torch.long)
        with torch.no_grad():
            for _ in range(2):
                model(input_ids=tokens, past_key_values=cache)
            writes.clear()
            with _count_ops() as count:
                model(input_ids=tokens, past_key_values=cache)
        runtime.disable()
        return count.ops, writes

    (few, _), (many, writes) = step(2), step(4)
    assert [w[0] for w in writes] == [0, 1, 2, 3]
    for layer, loc, k, kw, _ in writes:
        assert k.shape == (2, k.shape[1], 64, k.shape[-1]) and k.shape[1] >= 1, layer
        assert kw["columns"] is writes[0][3]["columns"] and loc is writes[0][1]
    _, loc, _, kw, stride = writes[0]
    assert kw["columns"].tolist() == [42, 42] and loc.tolist() == [42, stride + 42]
    more = {k for k in set(many) | set(few) if many.get(k, 0) > few.get(k, 0)}
    # (index_copy_ is the static cache's own write of the new K/V.)
    assert not {k for k in more if k.startswith(("aten.index.", "aten.gather"))}, more
