"""``compkv``: blocks by compensation residual against brute force, the compensation terms
against block means of the stored keys and values, every block selected = dense, and the merge
through the log-sum-exp."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_selectors import CompKV, CompKVConfig

GEOMETRIES = [([37, 12, 1], 2, 2, 8), ([50, 29], 6, 2, 16), ([41, 64, 5], 8, 2, 8)]
IDS = [f"T{'-'.join(map(str, ls))}-Hq{hq}-Hkv{hkv}-D{d}" for ls, hq, hkv, d in GEOMETRIES]


def brute_blocks(sim, layer: int, b: int, s: int) -> list[dict]:
    """Per block of row ``b``: its keys' count, mean and per-channel variance and its value
    mean, from the stored data in float64."""
    n = int(sim.lengths[b])
    out = []
    for j in range(-(-n // s)):
        k = sim.keys[layer][b, :, j * s : min((j + 1) * s, n)].double()  # [Hkv, c, D]
        v = sim.values[layer][b, :, j * s : min((j + 1) * s, n)].double()
        out.append(
            {
                "count": k.shape[1],
                "mu": k.mean(1),
                "var": k.var(1, unbiased=False),
                "vbar": v.mean(1),
            }
        )
    return out


def brute_terms(sim, layer: int, b: int, blocks: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Hq, NB]`` log-mass and logit-variance estimates of every block."""
    hkv = sim.spec.num_kv_heads
    g = sim.spec.group_size
    q = sim.queries[layer][b].double()  # [Hq, D]
    s = sim.scaling
    lm = torch.empty(q.shape[0], len(blocks), dtype=torch.float64)
    lv = torch.empty_like(lm)
    for j, blk in enumerate(blocks):
        for hq in range(q.shape[0]):
            h = hq // g
            lm[hq, j] = math.log(blk["count"]) + s * float(q[hq] @ blk["mu"][h])
            lv[hq, j] = s * s * float((q[hq] ** 2) @ blk["var"][h])
    assert hkv * g == q.shape[0]
    return lm, lv


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=IDS)
def test_selection_and_compensation_match_brute_force(
    make_sim, tools, layout, lengths, hq, hkv, d
) -> None:
    s, budget, n_sink, n_local = 4, 8, 2, 4
    sim = make_sim(
        lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout, max_new_tokens=2
    )
    if layout == "paged":
        pytest.skip("compkv keeps metadata per block: a paged pool needs whole pages")
    ck = CompKV(CompKVConfig(budget=budget, n_sink=n_sink, n_local=n_local, block_size=s))
    sim.attach(ck)
    g = hq // hkv
    for _ in range(2):
        sel = sim.select(0)
        comp = sel.compensation
        assert comp is not None
        for b, n in enumerate(sim.lengths.tolist()):
            blocks = brute_blocks(sim, 0, b, s)
            lm, lv = brute_terms(sim, 0, b, blocks)
            log_z = torch.logsumexp(lm, -1, keepdim=True)
            score = torch.exp(lm + lv.log() - log_z).view(hkv, g, -1).sum(1)  # [Hkv, NB]
            win = tools.blocks_of(tools.window(n, n_sink, n_local), s)
            for h in range(hkv):
                got = tools.chosen(sel, b, h)
                assert win <= got
                cand = [j for j in range(len(blocks)) if j not in win]
                scores = score[h].tolist()
                want = tools.brute_topk(cand, budget // s, scores)
                tools.assert_same_topk(got - win, want, scores, atol=1e-9)
                left = [j for j in range(len(blocks)) if j not in got]
                for qh in range(h * g, (h + 1) * g):
                    if not left:
                        assert comp.lse[b, qh] == float("-inf")
                        continue
                    terms = lm[qh, left]
                    c = torch.logsumexp(terms, 0)
                    w = torch.exp(terms - c)
                    value = sum(w[i] * blocks[j]["vbar"][h] for i, j in enumerate(left))
                    assert comp.lse[b, qh].item() == pytest.approx(c.item(), rel=1e-4, abs=1e-4)
                    torch.testing.assert_close(
                        comp.out[b, qh].double(), value, rtol=1e-4, atol=1e-5
                    )
        st = sel.stats
        assert not bool(st.retrieved.any())
        nb = (sim.lengths + s - 1) // s
        assert torch.equal(
            st.proxy_bytes, (nb.double() * (3 * d + 1) * 4).view(-1, 1).expand(-1, hkv)
        )
        sim.advance()


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d"), GEOMETRIES, ids=IDS)
def test_every_block_selected_is_dense_attention(make_sim, layout, lengths, hq, hkv, d) -> None:
    if layout == "paged":
        pytest.skip("compkv keeps metadata per block: a paged pool needs whole pages")
    sim = make_sim(lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, layout=layout)
    ck = CompKV(CompKVConfig(budget=4 * 64, n_sink=2, n_local=4, block_size=4))
    sim.attach(ck)
    sel = sim.select(0)
    assert bool(torch.isneginf(sel.compensation.lse).all())
    out, _ = sim.attend(0, sel)
    torch.testing.assert_close(out.double(), sim.reference_output(0), rtol=0, atol=1e-5)


def test_the_output_merges_the_exact_blocks_and_the_block_terms(make_sim) -> None:
    """Attention with the compensation equals a softmax over the selected positions' logits
    and one pseudo-logit per left-out block (log|B| + s·q·μ_B) with the block's mean value."""
    sim = make_sim([45], num_q_heads=2, num_kv_heads=1, head_dim=8, max_new_tokens=1)
    s = 4
    ck = CompKV(CompKVConfig(budget=8, n_sink=1, n_local=3, block_size=s))
    sim.attach(ck)
    sel = sim.select(0)
    out, lse = sim.attend(0, sel)
    blocks = brute_blocks(sim, 0, 0, s)
    lm, _ = brute_terms(sim, 0, 0, blocks)
    chosen = set(sel.indices[0, 0, : int(sel.counts[0, 0])].tolist())
    logits = sim.logits(0)[0]  # [Hq, T]
    for qh in range(2):
        terms, values = [], []
        for j, blk in enumerate(blocks):
            if j in chosen:
                for t in range(j * s, min((j + 1) * s, 45)):
                    terms.append(logits[qh, t])
                    values.append(sim.values[0][0, 0, t].double())
            else:
                terms.append(lm[qh, j])
                values.append(blk["vbar"][0])
        t = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in terms])
        w = torch.softmax(t, 0)
        want = sum(w[i] * v for i, v in enumerate(values))
        torch.testing.assert_close(out[0, qh].double(), want, rtol=1e-4, atol=1e-5)
        assert lse[0, qh].item() == pytest.approx(torch.logsumexp(t, 0).item(), abs=1e-4)


def test_a_row_with_a_non_finite_query_reads_its_windows_without_compensation(make_sim) -> None:
    sim = make_sim([40, 30], num_q_heads=2, num_kv_heads=1, head_dim=8)
    ck = CompKV(CompKVConfig(budget=8, n_sink=1, n_local=3, block_size=4))
    sim.attach(ck, checked=False)
    sim.queries[0][1, 0, 0] = float("nan")
    sel = sim.select(0)
    assert int(sel.counts[1, 0]) == 3  # block 0 (sink) and blocks 6-7 (local: 27..29)
    assert sel.compensation.lse[1].isneginf().all() and (sel.compensation.out[1] == 0).all()
    assert torch.isfinite(sel.compensation.lse[0]).all()


def test_a_value_dim_unlike_the_key_dim_is_refused(make_sim) -> None:
    sim = make_sim([20], num_q_heads=2, num_kv_heads=1, head_dim=8, value_dim=4)
    with pytest.raises(ValueError, match="value dim must equal the key dim"):
        sim.attach(CompKV(CompKVConfig(budget=4, block_size=4)))
