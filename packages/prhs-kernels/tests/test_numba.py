"""The Numba (CPU) paths against their torch references: the same tensors, bit for bit (ids,
order among ties, ``-1`` padding, counts, dtypes, shapes), and the dispatch that picks them."""

from __future__ import annotations

import logging

import pytest
import torch

import prhs_kernels.compose as compose
import prhs_kernels.paths as paths
import prhs_kernels.topk as topk
from prhs_kernels.compose.reference import dilate_indices_reference, union_indices_reference
from prhs_kernels.paths import numba_path
from prhs_kernels.topk.reference import top_p_indices_reference, topk_indices_reference

cn = pytest.importorskip("prhs_kernels.compose.numba")
tn = pytest.importorskip("prhs_kernels.topk.numba")

NAN, INF = float("nan"), float("inf")


def _same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(g, w), f"\n{g}\n!=\n{w}"


# --- union ----------------------------------------------------------------------------------


def _ids(shape, hi, gen, dtype=torch.int32, p_none=0.2):
    x = torch.randint(-3, hi, shape, generator=gen)
    x = torch.where(torch.rand(shape, generator=gen) < p_none, -1, x)
    return x.to(dtype)


@pytest.mark.parametrize("seed", range(6))
def test_union_random(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(25):
        b, h = (
            int(torch.randint(1, 4, (1,), generator=g)),
            int(torch.randint(1, 4, (1,), generator=g)),
        )
        hi = int(torch.randint(1, 60, (1,), generator=g)) * (1 if seed % 2 else 1000)
        dt = torch.int64 if seed % 3 == 0 else torch.int32
        parts = [
            _ids((b, int(torch.randint(0, 6, (1,), generator=g))), hi, g, dt),
            _ids((b, h, int(torch.randint(0, 40, (1,), generator=g))), hi, g),
            _ids((b, h, int(torch.randint(0, 9, (1,), generator=g))), hi, g, dt),
            _ids((b, int(torch.randint(0, 6, (1,), generator=g))), hi, g),
        ]
        limit = torch.randint(-2, hi + 5, (b,), generator=g, dtype=torch.int32)
        for width in (0, 1, 3, 17, 80):
            _same(
                cn.union_indices_numba(parts, limit, width),
                union_indices_reference(parts, limit, width),
            )


def test_union_edges():
    i32 = torch.int32
    lim = torch.tensor([10, 0, 5], dtype=i32)
    cases = [
        [torch.full((3, 2, 4), -1, dtype=i32)],  # all -1
        [torch.empty(3, 2, 0, dtype=i32), torch.empty(3, 0, dtype=i32)],  # empty lists
        [torch.empty(3, 0, dtype=i32)],  # shared parts only, empty
        [torch.tensor([[1, 1, 9], [0, 2, 3], [4, 4, 4]], dtype=i32)],  # shared only
        [  # duplicates across parts, ids past the limit, a negative id
            torch.tensor([[1, 2, 12], [0, 0, 1], [5, 4, -7]], dtype=i32),
            torch.tensor([[[2, 1, 10, 9]] * 2, [[0, 0, 0, 0]] * 2, [[4, 3, 4, 6]] * 2], dtype=i32),
            torch.tensor([[9, 1], [2, 3], [0, 4]], dtype=torch.int64),
        ],
        [torch.tensor([[[3, 2**40, 7]] * 2] * 3, dtype=torch.int64)],  # a huge id
    ]
    for parts in cases:
        for width in (0, 1, 2, 3, 8):
            _same(
                cn.union_indices_numba(parts, lim, width),
                union_indices_reference(parts, lim, width),
            )
    big = torch.tensor([2**40], dtype=torch.int64)  # sparse ids under a huge limit
    parts = [torch.tensor([[[2**39, 5, 2**38, 5, 2**39 + 1]]], dtype=torch.int64)]
    for width in (2, 4, 6):
        _same(cn.union_indices_numba(parts, big, width), union_indices_reference(parts, big, width))
    # Other integer dtypes, read as int64 like the reference's ``.long()``.
    parts = [
        torch.tensor([[[3, 1, 0, 3]]], dtype=torch.uint8),
        torch.tensor([[2, 0]], dtype=torch.int16),
    ]
    lim = torch.tensor([3], dtype=torch.int16)
    _same(cn.union_indices_numba(parts, lim, 4), union_indices_reference(parts, lim, 4))


def test_union_launcher_writes_the_reference():
    g = torch.Generator().manual_seed(7)
    parts = [_ids((2, 3), 40, g), _ids((2, 4, 30), 40, g), _ids((2, 5), 40, g)]
    limit = torch.tensor([40, 17], dtype=torch.int32)
    want_idx, want_cnt = union_indices_reference(parts, limit, 24)
    out_idx = torch.full((2, 4, 24), 99, dtype=torch.int64)
    out_cnt = torch.full((2, 4), 99, dtype=torch.int64)
    compose.union_indices(parts, limit, out_idx, out_cnt)
    assert torch.equal(out_idx, want_idx.long()) and torch.equal(out_cnt, want_cnt.long())


# --- dilation -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dilate_random_and_edges(dtype):
    g = torch.Generator().manual_seed(1)
    for shape in ((3, 4, 9), (5, 1), (2, 0), (0, 6), (2, 3, 0)):
        idx = _ids(shape, 12, g, dtype, p_none=0.25)
        cnt = torch.randint(-1, shape[-1] + 3, shape[:-1], generator=g, dtype=dtype)
        for m in (0, 1, 3, 9, 14):
            for r in (0, 1, 3):
                _same(
                    cn.dilate_indices_numba(idx, cnt, m, r),
                    dilate_indices_reference(idx, cnt, m, r),
                )
    # counts 0, every id -1, ids near 0 (p - j < 0), counts that broadcast.
    idx = torch.tensor([[0, 1, 2, -1], [-1, -1, -1, -1]], dtype=dtype)
    for cnt in (torch.zeros(2, dtype=dtype), torch.tensor([4, 4], dtype=dtype), torch.tensor([3])):
        _same(cn.dilate_indices_numba(idx, cnt, 4, 2), dilate_indices_reference(idx, cnt, 4, 2))
    idx1 = torch.tensor([[5, 0, 7]], dtype=dtype)
    cnt3 = torch.tensor([0, 2, 3])
    _same(cn.dilate_indices_numba(idx1, cnt3, 2, 1), dilate_indices_reference(idx1, cnt3, 2, 1))


# --- top-k and top-p ------------------------------------------------------------------------


def _scores(shape, dtype, gen, *, ties):
    if ties:
        x = torch.randint(-2, 3, shape, generator=gen).double()
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
    u = torch.rand(shape, generator=gen)
    x = torch.where(u < 0.08, NAN, x)
    x = torch.where((u >= 0.08) & (u < 0.14), -INF, x)
    x = torch.where((u >= 0.14) & (u < 0.18), INF, x)
    x = torch.where((u >= 0.18) & (u < 0.24), -0.0, x)
    x = torch.where((u >= 0.24) & (u < 0.28), torch.finfo(dtype).max, x)  # ties with +inf
    x = torch.where((u >= 0.28) & (u < 0.32), torch.finfo(dtype).min, x)  # ties with -inf
    return x.to(dtype)


def _eligible(shape, gen, p):
    ok = torch.rand(shape, generator=gen) < p
    if len(shape) > 1 and shape[0] > 1:
        ok[0] = True  # a row with everything eligible
        ok[1] = False  # and one with nothing
    return ok


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
def test_topk_matches_the_cpu_reference(dtype, ties):
    g = torch.Generator().manual_seed(3)
    # Small k of a long row takes the heap, a large one the radix sort.
    for shape in ((4, 3, 50), (6, 700), (2, 1), (3, 0), (0, 5)):
        x = _scores(shape, dtype, g, ties=ties)
        n = shape[-1]
        for ok in (None, _eligible(shape, g, 0.6), torch.zeros(shape, dtype=torch.bool)):
            for k in sorted({0, 1, 3, n // 20, n // 3, n, n + 4}):
                _same(tn.topk_indices_numba(x, k, ok), topk_indices_reference(x, k, ok))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top_p_matches_the_cpu_reference(dtype):
    g = torch.Generator().manual_seed(4)
    for shape in ((4, 3, 60), (5, 900), (2, 1), (3, 0)):
        n = shape[-1]
        mass = torch.rand(shape, generator=g, dtype=torch.float64) ** 4
        mass = (mass / mass.sum(-1, keepdim=True).clamp(min=1e-12)).to(dtype)
        odd = _scores(shape, dtype, g, ties=True)  # NaN, ±inf, negative, tied masses
        kept = torch.rand(shape[:-1], generator=g, dtype=torch.float64) * 0.3
        kept_odd = kept.clone()
        if kept_odd.numel() > 2:
            kept_odd.view(-1)[:3] = torch.tensor([NAN, INF, -INF], dtype=torch.float64)
        for m in (mass, torch.where(torch.rand(shape, generator=g) < 0.2, odd, mass)):
            for ok in (None, _eligible(shape, g, 0.7)):
                for kp in (None, kept, kept_odd.float()):
                    for target in (0.0, 0.05, 0.5, 1.0):
                        for cap in sorted({1, 2, max(1, n // 30), n, n + 3}):
                            _same(
                                tn.top_p_indices_numba(m, target, cap, ok, kp),
                                top_p_indices_reference(m, target, cap, ok, kp),
                            )
    # ``kept`` broadcasting past ``mass``.
    m = torch.rand(1, 20, generator=g, dtype=torch.float64)
    kp = torch.tensor([0.0, 0.5, 0.9], dtype=torch.float64)
    _same(tn.top_p_indices_numba(m, 0.1, 6, None, kp), top_p_indices_reference(m, 0.1, 6, None, kp))


def test_topk_launchers_on_realistic_block_scores():
    """Block scores of a CIS step (expanded eligibility, a probability-like row)."""
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(2, 3, 4096, generator=g) * 3, -1)
    scores = probs.view(2, 3, 512, 8).amax(-1)
    ok = (torch.rand(2, 1, 512, generator=g) < 0.95).expand(2, 3, 512)
    for k in (8, 256, 512):
        _same(topk.topk_indices(scores, k, ok), topk_indices_reference(scores, k, ok))
    mass = probs.double().view(2, 3, 512, 8).sum(-1)
    kept = mass[..., :1].sum(-1)
    _same(
        topk.top_p_indices(mass, 0.05, 256, ok, kept),
        top_p_indices_reference(mass, 0.05, 256, ok, kept),
    )


# --- dispatch -------------------------------------------------------------------------------


def test_numba_path_rule(monkeypatch):
    monkeypatch.delenv("PRHS_KERNELS", raising=False)
    assert numba_path("cpu") and numba_path(torch.device("cpu"))
    assert not numba_path("meta")
    monkeypatch.setenv("PRHS_KERNELS", "torch")
    assert not numba_path("cpu")
    monkeypatch.setenv("PRHS_KERNELS", "numba-please")
    with pytest.raises(ValueError, match="PRHS_KERNELS"):
        numba_path("cpu")


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kw):
        calls.append(name)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("forced", [False, True], ids=["auto", "torch"])
def test_launchers_dispatch(monkeypatch, caplog, forced):
    if forced:
        monkeypatch.setenv("PRHS_KERNELS", "torch")
    else:
        monkeypatch.delenv("PRHS_KERNELS", raising=False)
    names = [
        (compose, "union_indices_reference"),
        (compose, "dilate_indices_reference"),
        (topk, "topk_indices_reference"),
        (topk, "top_p_indices_reference"),
    ]
    calls = [_spy(monkeypatch, module, name) for module, name in names]
    monkeypatch.setattr(paths, "_announced", set())
    x = torch.rand(2, 3, 10)
    idx, cnt = topk.topk_indices(x, 4)
    topk.top_p_indices(x, 0.1, 4)
    compose.dilate_indices(idx, cnt, 2, 1)
    out_i, out_c = torch.empty(2, 3, 8, dtype=torch.int32), torch.empty(2, 3, dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="prhs_kernels"):
        compose.union_indices([idx], torch.tensor([10, 10]), out_i, out_c)
    assert all(len(c) == (1 if forced else 0) for c in calls), calls
    assert ("union_indices runs its numba path on cpu" in caplog.text) is not forced


# --- compiled code cached on disk ------------------------------------------------------------


def _dispatchers(module):
    from numba.core.registry import CPUDispatcher

    return {n: f for n, f in vars(module).items() if isinstance(f, CPUDispatcher)}


@pytest.mark.parametrize("name", ["compose", "topk", "louver", "rabitq"])
def test_every_kernel_caches_its_compiled_code(name):
    """Each process after the first loads the kernels instead of compiling them again (tens of
    seconds on a small CPU: every SGLang scheduler and ``prhs-eval`` process pays it)."""
    from numba.core.caching import FunctionCache

    module = pytest.importorskip(f"prhs_kernels.{name}.numba")
    kernels = _dispatchers(module)
    assert kernels, f"no Numba kernel found in {module.__name__}"
    for kname, kernel in kernels.items():
        assert kernel.targetoptions.get("nogil"), kname
        assert isinstance(kernel._cache, FunctionCache), f"{name}.{kname} is not cached"


def test_a_kernel_without_a_writable_cache_location_compiles_per_process(monkeypatch):
    """Where Numba finds no place to write its cache (a read-only install, no home), the
    decorator still returns a working kernel, compiled once per process."""
    from numba.core import caching

    from prhs_kernels._jit import njit

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in Numba 0.59
    monkeypatch.setattr(impl, "_locator_classes", [])

    def add_one(x):
        return x + 1

    kernel = njit(add_one)
    assert isinstance(kernel._cache, caching.NullCache)
    assert kernel(41) == 42
