"""prhs_kernels.keycodes: the 4-bit code rows of keys (their format, error bound and write) and
the code scorers' torch paths (every layout alike; exact where the keys lie on their grid; the
logit error within the codes' bound)."""

from __future__ import annotations

import pytest
import torch

from prhs_kernels.cis import cis_rescore, retrieval_block_scores
from prhs_kernels.keycodes import (
    KeyCodes,
    code_bytes,
    code_key_layout,
    code_logits,
    dequantize_keys_reference,
    quantize_keys_reference,
    write_key_codes,
)
from prhs_kernels.score import retrieval_probs, score_keys


@pytest.mark.parametrize("d", [2, 16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_channel_lies_within_half_a_step(d, dtype):
    gen = torch.Generator().manual_seed(d)
    keys = (torch.randn(50, 3, d, generator=gen) * 4 + torch.randn(d, generator=gen)).to(dtype)
    rows = quantize_keys_reference(keys)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, code_bytes(d))
    assert code_bytes(d) % 16 == 0 and code_bytes(d) >= d // 2 + 8  # rows on 16-byte bounds
    assert not rows[..., d // 2 + 8 :].any()  # the row's padding is zeros
    params = rows[..., d // 2 : d // 2 + 8].contiguous().view(torch.float32)
    lo, step = params[..., 0], params[..., 1]
    x = keys.float()
    assert torch.equal(lo, x.amin(-1))
    torch.testing.assert_close(step, (x.amax(-1) - lo) / 15)
    back = dequantize_keys_reference(rows, d)
    err = (back - x).abs()
    assert bool((err <= step.unsqueeze(-1) * (0.5 + 1e-5) + 1e-6).all())
    # The nibbles: channel j low, channel j + D/2 high.
    code = torch.floor((x - lo.unsqueeze(-1)) / step.unsqueeze(-1) + 0.5).clamp(0, 15)
    assert torch.equal(rows[..., : d // 2] & 15, code[..., : d // 2].to(torch.uint8))
    assert torch.equal(rows[..., : d // 2] >> 4, code[..., d // 2 :].to(torch.uint8))


def test_constant_and_nonfinite_keys():
    keys = torch.tensor([[[3.5] * 8], [[1.0, float("nan")] + [0.0] * 6], [[float("inf")] * 8]])
    back = dequantize_keys_reference(quantize_keys_reference(keys), 8)
    assert torch.equal(back[0], keys[0])  # step 0: exact
    assert torch.equal(back[1:], torch.zeros_like(back[1:]))  # non-finite: zeros, no NaN


def _write_case(n_loc: int, h: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (n_loc + 1, h, code_bytes(d)), generator=gen, dtype=torch.uint8)
    return rows, gen


def test_write_puts_each_key_at_its_location_and_counts_nonfinite():
    h, d = 2, 16
    rows, gen = _write_case(12, h, d, 0)
    before = rows.clone()
    keys = torch.randn(4, h, d, generator=gen)
    keys[2, 1, 5] = float("nan")
    loc = torch.tensor([7, -1, 3, 0])
    nonfinite = torch.zeros(1, dtype=torch.int64)
    write_key_codes(rows, loc, keys, nonfinite=nonfinite)
    assert int(nonfinite) == 1  # the written non-finite key; the unwritten row is not counted
    want = quantize_keys_reference(keys)
    assert torch.equal(rows[7], want[0]) and torch.equal(rows[0], want[3])
    assert torch.equal(rows[3], torch.zeros_like(rows[3]))  # non-finite: zeros
    untouched = [i for i in range(12) if i not in (0, 3, 7)]
    assert torch.equal(rows[untouched], before[untouched])
    # finite= given: nothing is counted, its rows are zeros.
    finite = torch.tensor([False, True, True, True])
    write_key_codes(rows, loc, keys, finite=finite, nonfinite=nonfinite)
    assert torch.equal(rows[7], torch.zeros_like(rows[7])) and int(nonfinite) == 1


def test_write_reads_a_cache_at_its_columns():
    h, d, t = 3, 8, 6
    rows, gen = _write_case(10, h, d, 1)
    cache = torch.randn(4, h, t, d, generator=gen)
    cols = torch.tensor([2, 5, 6, -1])  # the last two are outside [0, T): not written
    loc = torch.tensor([4, 9, 1, 2])
    other = rows.clone()
    write_key_codes(rows, loc, cache, columns=cols)
    write_key_codes(other, loc[:2], cache[torch.arange(2), :, cols[:2]])
    assert torch.equal(rows[:-1], other[:-1])  # the last row is scratch


def test_write_refuses_bad_input_before_writing():
    rows, gen = _write_case(6, 2, 8, 2)
    snap = rows.clone()
    keys = torch.randn(2, 2, 8, generator=gen)
    loc = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="code_bytes\\(D\\)"):  # 16-byte rows, D 40's are 32
        write_key_codes(rows, loc, torch.randn(2, 2, 40))
    with pytest.raises(ValueError, match="D even"):
        write_key_codes(rows, loc, torch.randn(2, 2, 9))
    with pytest.raises(ValueError, match="N=3"):
        write_key_codes(rows, torch.tensor([0, 1, 2]), keys)
    with pytest.raises(TypeError, match="uint8"):
        write_key_codes(rows.float(), loc, keys)
    with pytest.raises(ValueError, match="finite"):
        write_key_codes(rows, loc, keys, finite=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="columns"):
        write_key_codes(rows, loc, keys.unsqueeze(2), columns=torch.tensor([0]))
    assert torch.equal(rows, snap)


def test_key_codes_are_checked():
    with pytest.raises(TypeError, match="uint8"):
        KeyCodes(torch.zeros(4, 2, 16), 4)
    with pytest.raises(ValueError, match="row_stride"):
        KeyCodes(torch.zeros(4, 2, 16, dtype=torch.uint8), 0)
    codes = KeyCodes(torch.zeros(9, 2, 16, dtype=torch.uint8), 4)
    assert codes.rows.shape == (9, 2, 16) and codes.row_stride == 4 and codes.center is None


def test_codes_must_cover_the_cache(make_kv, make_codes):
    data = make_kv([30, 12], 2, 16, seed=0)
    codes = make_codes(data, "contig0")
    q = torch.randn(2, 4, 16)
    short = KeyCodes(codes.rows, 20)  # rows of 20 positions for a cache of 30
    with pytest.raises(ValueError, match="do not cover"):
        code_logits(q, data["contig0"], short, 0.25)
    with pytest.raises(ValueError, match="code_bytes\\(D\\)=32"):  # rows of 16 bytes for D 40
        code_logits(torch.randn(2, 4, 40), make_kv([30, 12], 2, 40)["contig0"], codes, 0.25)


def test_code_logits_are_within_the_codes_bound_on_every_layout(make_kv, make_codes):
    """``|l − l̂| ≤ scaling · Σ_j |q_j| · step/2`` for every position; every layout gives the
    same estimates."""
    gen = torch.Generator().manual_seed(3)
    h, g, d = 2, 3, 32
    data = make_kv([41, 7, 26], h, d, seed=4)
    q = torch.randn(3, h * g, d, generator=gen)
    exact = score_keys(q, data["contig0"], 0.2)
    results = []
    for name in data.layouts:
        est = code_logits(q, data[name], make_codes(data, name), 0.2)
        results.append(est)
        assert torch.equal(torch.isinf(est), torch.isinf(exact))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-6, atol=1e-6)
    rows = quantize_keys_reference(torch.nan_to_num(data.keys))  # [B, Hkv, T, D/2 + 8]
    step = rows[..., d // 2 :].contiguous().view(torch.float32)[..., 1]  # [B, Hkv, T]
    qa = q.abs().sum(-1).view(3, h, g, 1)
    bound = 0.2 * qa * step.unsqueeze(2) / 2 + 1e-5
    ok = torch.isfinite(exact)
    err = (results[0] - exact).abs()
    assert bool((err[ok] <= bound.expand_as(err)[ok]).all())
    assert float(err[ok].max()) > 0  # real keys are not on the grid: the estimates move


def test_keys_on_their_grid_score_exactly(make_kv, make_codes, make_grid_keys):
    """Where every key lies on its 4-bit grid, the codes' retrieval probabilities, block scores
    and re-ranking equal the exact ones (to float32 rounding)."""
    gen = torch.Generator().manual_seed(5)
    h, g, d = 2, 2, 16
    base = make_kv([60, 45], h, d, seed=6)
    data = make_kv([60, 45], h, d, seed=6, keys=make_grid_keys(torch.nan_to_num(base.keys)))
    q = torch.randn(2, h * g, d, generator=gen)
    active = torch.tensor([[True, False], [True, True]])
    for name in ("contig", "paged16"):
        kv, codes = data[name], make_codes(data, name)
        torch.testing.assert_close(
            retrieval_probs(q, kv, 0.3, active, codes=codes), retrieval_probs(q, kv, 0.3, active),
            rtol=1e-5, atol=1e-7,
        )  # fmt: skip
        kw = dict(block_size=4, n_sink=2, n_local=8, score="mass")
        torch.testing.assert_close(
            retrieval_block_scores(q, kv, 0.3, active, codes=codes, **kw),
            retrieval_block_scores(q, kv, 0.3, active, **kw), rtol=1e-5, atol=1e-7,
        )  # fmt: skip
        m, r = 3, 4
        pool = torch.stack([torch.randperm(11, generator=gen)[: m + r] for _ in range(3 * h)])
        pool = pool.view(3, h, m + r).to(torch.int32)
        outs = []
        for c in (codes, None):
            idx, nxt = pool[..., :m].clone(), pool[..., m:].clone()
            cnt = torch.full((3, h), m, dtype=torch.int32)
            alen = torch.full((3, h), 40, dtype=torch.int32)
            cis_rescore(q, kv, 0.3, active, alen, idx, cnt, nxt, torch.tensor([2, 0]),
                        block_size=4, n_sink=2, n_local=8, hold_local=True, codes=c)  # fmt: skip
            outs.append((idx, cnt, nxt))
        for x, y in zip(*outs, strict=True):
            assert torch.equal(x, y)


def test_code_layout_is_the_dequantised_keys(make_kv, make_codes):
    data = make_kv([20, 9], 1, 8, seed=8)
    for name in data.layouts:
        layout = code_key_layout(data[name], make_codes(data, name))
        assert layout.dtype == torch.float32
        got = score_keys(torch.eye(8)[:2].view(2, 1, 8), layout, 1.0)  # channel 0 / channel 1
        want = dequantize_keys_reference(quantize_keys_reference(torch.nan_to_num(data.keys)), 8)
        for b, n in enumerate(data.lens):
            torch.testing.assert_close(got[b, 0, 0, :n], want[b, 0, :n, b])


def test_codes_around_a_center_are_finer_where_keys_share_a_large_part():
    """Keys with a large common part (a projection bias): coded around their mean, every
    channel is within half of a much smaller step; decoded with the centre added back, the
    estimates are within the bound; the centre is the mean of the finite keys written."""
    from prhs_kernels.keycodes import key_center

    gen = torch.Generator().manual_seed(11)
    h, d = 2, 32
    bias = torch.zeros(h, d)
    bias[:, 3] = 40.0
    keys = torch.randn(64, h, d, generator=gen) + bias
    keys[5, 0, 0] = float("nan")  # left out of the mean
    loc = torch.arange(64)
    loc[7] = -1  # not written: left out too
    center = key_center(loc, keys)
    ok = torch.ones(64, dtype=torch.bool)
    ok[5] = ok[7] = False
    torch.testing.assert_close(center, keys[ok].mean(0))
    plain, around = quantize_keys_reference(keys[ok]), quantize_keys_reference(keys[ok], center)
    step_plain = plain[..., d // 2 :].contiguous().view(torch.float32)[..., 1]
    step_around = around[..., d // 2 :].contiguous().view(torch.float32)[..., 1]
    assert float(step_around.mean()) < float(step_plain.mean()) / 5
    back = dequantize_keys_reference(around, d, center)
    assert bool(((back - keys[ok]).abs() <= step_around.unsqueeze(-1) / 2 + 1e-5).all())
    rows = torch.zeros(65, h, code_bytes(d), dtype=torch.uint8)
    write_key_codes(rows, loc, keys, center=center)
    assert torch.equal(rows[0], around[0])
    with pytest.raises(ValueError, match="center must be float32"):
        write_key_codes(rows, loc, keys, center=center.double())
    with pytest.raises(ValueError, match="center must be float32"):
        KeyCodes(rows, 64, center[:1])
    # The rows' width is code_bytes(D), which several D share: the centre names D, and one whose
    # rows would be another width is refused.
    assert KeyCodes(rows, 64, center).center is center
    with pytest.raises(ValueError, match="code_bytes\\(D\\) = 32"):
        KeyCodes(rows, 64, torch.zeros(h, 64))
