"""CompKV's block statistics over its side cache (per aligned block of ``b`` positions: the key
sum, the key sum of squares, the value sum and the count of keys, float32, one row per page of
``b`` KV locations):

- :func:`block_estimates` -- per block and query head the estimated softmax log-mass
  ``log|B| + s·q·μ_B`` and the log of the estimated logit variance ``s²·Σ_j q_j²·σ²_{B,j}``,
  what CompKV ranks blocks by.
- :func:`block_compensation` -- ``Σ_n w_n·v̄_n`` over the blocks, the compensation output of the
  blocks left out (``w`` their normalised estimated masses).

Paths (:func:`compkv_path`): ``"triton"`` on CUDA for fp16/bf16 caches (the fields are read in
place through each block's page row, :mod:`.triton`), ``"triton-interpreter"`` on the CPU under
``TRITON_INTERPRET=1``, else ``"torch"`` (:mod:`.reference`, which gathers the fields' rows).
Blocks that do not exist (they start at or past the row's end) or hold no key are not valid:
``-inf`` estimates, no compensation, and their page rows are not read.
"""

from __future__ import annotations

import torch

from prhs_core.checks import check_device, check_float_tensor, check_int, shape_str
from prhs_kernels.compkv.reference import (
    block_compensation_reference,
    block_estimates_reference,
    block_validity,
)
from prhs_kernels.paths import announce, kernel_path

__all__ = [
    "block_compensation",
    "block_compensation_reference",
    "block_estimates",
    "block_estimates_reference",
    "block_validity",
    "compkv_path",
]


def compkv_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path the ops take for a KV cache of ``dtype`` on ``device``."""
    return kernel_path(device, dtype)


def _check_blocks(
    b: int, h: int, count: object, pages: object, seq_lens: object, block_size: int
) -> None:
    check_float_tensor("count", count, ndim=1)
    assert isinstance(count, torch.Tensor)
    if count.dtype != torch.float32 or count.shape[0] < 1:
        raise ValueError(f"count must be float32 [R], got {count.dtype} {shape_str(count)}")
    if not isinstance(pages, torch.Tensor) or pages.dtype not in (torch.int32, torch.int64):
        raise TypeError("pages must be an int32 or int64 tensor [B, NB] of page rows")
    if pages.ndim != 2 or pages.shape[0] != b:
        raise ValueError(f"pages must be [B={b}, NB], got {shape_str(pages)}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32:
        raise TypeError("seq_lens must be an int32 tensor [B]")
    if tuple(seq_lens.shape) != (b,):
        raise ValueError(f"seq_lens must be [B={b}], got {shape_str(seq_lens)}")
    check_int("block_size", block_size, minimum=1)


def _check_field(name: str, x: object, rows: int, h: int, d: int | None) -> None:
    check_float_tensor(name, x, ndim=3)
    assert isinstance(x, torch.Tensor)
    ok = x.dtype == torch.float32 and x.shape[0] == rows and x.shape[1] == h
    if not ok or (d is not None and x.shape[2] != d) or x.stride(-1) != 1:
        want = f"[R={rows}, Hkv={h}, {'D=' + str(d) if d is not None else 'Dv'}]"
        raise ValueError(
            f"{name} must be float32 {want} with a contiguous last dim, got {x.dtype} "
            f"{shape_str(x)}"
        )


def block_estimates(
    query: torch.Tensor,
    ksum: torch.Tensor,
    ksq: torch.Tensor,
    count: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    scaling: float,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_mass, log_var)``, each ``[B, Hkv, g, NB]`` float32, ``-inf`` where a block is not
    valid.

    ``query [B, Hq, D]``; one layer's side-cache fields ``ksum``, ``ksq`` ``[R, Hkv, D]`` and
    ``count [R]`` float32 (strided views such as ``side["ck_ksum"][:, layer]`` are read in
    place); ``pages [B, NB]`` the page row of block ``n`` (positions ``n·block_size ..``) of each
    row, read only where the block exists; ``seq_lens [B]`` int32. ``kv_dtype`` (default the
    query's) picks the path (:func:`compkv_path`). See
    :func:`.reference.block_estimates_reference`."""
    check_float_tensor("query", query, ndim=3)
    b, hq, d = query.shape
    check_float_tensor("ksum", ksum, ndim=3)
    rows, h = ksum.shape[0], ksum.shape[1]
    if h < 1 or hq % h:
        raise ValueError(f"query heads ({hq}) must be a multiple of the fields' KV heads ({h})")
    _check_field("ksum", ksum, rows, h, d)
    _check_field("ksq", ksq, rows, h, d)
    _check_blocks(b, h, count, pages, seq_lens, block_size)
    if count.shape[0] != rows:
        raise ValueError(f"count must have the fields' R={rows} rows, got {shape_str(count)}")
    check_device(
        ("query", "ksum", "ksq", "count", "pages", "seq_lens"),
        (query, ksum, ksq, count, pages, seq_lens),
    )
    path = compkv_path(query.device, kv_dtype or query.dtype)
    announce("block_estimates", path, query.device)
    args = (query, ksum, ksq, count, pages, seq_lens, block_size, float(scaling))
    if path.startswith("triton"):
        from prhs_kernels.compkv.triton import block_estimates_triton

        return block_estimates_triton(*args)
    return block_estimates_reference(*args)


def block_compensation(
    weight: torch.Tensor,
    vsum: torch.Tensor,
    count: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    kv_dtype: torch.dtype,
) -> torch.Tensor:
    """``[B, Hkv, g, Dv]`` float32 ``Σ_n weight[b, h, g, n]·v̄_n`` over the valid blocks, ``v̄_n``
    a block's value mean (``vsum [R, Hkv, Dv]`` over ``count [R]``, read in place); ``weight
    [B, Hkv, g, NB]``, ``pages`` and ``seq_lens`` as :func:`block_estimates`. Blocks that are not
    valid add nothing. ``kv_dtype`` picks the path (:func:`compkv_path`)."""
    check_float_tensor("weight", weight, ndim=4)
    b, h, _, nb = weight.shape
    check_float_tensor("vsum", vsum, ndim=3)
    _check_field("vsum", vsum, vsum.shape[0], h, None)
    _check_blocks(b, h, count, pages, seq_lens, block_size)
    if count.shape[0] != vsum.shape[0] or pages.shape[1] != nb:
        raise ValueError(
            f"count [R] must have vsum's R={vsum.shape[0]} rows and pages [B, NB] weight's "
            f"NB={nb} blocks, got {shape_str(count)} and {shape_str(pages)}"
        )
    check_device(
        ("weight", "vsum", "count", "pages", "seq_lens"), (weight, vsum, count, pages, seq_lens)
    )
    path = compkv_path(weight.device, kv_dtype)
    announce("block_compensation", path, weight.device)
    args = (weight, vsum, count, pages, seq_lens, block_size)
    if path.startswith("triton"):
        from prhs_kernels.compkv.triton import block_compensation_triton

        return block_compensation_triton(*args)
    return block_compensation_reference(*args)
