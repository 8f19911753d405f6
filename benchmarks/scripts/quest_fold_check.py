"""The fold of written keys into Quest's page bounds (``prhs_kernels.quest.fold_page_bounds``)
on a GPU: its one Triton launch against the torch path (a decode step's new tokens read in
place from a static cache at their columns, with non-finite keys; a batch of locations in
random order, several to a page), then a layer's write timed back to back in a CUDA graph:
the Triton launch, the torch path on the same columns, and the write as the integration made
it before (a gather of the new keys and values, the finiteness check and count, the fold by
``index_fill_`` / ``scatter_reduce_``).

    python benchmarks/scripts/quest_fold_check.py
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from prhs_kernels.quest import fold_page_bounds
from prhs_kernels.timing import graph_ms

P, LAYERS, BURST = 16, 30, 16


def fields(n_loc, h, d, dev):
    rows = -(-n_loc // P) + 1
    lo = torch.randn(rows, LAYERS, h, d, device=dev).to(torch.bfloat16)
    return lo, lo + 1.0


def decode_case(b, h, t, d, seed, dev):
    """A static cache [B, Hkv, T, D] whose rows' new tokens sit at column ``col``; locations
    ``b * stride + col - start`` as the integration computes them."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(b, h, t, d, generator=gen).to(torch.bfloat16)
    col = torch.full((b,), t - 100, dtype=torch.int64)
    start = torch.randint(0, 50, (b,), generator=gen)
    stride = -(-t // 256) * 256
    loc = torch.arange(b) * stride + col - start
    loc[1 % b] = -1  # an empty row writes nowhere
    cache[2 % b, 0, t - 100, 5] = float("nan")
    return cache.to(dev), loc.to(dev), col.to(dev), b * stride


def old_write(lo, hi, loc, cache, value, col, count):
    """The integration's write before: a gather of the new keys and values, the finiteness
    check and count, then the torch fold."""
    rows = torch.arange(cache.shape[0], device=cache.device)
    key = cache[rows, :, col]
    _ = value[rows, :, col]
    finite = torch.isfinite(key).flatten(1).all(-1)
    count.add_((~finite & (loc >= 0)).sum())
    fold_page_bounds(lo, hi, loc, key, page_size=P, finite=finite)


def main() -> int:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    ok = True
    shapes = [(16, 8, 16544, 128), (1, 32, 4256, 128), (8, 32, 16544, 128), (64, 8, 4256, 128)]
    for b, h, t, d in shapes:
        cache, loc, col, n_loc = decode_case(b, h, t, d, seed=b * t, dev=dev)
        lo, hi = fields(n_loc, h, d, dev)
        got = []
        for path in ("triton", "torch"):
            a, z = lo.clone(), hi.clone()
            count = torch.zeros(1, dtype=torch.int64, device=dev)
            fold_page_bounds(a[:, 7], z[:, 7], loc, cache, page_size=P, columns=col,
                             nonfinite=count, path=path)  # fmt: skip
            got.append((a, z, count))
        (a, z, c), (ra, rz, rc) = got
        same = bool(torch.equal(a[:-1], ra[:-1]) and torch.equal(z[:-1], rz[:-1]))
        same = same and bool(torch.equal(c, rc)) and int(c) == (1 if b > 2 else 0)
        ok &= same
        count = torch.zeros(1, dtype=torch.int64, device=dev)
        value = cache
        us = {}
        for name, fn in [
            ("triton", partial(fold_page_bounds, lo[:, 7], hi[:, 7], loc, cache, page_size=P,
                               columns=col, nonfinite=count, path="triton")),
            ("torch", partial(fold_page_bounds, lo[:, 7], hi[:, 7], loc, cache, page_size=P,
                              columns=col, nonfinite=count, path="torch")),
            ("before", partial(old_write, lo[:, 7], hi[:, 7], loc, cache, value, col, count)),
        ]:  # fmt: skip
            us[name] = graph_ms([fn] * BURST) * 1000 / BURST
        print(f"decode B{b} Hkv{h} T{t}: Triton == torch: {same}; a layer's write "
              + "  ".join(f"{k} {v:.2f} us" for k, v in us.items()), flush=True)  # fmt: skip
    # Locations in random order, several to a page (a prompt's chunk), some non-finite keys.
    gen = torch.Generator().manual_seed(7)
    for n in (300, 4096):
        locs = torch.randperm(8 * n, generator=gen)[:n]
        key = torch.randn(n, 8, 128, generator=gen).to(torch.bfloat16)
        key[::97, 3, 9] = float("inf")
        lo, hi = fields(8 * n, 8, 128, dev)
        got = []
        for path in ("triton", "torch"):
            a, z = lo.clone(), hi.clone()
            count = torch.zeros(1, dtype=torch.int64, device=dev)
            fold_page_bounds(a[:, 3], z[:, 3], locs.to(dev), key.to(dev), page_size=P,
                             nonfinite=count, path=path)  # fmt: skip
            got.append((a, z, count))
        (a, z, c), (ra, rz, rc) = got
        same = bool(torch.equal(a[:-1], ra[:-1]) and torch.equal(z[:-1], rz[:-1]))
        same = same and bool(torch.equal(c, rc))
        ok &= same
        print(f"random N{n}: Triton == torch: {same} (counted {int(c)})", flush=True)
    print("all equal" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
