"""Compressed keys: a side cache of 4-bit keys, written at every K/V write, that retrievals and
re-rankings score instead of the keys.

A key ``[D]`` becomes a code row of ``D/2 + 8`` bytes rounded up to a multiple of 16
(:func:`code_bytes`; :mod:`.reference` states the format): 80 bytes for ``D = 128`` against a
bf16 key's 256 (31 %), each channel within half a step of the key, coded around a centre
per layer and KV head (the mean of a prompt's keys, :func:`key_center`, or one a host pins),
no per-request state. :class:`KeyCodes` names one layer's rows as a scorer reads them;
:func:`write_key_codes` writes a step's keys into them (one launch on a Triton path,
non-finite keys found and counted there); :func:`code_key_layout` is the cache as its
dequantised keys, the reference every code scorer is tested against; :func:`code_logits` scores
every cached position from the codes.

The fast scorers live with the ops that score: :func:`prhs_kernels.score.retrieval_probs`,
:func:`prhs_kernels.cis.retrieval_block_scores`, :func:`prhs_kernels.cis.retrieval_compose` and
:func:`prhs_kernels.cis.cis_rescore` take ``codes=`` and, on a Triton path, read the code rows in
place (:func:`.triton.code_scores`, inlined) instead of the key rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prhs_core.checks import (
    check_bool_mask,
    check_counter,
    check_device,
    check_float_tensor,
    check_index_tensor,
    check_int,
    check_shape,
    shape_str,
)
from prhs_core.layout import ContiguousKV, KVLayout
from prhs_kernels.keycodes.reference import (
    LEVELS,
    code_bytes,
    code_key_layout_reference,
    dequantize_keys_reference,
    key_center_reference,
    quantize_keys_reference,
    write_key_codes_reference,
)
from prhs_kernels.paths import announce, kernel_path

__all__ = [
    "LEVELS",
    "KeyCodes",
    "check_key_codes",
    "code_bytes",
    "code_key_layout",
    "code_key_layout_reference",
    "code_logits",
    "codes_path",
    "dequantize_keys_reference",
    "key_center",
    "key_center_reference",
    "quantize_keys_reference",
    "write_key_codes",
    "write_key_codes_reference",
]


@dataclass(frozen=True)
class KeyCodes:
    """One layer's code rows, as the scorers read them.

    Attributes
    ----------
    rows:
        ``[R, Hkv, code_bytes(D)]`` uint8, one row per KV location (row ``b · row_stride + t`` of
        position ``t`` of row ``b`` in a contiguous layout, the token's slot in a paged one;
        the last row is scratch), a strided view such as ``side["cis_codes"][:, layer]``.
    row_stride:
        Contiguous layouts: locations per batch row.
    center:
        ``[Hkv, D]`` float32, the centre the rows were coded around (``None``: 0). The scorers
        do not read it (it shifts every logit of a query head by ``q · c``, which no
        probability or ranking sees); :func:`code_key_layout` adds it back.
    """

    rows: torch.Tensor
    row_stride: int
    center: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rows, torch.Tensor) or self.rows.dtype != torch.uint8:
            raise TypeError(
                "rows must be a uint8 tensor [R, Hkv, code_bytes(D)], got "
                f"{type(self.rows).__name__}"
                + (f" {self.rows.dtype}" if isinstance(self.rows, torch.Tensor) else "")
            )
        if self.rows.ndim != 3 or self.rows.shape[0] < 1 or self.rows.shape[-1] < 9:
            raise ValueError(f"rows must be [R, Hkv, code_bytes(D)], got {shape_str(self.rows)}")
        if self.rows.stride(-1) != 1:
            raise ValueError("rows must have a contiguous last dim")
        check_int("row_stride", self.row_stride, minimum=1)
        if self.center is not None:
            check_float_tensor("center", self.center, ndim=2)
            h, width = self.rows.shape[1], self.rows.shape[-1]
            d = self.center.shape[-1]
            if (
                self.center.shape[0] != h
                or d % 2
                or code_bytes(d) != width
                or self.center.dtype != torch.float32
            ):
                raise ValueError(
                    f"center must be float32 [Hkv={h}, D] with D even and code_bytes(D) = "
                    f"{width} (the rows' width), got {self.center.dtype} "
                    f"{shape_str(self.center)}"
                )


def codes_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path the code ops take for a cache of ``dtype`` on ``device``
    (:func:`prhs_kernels.paths.kernel_path`)."""
    return kernel_path(device, dtype)


def check_key_codes(kv: KVLayout, codes: object) -> None:
    """Raise unless ``codes`` is a :class:`KeyCodes` whose rows cover ``kv``'s locations."""
    if not isinstance(codes, KeyCodes):
        raise TypeError(f"codes must be a KeyCodes, got {type(codes).__name__}")
    d, h = kv.head_dim, kv.num_kv_heads
    if d % 2 or tuple(codes.rows.shape[1:]) != (h, code_bytes(d)):
        raise ValueError(
            f"codes rows must be [R, Hkv={h}, code_bytes(D)={code_bytes(d)}] for keys of D={d}, "
            "got "
            f"{shape_str(codes.rows)}"
        )
    rows = codes.rows.shape[0] - 1
    if isinstance(kv, ContiguousKV):
        if kv.max_len > codes.row_stride or kv.batch_size * codes.row_stride > rows:
            raise ValueError(
                f"codes of {rows} locations at row_stride {codes.row_stride} do not cover a "
                f"contiguous cache of {kv.batch_size} rows of {kv.max_len} positions"
            )
    elif kv.num_slots > rows:
        raise ValueError(f"codes of {rows} locations do not cover a pool of {kv.num_slots} slots")
    check_device(("codes", "the cache"), (codes.rows, kv.seq_lens))


def write_key_codes(
    rows: torch.Tensor,
    locations: torch.Tensor,
    key: torch.Tensor,
    *,
    columns: torch.Tensor | None = None,
    finite: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
    center: torch.Tensor | None = None,
    path: str = "torch",
) -> None:
    """Write the code rows of the keys a host wrote into ``rows [R, Hkv, code_bytes(D)]``
    (uint8, one layer's field, written in place; a strided view is fine; the last row is
    scratch), coded around ``center [Hkv, D]`` (float32; ``None``: 0).

    ``locations [N]`` (any integer dtype, ``-1``: none) are the KV locations written, distinct.
    ``key`` is ``[N, Hkv, D]`` (row ``i`` written at ``locations[i]``) or, with ``columns
    [N]``, a cache ``[N, Hkv, T, D]`` whose row ``i`` holds its key at column ``columns[i]`` (a
    decode step's new token, read in place); a column outside ``[0, T)`` writes nothing.
    ``finite [N]``: which keys are finite; ``None``: found here, and the written ones that are
    not counted into ``nonfinite`` (one int64 element) when given. A non-finite key's row is
    zeros. On a Triton ``path`` (``finite`` ``None``): one launch, a program per row.
    """
    check_index_tensor("locations", locations, ndim=1)
    n = locations.shape[0]
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.ndim != 3:
        raise TypeError("rows must be a uint8 tensor [R, Hkv, code_bytes(D)]")
    if columns is None:
        check_float_tensor("key", key, ndim=3)
    else:
        check_float_tensor("key", key, ndim=4)
        check_index_tensor("columns", columns, ndim=1)
        check_shape("columns", columns, (n,), "[N]")
        check_device(("key", "columns"), (key, columns))
    h, d = key.shape[1], key.shape[-1]
    if key.shape[0] != n or d % 2 or tuple(rows.shape[1:]) != (h, code_bytes(d)):
        raise ValueError(
            f"key must hold N={n} rows of [Hkv, D] with D even, and rows be "
            "[R, Hkv, code_bytes(D)] "
            f"to match; got key {shape_str(key)} and rows {shape_str(rows)}"
        )
    if rows.shape[0] < 1 or rows.stride(-1) != 1:
        raise ValueError("rows need the scratch row and a contiguous last dim")
    if finite is not None:
        check_bool_mask("finite", finite, (n,))
        check_device(("key", "finite"), (key, finite))
    if nonfinite is not None:
        check_counter("nonfinite", nonfinite, key.device, " (SelectorState.nonfinite)")
    if center is not None:
        check_float_tensor("center", center, ndim=2)
        if tuple(center.shape) != (h, d) or center.dtype != torch.float32:
            raise ValueError(
                f"center must be float32 [Hkv={h}, D={d}], got {center.dtype} {shape_str(center)}"
            )
        check_device(("key", "center"), (key, center))
    check_device(("rows", "locations", "key"), (rows, locations, key))
    if path.startswith("triton") and finite is None:
        from prhs_kernels.keycodes.triton import write_key_codes_triton

        announce("write_key_codes", path, key.device)
        write_key_codes_triton(rows, locations, key, columns, nonfinite, center)
        return
    announce("write_key_codes", "torch", key.device)
    write_key_codes_reference(rows, locations, key, columns, finite, nonfinite, center)


def key_center(
    locations: torch.Tensor, key: torch.Tensor, *, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """``[Hkv, D]`` float32: the mean of the finite keys of a write (arguments as
    :func:`write_key_codes`'), 0 when it holds none: the centre a pool's codes are taken
    around, set once from its first write (a prompt's keys). Torch ops, no host read."""
    check_index_tensor("locations", locations, ndim=1)
    check_float_tensor("key", key, ndim=3 if columns is None else 4)
    if key.shape[0] != locations.shape[0]:
        raise ValueError(
            f"key must hold one row per location ({locations.shape[0]}), got {shape_str(key)}"
        )
    if columns is not None:
        check_index_tensor("columns", columns, ndim=1)
        check_shape("columns", columns, (locations.shape[0],), "[N]")
    return key_center_reference(locations, key, columns)


def code_key_layout(kv: KVLayout, codes: KeyCodes) -> KVLayout:
    """The cache as its dequantised keys (float32): see
    :func:`.reference.code_key_layout_reference`. Scoring this layout with a float32 query is
    what every code scorer computes; the torch paths of the scoring ops do exactly that."""
    check_key_codes(kv, codes)
    return code_key_layout_reference(kv, codes.rows, codes.row_stride, codes.center)


def code_logits(query: torch.Tensor, kv: KVLayout, codes: KeyCodes, scaling: float) -> torch.Tensor:
    """``[B, Hkv, g, T]`` float32 estimated logits ``scaling · q · k̂`` of every position
    ``t < T = kv.max_len`` (``-inf`` past each sequence's end), from the code rows (torch)."""
    from prhs_kernels.score import check_query, score_keys

    check_query(query, kv)
    layout = code_key_layout(kv, codes)
    announce("code_logits", "torch", query.device)
    return score_keys(query.float(), layout, scaling)
