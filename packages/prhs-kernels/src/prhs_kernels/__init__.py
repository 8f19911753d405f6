"""PrHS kernels: Triton (GPU) and Numba (CPU) kernels, each beside a torch reference."""

__version__ = "0.1.0"
