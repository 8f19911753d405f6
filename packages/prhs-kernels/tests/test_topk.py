"""prhs_kernels.topk: top-k and top-p index lists, against brute-force Python.

Any order among tied scores is valid, so a result is checked as a *valid* top set, not as one
particular list: where its sorted index set differs from the brute force's, the scores there
must be tied (the two sets' sorted scores are equal).
"""

from __future__ import annotations

import math

import pytest
import torch

from prhs_kernels.topk import top_p_indices, topk_indices

NEG_INF = float("-inf")


def _rank_value(x: float, ok: bool) -> float:
    """What an entry ranks by: NaN counts as ``-inf``; ineligible entries are never picked."""
    if not ok:
        return math.nan
    return NEG_INF if math.isnan(x) else x


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _brute_order(values: list[float], ok: list[bool]) -> list[int]:
    """Eligible entries by decreasing value (NaN as ``-inf``), ties toward the lower index."""
    cand = [i for i in range(len(values)) if ok[i]]
    return sorted(cand, key=lambda i: (-_rank_value(values[i], True), i))


def _check_valid_top_set(idx_row, count, values, ok, want_set, what):
    """``idx_row[:count]`` is a top set as good as ``want_set``: distinct, eligible, largest
    first, and where it differs from ``want_set`` the values are tied."""
    got = idx_row[:count]
    assert all(i == -1 for i in idx_row[count:]), f"{what}: -1 past the count"
    assert len(set(got)) == count, f"{what}: distinct"
    assert all(0 <= i < len(values) and ok[i] for i in got), f"{what}: eligible ids"
    v = [_rank_value(values[i], True) for i in got]
    assert v == sorted(v, reverse=True), f"{what}: largest first"
    if sorted(got) != sorted(want_set):
        w = sorted(_rank_value(values[i], True) for i in want_set)
        assert sorted(v) == w, f"{what}: {sorted(got)} vs {sorted(want_set)} differ beyond ties"


def _scores(shape, dtype, seed, *, ties: bool, nan: bool):
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(0, 4, shape, generator=g).double()
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    if nan:
        special = torch.rand(shape, generator=g)
        x = torch.where(special < 0.15, float("nan"), x)
        x = torch.where((special >= 0.15) & (special < 0.25), NEG_INF, x)
        x = torch.where((special >= 0.25) & (special < 0.3), float("inf"), x)
    eligible = torch.rand(shape, generator=g) < 0.7
    eligible.view(-1, shape[-1])[0] = True  # a row with every entry eligible
    if eligible.view(-1, shape[-1]).shape[0] > 1:
        eligible.view(-1, shape[-1])[1] = False  # and one with none
    return x.to(dtype), eligible


SHAPES = {"N13": (13,), "3x4xN29": (3, 4, 29), "5xN1": (5, 1)}
KS = [0, 1, 5, 13, 40]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@pytest.mark.parametrize("kind", ["ties", "nan", "plain"])
@pytest.mark.parametrize("k", KS, ids=[f"k{k}" for k in KS])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_topk_is_a_valid_top_set(dtype, shape, k, kind):
    shp = SHAPES[shape]
    for use_eligible in (False, True):
        _check_topk(shp, DTYPES[dtype], k, use_eligible, kind)


def _check_topk(shp, dtype, k, use_eligible, kind, device="cpu"):
    scores, eligible = _scores(shp, dtype, seed=k, ties=kind == "ties", nan=kind == "nan")
    elig = eligible.to(device) if use_eligible else None
    idx, counts = topk_indices(scores.to(device), k, elig)
    assert idx.device.type == counts.device.type == torch.device(device).type
    idx, counts = idx.cpu(), counts.cpu()
    assert idx.dtype == torch.int32 and counts.dtype == torch.int32
    assert idx.shape == (*shp[:-1], k) and counts.shape == shp[:-1]
    rows_x = _rows(scores.double()).tolist()
    rows_ok = _rows(eligible if use_eligible else torch.ones_like(eligible)).tolist()
    for r, (x, ok, ir, c) in enumerate(
        zip(rows_x, rows_ok, _rows(idx).tolist(), counts.reshape(-1).tolist(), strict=True)
    ):
        assert c == min(k, sum(ok)), f"row {r}: count"
        want = _brute_order(x, ok)[:c]
        _check_valid_top_set(ir, c, x, ok, want, f"row {r}")


def test_topk_never_prefers_nan_or_ineligible():
    nan, inf = float("nan"), NEG_INF
    scores = torch.tensor(
        [
            [nan, 1.0, nan, -5.0, inf, 2.0],  # NaN never beats a finite score
            [1.0, 9.0, 2.0, nan, inf, 0.0],  # nor -inf; ineligible 9.0 is never picked
            [5.0, nan, 4.0, inf, 3.0, nan],  # eligible NaN / -inf rank after finite, before none
        ]
    )
    eligible = torch.tensor(
        [
            [True, True, True, True, True, True],
            [True, False, True, True, True, False],
            [False, True, False, True, False, True],
        ]
    )
    idx, counts = topk_indices(scores, 4, eligible)
    assert counts.tolist() == [4, 4, 3]
    assert idx[0, :3].tolist() == [5, 1, 3] and idx[0, 3].item() in (0, 2, 4)
    assert idx[1, :2].tolist() == [2, 0] and set(idx[1, 2:].tolist()) == {3, 4}
    assert sorted(idx[2, :3].tolist()) == [1, 3, 5] and idx[2, 3].item() == -1


def test_topk_k_larger_than_n_and_empty():
    scores = torch.tensor([[0.5, -1.0, 2.0]])
    idx, counts = topk_indices(scores, 6)
    assert idx.tolist() == [[2, 0, 1, -1, -1, -1]] and counts.tolist() == [3]
    idx, counts = topk_indices(torch.empty(2, 0), 3)
    assert idx.tolist() == [[-1] * 3] * 2 and counts.tolist() == [0, 0]
    idx, counts = topk_indices(scores, 0)
    assert idx.shape == (1, 0) and counts.tolist() == [0]


def _brute_top_p(mass, target, cap, ok, kept):
    """Count of the smallest top prefix (at least one) whose dropped mass ``1 − kept − Σ`` is
    ``<= target``, capped at ``cap`` and at the eligible entries; and the prefix."""
    order = _brute_order(mass, ok)
    need = None
    s = 0.0
    for m, i in enumerate(order, 1):
        x = _rank_value(mass[i], True)
        s += max(x, 0.0)
        if (1.0 - kept) - s <= target:
            need = m
            break
    if need is None:
        need = len(order)
    count = min(need, len(order), cap)
    return count, order[:count]


def _masses(shape, seed, *, ties: bool, nan: bool, with_kept: bool):
    g = torch.Generator().manual_seed(seed)
    if ties:
        w = torch.randint(1, 4, shape, generator=g).double()
    else:
        w = torch.randn(shape, generator=g, dtype=torch.float64).mul(2).exp()
    kept = torch.rand(shape[:-1], generator=g, dtype=torch.float64) * 0.5 if with_kept else None
    mass = w / w.sum(-1, keepdim=True) * (1.0 if kept is None else (1 - kept).unsqueeze(-1))
    if nan:
        mass = torch.where(torch.rand(shape, generator=g) < 0.2, float("nan"), mass)
    eligible = torch.rand(shape, generator=g) < 0.8
    return mass, eligible, kept


TARGETS = [0.0, 0.05, 0.3, 1.0]
CAPS = [1, 4, 40]


@pytest.mark.parametrize("kind", ["ties", "nan", "plain"])
@pytest.mark.parametrize("with_kept", [False, True], ids=["nokept", "kept"])
@pytest.mark.parametrize("cap", CAPS, ids=[f"cap{c}" for c in CAPS])
@pytest.mark.parametrize("target", TARGETS, ids=[f"target{t}" for t in TARGETS])
def test_top_p_is_the_smallest_prefix(target, cap, with_kept, kind):
    for use_eligible in (False, True):
        _check_top_p(target, cap, use_eligible, with_kept, kind)


def _check_top_p(target, cap, use_eligible, with_kept, kind, device="cpu"):
    shp = (4, 3, 17)
    mass, eligible, kept = _masses(
        shp, seed=cap, ties=kind == "ties", nan=kind == "nan", with_kept=with_kept
    )
    mass = mass.float()
    elig = eligible if use_eligible else None
    kept_t = kept.float() if kept is not None else None
    idx, counts = top_p_indices(
        mass.to(device),
        target,
        cap,
        None if elig is None else elig.to(device),
        None if kept_t is None else kept_t.to(device),
    )
    idx, counts = idx.cpu(), counts.cpu()
    assert idx.dtype == torch.int32 and counts.dtype == torch.int32
    assert idx.shape == (*shp[:-1], cap) and counts.shape == shp[:-1]
    rows_m = _rows(mass.double()).tolist()
    rows_ok = _rows(eligible if use_eligible else torch.ones_like(eligible)).tolist()
    rows_kept = kept_t.double().reshape(-1).tolist() if kept_t is not None else [0.0] * 12
    for r, (m, ok, kp, ir, c) in enumerate(
        zip(
            rows_m,
            rows_ok,
            rows_kept,
            _rows(idx).tolist(),
            counts.reshape(-1).tolist(),
            strict=True,
        )
    ):
        want_c, want = _brute_top_p(m, target, cap, ok, kp)
        assert c == want_c, f"row {r}: count"
        assert c <= cap
        _check_valid_top_set(ir, c, m, ok, want, f"row {r}")
        got_mass = sum(max(_rank_value(m[i], True), 0.0) for i in ir[:c])
        dropped = 1.0 - kp - got_mass
        if c < min(cap, sum(ok)):
            assert dropped <= target + 1e-12, f"row {r}: target met"
        if c > 1:  # minimal: one entry less misses the target
            smallest = min(max(_rank_value(m[i], True), 0.0) for i in ir[:c])
            assert dropped + smallest > target - 1e-12, f"row {r}: minimal"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path():
    """On CUDA the reference ranks with ``torch.topk``: the same checks hold."""
    for dtype in DTYPES.values():
        for shape in SHAPES.values():
            for k in KS:
                for kind in ("ties", "nan", "plain"):
                    for use_eligible in (False, True):
                        _check_topk(shape, dtype, k, use_eligible, kind, device="cuda")
    for target in TARGETS:
        for cap in CAPS:
            for use_eligible in (False, True):
                _check_top_p(target, cap, use_eligible, True, "nan", device="cuda")


def test_top_p_small_cases():
    mass = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.1, 0.5, 0.15, 0.25]])
    idx, counts = top_p_indices(mass, 0.2, 6)
    # 0.5 + 0.25 = 0.75 drops 0.25 > 0.2; + 0.15 drops 0.10 <= 0.2.
    assert counts.tolist() == [3, 3]
    assert idx[0].tolist() == [1, 3, 2, -1, -1, -1]
    # Mass kept outside the candidates: 0.3 + 0.35 + 0.175 leaves 0.175 <= 0.2. Without it the
    # candidates (0.7 in all) never meet the target: every one is kept.
    idx, counts = top_p_indices(mass * 0.7, 0.2, 6, kept=torch.tensor([0.3, 0.0]))
    assert counts.tolist() == [2, 4] and idx[0, :3].tolist() == [1, 3, -1]
    # The cap wins over the target; a target met by ``kept`` alone still keeps one entry.
    idx, counts = top_p_indices(mass, 0.0, 2)
    assert counts.tolist() == [2, 2] and idx[0].tolist() == [1, 3]
    idx, counts = top_p_indices(mass, 0.5, 4, kept=torch.tensor([0.9, 0.9]))
    assert counts.tolist() == [1, 1] and idx[0].tolist() == [1, -1, -1, -1]
    # No eligible entry: an empty list.
    none = torch.zeros_like(mass, dtype=torch.bool)
    idx, counts = top_p_indices(mass, 0.1, 3, none)
    assert counts.tolist() == [0, 0] and (idx == -1).all()


def test_bad_input_is_rejected():
    x = torch.rand(2, 5)
    with pytest.raises(TypeError, match="floating"):
        topk_indices(torch.ones(2, 5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        topk_indices(x, -1)
    with pytest.raises(ValueError, match="eligible must have shape"):
        topk_indices(x, 2, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="target"):
        top_p_indices(x, 1.5, 2)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        top_p_indices(x, 0.1, 0)
    with pytest.raises(ValueError, match="kept must have 1 dimensions"):
        top_p_indices(x, 0.1, 2, kept=torch.zeros(2, 1))


def test_meta_shapes():
    """No value is read on the host: both ops run on ``meta`` tensors."""
    x = torch.empty(2, 3, 50, device="meta")
    ok = torch.empty(2, 3, 50, dtype=torch.bool, device="meta")
    for eligible in (None, ok):
        idx, counts = topk_indices(x, 8, eligible)
        assert (idx.shape, idx.dtype, idx.device.type) == ((2, 3, 8), torch.int32, "meta")
        assert (counts.shape, counts.dtype) == ((2, 3), torch.int32)
        idx, counts = topk_indices(x, 60, eligible)
        assert idx.shape == (2, 3, 60)
        kept = torch.empty(2, 3, device="meta")
        idx, counts = top_p_indices(x, 0.1, 16, eligible, kept)
        assert (idx.shape, idx.dtype, idx.device.type) == ((2, 3, 16), torch.int32, "meta")
        assert (counts.shape, counts.dtype) == ((2, 3), torch.int32)


@pytest.mark.parametrize("seed_kind", ["good", "partial", "poor", "none"])
def test_seeded_candidates_hold_the_top_k_unless_flagged(seed_kind):
    """Guess (thresholds from the seed's best to its k-th best score) and verify (the highest
    threshold k scores reach, and every score reaching it, in position order): a row that is
    not flagged holds its exact top k among its candidates, at most ``capacity`` of them, none
    below the seed's k-th best; a seed with fewer than k finite scores is flagged."""
    from prhs_kernels.topk import seeded_candidates

    gen = torch.Generator().manual_seed(3)
    rows, n, k, cap = 6, 500, 20, 48
    x = torch.randn(rows, n, generator=gen)
    x[0, ::9] = x[0, 4]  # ties
    x[1, :30] = float("nan")
    best = torch.topk(x.nan_to_num(nan=float("-inf")), 2 * k, dim=-1).indices
    seed = {
        "good": best,
        "partial": torch.cat([best[:, : k // 2], best[:, k + k // 2 :], best[:, k : k + 5]], -1),
        "poor": torch.stack([torch.randperm(n, generator=gen)[: 2 * k] for _ in range(rows)]),
        "none": torch.full((rows, 2 * k), -1),
    }[seed_kind].to(torch.int32)
    vals, ids, over = seeded_candidates(x, k, seed, capacity=cap)
    assert vals.shape == (rows, cap) and ids.dtype == torch.int32
    xs = x.nan_to_num(nan=float("-inf"))
    sv = torch.gather(xs, -1, seed.long().clamp(min=0)).masked_fill(seed < 0, float("-inf"))
    for r in range(rows):
        if (sv[r] > float("-inf")).sum() < k:
            assert bool(over[r])
            continue
        if over[r]:  # then the lowest threshold's candidates overflow
            assert int((xs[r] >= torch.topk(sv[r], k).values[-1]).sum()) > cap
            continue
        got = ids[r][ids[r] >= 0]
        assert len(got) <= cap and bool((got[1:] > got[:-1]).all())
        assert torch.equal(vals[r][: len(got)], xs[r][got.long()])
        assert bool((vals[r][: len(got)] >= torch.topk(sv[r], k).values[-1]).all())
        assert bool((vals[r][len(got) :] == float("-inf")).all())
        kth = torch.topk(xs[r], k).values[-1]
        assert set(torch.nonzero(xs[r] > kth).flatten().tolist()) <= set(got.tolist())
        assert int((vals[r] >= kth).sum()) >= k  # the top k, ties included
    if seed_kind == "good":
        assert not bool(over.any())
    if seed_kind == "none":
        assert bool(over.all())


def test_seeded_candidates_refuse_bad_input():
    from prhs_kernels.topk import seeded_candidates

    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="capacity"):
        seeded_candidates(x, 4, torch.zeros(2, 4, dtype=torch.int32), capacity=3)
    with pytest.raises(ValueError, match="seed"):
        seeded_candidates(x, 4, torch.zeros(3, 4, dtype=torch.int32), capacity=8)
    with pytest.raises(TypeError):
        seeded_candidates(x, 4, torch.zeros(2, 4), capacity=8)


def test_seeded_candidates_take_two_seeds_at_their_rows():
    """The torch path: two seeds at ``seed_rows`` are one seed gathered and concatenated; a
    misshapen seed or ``seed_rows`` is refused."""
    from prhs_kernels.topk import seeded_candidates, seeded_candidates_reference

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 50, generator=gen)
    a = torch.randint(0, 50, (4, 3, 6), generator=gen, dtype=torch.int32)
    c = torch.randint(0, 50, (4, 3, 4), generator=gen)
    rows = torch.tensor([3, 1])
    got = seeded_candidates(x, 5, (a, c), capacity=16, seed_rows=rows)
    want = seeded_candidates_reference(x, 5, torch.cat([a[rows].long(), c[rows]], -1), 16)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match="seed_rows must be"):
        seeded_candidates(x, 5, (a, c), capacity=16, seed_rows=rows[:1])
    with pytest.raises(ValueError, match=r"seed\[1\] \[..., S\] must have"):
        seeded_candidates(x, 5, (a, c[:, :2]), capacity=16, seed_rows=rows)
    with pytest.raises(ValueError, match="a tensor or two"):
        seeded_candidates(x, 5, (a, a, a), capacity=16, seed_rows=rows)


def test_topk_path_picks_the_triton_kernel_on_cuda_where_it_applies(monkeypatch):
    """Triton on CUDA for float32 / bf16 / fp16 rows of up to 16 384 scores; the reference for
    longer rows, float64 or ``PRHS_KERNELS=torch``; the CPU keeps its Numba kernel."""
    pytest.importorskip("triton")
    from prhs_kernels.topk import topk_path

    monkeypatch.delenv("PRHS_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert topk_path("cuda", dtype, 16384) == "triton"
        assert topk_path("cuda", dtype, 16385) == "torch"
    assert topk_path("cuda", torch.float64, 100) == "torch"
    assert topk_path("cuda", torch.float32, 100, "torch") == "torch"
    assert topk_path("cpu", torch.float32, 100) in ("numba", "torch")
    monkeypatch.setenv("PRHS_KERNELS", "torch")
    assert topk_path("cuda", torch.float32, 100) == "torch"


@pytest.mark.parametrize(
    ("dtype", "n", "k", "masked"),
    [(torch.float32, 4096, 64, True), (torch.bfloat16, 16384, 1024, False),
     (torch.float16, 300, 500, True)],
    ids=["fp32-N4096-k64", "bf16-N16384-k1024", "fp16-N300-k500"],
)  # fmt: skip
def test_the_triton_path_is_one_launch_that_compiles_for_a_hopper_gpu(
    hopper_compile, catch_launches, dtype, n, k, masked
):
    """One launch, a program per row, compiled for sm_90 (the interpreter runs what Triton's
    compiler may reject); its results under the interpreter: ``interpreted/``."""
    pytest.importorskip("triton")
    x = torch.zeros(2, 3, n, dtype=dtype)
    eligible = torch.ones(2, 3, n, dtype=torch.bool) if masked else None
    idx, counts = topk_indices(x, k, eligible, path="triton")
    assert idx.shape == (2, 3, k) and counts.shape == (2, 3)
    assert [fn.fn.__name__ for fn, _, _ in catch_launches] == ["_topk_rows_kernel"]
    fn, args, kw = catch_launches[0]
    assert kw["HAS_ELIG"] is masked
    assert "ld.global" in hopper_compile(fn, args, kw)


def test_topk_bad_input_is_refused_before_any_launch(catch_launches):
    x = torch.zeros(2, 5)
    for args, kw, error, match in [
        ((x, 2), {"path": "cuda"}, ValueError, "path must be one of"),
        ((x.long(), 2), {"path": "triton"}, TypeError, "scores"),
        ((x, -1), {"path": "triton"}, ValueError, "k"),
        ((x, 2, torch.ones(2, 4, dtype=torch.bool)), {"path": "triton"}, ValueError, "eligible"),
        ((x, 2, torch.ones(2, 5)), {"path": "triton"}, TypeError, "eligible"),
    ]:
        with pytest.raises(error, match=match):
            topk_indices(*args, **kw)
    assert catch_launches == []
