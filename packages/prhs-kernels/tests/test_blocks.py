"""prhs_kernels.blocks: block reductions against Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from prhs_kernels.blocks import BLOCK_OPS, block_reduce

TS = [1, 7, 16, 37]
SS = [1, 3, 8, 16, 64]


def _brute(x: torch.Tensor, s: int, op: str) -> torch.Tensor:
    """Loops over every row and block; sums in float64."""
    t = x.shape[-1]
    nb = -(-t // s)
    rows = x.reshape(-1, t)
    out = []
    for row in rows.tolist():
        vals = []
        for j in range(nb):
            blk = row[j * s : (j + 1) * s]
            if op == "max":
                vals.append(max(blk))
            elif op == "min":
                vals.append(min(blk))
            elif op == "sum":
                vals.append(math.fsum(blk))
            else:
                vals.append(any(blk))
        out.append(vals)
    dtype = torch.bool if op == "any" else torch.float64
    return torch.tensor(out, dtype=dtype).reshape(*x.shape[:-1], nb)


def _input(shape, op, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if op == "any":
        return torch.rand(shape, generator=g) < 0.15
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    # Scores past a sequence's end are -inf: whole blocks of them, and blocks with some.
    x = torch.where(torch.rand(shape, generator=g) < 0.2, float("-inf"), x)
    if op == "sum":
        x = x.nan_to_num(neginf=0.0)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", BLOCK_OPS)
@pytest.mark.parametrize("s", SS, ids=[f"s{s}" for s in SS])
@pytest.mark.parametrize("t", TS, ids=[f"T{t}" for t in TS])
def test_block_reduce_matches_loops(t, s, op, dtype):
    for shape in ((t,), (2, 3, t)):
        x = _input(shape, op, dtype, seed=t * 100 + s)
        got = block_reduce(x, s, op)
        nb = -(-t // s)
        assert got.shape == (*shape[:-1], nb)
        assert got.dtype == x.dtype
        want = _brute(x.double() if op != "any" else x, s, op)
        if op == "sum":
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        elif op == "any":
            assert torch.equal(got, want)
        else:  # max / min pick a stored value: exact
            assert torch.equal(got.double(), want)
        if s == 1:
            assert torch.equal(got, x)


def test_last_short_block_ignores_padding():
    """A short last block reduces over its own entries only (the padding is the op's identity)."""
    x = torch.tensor([-3.0, -2.0, -1.0, -7.0, -5.0])
    assert block_reduce(x, 4, "max").tolist() == [-1.0, -5.0]
    assert block_reduce(-x, 4, "min").tolist() == [1.0, 5.0]
    assert block_reduce(x, 4, "sum").tolist() == [-13.0, -5.0]
    assert block_reduce(torch.tensor([False, False, False, False, True]), 4, "any").tolist() == [
        False,
        True,
    ]


def test_bad_input_is_rejected():
    x = torch.rand(4, 10)
    with pytest.raises(ValueError, match="op must be one of"):
        block_reduce(x, 2, "mean")
    with pytest.raises(TypeError, match=r"got a torch\.bool"):
        block_reduce(x > 0, 2, "max")
    with pytest.raises(TypeError, match=r"got a torch\.float32"):
        block_reduce(x, 2, "any")
    with pytest.raises(ValueError, match="s must be >= 1"):
        block_reduce(x, 0, "max")
    with pytest.raises(TypeError, match="at least one dimension"):
        block_reduce(torch.tensor(1.0), 2, "max")


def test_meta_shapes():
    """No value is read on the host: the op runs on ``meta`` tensors."""
    x = torch.empty(2, 3, 37, device="meta")
    for op in ("max", "min", "sum"):
        for s in (1, 8):
            y = block_reduce(x, s, op)
            assert (y.shape, y.dtype, y.device.type) == ((2, 3, -(-37 // s)), torch.float32, "meta")
    y = block_reduce(torch.empty(2, 37, dtype=torch.bool, device="meta"), 16, "any")
    assert (y.shape, y.dtype, y.device.type) == ((2, 3), torch.bool, "meta")
