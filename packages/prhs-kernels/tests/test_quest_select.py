"""``prhs_kernels.quest.quest_select`` without a GPU: the torch path against a plain Python
reading of Quest's rule, the Triton path's one launch (caught on the CPU) and its sm_90
compile, the torch path for rows too long for one program, and bad input refused before any
write. The Triton path against the torch path runs under the interpreter
(``interpreted/test_quest_kernels.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_kernels.quest import quest_select


def _call(built, case, path="torch", **change):
    """``quest_select`` of ``built`` (:func:`quest_select_case`) with ``case``'s page size,
    windows and ``k``; ``change`` replaces arguments by name."""
    _, _, p, n_sink, n_local, k = case
    scores, seq_lens, bad, out, cnt = built
    args = dict(scores=scores, seq_lens=seq_lens, bad=bad, k=k, out_indices=out, out_counts=cnt,
                query=None, nonfinite=None)  # fmt: skip
    args.update(change)
    quest_select(
        args["scores"], args["seq_lens"], args["bad"], args["k"], page_size=p, n_sink=n_sink,
        n_local=n_local, out_indices=args["out_indices"], out_counts=args["out_counts"],
        query=args["query"], nonfinite=args["nonfinite"], path=path,
    )  # fmt: skip


def _rule(scores, seq_lens, bad, k, p, n_sink, n_local):
    """Quest's selection of each row, read plainly: the windows' pages and the ``k`` best pages
    between them (NaN as -inf; ties toward the lower page), ascending."""
    b, h, _ = scores.shape
    rows = {}
    for i in range(b):
        t = int(seq_lens[i])
        nb = -(-t // p)
        sink = set(range(-(-min(t, n_sink) // p)))
        local = set(range(max(t - n_local, 0) // p, nb)) if n_local > 0 else set()
        for j in range(h):
            pick = [] if bool(bad[i, j]) else [
                x for x in range(nb) if x not in sink and x not in local
            ]  # fmt: skip
            val = [float(scores[i, j, x]) for x in pick]
            val = [-math.inf if math.isnan(v) else v for v in val]
            best = sorted(zip(val, pick, strict=True), key=lambda vx: (-vx[0], vx[1]))[:k]
            rows[i, j] = sorted(sink | local | {x for _, x in best})
    return rows


def test_the_torch_path_is_the_windows_and_the_top_pages(quest_case):
    case, built = quest_case
    _, _, p, n_sink, n_local, k = case
    _call(built, case)
    scores, seq_lens, bad, out, cnt = built
    for (i, j), want in _rule(scores, seq_lens, bad, k, p, n_sink, n_local).items():
        assert int(cnt[i, j]) == len(want), (i, j)
        assert out[i, j, : len(want)].tolist() == want, (i, j)
        assert bool((out[i, j, len(want) :] == -1).all()), (i, j)


@pytest.mark.parametrize("find", [False, True], ids=["bad-given", "bad-found"])
@pytest.mark.parametrize(
    "case", [([5000, 4096], 8, 16, 4, 64, 64), ([9000], 2, 1, 4, 64, 1024)], ids=["p16", "p1"]
)
def test_the_triton_path_is_one_launch_a_step_that_compiles_for_a_hopper_gpu(
    make_quest_case, hopper_compile, catch_launches, case, find
):
    """The page scores and the selection, one launch each (with ``bad=None`` both find the bad
    rows from the query, the selection counting them), both compiled for sm_90."""
    pytest.importorskip("triton")
    from prhs_kernels.quest import quest_page_scores
    from prhs_kernels.quest.triton import quest_select_fits

    built = make_quest_case(*case)
    b, h, n_pages = built[0].shape
    assert quest_select_fits(n_pages)
    query = torch.zeros(b, 4 * h, 128, dtype=torch.bfloat16)
    side = torch.zeros(b * n_pages + 1, h, 128, dtype=torch.bfloat16)
    pages = torch.arange(b * n_pages).view(b, n_pages)
    bad = None if find else built[2]
    quest_page_scores(query, side, side, pages, built[1], bad, 0.08, page_size=case[2],
                      n_sink=case[3], n_local=case[4], path="triton")  # fmt: skip
    extra = dict(bad=None, query=query, nonfinite=torch.zeros(1, dtype=torch.int64)) if find else {}
    _call(built, case, path="triton", **extra)
    names = [fn.fn.__name__ for fn, _, _ in catch_launches]
    assert names == ["_page_scores_kernel", "_select_kernel"]
    for fn, args, kw in catch_launches:
        assert kw["FIND_BAD"] is find
        assert "ld.global" in hopper_compile(fn, args, kw), fn.fn.__name__


def test_rows_too_long_for_one_program_take_the_torch_path(monkeypatch, quest_case, catch_launches):
    import prhs_kernels.quest.triton as qt

    case, built = quest_case
    monkeypatch.setattr(qt, "MAX_PAGES", built[0].shape[-1] - 1)
    _call(built, case, path="triton")
    assert catch_launches == []
    want = [x.clone() for x in built]
    _call(want, case)
    assert torch.equal(built[3], want[3]) and torch.equal(built[4], want[4])


def test_bad_input_is_refused_before_any_write(make_quest_case, catch_launches):
    case = ([300, 129], 4, 16, 64, 32, 64)
    built = make_quest_case(*case)
    scores, seq_lens, bad, out, cnt = built
    before = [x.clone() for x in built]
    for change, error, match in [
        (dict(scores=scores.double()), TypeError, "scores must be float32"),
        (dict(scores=scores[:1]), ValueError, "seq_lens"),
        (dict(seq_lens=seq_lens.long()), TypeError, "seq_lens must be int32"),
        (dict(bad=bad[:, :1]), ValueError, "bad"),
        (dict(k=0), ValueError, "k"),
        (dict(out_indices=out[..., :-4]), ValueError, r"ws \+ k \+ wl"),
        (dict(out_indices=out.long()), TypeError, "must be int32"),
        (dict(out_counts=cnt[:, :1]), ValueError, "out_counts"),
        (dict(bad=None), ValueError, "needs the query"),
        (dict(bad=None, query=torch.zeros(2, 6, 8)), ValueError, "multiple of Hkv=4"),
        (dict(nonfinite=torch.zeros(1, dtype=torch.int32)), ValueError, "one-element int64"),
    ]:
        with pytest.raises(error, match=match):
            _call(built, case, path="triton", **change)
    with pytest.raises(ValueError, match="path must be one of"):
        _call(built, case, path="cuda")
    assert catch_launches == []
    for got, was in zip(built, before, strict=True):
        torch.testing.assert_close(got, was, rtol=0, atol=0, equal_nan=True)
