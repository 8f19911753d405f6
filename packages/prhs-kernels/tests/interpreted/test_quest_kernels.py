"""Quest's kernels against their torch references, under Triton's interpreter (run by
``../test_triton.py``). The page scores: small and odd shapes (rows of length 1, lengths that
are not a multiple of the page, several spans of pages), GQA 1 / 4 / 8, pages of 1 and 16, the
side cache built through every layout's KV locations, bf16 and fp16. The selection: every row
shape of ``SELECT_CASES`` (empty rows, rows inside the windows, ``k`` above the pages that may
be picked, no sink, no local window, ties, NaN and ``-inf`` bounds, bad rows)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels import paths
from prhs_kernels.kv import token_locations
from prhs_kernels.quest import quest_page_scores, quest_select

PATH = "triton-interpreter"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# A page no key was folded into (+inf / -inf) gives 0·inf = NaN in both paths, by design.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    assert paths.interpreting(), "run this folder with TRITON_INTERPRET=1 (see ../test_triton.py)"
    monkeypatch.delenv("PRHS_KERNELS", raising=False)


def test_path_rules():
    assert paths.kernel_path("cpu", torch.bfloat16) == PATH
    assert paths.kernel_path("cpu", torch.float16) == PATH
    assert paths.kernel_path("cpu", torch.float32) == "torch"


def _side_pages(data, name: str, p: int, gen: torch.Generator, empty: int):
    """One layer's Quest fields as a side cache holds them, built through ``name``'s KV
    locations: ``(kmin, kmax, pages)``. ``kmin`` / ``kmax`` are strided ``[R, Hkv, D]`` views
    (layer 1 of a two-layer field); rows no page uses hold NaN (a read of one shows), and
    ``empty`` random existing pages hold no key (``+inf`` / ``-inf``: a NaN bound). ``pages`` is
    ``[B, P]``, garbage where a page does not exist (it must not be read)."""
    kv = data[name]
    b, hkv, t, d = data.keys.shape
    row_stride = -(-t // p) * p + p  # a page-aligned row and one spare page
    n_loc = b * row_stride if name.startswith("contig") else kv.k_pool.shape[0]
    n_rows = -(-n_loc // p) + 1  # the last row is scratch
    pos = torch.arange(t).view(1, -1).expand(b, -1)
    loc = token_locations(kv, pos, row_stride)  # [B, T], -1 past each row's end
    kmin = torch.full((n_rows, 2, hkv, d), float("nan"), dtype=data.keys.dtype)
    kmax = kmin.clone()
    ok = loc >= 0
    page = torch.where(ok, loc // p, n_rows - 1)
    keys = torch.where(ok[:, None, :, None], data.keys, 0.0).transpose(1, 2)  # [B, T, Hkv, D]
    at = page.view(-1, 1, 1).expand(-1, hkv, d)
    lo, hi = kmin[:, 1], kmax[:, 1]
    lo.index_fill_(0, page.flatten(), float("inf"))
    hi.index_fill_(0, page.flatten(), float("-inf"))
    lo.scatter_reduce_(0, at, keys.reshape(-1, hkv, d), "amin", include_self=True)
    hi.scatter_reduce_(0, at, keys.reshape(-1, hkv, d), "amax", include_self=True)
    n_pages = -(-t // p)
    first = page[:, ::p]  # [B, P] the page row of each page's first position
    exists = torch.arange(n_pages).view(1, -1) * p < data.seq_lens.view(-1, 1)
    live = first[exists]
    gone = live[torch.randperm(live.numel(), generator=gen)[:empty]]
    lo[gone], hi[gone] = float("inf"), float("-inf")
    garbage = torch.randint(-5, 1 << 20, first.shape, generator=gen)
    return lo, hi, torch.where(exists, first, garbage)


# (lens, Hq, Hkv, D, page size, n_sink, n_local)
CASES = [
    ([1], 4, 4, 16, 1, 0, 0),  # a row of one position, GQA 1, no windows
    ([37, 5, 1], 8, 2, 16, 16, 4, 8),  # GQA 4, T not a multiple of the page, a row of 1
    ([70, 3], 8, 1, 32, 1, 4, 16),  # GQA 8, pages of one position
    ([100, 61], 4, 1, 128, 1, 1, 1),  # D 128: 32 pages a program, four spans
    ([50, 33], 8, 2, 24, 16, 20, 0),  # D not a power of two, a sink over a page
]
IDS = [f"T{max(c[0])}-B{len(c[0])}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-p{c[4]}" for c in CASES]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "p", "n_sink", "n_local"), CASES, ids=IDS)
def test_page_scores_match_the_reference(make_kv, dtype, lens, hq, hkv, d, p, n_sink, n_local):
    gen = torch.Generator().manual_seed(sum(lens) + p)
    data = make_kv(lens, hkv, d, dtype=dtype, seed=d + p)
    b = len(lens)
    query = torch.randn(b, hq, d, generator=gen).to(dtype)
    bad = torch.rand(b, hkv, generator=gen) < 0.25
    bad[0] = False
    layouts = [n for n in data.layouts if n != "paged1" or p == 1]  # paged1: pages of 1 slot
    for i, name in enumerate(layouts):
        kmin, kmax, pages = _side_pages(data, name, p, gen, empty=i % 2)
        args = (query, kmin, kmax, pages, data.seq_lens, bad, d**-0.5)
        kw = dict(page_size=p, n_sink=n_sink, n_local=n_local)
        got = quest_page_scores(*args, **kw, path=PATH)
        want = quest_page_scores(*args, **kw, path="torch")
        assert got.shape == (b, hkv, -(-max(lens) // p)) and got.dtype == torch.float32, name
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), name
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        assert bool(torch.isfinite(want[~torch.isneginf(want) & ~torch.isnan(want)]).all())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        # The same scores through int32 page rows and a query laid out with other strides.
        q_t = query.transpose(0, 1).contiguous().transpose(0, 1)
        got32 = quest_page_scores(q_t, kmin, kmax, pages.int(), *args[4:], **kw, path=PATH)
        torch.testing.assert_close(got32, got, rtol=0, atol=0, equal_nan=True)


def test_every_page_may_be_picked_without_windows_or_bad_rows(make_kv):
    gen = torch.Generator().manual_seed(7)
    data = make_kv([33, 16], 2, 16, dtype=torch.bfloat16, seed=3)
    kmin, kmax, pages = _side_pages(data, "paged16", 16, gen, empty=0)
    query = torch.randn(2, 4, 16, generator=gen).bfloat16()
    bad = torch.zeros(2, 2, dtype=torch.bool)
    got = quest_page_scores(
        query, kmin, kmax, pages, data.seq_lens, bad, 0.25,
        page_size=16, n_sink=0, n_local=0, path=PATH,
    )  # fmt: skip
    # Row 0 has pages 0..2 (33 positions), row 1 one page (16): the rest do not exist.
    assert bool(torch.isfinite(got[0]).all())
    assert bool(torch.isfinite(got[1, :, :1]).all()) and bool(torch.isneginf(got[1, :, 1:]).all())


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(query=torch.zeros(2, 4)), ValueError, "query must have 3 dimensions"),
        (dict(kmax=torch.zeros(9, 2, 8)), ValueError, "kmin and kmax must share"),
        (dict(kmin=torch.zeros(9, 3, 16), kmax=torch.zeros(9, 3, 16)), ValueError, "multiple"),
        (dict(kmin=torch.zeros(9, 2, 8), kmax=torch.zeros(9, 2, 8)), ValueError, "head size"),
        (dict(pages=torch.zeros(2, 3)), TypeError, "pages must be an integer tensor"),
        (dict(pages=torch.zeros(3, 3, dtype=torch.int64)), ValueError, r"\[B, P\]"),
        (dict(seq_lens=torch.ones(2, dtype=torch.int64)), TypeError, "seq_lens must be int32"),
        (dict(bad=torch.zeros(2, 4, dtype=torch.bool)), ValueError, "bad must have shape"),
        (dict(scaling=float("nan")), ValueError, "scaling must be finite"),
        (dict(page_size=0), ValueError, "page_size must be >= 1"),
        (dict(path="cuda"), ValueError, "path must be one of"),
    ],
)
def test_bad_input_raises(change, error, match):
    kw = dict(
        query=torch.zeros(2, 4, 16, dtype=torch.bfloat16),
        kmin=torch.zeros(9, 2, 16, dtype=torch.bfloat16),
        kmax=torch.zeros(9, 2, 16, dtype=torch.bfloat16),
        pages=torch.zeros(2, 3, dtype=torch.int64),
        seq_lens=torch.ones(2, dtype=torch.int32),
        bad=torch.zeros(2, 2, dtype=torch.bool),
        scaling=0.25,
        page_size=16,
        n_sink=0,
        n_local=0,
        path=PATH,
    )
    kw.update(change)
    with pytest.raises(error, match=match):
        quest_page_scores(**kw)


def test_select_matches_the_torch_path(quest_case):
    (_, _, p, n_sink, n_local, k), (scores, seq_lens, bad, out, cnt) = quest_case
    want_out, want_cnt = out.clone(), cnt.clone()
    kw = dict(page_size=p, n_sink=n_sink, n_local=n_local)
    quest_select(scores, seq_lens, bad, k, **kw, out_indices=out, out_counts=cnt, path=PATH)
    quest_select(
        scores, seq_lens, bad, k, **kw, out_indices=want_out, out_counts=want_cnt, path="torch"
    )  # fmt: skip
    # Ties go to the lower page on both paths on the CPU: the same selections, every entry.
    assert torch.equal(cnt, want_cnt)
    assert torch.equal(out, want_out)


def test_select_writes_through_strided_buffers():
    """A plan's buffers may be views: rows and heads of a wider selection."""
    b, hkv, p, n_pages = 2, 3, 16, 40
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(b, hkv, n_pages, generator=gen)
    seq_lens = torch.tensor([600, 333], dtype=torch.int32)
    bad = torch.zeros(b, hkv, dtype=torch.bool)
    kw = dict(page_size=p, n_sink=4, n_local=32)
    big = torch.full((b, 2 * hkv, 20), 7, dtype=torch.int32)
    big_cnt = torch.full((b, 2 * hkv), 7, dtype=torch.int32)
    out, cnt = big[:, ::2, 2:], big_cnt[:, ::2]
    quest_select(scores, seq_lens, bad, 8, **kw, out_indices=out, out_counts=cnt, path=PATH)
    want, want_cnt = torch.empty(b, hkv, 18, dtype=torch.int32), cnt.clone()
    quest_select(scores, seq_lens, bad, 8, **kw, out_indices=want, out_counts=want_cnt)
    assert torch.equal(out, want) and torch.equal(cnt, want_cnt)
    assert bool((big[:, 1::2] == 7).all()) and bool((big[:, :, :2] == 7).all())
    assert bool((big_cnt[:, 1::2] == 7).all())


def test_both_launches_find_the_bad_rows_themselves(make_kv):
    """``bad=None``: the page scores and the selection find the rows whose group's queries hold
    a NaN or an infinity (the selection counts them), as the separate check would."""
    gen = torch.Generator().manual_seed(11)
    lens, hq, hkv, d, p = [300, 129, 77], 8, 2, 16, 16
    data = make_kv(lens, hkv, d, dtype=torch.bfloat16, seed=4)
    kmin, kmax, pages = _side_pages(data, "contig", p, gen, empty=0)
    query = torch.randn(len(lens), hq, d, generator=gen).bfloat16()
    query[0, 5, 3] = float("nan")  # row (0, KV head 1)
    query[2, 0, 0] = float("inf")  # row (2, KV head 0)
    query[2, 7, 15] = float("-inf")  # row (2, KV head 1)
    bad = torch.tensor([[False, True], [False, False], [True, True]])
    kw = dict(page_size=p, n_sink=4, n_local=32)
    args = (query, kmin, kmax, pages, data.seq_lens)
    found = quest_page_scores(*args, None, d**-0.5, **kw, path=PATH)
    given = quest_page_scores(*args, bad, d**-0.5, **kw, path=PATH)
    torch.testing.assert_close(found, given, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isneginf(found[bad]).all())
    ws_k_wl = 1 + 8 + 3
    out = torch.full((3, hkv, ws_k_wl), 9, dtype=torch.int32)
    cnt = torch.full((3, hkv), 9, dtype=torch.int32)
    want, want_cnt = out.clone(), cnt.clone()
    nonfinite = torch.tensor([5], dtype=torch.int64)
    quest_select(found, data.seq_lens, None, 8, **kw, out_indices=out, out_counts=cnt,
                 query=query, nonfinite=nonfinite, path=PATH)  # fmt: skip
    quest_select(given, data.seq_lens, bad, 8, **kw, out_indices=want, out_counts=want_cnt)
    assert torch.equal(out, want) and torch.equal(cnt, want_cnt)
    assert int(nonfinite) == 5 + 3
    # The torch path counts them the same way.
    nonfinite_t = torch.tensor([0], dtype=torch.int64)
    quest_select(found, data.seq_lens, None, 8, **kw, out_indices=want, out_counts=want_cnt,
                 query=query, nonfinite=nonfinite_t)  # fmt: skip
    assert torch.equal(out, want) and int(nonfinite_t) == 3


# -- the fold of written keys into the page bounds --------------------------------------------
# (KV locations, Hkv, D, page size, non-finite rows, columns of a cache of T, or None)
FOLD_CASES = [
    ([5, 8, 17, -1, 40], 2, 8, 4, (), None),  # a decode step: a row a page, one writes nowhere
    ([9, 8, 10, 11, 3, 33, 32], 2, 8, 4, (1, 3), None),  # a page's rows out of order
    ([9, 8, 10, 11, 3, 33, 32], 3, 20, 4, (2,), None),  # Hkv and D not powers of two
    ([5, 8, 17, -1, 40, 41], 2, 8, 4, (0,), ([3, 0, 7, 2, -1, 9], 8)),  # columns, two outside
    ("perm300", 4, 32, 16, (5, 17), None),  # 300 locations in random order, pages of 16
    ("all64", 1, 128, 4, (0, 8, 9), None),  # a whole prompt: first locations not finite
    ([7, 3, 12], 2, 16, 1, (1,), None),  # pages of one location: every write resets its page
    ([21], 2, 16, 16, (), ([4], 6)),  # one row, mid-page
]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("int32", [False, True], ids=["int64", "int32"])
@pytest.mark.parametrize(("locs", "hkv", "d", "p", "bad", "cols"), FOLD_CASES)
def test_fold_matches_the_reference(dtype, int32, locs, hkv, d, p, bad, cols):
    from prhs_kernels.quest import fold_page_bounds

    gen = torch.Generator().manual_seed(len(str(locs)) + d)
    if locs == "perm300":
        locs = torch.randperm(4096, generator=gen)[:300].tolist()
    elif locs == "all64":
        locs = list(range(64))
    n, n_loc = len(locs), max(locs) + 1
    rows = -(-n_loc // p) + 1
    base_lo = torch.randn(rows, 3, hkv, d, generator=gen).to(dtype)
    base_hi = base_lo + 1.0
    loc = torch.tensor(locs, dtype=torch.int32 if int32 else torch.int64)
    kw = {}
    if cols is None:
        key = torch.randn(n, hkv, d, generator=gen).to(dtype)
        for r in bad:
            key[r, 0, 1] = float("nan")
    else:
        cols, t = cols
        key = torch.randn(n, t, hkv, d, generator=gen).to(dtype).transpose(1, 2)  # strided
        for r in bad:
            key[r, 0, cols[r], 1] = float("inf")
        kw["columns"] = torch.tensor(cols, dtype=torch.int32)
    got = []
    for path in ("torch", PATH):
        lo, hi = base_lo.clone(), base_hi.clone()
        count = torch.zeros(1, dtype=torch.int64)
        fold_page_bounds(
            lo[:, 1], hi[:, 1], loc, key, page_size=p, nonfinite=count, path=path, **kw
        )
        got.append((lo, hi, count))
    (lo_t, hi_t, n_t), (lo_k, hi_k, n_k) = got
    assert int(n_t) == len(bad) and torch.equal(n_t, n_k)
    assert torch.equal(lo_t[:-1], lo_k[:-1]) and torch.equal(hi_t[:-1], hi_k[:-1])
    # The other layers' rows are untouched.
    assert torch.equal(lo_k[:, [0, 2]], base_lo[:, [0, 2]])
    assert torch.equal(hi_k[:, [0, 2]], base_hi[:, [0, 2]])
