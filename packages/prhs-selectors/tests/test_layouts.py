"""Every selector gives identical results on every KV layout: a selector speaks in logical
positions, and only the layout knows where a position is stored (its side caches follow the KV
locations, which differ between layouts)."""

from __future__ import annotations

import torch

from prhs_core.registry import selectors


def test_cases_cover_every_registered_selector(tools) -> None:
    assert {name for name, _ in tools.cases.values()} == set(selectors.names())


def _run(make_sim, tools, case: str, layout: str) -> list[tuple]:
    sim = make_sim(
        [41, 18, 3],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_layers=2,
        layout=layout,
        max_new_tokens=4,
        seed=13,
    )
    sel = tools.make_selector(case)
    sim.attach(sel)
    got = []
    for _ in range(4):
        for layer in range(2):
            s = sim.select(layer)
            out, lse = sim.attend(layer, s)
            assert bool(torch.isfinite(out).all()), "a read of unused storage (NaN)"
            st = sim.plan().stats
            row = [out, lse, st.retrieved.clone(), st.num_selected.clone()]
            row += [st.proxy_bytes.clone(), st.delta_hat]
            if st.delta_hat is not None:
                row[-1] = st.delta_hat.clone()
            if s is not None:
                row += [s.indices.clone(), s.counts.clone()]
            got.append(tuple(row))
        sim.advance()
    return got


def test_identical_results_on_every_layout(make_sim, tools, case) -> None:
    runs = {
        layout: _run(make_sim, tools, case, layout)
        for layout in ("contiguous", "paged", "paged16")
        if tools.supports(case, layout)
    }
    assert len(runs) >= 2
    first, *rest = runs.values()
    for other in rest:
        for a, b in zip(first, other, strict=True):
            for x, y in zip(a, b, strict=True):
                assert (x is None and y is None) or torch.equal(x, y)


def test_simulators_hold_the_same_logical_data_on_every_layout(make_sim) -> None:
    """The harness itself: equal logical data whatever the layout, NaN in storage no sequence
    uses, and each layout reads back the logical keys and values."""
    from prhs_kernels import gather_kv

    sims = [
        make_sim([23, 40, 1], num_q_heads=4, num_kv_heads=2, head_dim=8, layout=lay, num_layers=2)
        for lay in ("contiguous", "paged", "paged16")
    ]
    first = sims[0]
    for sim in sims:
        assert sim.t_cap == first.t_cap
        for layer in range(2):
            assert torch.equal(sim.keys[layer], first.keys[layer])
            assert torch.equal(sim.values[layer], first.values[layer])
            assert torch.equal(sim.queries[layer], first.queries[layer])
            kv = sim.kv(layer)
            kv.check_values()
            assert kv.max_len == sim.t_cap
            pos = torch.arange(sim.t_cap).expand(3, 2, -1)
            k, v = gather_kv(kv, pos)
            used = (pos < sim.lengths.view(-1, 1, 1)).unsqueeze(-1)
            assert torch.equal(k, torch.where(used, sim.keys[layer], 0.0))
            assert torch.equal(v, torch.where(used, sim.values[layer], 0.0))
            storage = kv.k if sim.layout == "contiguous" else kv.k_pool
            assert int(storage.isnan().any(-1).sum()) == storage[..., 0].numel() - 64 * 2
    for sim in sims:
        sim.advance()
    assert all(torch.equal(s.queries[1], first.queries[1]) for s in sims)
