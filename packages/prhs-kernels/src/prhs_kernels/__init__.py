"""PrHS kernels: each op beside a torch reference, behind a typed launcher that checks its input.

- :mod:`prhs_kernels.kv` -- KV locations and gathers through either layout;
- :mod:`prhs_kernels.score` -- exact scoring of every cached key (retrieval);
- :mod:`prhs_kernels.keycodes` -- 4-bit key codes a retrieval can score instead of the keys;
- :mod:`prhs_kernels.topk` -- top-k / top-p into fixed-width index lists, and a seeded top-k's
  first passes;
- :mod:`prhs_kernels.blocks` -- block reductions;
- :mod:`prhs_kernels.compose` -- windows, dilation and union into a selection's buffers;
- :mod:`prhs_kernels.sparse_decode` -- attention over a selection;
- :mod:`prhs_kernels.cis` -- the CIS step (decide, block scores, top-k, compose);
- :mod:`prhs_kernels.quest` -- Quest's page scores;
- :mod:`prhs_kernels.prefill` -- PSAW prefill attention;
- :mod:`prhs_kernels.gemm` -- decode-size linear layers as one weight stream;
- :mod:`prhs_kernels.graphs` -- kernels a captured step skips when a device flag says so;
- :mod:`prhs_kernels.paths` -- which path an op takes, and the Numba warm-up.

Every op keeps shapes static and reads no device value on the host, so a decode step built from
them can be captured in a CUDA graph. Paths: Triton kernels on CUDA for fp16/bf16 caches, Numba
kernels on the CPU for top-k, top-p, dilation and union, the torch reference elsewhere; every
fast path is tested against its reference.
"""

from prhs_kernels.blocks import block_reduce
from prhs_kernels.compose import dilate_indices, union_indices, window_indices, window_widths
from prhs_kernels.gemm import decode_linear
from prhs_kernels.kv import gather_kv, token_locations
from prhs_kernels.score import max_key_norm, score_keys
from prhs_kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_reference
from prhs_kernels.topk import top_p_indices, topk_indices

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "block_reduce",
    "decode_linear",
    "dilate_indices",
    "gather_kv",
    "max_key_norm",
    "score_keys",
    "sparse_decode_attention",
    "sparse_decode_attention_reference",
    "token_locations",
    "top_p_indices",
    "topk_indices",
    "union_indices",
    "window_indices",
    "window_widths",
]
