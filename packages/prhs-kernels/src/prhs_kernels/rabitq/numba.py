"""Numba (CPU) path of RaBitQ's bit packing: the bytes of
:func:`~prhs_kernels.rabitq.reference.pack_bits`, bit for bit (bit ``j % 8`` of byte ``j // 8``
is ``bits[j]``), one pass over the bits instead of the reference's int32 products and sum.

Importing this module imports Numba; :mod:`prhs_kernels.rabitq` imports it only when the Numba
path runs. The kernel compiles at its first call (cached on disk for later processes:
:mod:`prhs_kernels._jit`); :func:`warm_up` does it up front.
"""

from __future__ import annotations

import numpy as np
import torch

from prhs_kernels._jit import njit

__all__ = ["pack_bits_numba", "warm_up"]


@njit
def _pack(bits: np.ndarray, out: np.ndarray) -> None:
    """``out [N, D/8]`` uint8: the bits ``bits [N, D]`` (bool) eight to a byte, low bit first."""
    n, d = bits.shape
    for i in range(n):
        for j in range(d // 8):
            byte = 0
            for k in range(8):
                if bits[i, 8 * j + k]:
                    byte |= 1 << k
            out[i, j] = byte


def pack_bits_numba(bits: torch.Tensor) -> torch.Tensor:
    """:func:`~prhs_kernels.rabitq.reference.pack_bits` on the CPU, with Numba: ``[..., D]``
    bool to ``[..., D/8]`` uint8."""
    d = bits.shape[-1]
    flat = bits.detach().reshape(-1, d).to(torch.bool).contiguous().numpy()
    out = np.empty((flat.shape[0], d // 8), np.uint8)
    _pack(flat, out)
    return torch.from_numpy(out).view(*bits.shape[:-1], d // 8)


def warm_up() -> None:
    """Compile the kernel now (about a second), not at the first quantisation."""
    pack_bits_numba(torch.zeros(2, 16, dtype=torch.bool))
