"""PrHS kernels: Triton (GPU) and Numba (CPU) kernels, each beside a torch reference."""

from prhs_kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_reference

__version__ = "0.1.0"

__all__ = ["__version__", "sparse_decode_attention", "sparse_decode_attention_reference"]
