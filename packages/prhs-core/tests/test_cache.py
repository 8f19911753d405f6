"""KV cache views: the contiguous (left-padded) and paged layouts agree position by position.

The paged pool is built by scattering the contiguous data into random distinct slots, with
NaN in every slot no sequence uses, so any read of storage that should be padding shows up.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from prhs_core import ContiguousKVCache, KVCacheView, PagedKVCache


@dataclass
class Case:
    key: torch.Tensor  # [B, Hkv, T, D] contiguous storage
    value: torch.Tensor  # [B, Hkv, T, Dv]
    start: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    contiguous: ContiguousKVCache
    paged: PagedKVCache

    def ref_gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Python-loop reference: storage row ``start + p`` for ``0 <= p < seq_len``, else 0."""
        b_, h_, k_ = positions.shape
        k = torch.zeros(b_, h_, k_, self.key.shape[-1], dtype=self.key.dtype)
        v = torch.zeros(b_, h_, k_, self.value.shape[-1], dtype=self.value.dtype)
        for b in range(b_):
            for h in range(h_):
                for i in range(k_):
                    p = int(positions[b, h, i])
                    if 0 <= p < int(self.seq_lens[b]):
                        k[b, h, i] = self.key[b, h, int(self.start[b]) + p]
                        v[b, h, i] = self.value[b, h, int(self.start[b]) + p]
        return k, v


def make_case(
    b: int,
    t: int,
    hkv: int,
    d: int,
    dv: int,
    dtype: torch.dtype,
    seed: int,
    *,
    lens: list[int] | None = None,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    value = torch.randn(b, hkv, t, dv, generator=g).to(dtype)
    if lens is None:
        seq_lens = torch.randint(0, t + 1, (b,), generator=g)
        seq_lens[0] = t  # one full row, so max_seq_len == T
        if b >= 3:
            seq_lens[-1] = 0  # an idle row
    else:
        seq_lens = torch.tensor(lens)
    start = torch.stack([torch.randint(0, t - int(n) + 1, (1,), generator=g)[0] for n in seq_lens])
    if lens is None and b >= 3:
        start[-1] = t  # ... whose storage starts past the end (all left padding)
    # Left padding holds garbage (NaN) that must never be read back.
    for r in range(b):
        key[r, :, : int(start[r])] = float("nan")
        key[r, :, int(start[r]) + int(seq_lens[r]) :] = float("nan")
        value[r, :, : int(start[r])] = float("nan")
    contiguous = ContiguousKVCache(key, value, seq_lens=seq_lens, start=start)

    total = int(seq_lens.sum())
    num_slots = total + 5
    perm = torch.randperm(num_slots, generator=g)
    key_pool = torch.full((num_slots, hkv, d), float("nan"), dtype=dtype)
    value_pool = torch.full((num_slots, hkv, dv), float("nan"), dtype=dtype)
    width = t + 3
    # Entries past seq_len are never read: fill them with out-of-range junk.
    token_table = torch.randint(-50, 50 + num_slots, (b, width), generator=g)
    used = 0
    for r in range(b):
        for p in range(int(seq_lens[r])):
            slot = int(perm[used])
            used += 1
            token_table[r, p] = slot
            key_pool[slot] = key[r, :, int(start[r]) + p]
            value_pool[slot] = value[r, :, int(start[r]) + p]
    paged = PagedKVCache(key_pool, value_pool, token_table.to(torch.int32), seq_lens)
    return Case(key, value, start, seq_lens, contiguous, paged)


SHAPES = [
    # (B, T, Hkv, D, Dv)
    (1, 1, 1, 4, 4),
    (2, 37, 2, 16, 16),
    (3, 64, 4, 8, 12),
    (4, 5, 1, 2, 3),
]
SHAPE_IDS = [f"B{b}-T{t}-Hkv{h}-D{d}-Dv{dv}" for b, t, h, d, dv in SHAPES]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def both(case: Case) -> list[KVCacheView]:
    return [case.contiguous, case.paged]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("b", "t", "hkv", "d", "dv"), SHAPES, ids=SHAPE_IDS)
def test_contiguous_and_paged_agree_with_the_reference(
    b: int, t: int, hkv: int, d: int, dv: int, dtype: torch.dtype
) -> None:
    case = make_case(b, t, hkv, d, dv, dtype, seed=b * 1000 + t)
    g = torch.Generator().manual_seed(7)
    # Valid positions, plus padding: -1, -7, seq_len, and far past the end.
    positions = torch.randint(-3, t + 4, (b, hkv, 2 * t + 3), generator=g)
    positions[..., 0] = -1
    positions[..., 1] = case.seq_lens.view(-1, 1)
    ref_k, ref_v = case.ref_gather(positions)
    for view in both(case):
        k, v = view.gather(positions)
        assert k.dtype == dtype and v.dtype == dtype
        assert k.shape == (b, hkv, 2 * t + 3, d) and v.shape == (b, hkv, 2 * t + 3, dv)
        assert torch.equal(k, ref_k), type(view).__name__
        assert torch.equal(v, ref_v), type(view).__name__
    # Same answers through the dense accessors.
    c, p = case.contiguous, case.paged
    assert c.max_seq_len == p.max_seq_len == int(case.seq_lens.max())
    assert isinstance(c.max_seq_len, int) and isinstance(p.max_seq_len, int)
    assert torch.equal(c.keys(), p.keys())
    assert torch.equal(c.values(), p.values())
    assert torch.equal(c.valid_mask(), p.valid_mask())


@pytest.mark.parametrize(("b", "t", "hkv", "d", "dv"), SHAPES, ids=SHAPE_IDS)
def test_keys_values_are_zero_past_each_seq_len(b: int, t: int, hkv: int, d: int, dv: int) -> None:
    case = make_case(b, t, hkv, d, dv, torch.float32, seed=3 + t)
    for view in both(case):
        keys, values, valid = view.keys(), view.values(), view.valid_mask()
        assert keys.shape == (b, hkv, t, d)
        assert values.shape == (b, hkv, t, dv)
        assert valid.dtype == torch.bool and valid.shape == (b, t)
        expected_valid = torch.arange(t).view(1, -1) < case.seq_lens.view(-1, 1)
        assert torch.equal(valid, expected_valid)
        assert bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())
        for r in range(b):
            n, s = int(case.seq_lens[r]), int(case.start[r])
            assert torch.equal(keys[r, :, :n], case.key[r, :, s : s + n])
            assert torch.equal(values[r, :, :n], case.value[r, :, s : s + n])
            assert not keys[r, :, n:].any()
            assert not values[r, :, n:].any()


def test_views_satisfy_the_protocol_and_report_geometry() -> None:
    case = make_case(3, 9, 2, 4, 6, torch.float32, seed=0)
    for view in both(case):
        assert isinstance(view, KVCacheView)
        assert (view.batch_size, view.num_kv_heads, view.head_dim) == (3, 2, 4)
        assert view.seq_lens.dtype == torch.int64
        assert torch.equal(view.seq_lens, case.seq_lens)
    assert not isinstance(object(), KVCacheView)


def test_contiguous_default_seq_lens_is_t_minus_start() -> None:
    key = torch.randn(3, 1, 6, 2)
    cache = ContiguousKVCache(key, key.clone(), start=torch.tensor([0, 2, 6]))
    assert cache.seq_lens.tolist() == [6, 4, 0]
    assert cache.max_seq_len == 6
    keys = cache.keys()
    assert torch.equal(keys[1, :, :4], key[1, :, 2:])
    assert not keys[1, :, 4:].any()
    assert not keys[2].any()  # an empty row that starts at T must read nothing (and not crash)


def test_empty_row_reads_zeros_even_when_its_storage_is_nan() -> None:
    # An idle row of a paged batch (seq_len 0) points at an unset slot full of NaN.
    pool = torch.randn(4, 1, 3)
    pool[3] = float("nan")
    table = torch.tensor([[0, 1], [3, 3]])
    cache = PagedKVCache(pool, pool.clone(), table, torch.tensor([2, 0]))
    k, v = cache.gather(torch.tensor([[[0, 1, -1]], [[0, 1, 5]]]))
    assert torch.equal(k[0, 0, :2], pool[:2, 0])
    assert not k[0, 0, 2].any()
    assert torch.equal(k[1], torch.zeros(1, 3, 3)) and torch.equal(v[1], torch.zeros(1, 3, 3))


def test_paged_accepts_a_host_supplied_max_seq_len() -> None:
    case = make_case(2, 10, 1, 4, 4, torch.float32, seed=1, lens=[10, 3])
    paged = PagedKVCache(
        case.paged.key_pool,
        case.paged.value_pool,
        case.paged.token_table,
        case.seq_lens,
        max_seq_len=12,
    )
    assert paged.max_seq_len == 12
    keys = paged.keys()
    assert keys.shape == (2, 1, 12, 4)
    assert torch.equal(keys[:, :, :10], case.contiguous.keys())
    assert not keys[:, :, 10:].any()


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (
            lambda: ContiguousKVCache([0.0], torch.zeros(1, 1, 1, 1)),
            TypeError,
            "key must be a torch.Tensor",
        ),
        (
            lambda: ContiguousKVCache(
                torch.zeros(1, 1, 2, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 2)
            ),
            TypeError,
            "key must be a floating-point tensor",
        ),
        (
            lambda: ContiguousKVCache(torch.zeros(1, 2, 2), torch.zeros(1, 1, 2, 2)),
            ValueError,
            r"key must have 4 dimensions, got shape \[1, 2, 2\]",
        ),
        (
            lambda: ContiguousKVCache(torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 5, 2)),
            ValueError,
            "must agree on B, Hkv and T",
        ),
        (
            lambda: ContiguousKVCache(
                torch.zeros(2, 1, 4, 2),
                torch.zeros(2, 1, 4, 2),
                start=torch.zeros(3, dtype=torch.long),
            ),
            ValueError,
            r"start must have shape \[B=2\], got \[3\]",
        ),
        (
            lambda: ContiguousKVCache(
                torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2), start=torch.zeros(2)
            ),
            TypeError,
            "start must be an integer tensor",
        ),
        (
            lambda: ContiguousKVCache(
                torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2), seq_lens=torch.tensor([4])
            ),
            ValueError,
            r"seq_lens must have shape \[B=2\], got \[1\]",
        ),
        (
            lambda: ContiguousKVCache(
                torch.zeros(2, 1, 4, 2),
                torch.zeros(2, 1, 4, 2),
                seq_lens=torch.tensor([4, 3]),
                start=torch.tensor([0, 2]),
            ),
            ValueError,
            r"start \+ seq_lens must be <= T=4",
        ),
        (
            lambda: ContiguousKVCache(
                torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2), start=torch.tensor([0, 5])
            ),
            ValueError,
            "start and seq_lens must be >= 0",
        ),
        (
            lambda: ContiguousKVCache(
                torch.zeros(2, 1, 4, 2), torch.zeros(2, 1, 4, 2), start=torch.tensor([-1, 0])
            ),
            ValueError,
            "start and seq_lens must be >= 0",
        ),
    ],
    ids=[
        "key-list",
        "key-int",
        "key-3d",
        "T-mismatch",
        "start-shape",
        "start-float",
        "lens-shape",
        "start+lens>T",
        "start>T",
        "start-neg",
    ],
)
def test_contiguous_rejects_bad_input(make, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        make()


def _pool(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 2, 4), torch.randn(n, 2, 3)


@pytest.mark.parametrize(
    ("args", "error", "fragment"),
    [
        (
            (
                torch.zeros(6, 4),
                torch.zeros(6, 2, 3),
                torch.zeros(1, 3, dtype=torch.long),
                torch.tensor([3]),
            ),
            ValueError,
            "key_pool must have 3 dimensions",
        ),
        (
            (
                torch.zeros(6, 2, 4),
                torch.zeros(5, 2, 3),
                torch.zeros(1, 3, dtype=torch.long),
                torch.tensor([3]),
            ),
            ValueError,
            "must agree on N and Hkv",
        ),
        (
            (torch.zeros(6, 2, 4), torch.zeros(6, 2, 3), torch.zeros(1, 3), torch.tensor([3])),
            TypeError,
            "token_table must be an integer tensor",
        ),
        (
            (
                torch.zeros(6, 2, 4),
                torch.zeros(6, 2, 3),
                torch.zeros(2, 3, dtype=torch.long),
                torch.tensor([3]),
            ),
            ValueError,
            r"seq_lens must have shape \[B=2\]",
        ),
        (
            (
                torch.zeros(6, 2, 4),
                torch.zeros(6, 2, 3),
                torch.zeros(1, 3, dtype=torch.long),
                torch.tensor([4]),
            ),
            ValueError,
            r"seq_lens must lie in \[0, M=3\]",
        ),
        (
            (
                torch.zeros(6, 2, 4),
                torch.zeros(6, 2, 3),
                torch.zeros(1, 3, dtype=torch.long),
                torch.tensor([-1]),
            ),
            ValueError,
            r"seq_lens must lie in \[0, M=3\]",
        ),
        (
            (
                torch.zeros(6, 2, 4),
                torch.zeros(6, 2, 3),
                torch.tensor([[0, 6, 1]]),
                torch.tensor([2]),
            ),
            ValueError,
            r"token_table slots in use must lie in \[0, 6\)",
        ),
        (
            (
                torch.zeros(6, 2, 4),
                torch.zeros(6, 2, 3),
                torch.tensor([[-1, 2, 1]]),
                torch.tensor([1]),
            ),
            ValueError,
            r"token_table slots in use must lie in \[0, 6\)",
        ),
    ],
    ids=[
        "pool-2d",
        "pool-N-mismatch",
        "table-float",
        "lens-shape",
        "lens>M",
        "lens-neg",
        "slot=N",
        "slot-neg",
    ],
)
def test_paged_rejects_bad_input(args: tuple, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        PagedKVCache(*args)


def test_paged_ignores_junk_past_seq_len() -> None:
    kp, vp = _pool()
    table = torch.tensor([[4, 1, 99, -7]])  # only the first 2 entries are in use
    cache = PagedKVCache(kp, vp, table, torch.tensor([2]))
    assert torch.equal(cache.keys()[0, :, 0], kp[4])
    assert torch.equal(cache.keys()[0, :, 1], kp[1])
    assert torch.equal(cache.values()[0, :, 1], vp[1])


@pytest.mark.parametrize(
    ("positions", "error", "fragment"),
    [
        (torch.zeros(2, 2, 3), TypeError, "positions must be an integer tensor"),
        (torch.zeros(2, 3, dtype=torch.long), ValueError, "positions must have 3 dimensions"),
        (
            torch.zeros(2, 1, 3, dtype=torch.long),
            ValueError,
            r"positions must have shape \[B=2, Hkv=2, K\]",
        ),
        (
            torch.zeros(1, 2, 3, dtype=torch.long),
            ValueError,
            r"positions must have shape \[B=2, Hkv=2, K\]",
        ),
        (torch.zeros(2, 2, 3, dtype=torch.bool), TypeError, "positions must be an integer tensor"),
    ],
    ids=["float", "2d", "wrong-Hkv", "wrong-B", "bool"],
)
def test_gather_rejects_bad_positions(positions: torch.Tensor, error: type, fragment: str) -> None:
    case = make_case(2, 5, 2, 4, 4, torch.float32, seed=11)
    for view in both(case):
        with pytest.raises(error, match=fragment):
            view.gather(positions)
