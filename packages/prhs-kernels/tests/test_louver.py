"""prhs_kernels.louver: balanced clusters partition each page; the cluster bound is above every
member's logit on random, clustered and adversarial keys, so a threshold on it misses no key."""

from __future__ import annotations

import logging

import pytest
import torch

from prhs_kernels.louver import (
    balanced_clusters,
    balanced_clusters_reference,
    cluster_bounds,
    cluster_upper_bounds,
    index_pages,
    index_pages_reference,
)


def key_sets(kind: str, n: int, p: int, d: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(n, p, d, generator=g)
    if kind == "clustered":
        centres = torch.randn(n, 3, d, generator=g) * 4
        pick = torch.randint(0, 3, (n, p), generator=g)
        return torch.gather(centres, 1, pick.unsqueeze(-1).expand(n, p, d)) + 0.05 * torch.randn(
            n, p, d, generator=g
        )
    if kind == "adversarial":  # huge and tiny norms, one dominant channel, exact duplicates
        k = torch.randn(n, p, d, generator=g)
        k[:, ::3] *= 1e3
        k[:, 1::3] *= 1e-4
        k[:, :, 0] += 50.0
        k[:, p // 2 :] = k[:, : p // 2]
        return k
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "clustered", "adversarial"])
@pytest.mark.parametrize(("p", "s"), [(16, 2), (64, 4), (256, 4)])
def test_no_member_logit_exceeds_its_cluster_bound(kind, p, s) -> None:
    g = torch.Generator().manual_seed(p + s)
    d = 16
    keys = key_sets(kind, 3, p, d, g)
    perm = balanced_clusters(keys)
    assert torch.equal(perm.sort(-1).values, torch.arange(p).expand(3, p))
    for dtype in (torch.float32, torch.bfloat16):
        centres, radii = cluster_bounds(keys, perm, s, center_dtype=dtype)
        q = torch.randn(3, 5, d, generator=g) * torch.tensor([1.0, 10.0, 1e-3, 100.0, 1.0]).view(
            1, 5, 1
        )
        ub = cluster_upper_bounds(q, centres, radii)  # [3, 5, C]
        members = torch.gather(keys, 1, perm.unsqueeze(-1).expand_as(keys)).view(3, p // 4, 4, d)
        logits = torch.einsum("ngd,ncmd->ngcm", q.double(), members.double())
        assert bool((ub.double().unsqueeze(-1) >= logits).all())
        # so for any threshold, the clusters whose bound reaches it hold every key above it
        for t in torch.quantile(logits.flatten(), torch.tensor([0.5, 0.9, 0.99, 1.0]).double()):
            above = logits >= t
            assert bool((ub.double() >= t).unsqueeze(-1).expand_as(above)[above].all())


def test_pca_clusters_are_tighter_than_random_groups() -> None:
    g = torch.Generator().manual_seed(0)
    keys = key_sets("clustered", 4, 64, 16, g) + torch.randn(4, 64, 16, generator=g)
    _, tight = cluster_bounds(keys, balanced_clusters(keys), 4)
    rand = torch.stack([torch.randperm(64, generator=g) for _ in range(4)])
    _, loose = cluster_bounds(keys, rand, 4)
    assert tight.mean() < 0.8 * loose.mean()


def test_cluster_scores_are_each_clusters_best_margin_over_the_group() -> None:
    from prhs_kernels.louver import cluster_scores

    g = torch.Generator().manual_seed(8)
    b, h, grp, d, c, s, n_pages, r = 2, 2, 3, 16, 4, 4, 3, 9
    q = torch.randn(b, h * grp, d, generator=g)
    centres = torch.randn(r, 2, h, c, d, generator=g)[:, 1]  # strided, as a side cache holds
    radii = torch.rand(r, 2, h, c, s, generator=g)[:, 0]
    rows = torch.randint(0, r, (b, n_pages), generator=g)
    thr = torch.randn(b, h, grp, generator=g)
    got = cluster_scores(q, centres, radii, rows, thr, 0.5)
    assert got.shape == (b, h, n_pages * c)
    for bi in range(b):
        for hi in range(h):
            for p in range(n_pages):
                qq = q[bi, hi * grp : (hi + 1) * grp]  # [g, D]
                ub = cluster_upper_bounds(qq, centres[rows[bi, p], hi], radii[rows[bi, p], hi])
                want = (ub * 0.5 - thr[bi, hi].unsqueeze(-1)).amax(0)  # [C]
                torch.testing.assert_close(got[bi, hi, p * c : (p + 1) * c], want)
    with pytest.raises(ValueError, match="S dividing D=16"):
        cluster_scores(q, centres, radii[..., :3], rows, thr, 0.5)
    with pytest.raises(TypeError, match="rows must be an int32 or int64"):
        cluster_scores(q, centres, radii, rows.float(), thr, 0.5)
    with pytest.raises(ValueError, match=r"threshold must be \[B=2, Hkv=2, g=3\]"):
        cluster_scores(q, centres, radii, rows, thr[..., :2], 0.5)


# --- the clustering's Numba path ------------------------------------------------------------


def _partition(perm: torch.Tensor, size: int = 4) -> list[list[frozenset[int]]]:
    """Each group's clusters as sets (the order of clusters kept)."""
    return [
        [frozenset(c.tolist()) for c in row.view(-1, size)]
        for row in perm.reshape(-1, perm.shape[-1])
    ]


@pytest.mark.parametrize(
    ("kind", "p", "d"), [("random", 256, 64), ("clustered", 64, 16), ("random", 4, 8)]
)
def test_numba_clusters_are_the_references(kind, p, d) -> None:
    ln = pytest.importorskip("prhs_kernels.louver.numba")
    g = torch.Generator().manual_seed(p + d)
    keys = key_sets(kind, 6, p, d, g).view(2, 3, p, d)
    want = balanced_clusters_reference(keys)
    got = ln.balanced_clusters_numba(keys, 4)
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want)


def test_numba_clusters_skip_inactive_groups_as_the_reference_marks_them() -> None:
    ln = pytest.importorskip("prhs_kernels.louver.numba")
    g = torch.Generator().manual_seed(7)
    keys = key_sets("random", 4, 64, 16, g)
    active = torch.tensor([True, False, False, True])
    want = balanced_clusters_reference(keys, 4, active)
    got = ln.balanced_clusters_numba(keys, 4, active)
    assert torch.equal(got, want)
    assert torch.equal(got[1], torch.arange(64)) and torch.equal(got[2], torch.arange(64))
    assert not torch.equal(got[0], torch.arange(64))
    assert torch.equal(got[[0, 3]], balanced_clusters_reference(keys[[0, 3]]))


def test_numba_clusters_of_adversarial_keys_are_as_tight_and_keep_the_bound() -> None:
    # Huge and tiny norms and exact duplicates: float64 projections may split ties otherwise
    # than the reference's float32 ones, so compare what matters: a partition, as tight, bounded.
    ln = pytest.importorskip("prhs_kernels.louver.numba")
    g = torch.Generator().manual_seed(3)
    keys = key_sets("adversarial", 4, 256, 16, g)
    perm = ln.balanced_clusters_numba(keys, 4)
    assert torch.equal(perm.sort(-1).values, torch.arange(256).expand(4, 256))
    _, radii = cluster_bounds(keys, perm, 4)
    _, ref_radii = cluster_bounds(keys, balanced_clusters_reference(keys), 4)
    assert radii.mean() <= 1.01 * ref_radii.mean()
    centres, radii = cluster_bounds(keys, perm, 4)
    q = torch.randn(4, 3, 16, generator=g)
    members = torch.gather(keys, 1, perm.unsqueeze(-1).expand_as(keys)).view(4, 64, 4, 16)
    logits = torch.einsum("ngd,ncmd->ngcm", q.double(), members.double())
    assert bool((cluster_upper_bounds(q, centres, radii).double().unsqueeze(-1) >= logits).all())


@pytest.mark.parametrize("forced", [False, True], ids=["auto", "torch"])
def test_balanced_clusters_dispatch(monkeypatch, caplog, forced) -> None:
    pytest.importorskip("numba")
    import prhs_kernels.louver as louver
    import prhs_kernels.paths as paths

    if forced:
        monkeypatch.setenv("PRHS_KERNELS", "torch")
    else:
        monkeypatch.delenv("PRHS_KERNELS", raising=False)
    calls = []
    real = louver.balanced_clusters_reference

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(louver, "balanced_clusters_reference", spy)
    monkeypatch.setattr(paths, "_announced", set())
    keys = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="prhs_kernels"):
        perm = balanced_clusters(keys, 4, torch.tensor([True, True]))
    assert torch.equal(perm, real(keys, 4))
    assert len(calls) == (1 if forced else 0)
    assert ("balanced_clusters runs its numba path on cpu" in caplog.text) is not forced


def test_balanced_clusters_refuses_bad_input() -> None:
    keys = torch.randn(2, 3, 16, 8)
    with pytest.raises(ValueError, match="power of two"):
        balanced_clusters(torch.randn(2, 24, 8), 4)
    with pytest.raises(ValueError, match="active must have shape"):
        balanced_clusters(keys, 4, torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        balanced_clusters(keys, 4, torch.ones(2, 3))
    with pytest.raises(ValueError, match="cluster_size"):
        balanced_clusters(keys, 0)


# --- the index build's CPU path -------------------------------------------------------------


def test_index_pages_writes_the_references_index_for_active_sequences_only() -> None:
    g = torch.Generator().manual_seed(11)
    b, h, n_pages, p, d, s = 3, 2, 2, 64, 16, 4
    keys = torch.randn(b, h, n_pages, p, d, generator=g)
    keys[1, 0, 1, 5] = float("nan")
    rows = torch.tensor([[4, 0], [2, 6], [1, 5]])
    active = torch.tensor([True, True, False])

    def fields():
        return (
            torch.full((8, h, p), -7, dtype=torch.int16),
            torch.full((8, h, p // 4, d), 9.0),
            torch.full((8, h, p // 4, s), 5.0),
        )

    got, want = fields(), fields()
    index_pages(keys, rows, active, *got)  # the Numba clustering where Numba is installed
    index_pages_reference(keys, rows, active, *want)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
    perm, centres, radii = got
    for row in (1, 5, 3, 7):  # rows of the inactive sequence and rows nobody owns
        assert bool((perm[row] == -7).all()) and bool((centres[row] == 9.0).all())
        assert bool((radii[row] == 5.0).all())
    k = torch.nan_to_num(keys, nan=0.0)
    order = balanced_clusters_reference(k[0, :, 0])
    assert torch.equal(perm[4].long(), order)
    c, r = cluster_bounds(k[0, :, 0], order, s)
    assert torch.equal(centres[4], c) and torch.equal(radii[4], r)


def test_index_pages_refuses_bad_input() -> None:
    keys = torch.randn(1, 2, 1, 16, 8)
    rows = torch.zeros(1, 1, dtype=torch.long)
    on = torch.ones(1, dtype=torch.bool)
    perm = torch.zeros(3, 2, 16, dtype=torch.int16)
    cen, rad = torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 2)
    with pytest.raises(ValueError, match="rows must be"):
        index_pages(keys, rows.view(1), on, perm, cen, rad)
    with pytest.raises(ValueError, match="active must have shape"):
        index_pages(keys, rows, on.repeat(2), perm, cen, rad)
    with pytest.raises(TypeError, match="perm must be an int16"):
        index_pages(keys, rows, on, perm.int(), cen, rad)
    with pytest.raises(ValueError, match="centres must be"):
        index_pages(keys, rows, on, perm, cen[:, :, :2], rad)
    with pytest.raises(ValueError, match="radii must be"):
        index_pages(keys, rows, on, perm, cen, torch.zeros(3, 2, 4, 3))
    with pytest.raises(ValueError, match="power of two"):
        index_pages(torch.randn(1, 2, 1, 12, 8), rows, on, perm, cen, rad)
    assert bool((perm == 0).all()) and bool((cen == 0).all()) and bool((rad == 0).all())
