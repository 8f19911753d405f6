"""prhs_kernels.louver: balanced clusters partition each page; the cluster bound is above every
member's logit on random, clustered and adversarial keys, so a threshold on it misses no key."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.louver import balanced_clusters, cluster_bounds, cluster_upper_bounds


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
